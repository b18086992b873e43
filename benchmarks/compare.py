"""Does AdLoCo help? AdLoCo against DiLoCo baselines, LocalSGD and ablations, at matched budgets.

    python -m benchmarks.compare --config configs/compare_cpu.yaml --seeds 3 --out benchmarks/results/compare

    # the paper's regime: one shared pretrained start, then every variant fine-tunes it with a small lr
    python -m benchmarks.compare --config configs/compare_warm_cpu.yaml --pretrain_config configs/pretrain_cpu.yaml \
        --seeds 3 --out benchmarks/results/compare_warm

Every variant trains on the same data, model and seeds, with the same token budget (`--max_tokens`,
default: what the AdLoCo config uses in num_outer_steps, measured by a first AdLoCo run), as a separate
`run.py` process. Variants are config overrides of the base config:

  adloco              the base config (adaptive batching, merging, switch mode)
  adloco_no_adaptive  sampling_method: constant
  adloco_no_merge     merge_frequency: 0
  adloco_no_switch    switch_mode: only_data_loader (never accumulate)
  diloco_bB           one trainer on all nodes, constant batch B (--diloco_batches, default 2,4,8,16),
                      run as it really is: loader batch x accumulation (only_gradient_accumulation)
  diloco_rampup       as diloco, with the batch ramped linearly from initial_batch_size to
                      max_requested_batch over the token budget (Megatron's rampup-batch-size)
  localsgd            as diloco_b<initial batch> with LocalSGD (inner SGD at --localsgd_lr, outer = average)
  communication (when named, or --variants communication; error feedback on):
  adloco_sketch       statistics_comm: sketch
  adloco_int8, adloco_fp8, adloco_topk    outer_compression int8 / fp8 / topk (2%)
  adloco_int8_sketch  both
  diloco_int8, diloco_topk                diloco_bB (B the middle --diloco_batches) compressed
  heterogeneous clusters (with --cluster FILE, included in all):
  diloco_by_speed     diloco_bB with inner_steps_by_speed (each node's inner steps in proportion to its
                      throughput, the mean weighted by tokens: DyLU of Async Local-SGD)
  adloco_by_speed     adloco with inner_steps_by_speed

--cluster FILE: a YAML mapping of the cluster keys (devices with speed / memory_mb, nodes_per_gpu, network,
throughput, node_tokens_per_s, node_schedule) applied to every run, whose own simulated clock (README "A
simulated clock") then times it: the report gains time to target, utilisation and idle time under that
clock. --throughput_curve FILE prices the finished runs' rounds with a throughput curve instead of a flat
tokens/s (the network model's tables).

Warm start (two phases): `--pretrain_config CFG` trains one shared start with run.py (phase 1, into
<out>/pretrain, reused when finished); `--init_from RUN_DIR` uses an existing run's final model. Phase 2
starts every variant from that Hugging Face directory (model_weights/final/final_model, with its
tokenizer) on the --config data.

Outputs in --out: comparison.md (every table), comparison.csv (one row per variant), budgets.csv (the
metric at matched budgets), merges.csv (every merge of every run) and plots of the metric against
rounds, syncs, bytes, tokens and wall time. Reported per run: the real final model (summary.json's
final_metric, the model in model_weights/final) and, separately, the best metric seen during the run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import signal
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import yaml
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from algorithms.clock import ThroughputCurve  # noqa: E402
from benchmarks import network  # noqa: E402
from benchmarks.tables import cell  # noqa: E402
from benchmarks.theory import communication_bound  # noqa: E402
from training_logs.plots import readable_y  # noqa: E402
from utils.config import Config, load_config  # noqa: E402
from utils.errors import Interrupted, raise_interrupted  # noqa: E402
from utils.run_state import in_use  # noqa: E402

# budget axes: curve key -> what it counts (definitions in algorithms/traffic.py)
AXES = {"tokens": "tokens seen (all trainers)", "rounds": "rounds (outer steps)",
        "syncs": "syncs (cross-node all-reduces + merges)", "bytes": "bytes communicated"}


def variants(base: Config, diloco_batches: list[int], localsgd_lr: float) -> dict[str, list[str]]:
    single = ["num_init_trainers=1", "merge_frequency=0"]
    real_batch = "switch_mode=only_gradient_accumulation"  # a constant batch B really runs B sequences per step
    chosen = {
        "adloco": [],
        "adloco_no_adaptive": ["sampling_method=constant"],
        "adloco_no_merge": ["merge_frequency=0"],
        "adloco_no_switch": ["switch_mode=only_data_loader"],
    }
    for b in diloco_batches:
        chosen[f"diloco_b{b}"] = [*single, "sampling_method=constant", f"initial_batch_size={b}",
                                  f"max_requested_batch={max(b, base.max_requested_batch)}", real_batch]
    chosen["diloco_rampup"] = [*single, "sampling_method=linear_rampup", "rampup_tokens=0", real_batch]
    chosen["localsgd"] = [*single, "sampling_method=constant", "distributed_algo=LocalSGD", f"lr_inner={localsgd_lr}"]
    # communication (issue 22), run when named or with --variants communication: error feedback on throughout
    reference_batch = diloco_batches[len(diloco_batches) // 2] if diloco_batches else base.initial_batch_size
    diloco = chosen.get(f"diloco_b{reference_batch}") or [*single, "sampling_method=constant", real_batch]
    for name, scheme in COMMUNICATION_VARIANTS.items():
        chosen[name] = [*(diloco if name.startswith("diloco") else []), *scheme]
    for name, scheme in CLUSTER_VARIANTS.items():
        chosen[name] = [*(diloco if name.startswith("diloco") else []), *scheme]
    return chosen


# compressed outer sync, sketched statistics and streaming; diloco_* use the middle --diloco_batches batch (8 by
# default)
STREAMING = ["sync_fragments=4", "sync_delay=1", "fragment_alpha=0.5"]
COMMUNICATION_VARIANTS = {
    "adloco_sketch": ["statistics_comm=sketch"],
    "adloco_int8": ["outer_compression=int8"],
    "adloco_int8_sketch": ["outer_compression=int8", "statistics_comm=sketch"],
    "adloco_fp8": ["outer_compression=fp8"],
    "adloco_topk": ["outer_compression=topk"],
    "diloco_int8": ["outer_compression=int8"],
    "diloco_topk": ["outer_compression=topk"],
    # Streaming DiLoCo: 4 fragments (one per block of microllama-tiny), each overlapping one inner step, mixed
    # half and half when it lands (Douillard et al. 2025's alpha with overlap)
    "adloco_streaming": STREAMING,
    "adloco_streaming_int8": [*STREAMING, "outer_compression=int8"],
    "diloco_streaming": STREAMING,
}
# heterogeneous clusters (issue 23): the field's speed-aware baseline, DyLU (Async Local-SGD), and AdLoCo with it
CLUSTER_VARIANTS = {"diloco_by_speed": ["inner_steps_by_speed=true"], "adloco_by_speed": ["inner_steps_by_speed=true"]}
CLUSTER_KEYS = ("devices", "nodes_per_gpu", "network", "throughput", "node_tokens_per_s", "node_schedule",
                "device_memory_mb")


def cluster_overrides(path: str) -> list[str]:
    """--cluster FILE as run.py overrides; a one-line error for what is not a cluster description."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"error: --cluster: cannot read {path} ({exc})") from None
    if not isinstance(raw, dict) or not raw:
        raise SystemExit(f"error: --cluster: {path} must hold a mapping of cluster keys ({', '.join(CLUSTER_KEYS)})")
    unknown = sorted(set(raw) - set(CLUSTER_KEYS))
    if unknown:
        raise SystemExit(f"error: --cluster: {path}: '{unknown[0]}' is not a cluster key ({', '.join(CLUSTER_KEYS)})")
    return [f"{k}={json.dumps(v)}" for k, v in raw.items()]


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def read_run(run_dir: Path) -> dict:
    """A finished run: its curve (one point per outer step, the models alive after that step's merge),
    the real final metric, the best metric seen, merge diagnostics and what batches it really ran."""
    report = run_dir / "model_training_report"
    rows, merges = _read_csv(report / "training_log.csv"), _read_csv(report / "merge_events.csv")
    summary = json.loads((run_dir / "summary.json").read_text())
    metric = summary["metric"]
    pick = max if metric == "val_accuracy" else min
    merge_at = {int(m["outer_step"]): m for m in merges}
    by_step: dict[int, list[dict[str, str]]] = {}
    for r in rows:
        by_step.setdefault(int(r["outer_step"]), []).append(r)
    curve = []
    for step in sorted(by_step):
        rs = by_step[step]
        alive = {r["trainer_id"]: float(r[metric]) for r in rs}
        if step in merge_at:  # the merged model replaces its members from this point on
            m = merge_at[step]
            for merged in m["merged"].split():
                alive.pop(merged, None)
            alive[m["survivor"]] = float(m["metric_after"])
        last = rs[-1]
        # the run's own simulated clock: when this step's last trainer (or its merge) finished
        sim = [float(r["sim_time_s"]) for r in rs if r.get("sim_time_s")]
        if step in merge_at and merge_at[step].get("sim_time_s"):
            sim.append(float(merge_at[step]["sim_time_s"]))
        curve.append({"step": step, "metric": pick(alive.values()), "tokens": int(last["global_tokens"] or 0),
                      "rounds": int(last["rounds"] or 0), "syncs": int(last["syncs"] or 0),
                      "bytes": int(last["bytes_communicated"] or 0), "wall": float(last["wall_time"] or 0),
                      "sim_time": max(sim, default=0.0)})
    trained = [r for r in rows if r["outer_step"] != "0"]
    ran = ran_shapes(trained)
    return {"run_dir": run_dir, "curve": curve, "summary": summary, "metric": metric, "final": summary["final_metric"],
            "best_seen": summary.get("best_metric_seen"), "ran": ran,
            "merges": [{"before": [float(v) for v in m["metric_before"].split()],
                        "weighted": float(m["metric_weighted_before"]), "after": float(m["metric_after"])}
                       for m in merges],
            "requested_batches": sorted({int(r["requested_batch"]) for r in trained}),
            "max_accumulation": max(int(r["accumulation_steps"]) for r in trained),
            "grad_sq_norm": [float(r["grad_sq_norm"]) for r in trained if r.get("grad_sq_norm")],
            "train_loss_first": float(trained[0]["train_loss"])}


