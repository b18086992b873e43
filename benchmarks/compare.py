"""Reproduce the paper's comparison (Figures 1 and 2): AdLoCo against DiLoCo, LocalSGD and ablations.

    python -m benchmarks.compare --config config.yaml --seeds 3 --out benchmarks/results/compare

Every variant trains on the same data, model and seeds, with the same token budget (`--max_tokens`,
default: what the AdLoCo config uses in num_outer_steps with its initial batch, measured by a first
AdLoCo run), as a separate `run.py` process. Variants are config overrides of the base config:

  adloco              the base config (adaptive batching, merging, switch mode)
  diloco              one trainer on all nodes, constant batch, no merging (DiLoCo)
  localsgd            as diloco with LocalSGD (inner SGD at --localsgd_lr, outer = average)
  adloco_no_adaptive  sampling_method: constant
  adloco_no_merge     merge_frequency: 0
  adloco_no_switch    switch_mode: only_data_loader (never accumulate)

Writes comparison.md and comparison.csv (final validation perplexity mean and spread over seeds,
outer synchronisations, bytes, tokens and wall time to reach the target perplexity, default
DiLoCo's final mean) and plots of perplexity against synchronisations, tokens and wall time.
Beside the measured synchronisations it prints the Theorem-2-style bound (benchmarks/theory.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.theory import communication_bound  # noqa: E402
from utils.config import load_config  # noqa: E402


def variants(localsgd_lr: float) -> dict[str, list[str]]:
    single = ["num_init_trainers=1", "sampling_method=constant", "merge_frequency=0"]
    return {
        "adloco": [],
        "diloco": single,
        "localsgd": [*single, "distributed_algo=LocalSGD", f"lr_inner={localsgd_lr}"],
        "adloco_no_adaptive": ["sampling_method=constant"],
        "adloco_no_merge": ["merge_frequency=0"],
        "adloco_no_switch": ["switch_mode=only_data_loader"],
    }


def read_run(run_dir: Path) -> dict:
    with (run_dir / "model_training_report" / "training_log.csv").open() as f:
        rows = list(csv.DictReader(f))
    with (run_dir / "model_training_report" / "merge_events.csv").open() as f:
        merges = list(csv.DictReader(f))
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = {}  # outer step -> the best trainer's perplexity and the run's counters at that point
    for r in rows:
        step = int(r["outer_step"])
        point = curve.setdefault(step, {"ppl": math.inf, "comms": 0, "tokens": 0, "wall": 0.0, "bytes": 0})
        point["ppl"] = min(point["ppl"], float(r["val_perplexity"]))
        point["comms"] = max(point["comms"], int(r["communications"] or 0))
        point["tokens"] = max(point["tokens"], int(r["global_tokens"] or 0))
        point["bytes"] = max(point["bytes"], int(r["bytes_communicated"] or 0))
        point["wall"] = max(point["wall"], float(r["wall_time"] or 0))
    trained = [r for r in rows if r["outer_step"] != "0"]
    return {"curve": [curve[s] for s in sorted(curve)], "summary": summary, "merges": len(merges),
            "requested_batches": sorted({int(r["requested_batch"]) for r in trained}),
            "max_accumulation": max(int(r["accumulation_steps"]) for r in trained),
            "grad_sq_norm": [float(r["grad_sq_norm"]) for r in trained if r.get("grad_sq_norm")],
            "train_loss_first": float(trained[0]["train_loss"])}


def first_reaching(curve: list[dict], target: float, key: str) -> float | None:
    for point in curve:
        if point["ppl"] <= target:
            return point[key]
    return None


def run_variant(name: str, overrides: list[str], seed: int, args, out: Path) -> Path:
    run_name = f"{name}_seed{seed}"
    run_dir = out / "runs" / run_name
    if (run_dir / "summary.json").is_file() and not args.rerun:
        return run_dir  # finished earlier: resume the comparison instead of redoing it
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cmd = [sys.executable, str(ROOT / "run.py"), "--config", args.config, *args.overrides, *overrides,
           f"training_seed={seed}", f"log_dir={out / 'runs'}", f"run_name={run_name}", "clearml_mode=off",
           f"max_tokens={args.max_tokens}", f"num_outer_steps={args.max_outer_steps}", "save_weights_every=0"]
    with (out / "runs" / f"{run_name}.out").open("w") as log_file:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"variant {name} (seed {seed}) failed; see {out / 'runs' / f'{run_name}.out'}")
    return run_dir


def plot(results: dict[str, list[dict]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label in (("comms", "outer synchronisations + merges"), ("tokens", "tokens seen"),
                       ("wall", "wall time (s)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, runs in results.items():
            curve = runs[0]["curve"]  # first seed; the table has the spread over seeds
            ax.plot([p[key] for p in curve], [p["ppl"] for p in curve], marker="o", ms=3, label=name)
        ax.set_yscale("log")
        ax.set(xlabel=label, ylabel="validation perplexity (best trainer)",
               title=f"Validation perplexity against {label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"perplexity_vs_{key}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "config.yaml"))
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant (training_seed 0..seeds-1)")
    p.add_argument("--max_tokens", type=int, default=0,
                   help="token budget per run; 0 = what the first AdLoCo run uses in its num_outer_steps")
    p.add_argument("--max_outer_steps", type=int, default=200, help="upper bound on outer steps per run")
    p.add_argument("--variants", default="all", help="comma-separated subset of the variants")
    p.add_argument("--target", type=float, default=0.0, help="target perplexity; 0 = DiLoCo's final mean")
    p.add_argument("--localsgd_lr", type=float, default=0.3, help="inner SGD learning rate of the LocalSGD baseline")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compare"))
    p.add_argument("--rerun", action="store_true", help="redo runs that already finished")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every variant")
    args = p.parse_args(argv)
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    base = load_config(args.config, args.overrides)
    chosen = variants(args.localsgd_lr)
    if args.variants != "all":
        chosen = {k: v for k, v in chosen.items() if k in args.variants.split(",")}
    if not args.max_tokens:
        # the budget: what AdLoCo itself consumes in the configured number of outer steps
        budget_args = argparse.Namespace(**{**vars(args), "max_tokens": 0, "max_outer_steps": base.num_outer_steps})
        first = read_run(run_variant("adloco", [], 0, budget_args, out))
        args.max_tokens = first["curve"][-1]["tokens"]
        print(f"token budget: {args.max_tokens} tokens (AdLoCo, {base.num_outer_steps} outer steps, seed 0)")
    results: dict[str, list[dict]] = {}
    jobs = [(name, seed) for name in chosen for seed in range(args.seeds)]
    for name, seed in tqdm(jobs, desc="runs", unit="run"):
        run_dir = run_variant(name, chosen[name], seed, args, out)
        results.setdefault(name, []).append(read_run(run_dir))
    # final = the best trainer at the last outer step, from the same CSV as the curves
    finals = {n: [r["curve"][-1]["ppl"] for r in runs] for n, runs in results.items()}
    target = args.target or (statistics.mean(finals["diloco"]) if "diloco" in finals else 0.0)
    table = []
    for name, runs in results.items():
        ppl = finals[name]
        reach = [first_reaching(r["curve"], target, "comms") for r in runs]
        reach_tokens = [first_reaching(r["curve"], target, "tokens") for r in runs]
        reach_wall = [first_reaching(r["curve"], target, "wall") for r in runs]

        def mean_or_none(values):
            got = [v for v in values if v is not None]
            return statistics.mean(got) if len(got) == len(values) else None

        bound = communication_bound(base, runs[0])
        table.append({
            "variant": name, "final_ppl_mean": statistics.mean(ppl),
            "final_ppl_std": statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
            "syncs": statistics.mean(r["curve"][-1]["comms"] for r in runs),
            "bytes_mb": statistics.mean(r["curve"][-1]["bytes"] for r in runs) / 1e6,
            "tokens": statistics.mean(r["curve"][-1]["tokens"] for r in runs),
            "wall_s": statistics.mean(r["curve"][-1]["wall"] for r in runs),
            "syncs_to_target": mean_or_none(reach), "tokens_to_target": mean_or_none(reach_tokens),
            "wall_s_to_target": mean_or_none(reach_wall),
            "merges": statistics.mean(r["merges"] for r in runs),
            "max_requested_batch": max(max(r["requested_batches"]) for r in runs),
            "max_accumulation": max(r["max_accumulation"] for r in runs),
            "theorem2_bound": bound,
        })
    write_outputs(table, results, target, args, out)
    return 0


def _fmt(v) -> str:
    if v is None:
        return "not reached"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_outputs(table: list[dict], results: dict, target: float, args, out: Path) -> None:
    with (out / "comparison.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    cols = ["variant", "final_ppl_mean", "final_ppl_std", "syncs", "bytes_mb", "tokens", "wall_s", "syncs_to_target",
            "tokens_to_target", "wall_s_to_target", "merges", "max_requested_batch", "max_accumulation",
            "theorem2_bound"]
    lines = [f"# AdLoCo comparison ({datetime.now():%Y-%m-%d})", "",
             f"Config `{args.config}` {' '.join(args.overrides)}; seeds: {args.seeds}; token budget per run: "
             f"{args.max_tokens}; target perplexity: {target:.4g} "
             f"({'given' if args.target else 'DiLoCo final mean'}).", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in table:
        lines.append("| " + " | ".join(_fmt(row[c]) for c in cols) + " |")
    lines += ["", "syncs = outer synchronisations (one per trainer per outer step) + merges; *_to_target = first "
              "outer step whose best trainer reaches the target (mean over seeds; 'not reached' if a seed never "
              "did); theorem2_bound: see benchmarks/theory.py for the formula and its assumptions.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plot(results, out)]
    (out / "comparison.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
