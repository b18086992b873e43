"""Simulated cluster vs torchrun: wall time per round, and communication time against bytes per round.

    python -m benchmarks.distributed [--out benchmarks/results/distributed] [--steps 5] [key=value ...]

Runs the same config twice, 2 nodes each: in one process (the simulation, nodes in turn) and under
`torchrun --standalone --nproc-per-node 2` (gloo, one node per process). Per round it reads the wall
time from training_log.csv and, for torchrun, the seconds and bytes of rank 0's collectives per round
(metrics.jsonl, comm/*) and what all ranks sent over the run (summary.json, bytes_sent_by_collectives)
against the accounting's weights_traffic_bytes. Both runs must take the same decisions; the script checks it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.launch import run_child
from run_dir.reader import RunFiles
from training_logs.records import TrainerRow

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ["devices=[cpu]", "nodes_per_gpu=2", "num_init_trainers=2", "merge_frequency=2", "num_inner_steps=10",
          "max_batch_size=4", "clearml_mode=off", "save_weights_every=0", "plot_every=100"]


def run(cmd: list[str], out: Path) -> float:
    start = time.time()
    code = run_child(cmd, out)
    if code != 0:
        sys.exit(f"error: {' '.join(cmd[:4])} ... failed (exit {code}); see {out}")
    return time.time() - start


def per_round(run_dir: Path) -> list[float]:
    walls = sorted({r.outer_step: r.wall_time for r in RunFiles(run_dir).records(TrainerRow)}.items())
    return [b - a for (_, a), (_, b) in zip(walls, walls[1:])]


def decisions(run_dir: Path) -> list[tuple]:
    return [(r.outer_step, r.trainer_id, r.nodes, r.requested_batch, r.next_requested_batch)
            for r in RunFiles(run_dir).records(TrainerRow)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "distributed"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out / "runs", ignore_errors=True)  # the previous benchmark's runs
    (out / "runs").mkdir(parents=True)
    config = [*CONFIG, f"num_outer_steps={args.steps}", f"log_dir={out / 'runs'}", *args.overrides]
    total = {
        "simulated": run([sys.executable, "run.py", *config, "run_name=simulated"], out / "runs" / "simulated.out"),
        "torchrun": run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "run.py", *config, "run_name=torchrun"], out / "runs" / "torchrun.out"),
    }
    sim, dist = out / "runs" / "simulated", out / "runs" / "torchrun"
    same = decisions(sim) == decisions(dist)
    comm = RunFiles(dist).metrics()
    comm = [r["metrics"] for r in comm if "comm/seconds" in r["metrics"]]
    result = {
        "config": config, "same_decisions": same, "process_wall_s": total,
        "round_s": {"simulated": per_round(sim), "torchrun": per_round(dist)},
        "comm_s_per_round": [c["comm/seconds"] for c in comm],
        "comm_weights_mb_per_round": [c["comm/weights_mb"] for c in comm],
        "comm_statistics_mb_per_round": [c["comm/statistics_mb"] for c in comm],
        "summary": {k: RunFiles(d).summary() for k, d in (("simulated", sim), ("torchrun", dist))},
    }
    sim_round, dist_round = (statistics.median(result["round_s"][k]) for k in ("simulated", "torchrun"))
    # rounds where rank 0's trainer had two nodes (before the first merge, each trainer has one)
    busy = [(s, w + st) for s, w, st in zip(result["comm_s_per_round"], result["comm_weights_mb_per_round"],
                                             result["comm_statistics_mb_per_round"]) if w + st > 0] or [(0.0, 0.0)]
    comm_s = statistics.median(s for s, _ in busy)
    payload = statistics.median(mb for _, mb in busy)
    sent = result["summary"]["torchrun"]["bytes_sent_by_collectives"]
    counted = result["summary"]["simulated"]["weights_traffic_bytes"]
    lines = [
        "| | simulated (1 process) | torchrun (2 processes, gloo) |", "|---|---|---|",
        f"| median wall time per round | {sim_round:.2f} s | {dist_round:.2f} s ({dist_round / sim_round:.2f}x) |",
        f"| whole command (start-up included) | {total['simulated']:.0f} s | {total['torchrun']:.0f} s |",
        f"| collectives per round that sends (rank 0, median of {len(busy)}) | - | {comm_s * 1000:.0f} ms, "
        f"{payload:.1f} MB sent ({payload / max(comm_s, 1e-9):.0f} MB/s) |",
        f"| weights traffic over the run (all ranks) | {counted / 1e6:.1f} MB counted (`weights_traffic_bytes`) | "
        f"{sent['weights'] / 1e6:.1f} MB sent |",
        f"| batch-test statistics over the run (all ranks) | - | {sent['statistics'] / 1e6:.1f} MB sent |",
        f"| same decisions | {'yes' if same else 'NO'} | |",
    ]
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