def ran_shapes(rows: list[dict]) -> str:
    """What a run really ran, loader batch x accumulation steps: one shape, or the smallest..largest by the
    batch they make (every trainer, every step; not the first and last rows)."""
    shapes = {(int(r["loader_batch"]) * int(r["accumulation_steps"]), int(r["accumulation_steps"]),
               f"{r['loader_batch']}x{r['accumulation_steps']}") for r in rows}
    low, high = min(shapes), max(shapes)
    return low[2] if low == high else f"{low[2]}..{high[2]}"


def value_at(curve: list[dict], axis: str, budget: float, log_scale: bool = True) -> tuple[float, bool]:
    """The metric at exactly `budget` on `axis`: interpolated between the last point at or under the budget
    and the next one (in log space for perplexity). (value, True) when the run reached the budget;
    (its last value, False) when it ended below it."""
    under = [p for p in curve if p[axis] <= budget]
    after = next((p for p in curve if p[axis] > budget), None)
    last = under[-1]
    if after is None or last[axis] == budget:
        return last["metric"], last[axis] >= budget
    frac = (budget - last[axis]) / (after[axis] - last[axis])
    if log_scale:
        return math.exp(math.log(last["metric"]) + frac * (math.log(after["metric"]) - math.log(last["metric"]))), True
    return last["metric"] + frac * (after["metric"] - last["metric"]), True


