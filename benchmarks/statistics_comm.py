"""How cheap can the batch tests' statistics travel without changing the decisions? (statistics_comm)

    python -m benchmarks.statistics_comm [--configs config.yaml configs/compare_cpu.yaml:ETA=0.8 ...] [--dims 4096]

Each config (PATH or PATH:KEY=VALUE,KEY=VALUE) runs once with the exact fp64 two-vector statistics (the
reference trajectory). At every batch-test decision the same gradient samples are also reduced as `minimal`
(the default: one fp32 vector and fp64 scalars) sends them and count-sketched to each --dims k (as `sketch`
would), and the test decides again on those statistics from the same state.
Reported per config and mode: the share of decisions whose next requested batch equals fp64's, the
share whose uncapped request (test_requested_batch) does, and the statistics bytes per round as a
share of the weights bytes (both per node of a trainer's ring reductions: payload / 4P).
Written to --out (default logs/statistics_comm): statistics_comm.json and statistics_comm.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import distributed.node_round as node_round
from algorithms.calc_batch import REFERENCE_WIRE, STATISTICS_WIRE, BatchTest, statistics_payload_bytes
from algorithms.sketch import CountSketch, sketch_coefficients
from utils import run_plan
from utils.config import load_config
from utils.errors import exit_code_of

ROOT = Path(__file__).resolve().parents[1]

# the default run, the harness's from-scratch and warm AdLoCo, and the paper's variant from scratch (nodes estimator)
DEFAULT_CONFIGS = ["config.yaml", "configs/compare_cpu.yaml", "configs/compare_warm_cpu.yaml",
                   "configs/compare_cpu.yaml:variance_estimator=nodes,ETA=0.8,initial_batch_size=1,merge_frequency=3"]


def shadow_run(config: str, overrides: list[str], dims: list[int]) -> dict:
    """One fp64 run; every decision also taken on minimal- and sketch-reduced statistics of the same samples."""
    from run import train

    path, _, own = config.partition(":")
    overrides = [*overrides, *(o for o in own.split(",") if o)]
    modes = ["minimal"] + [f"sketch k={k}" for k in dims]
    counts = {m: {"decisions": 0, "same_batch": 0, "same_request": 0} for m in modes}
    shadows: dict[int, dict] = {}
    sketches: dict[int, CountSketch] = {}
    exact_statistics, exact_call = node_round.trainer_statistics, BatchTest.__call__

    def statistics(samples, within_node, wire=REFERENCE_WIRE):
        exact = exact_statistics(samples, within_node, wire)
        alternatives = {"minimal": exact_statistics(samples, within_node, STATISTICS_WIRE["minimal"])}
        for k in dims:
            sketch = sketches.setdefault(k, CountSketch(k, sketch_coefficients(k)))
            alternatives[f"sketch k={k}"] = exact_statistics([(sketch(g), b) for g, b in samples], within_node,
                                                             STATISTICS_WIRE["sketch"])
        shadows[id(exact)] = alternatives
        return exact

    def decide(self, samples, current, num_nodes, tokens_seen=0):
        decision = exact_call(self, samples, current, num_nodes, tokens_seen)
        for mode, other in shadows.pop(id(samples), {}).items():
            shadow = exact_call(self, other, current, num_nodes, tokens_seen)
            c = counts[mode]
            c["decisions"] += 1
            c["same_batch"] += shadow.requested_batch == decision.requested_batch
            asked = decision.stats.get("test_requested_batch")
            c["same_request"] += shadow.stats.get("test_requested_batch") == asked
        return decision

    node_round.trainer_statistics, BatchTest.__call__ = statistics, decide
    try:
        with tempfile.TemporaryDirectory() as log_dir:
            cfg = load_config(ROOT / path, [*overrides, f"log_dir={log_dir}", "clearml_mode=off",
                                              "statistics_comm=fp64"])
            _, summary = train(cfg)
    finally:
        node_round.trainer_statistics, BatchTest.__call__ = exact_statistics, exact_call
    within_node = run_plan.within_node(cfg)
    weights = summary["weight_bytes"]
    trainable = weights // 4  # float state ~ trainable parameters for these models
    out = {"config": config, "overrides": overrides, "weight_bytes": weights, "final_metric": summary["final_metric"],
           "modes": {}}
    for mode in ["fp64", *modes]:
        numel = int(mode.split("=")[1]) if mode.startswith("sketch") else trainable
        wire = STATISTICS_WIRE[mode.split()[0]]
        share = statistics_payload_bytes(numel, within_node, wire) / weights
        row = {"statistics_share_of_weights": share}
        if mode != "fp64":
            c = counts[mode]
            row.update(c, same_batch_share=c["same_batch"] / max(1, c["decisions"]),
                       same_request_share=c["same_request"] / max(1, c["decisions"]))
        out["modes"][mode] = row
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| config | statistics_comm | decisions | same next batch | same uncapped request | "
             "statistics bytes / weights bytes |", "|---|---|---|---|---|---|"]
    for r in results:
        for mode, row in r["modes"].items():
            if mode == "fp64":
                share = 100 * row["statistics_share_of_weights"]
                lines.append(f"| {r['config']} | fp64 (reference) | | | | {share:.1f}% |")
                continue
            lines.append(f"| {r['config']} | {mode} | {row['decisions']} | {100 * row['same_batch_share']:.1f}% | "
                         f"{100 * row['same_request_share']:.1f}% | {100 * row['statistics_share_of_weights']:.2f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    p.add_argument("--dims", nargs="+", type=int, default=[4096, 16384, 65536])
    p.add_argument("--out", default="logs/statistics_comm")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    args = p.parse_args(argv)
    results: list[dict] = []
    code = exit_code_of(lambda: results.extend(shadow_run(c, args.overrides, args.dims) for c in args.configs))
    if code:
        return code
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "statistics_comm.json").write_text(json.dumps(results, indent=2))
    (out / "statistics_comm.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