def first_reaching(curve: list[dict], target: float, key: str, higher_is_better: bool) -> float | None:
    for point in curve:
        if (point["metric"] >= target) if higher_is_better else (point["metric"] <= target):
            return point[key]
    return None


# Keys that say where a run's files go, not what it computes: a finished run is reused across them.
WHERE_KEYS = frozenset({"log_dir", "cache_dir", "run_name"})


def resolved(config_path: str | Path, overrides: list[str]) -> dict:
    """The config a run.py command line resolves to, as its config.yaml records it (cpu_capability auto:
    the kernels torch uses here, which the harness's children inherit), without the keys that only place
    files."""
    values = {k: v for k, v in load_config(config_path, overrides).to_dict().items() if k not in WHERE_KEYS}
    if values.get("cpu_capability") == "auto":
        import torch

        values["cpu_capability"] = torch.backends.cpu.get_cpu_capability().lower()
    return values


def config_changes(run_dir: Path, wanted: dict) -> list[str]:
    """How a finished run's config differs from the one asked for ('key: was -> now'); [] = the same."""
    try:
        had = resolved(run_dir / "config.yaml", [])
    except Exception:  # unreadable, or keys of another version: not reusable
        return ["config.yaml: unreadable"]
    return [f"{k}: {had.get(k)!r} -> {wanted.get(k)!r}" for k in sorted(set(had) | set(wanted))
            if had.get(k) != wanted.get(k)]


def clear_run_dir(run_dir: Path) -> None:
    """Remove a run directory to redo it, unless a live process holds it (another harness, a run.py)."""
    holder = in_use(run_dir)
    if holder:
        raise SystemExit(f"error: {run_dir} is in use by {holder}; stop that run or use another --out")
    shutil.rmtree(run_dir)


def run_child(cmd: list[str], log_path: Path) -> int:
    """Run one run.py to its end. If the harness is stopped meanwhile, the child gets the same signal (it
    checkpoints and exits; SIGKILL after 120 s), so no orphan keeps training."""
    with log_path.open("w") as log_file:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            return child.wait()
        except BaseException as exc:
            signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGTERM
            if child.poll() is None:
                child.send_signal(signum)
                try:
                    child.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            raise


def run_variant(name: str, overrides: list[str], seed: int, args, out: Path, extra: list[str]) -> Path:
    run_name = f"{name}_seed{seed}"
    run_dir = out / "runs" / run_name
    run_args = [*args.overrides, *extra, *overrides, f"training_seed={seed}", f"log_dir={out / 'runs'}",
                f"run_name={run_name}", "clearml_mode=off", f"max_tokens={args.max_tokens}",
                f"num_outer_steps={args.max_outer_steps}", "save_weights_every=0"]
    if (run_dir / "summary.json").is_file() and not args.rerun:
        changes = config_changes(run_dir, resolved(args.config, run_args))
        if not changes:
            return run_dir  # finished earlier with this very config: resume the comparison instead of redoing it
        shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
        print(f"{run_name}: the finished run in {run_dir} was made with another config ({shown}); running it again")
    if run_dir.exists():
        clear_run_dir(run_dir)
    cmd = [sys.executable, str(ROOT / "run.py"), "--config", args.config, *run_args]
    if run_child(cmd, out / "runs" / f"{run_name}.out") != 0:
        raise SystemExit(f"variant {name} (seed {seed}) failed; see {out / 'runs' / f'{run_name}.out'}")
    return run_dir


def warm_start(args, out: Path) -> list[str]:
    """Phase 1 of the warm-start workflow: the overrides that start every variant from one pretrained model."""
    if args.pretrain_config:
        run_dir = out / "pretrain"
        pretrain_args = [*args.pretrain_set, f"log_dir={out}", "run_name=pretrain", "clearml_mode=off",
                         "save_weights_every=0"]
        finished = (run_dir / "summary.json").is_file()
        changes = config_changes(run_dir, resolved(args.pretrain_config, pretrain_args)) if finished else []
        if changes:
            print(f"phase 1: the pretrained start in {run_dir} was made with another config "
                  f"({'; '.join(changes[:4])}); pretraining again")
        if not finished or changes:
            if run_dir.exists():
                clear_run_dir(run_dir)
            cmd = [sys.executable, str(ROOT / "run.py"), "--config", args.pretrain_config, *pretrain_args]
            print(f"phase 1: pretraining the shared start ({args.pretrain_config}) into {run_dir}")
            if run_child(cmd, out / "pretrain.out") != 0:
                raise SystemExit(f"error: --pretrain_config: phase 1 failed; see {out / 'pretrain.out'}")
        init_from = run_dir
    elif args.init_from:
        init_from = Path(args.init_from)
    else:
        return []
    model_dir = (init_from / "model_weights" / "final" / "final_model").resolve()
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"error: --init_from: {model_dir} holds no final model (config.json); give a finished "
                         "run directory")
    summary = json.loads((init_from / "summary.json").read_text()) if (init_from / "summary.json").is_file() else {}
    print(f"warm start from {model_dir} ({summary.get('metric', 'metric')} {summary.get('final_metric', '?')} "
          "on its own data)")
    return [f"model_config.name={model_dir}", "model_config.pretrained=true", "tokenizer=auto"]


def _shown(path: Path) -> str:
    """A path as the report shows it: relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(results: dict[str, list[dict]], base: Config, args) -> dict:
    """Every table of the report, as lists of dicts."""
    any_run = next(iter(results.values()))[0]
    metric = any_run["metric"]
    higher = metric == "val_accuracy"
    diloco_default = f"diloco_b{base.initial_batch_size}"
    finals = {n: [r["final"] for r in runs] for n, runs in results.items()}
    reference = diloco_default if diloco_default in finals else next((n for n in finals if n.startswith("diloco")), "")
    target = args.target or (statistics.mean(finals[reference]) if reference else 0.0)
    main_rows, budget_rows, merge_rows = [], [], []
    for name, runs in results.items():
        final_mean, final_std = _mean_std(finals[name])
        row = {"variant": name, "ran": runs[0]["ran"], "final_mean": final_mean, "final_std": final_std,
               "best_seen_mean": statistics.mean(r["best_seen"] for r in runs if r["best_seen"] is not None)
               if any(r["best_seen"] is not None for r in runs) else None}
        for key in ("tokens", "rounds", "syncs", "bytes", "wall"):
            row[key] = statistics.mean(r["curve"][-1][key] for r in runs)
        for key in ("tokens", "rounds", "syncs", "bytes", "wall"):
            reach = [first_reaching(r["curve"], target, key, higher) for r in runs]
            got = [v for v in reach if v is not None]
            row[f"{key}_to_target"] = statistics.mean(got) if len(got) == len(reach) else f"{len(got)}/{len(reach)}"
        row.update({"merges": statistics.mean(len(r["merges"]) for r in runs),
                    "max_requested_batch": max(max(r["requested_batches"]) for r in runs),
                    "max_accumulation": max(r["max_accumulation"] for r in runs),
                    "theorem2_bound": communication_bound(base, runs[0])})
        main_rows.append(row)
        events = [m for r in runs for m in r["merges"]]
        if events:
            best_member = [(max if higher else min)(m["before"]) for m in events]
            change = [100 * (m["after"] - b) / b for m, b in zip(events, best_member)]
            better_than_weighted = [(m["after"] >= m["weighted"]) if higher else (m["after"] <= m["weighted"])
                                    for m in events]
            merge_rows.append({"variant": name, "merges": len(events),
                               "best_member_mean": statistics.mean(best_member),
                               "weighted_members_mean": statistics.mean(m["weighted"] for m in events),
                               "after_mean": statistics.mean(m["after"] for m in events),
                               "after_vs_best_member_pct_mean": statistics.mean(change),
                               "after_vs_best_member_pct_worst": (min if higher else max)(change),
                               "share_better_than_weighted": sum(better_than_weighted) / len(events)})
    budgets = {"tokens": float(args.max_tokens)}
    for axis in ("rounds", "syncs", "bytes"):
        totals = [r["curve"][-1][axis] for runs in results.values() for r in runs if r["curve"][-1][axis] > 0]
        if totals:
            budgets[axis] = float(min(totals))  # the largest budget every communicating run reached
    for axis, budget in budgets.items():
        for name, runs in results.items():
            values = [value_at(r["curve"], axis, budget, log_scale=not higher) for r in runs]
            mean, std = _mean_std([v for v, _ in values])
            budget_rows.append({"axis": axis, "budget": budget, "variant": name, "metric_mean": mean,
                                "metric_std": std, "runs_ended_below_budget": sum(not ok for _, ok in values)})
    return {"metric": metric, "target": target, "reference": reference, "main": main_rows, "budgets": budget_rows,
            "merges": merge_rows}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _time_to(curves: list[list[dict]], target: float, higher: bool) -> float | None:
    """Mean predicted time to the target over seeds; None unless every seed reached it."""
    reach = [first_reaching(c, target, "time", higher) for c in curves]
    return statistics.mean(reach) if all(v is not None for v in reach) else None


def parse_networks(args) -> tuple[list[network.Network], float]:
    """--network and --crossover_latency, checked before any run starts."""
    try:
        nets = [network.parse_network(s) for s in (args.network or list(network.PRESETS))]
        return nets, network.parse_latency(args.crossover_latency)
    except ValueError as e:
        raise SystemExit(f"error: --network / --crossover_latency: {e}") from None


def network_report(results: dict[str, list[dict]], metric: str, args, out: Path) -> list[str]:
    """Predicted wall time on each --network (benchmarks/network.py): network.csv, crossover.csv, two plots,
    and the report's markdown lines."""
    predicted = predict_on_networks(results, metric, args)
    rows, crossover, target = predicted["rows"], predicted["crossover"], predicted["target"]
    for name, table in (("network.csv", rows), ("crossover.csv", crossover)):
        if table:
            with (out / name).open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(table[0]))
                w.writeheader()
                w.writerows(table)
    figures = [_plot_network(predicted["panels"], target, metric, out),
               _plot_crossover(crossover, list(results), target, metric, predicted["crossover_latency"], out)]
    lines = ["## Predicted wall time on a network (benchmarks/network.py)", "",
             "A cost model, not a measurement: each run's logged rounds (tokens per node, nodes per trainer, merges, "
             f"node moves) priced at {_throughput_words(predicted['throughput'], args)} plus, per "
             "synchronisation, latency + bytes / bandwidth (ring all-reduce for a trainer's nodes, all-gather of "
             "compressed payloads"
             f"{'' if args.no_statistics else ', the batch test statistics included'}). Nodes compute in parallel, "
             "trainers synchronise in parallel; a streamed fragment costs only what its sync_delay inner steps "
             "do not hide. Ignored: other overlap of compute and communication, stragglers, "
             f"contention, evaluation. Target {metric}: {target:.4g} "
             f"({'given' if args.time_target else 'the loosest value every run reached'}); time budget: "
             f"{'given' if args.time_budget else 'the shortest predicted run'} per network. "
             "network_share: the part of the predicted time the network adds.", ""]
    for net, _, budget in predicted["panels"]:
        lines += [f"### {network.describe(net)}", "",
                  *_table([r for r in rows if r["network"] == net.name],
                          ["variant", "time_to_target_s", "vs_fastest", "metric_at_budget_mean", "metric_at_budget_std",
                           "total_time_s", "network_share"]), "",
                  f"metric_at_budget: at {budget:.4g} s of predicted time.", ""]
    lines += [f"### Crossover: who reaches {metric} {target:.4g} first, by bandwidth (latency "
              f"{args.crossover_latency})", "",
              *_table(_crossover_ranges(crossover), ["bandwidth", "winner", "runner_up", "margin",
                                                     "adloco_vs_best_diloco"]), "",
              "margin: the runner-up's predicted time to the target over the winner's (range over the band). "
              "adloco_vs_best_diloco: AdLoCo's predicted time to the target over the fastest DiLoCo variant's "
              "(below 1: AdLoCo is faster).", "",
              *[f"![{p.stem}]({p.name})" for p in figures], ""]
    return lines


def _throughput_words(throughput, args) -> str:
    if isinstance(throughput, ThroughputCurve):
        return (f"the throughput curve {args.throughput_curve} ({throughput.source}; each trainer's micro-batch and "
                "accumulation as it ran them)")
    how = "given" if args.node_throughput else "measured: all runs, tokens / wall time"
    return f"{throughput:.4g} tokens/s per node ({how})"


def clock_report(results: dict[str, list[dict]], metric: str, args) -> list[str]:
    """--cluster: each run timed by its own simulated clock (sim_time_s), utilisation and idle time."""
    higher = metric == "val_accuracy"
    runs = [r for rs in results.values() for r in rs]
    pick = min if higher else max
    target = args.time_target or pick((max if higher else min)(p["metric"] for p in r["curve"]) for r in runs)
    rows = []
    for name, rs in results.items():
        reach = [first_reaching(r["curve"], target, "sim_time", higher) for r in rs]
        got = [v for v in reach if v is not None]
        s = [r["summary"] for r in rs]
        rows.append({"variant": name, "sim_time_to_target_s": statistics.mean(got) if len(got) == len(reach)
                     else f"{len(got)}/{len(reach)}", "sim_time_s": statistics.mean(x["sim_time_s"] for x in s),
                     "utilisation": statistics.mean(x["utilisation"] for x in s),
                     "idle_node_seconds": statistics.mean(x["idle_node_seconds"] for x in s),
                     "busy_node_seconds": statistics.mean(x["busy_node_seconds"] for x in s),
                     "goodput_tokens_per_s": statistics.mean(x["goodput_tokens_per_s"] for x in s),
                     "final_mean": statistics.mean(x["final_metric"] for x in s)})
    reached = [r["sim_time_to_target_s"] for r in rows if isinstance(r["sim_time_to_target_s"], float)]
    for r in rows:
        r["vs_fastest"] = r["sim_time_to_target_s"] / min(reached) if r["sim_time_to_target_s"] in reached else None
    clock = runs[0]["summary"].get("clock", {})
    how = "given" if args.time_target else "the loosest value every run reached"
    with (Path(args.report_out or args.out) / "clock.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return ["## The simulated cluster's clock (--cluster)", "",
            f"Cluster `{args.cluster}`: network {clock.get('network')}, throughput {clock.get('throughput')}, node "
            f"speeds {clock.get('node_speeds')}. Each run timed live by its own clock (README \"A simulated clock\": "
            "each node computes its tokens at the curve's pace for its micro-batch x its speed, a trainer's round "
            "ends with its slowest node and its collectives, trainers advance independently between merges, a merge "
            f"waits for its members). Target {metric}: {target:.4g} ({how}). utilisation: busy node-seconds / "
            "available node-seconds; idle: present and "
            "not computing (stragglers, collectives, merges, a finished trainer waiting); means over seeds.", "",
            *_table(rows, ["variant", "sim_time_to_target_s", "vs_fastest", "final_mean", "sim_time_s", "utilisation",
                           "idle_node_seconds", "busy_node_seconds", "goodput_tokens_per_s"]), ""]


def predict_on_networks(results: dict[str, list[dict]], metric: str, args) -> dict:
    """Every run's curve against predicted time, per --network and over a grid of bandwidths: the rows of
    network.csv (time to target, metric at a time budget, network share) and of crossover.csv."""
    higher = metric == "val_accuracy"
    nets, crossover_latency = parse_networks(args)
    runs = [r for rs in results.values() for r in rs]
    for r in runs:
        r["rounds_work"], r["weight_bytes"], _ = network.read_rounds(r["run_dir"], statistics=not args.no_statistics)
    measured = sum(r["curve"][-1]["tokens"] for r in runs) / max(sum(r["curve"][-1]["wall"] for r in runs), 1e-9)
    throughput = ThroughputCurve.load(args.throughput_curve) if args.throughput_curve else \
        args.node_throughput or measured

    def timed(net: network.Network) -> dict[str, list[list[dict]]]:
        curves = {}
        for name, rs in results.items():
            for r in rs:
                times, compute = network.timeline(r["rounds_work"], net, throughput, r["weight_bytes"])
                curve = [{**p, "time": times[p["step"]]} for p in r["curve"] if p["step"] in times]
                curve[-1]["compute"] = compute
                curves.setdefault(name, []).append(curve)
        return curves

    pick = min if higher else max  # the loosest value: every run's best point reaches it
    target = args.time_target or pick((max if higher else min)(p["metric"] for p in r["curve"]) for r in runs)
    rows, panels = [], []
    for net in nets:
        curves = timed(net)
        budget = args.time_budget or min(c[-1]["time"] for cs in curves.values() for c in cs)
        reach = {name: _time_to(cs, target, higher) for name, cs in curves.items()}
        fastest = min((v for v in reach.values() if v is not None), default=None)
        for name, cs in curves.items():
            values = [value_at(c, "time", budget, log_scale=not higher) for c in cs]
            mean, std = _mean_std([v for v, _ in values])
            got = sum(first_reaching(c, target, "time", higher) is not None for c in cs)
            rows.append({"network": net.name, "variant": name,
                         "time_to_target_s": reach[name] if reach[name] is not None else f"{got}/{len(cs)}",
                         "vs_fastest": reach[name] / fastest if reach[name] is not None and fastest else None,
                         "time_budget_s": budget, "metric_at_budget_mean": mean, "metric_at_budget_std": std,
                         "total_time_s": statistics.mean(c[-1]["time"] for c in cs),
                         "network_share": statistics.mean(1 - c[-1]["compute"] / c[-1]["time"] if c[-1]["time"]
                                                          else 0.0 for c in cs)})
        panels.append((net, curves, budget))
    crossover = []  # which variant reaches the target first, bandwidth by bandwidth
    for bandwidth in network.bandwidth_grid():
        reach = {name: _time_to(cs, target, higher)
                 for name, cs in timed(network.Network("grid", bandwidth, crossover_latency)).items()}
        ranked = sorted((v, name) for name, v in reach.items() if v is not None)
        if not ranked:
            continue
        diloco = [v for name, v in reach.items() if name.startswith("diloco") and v is not None]
        crossover.append({"bandwidth_bit_s": bandwidth * 8, "winner": ranked[0][1], "winner_time_s": ranked[0][0],
                          "runner_up": ranked[1][1] if len(ranked) > 1 else None,
                          "margin": ranked[1][0] / ranked[0][0] if len(ranked) > 1 else None,
                          "adloco_vs_best_diloco": reach["adloco"] / min(diloco)
                          if reach.get("adloco") and diloco else None,
                          **{f"time_{name}": v for name, v in reach.items()}})
    return {"throughput": throughput, "target": target, "crossover_latency": crossover_latency, "rows": rows,
            "panels": panels, "crossover": crossover}


def _crossover_ranges(crossover: list[dict]) -> list[dict]:
    """Consecutive bandwidths with the same winner and runner-up, as one row."""
    bands: list[dict] = []
    for row in crossover:
        last = bands[-1] if bands else None
        if last and (last["winner"], last["runner_up"]) == (row["winner"], row["runner_up"]):
            last["high"] = row["bandwidth_bit_s"]
            last["margins"].append(row["margin"])
            last["adloco"].append(row["adloco_vs_best_diloco"])
        else:
            bands.append({"winner": row["winner"], "runner_up": row["runner_up"], "low": row["bandwidth_bit_s"],
                          "high": row["bandwidth_bit_s"], "margins": [row["margin"]],
                          "adloco": [row["adloco_vs_best_diloco"]]})

    def span(values: list) -> str:
        values = [v for v in values if v is not None]
        return f"{min(values):.3g}x..{max(values):.3g}x" if values else "-"

    return [{"bandwidth": f"{network.format_rate(b['low'], 3)} .. {network.format_rate(b['high'], 3)}",
             "winner": b["winner"], "runner_up": b["runner_up"], "margin": span(b["margins"]),
             "adloco_vs_best_diloco": span(b["adloco"])} for b in bands]


def _plot_network(panels: list, target: float, metric: str, out: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (net, curves, budget) in zip(axes[0], panels):
        for name, cs in curves.items():
            ax.plot([p["time"] for p in cs[0]], [p["metric"] for p in cs[0]], marker="o", ms=2.5,
                    ls="-" if name.startswith("adloco") else "--", label=name)
        ax.axhline(target, color="grey", lw=0.8, ls=":")
        ax.axvline(budget, color="grey", lw=0.8, ls=":")
        if metric == "val_perplexity":
            readable_y(ax, [p["metric"] for cs in curves.values() for p in cs[0]])
        ax.set(xlabel="predicted wall time (s)", title=network.describe(net))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{metric} (best model alive, seed 0)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(f"{metric} against predicted wall time (dotted: the target and the time budget)")
    fig.tight_layout()
    path = out / f"{metric}_vs_predicted_time.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_crossover(crossover: list[dict], names: list[str], target: float, metric: str, latency: float,
                    out: Path) -> Path:
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.5, 7), sharex=True)
    bits = [row["bandwidth_bit_s"] for row in crossover]
    for name in names:
        times = [row.get(f"time_{name}") for row in crossover]
        if not any(t is not None for t in times):
            continue
        style = "-" if name.startswith("adloco") else "--"
        top.plot(bits, [t if t is not None else float("nan") for t in times], style, label=name)
        bottom.plot(bits, [t / row["winner_time_s"] if t is not None else float("nan")
                           for t, row in zip(times, crossover)], style, label=name)
    top.set(xscale="log", yscale="log", ylabel="predicted time to target (s)",
            title=f"time to {metric} {target:.4g}, by bandwidth (latency {latency * 1e3:g} ms)")
    bottom.set(xscale="log", yscale="log", xlabel="bandwidth per node link (bit/s)",
               ylabel="time / the fastest variant's")
    for ax in (top, bottom):
        ax.grid(alpha=0.3, which="both")
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    path = out / "crossover_bandwidth.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(results: dict[str, list[dict]], metric: str, out: Path) -> list[Path]:
    plt = _plt()
    paths = []
    for key, label in (*AXES.items(), ("wall", "wall time (s)")):
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, runs in results.items():
            curve = runs[0]["curve"]  # first seed; the tables have the spread over seeds
            ax.plot([p[key] for p in curve], [p["metric"] for p in curve], marker="o", ms=3,
                    ls="-" if name.startswith("adloco") else "--", label=f"{name} ({runs[0]['ran']})")
        if metric == "val_perplexity":
            readable_y(ax, [p["metric"] for runs in results.values() for p in runs[0]["curve"]])
        ax.set(xlabel=label, ylabel=f"{metric} (best model alive)", title=f"{metric} against {label} (seed 0)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{metric}_vs_{key}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows)]


def write_outputs(report: dict, results: dict, args, out: Path) -> str:
    with (out / "comparison.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(report["main"][0]))
        w.writeheader()
        w.writerows(report["main"])
    with (out / "budgets.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(report["budgets"][0]))
        w.writeheader()
        w.writerows(report["budgets"])
    with (out / "merges.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "seed", "metric_before", "metric_weighted_before", "metric_after"])
        for name, runs in results.items():
            for seed, r in enumerate(runs):
                for m in r["merges"]:
                    w.writerow([name, seed, " ".join(f"{v:.6g}" for v in m["before"]), m["weighted"], m["after"]])
    metric = report["metric"]
    warm = f"; warm start: {args.warm_from}" if args.warm_from else ""
    lines = [f"# AdLoCo comparison ({datetime.now():%Y-%m-%d})", "",
             f"Config `{args.config}` {' '.join(args.overrides)}; seeds: {args.seeds}; token budget per run: "
             f"{args.max_tokens}{warm}; target {metric}: {report['target']:.4g} "
             f"({'given' if args.target else report['reference'] + ' final mean'}).", "",
             f"## Final models ({metric} of the real final model, mean and std over seeds; best seen during the run)",
             "", *_table(report["main"], ["variant", "ran", "final_mean", "final_std", "best_seen_mean", "tokens",
                                          "rounds", "syncs", "bytes", "wall", "merges", "max_requested_batch",
                                          "max_accumulation", "theorem2_bound"]), "",
             "## To the target (mean over seeds; k/n: only k of n seeds reached it)", "",
             *_table(report["main"], ["variant", "tokens_to_target", "rounds_to_target", "syncs_to_target",
                                      "bytes_to_target", "wall_to_target"]), ""]
    for axis, label in AXES.items():
        rows = [r for r in report["budgets"] if r["axis"] == axis]
        if not rows:
            continue
        lines += [f"## At a matched budget of {rows[0]['budget']:.6g} {label}", "",
                  *_table(rows, ["variant", "metric_mean", "metric_std", "runs_ended_below_budget"]), ""]
    lines += ["## Merges: the merged model against its members (every merge of every seed)", ""]
    lines += (_table(report["merges"], ["variant", "merges", "best_member_mean", "weighted_members_mean",
                                        "after_mean", "after_vs_best_member_pct_mean",
                                        "after_vs_best_member_pct_worst", "share_better_than_weighted"])
              if report["merges"] else ["no merges"])
    lines += ["", "ran: loader batch x accumulation steps actually run (first..last). final: the model the run "
              "leaves in model_weights/final (after its last merge). At a matched budget: the metric of the best "
              "model alive, interpolated between the last outer step at or under the budget and the next (log "
              "scale for perplexity); runs_ended_below_budget counts seeds that stopped before it (their last "
              "value is used). Budgets for rounds, syncs and bytes: the smallest total any communicating run "
              "reached. Definitions of rounds, syncs and bytes: algorithms/traffic.py. theorem2_bound: "
              "benchmarks/theory.py.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plot(results, metric, out)]
    if args.cluster:
        lines += ["", *clock_report(results, metric, args)]
    lines += ["", *network_report(results, metric, args, out)]
    text = "\n".join(lines) + "\n"
    (out / "comparison.md").write_text(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "config.yaml"))
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant (training_seed 0..seeds-1)")
    p.add_argument("--max_tokens", type=int, default=0,
                   help="token budget per run; 0 = what the first AdLoCo run uses in its num_outer_steps")
    p.add_argument("--max_outer_steps", type=int, default=200, help="upper bound on outer steps per run")
    p.add_argument("--variants", default="all", help="comma-separated subset of the variants; all (the comparison "
                   "without the communication variants) or communication (adloco, the middle diloco_bB and the "
                   "compressed / sketched variants)")
    p.add_argument("--diloco_batches", default="2,4,8,16", help="constant batches of the DiLoCo baselines")
    p.add_argument("--target", type=float, default=0.0,
                   help="target metric; 0 = the final mean of DiLoCo at the initial batch")
    p.add_argument("--localsgd_lr", type=float, default=0.3, help="inner SGD learning rate of the LocalSGD baseline")
    p.add_argument("--pretrain_config", default="", help="phase 1 of the warm start: run.py config of the shared start")
    p.add_argument("--pretrain_set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for phase 1 (repeatable)")
    p.add_argument("--init_from", default="", help="warm start from this finished run's final model")
    p.add_argument("--out", default=str(ROOT / "logs" / "compare"),
                   help="runs and report (default logs/compare, outside the committed results; BENCHMARKS.md's "
                        "commands name benchmarks/results/... explicitly)")
    p.add_argument("--rerun", action="store_true", help="redo runs that already finished")
    p.add_argument("--report_out", default="",
                   help="write the tables and plots here instead of --out (the runs stay in --out/runs): another "
                        "view of finished runs, e.g. on other --network settings, without overwriting the report")
    p.add_argument("--network", action="append", default=[], metavar="[NAME=]BANDWIDTH,LATENCY",
                   help="a network to predict wall time on (repeatable): e.g. '10Gbit/s,1ms', 'lab=1Gbit/s,0.2ms' "
                        f"or a preset ({', '.join(network.PRESETS)}); default: the three presets")
    p.add_argument("--node_throughput", type=float, default=0.0,
                   help="tokens/s of one node for the network model; 0 = measured from the runs")
    p.add_argument("--time_target", type=float, default=0.0,
                   help="target metric of the network model; 0 = the loosest value every run reached")
    p.add_argument("--time_budget", type=float, default=0.0,
                   help="seconds of predicted time; 0 = the shortest predicted run, per network")
    p.add_argument("--crossover_latency", default="10ms", help="latency of the crossover over bandwidths")
    p.add_argument("--cluster", default="", help="a cluster description (YAML: devices with speed, nodes_per_gpu, "
                   "network, throughput, node_schedule, ...) applied to every run; adds the by_speed variants and the "
                   "clock's report")
    p.add_argument("--throughput_curve", default="", help="network model: a throughput curve file (benchmarks.system "
                   "--curve) instead of a flat tokens/s")
    p.add_argument("--no_statistics", action="store_true",
                   help="network model: leave out the batch test's statistics (the weights traffic only)")
    p.add_argument("overrides", nargs="*", help="run.py key=value overrides applied to every variant, after "
                   "--config (e.g. lr_inner=1e-3 num_inner_steps=10); each variant's own keys come after them")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parse_networks(args)
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, raise_interrupted) for signum in stops}
    try:
        return _compare(args)
    except Interrupted as stopped:  # SIGINT / SIGTERM / SIGHUP: the running child was stopped too
        print(f"stopped by {signal.Signals(stopped.signum).name}: the running variant was stopped too; run the same "
              "command again to go on (finished runs are reused)", file=sys.stderr)
        return 128 + stopped.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _compare(args) -> int:
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if args.cluster:  # every run on the described cluster, before the command line's own overrides
        args.overrides = [*cluster_overrides(args.cluster), *args.overrides]
    if args.throughput_curve:
        try:
            ThroughputCurve.load(args.throughput_curve)
        except ValueError as exc:
            raise SystemExit(f"error: --throughput_curve: {exc}") from None
    base = load_config(args.config, args.overrides)
    extra = warm_start(args, out)
    args.warm_from = _shown(Path(extra[0].split("=", 1)[1])) if extra else ""
    chosen = variants(base, [int(b) for b in args.diloco_batches.split(",") if b], args.localsgd_lr)
    if args.variants == "all":  # the original comparison; the communication variants when asked for
        chosen = {k: v for k, v in chosen.items() if k not in COMMUNICATION_VARIANTS
                  and (args.cluster or k not in CLUSTER_VARIANTS)}
    elif args.variants == "communication":
        middle = f"diloco_b{args.diloco_batches.split(',')[len(args.diloco_batches.split(',')) // 2]}"
        chosen = {k: v for k, v in chosen.items() if k in ("adloco", middle, *COMMUNICATION_VARIANTS)}
    else:
        unknown = set(args.variants.split(",")) - set(chosen)
        if unknown:
            raise SystemExit(f"error: --variants: unknown {', '.join(sorted(unknown))}; "
                             f"choose from {', '.join(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in args.variants.split(",")}
    if not args.max_tokens:
        # the budget: what AdLoCo itself consumes in the configured number of outer steps
        budget_args = argparse.Namespace(**{**vars(args), "max_tokens": 0, "max_outer_steps": base.num_outer_steps})
        first = read_run(run_variant("adloco", [], 0, budget_args, out, extra))
        args.max_tokens = first["curve"][-1]["tokens"]
        print(f"token budget: {args.max_tokens} tokens (AdLoCo, {base.num_outer_steps} outer steps, seed 0)")
    results: dict[str, list[dict]] = {}
    jobs = [(name, seed) for name in chosen for seed in range(args.seeds)]
    for name, seed in tqdm(jobs, desc="runs", unit="run"):
        results.setdefault(name, []).append(read_run(run_variant(name, chosen[name], seed, args, out, extra)))
    report_out = Path(args.report_out) if args.report_out else out
    report_out.mkdir(parents=True, exist_ok=True)
    print(write_outputs(summarise(results, base, args), results, args, report_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
