"""Does the network cost model predict real collectives? Measured on this machine's loopback under torchrun.

    python -m benchmarks.network_check [--out benchmarks/results/network_check] [--procs 2] [--backend gloo]

Starts `torchrun --standalone --nproc-per-node N` on itself. The ranks first calibrate the model's two
numbers on point-to-point messages only: latency = half the round trip of a 4-byte message, bandwidth =
bytes / (one-way time of a 64 MB message - latency). Then they time all-reduces of several sizes (those of
a microllama-tiny round among them: the fp32 weights, the fp64 batch-test statistics) and compare each
with what benchmarks/replay.py predicts from the calibrated numbers. When benchmarks/results/distributed/
results.json exists (python -m benchmarks.distributed), the collectives of its training rounds are also
compared with the model's prediction for the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from algorithms.network import Network
from benchmarks.launch import run_child

ROOT = Path(__file__).resolve().parents[1]

TINY_WEIGHTS = 7_148_032  # microllama-tiny's fp32 weights (P), as in the benchmark runs
SIZES = {"8 B (a scalar)": 8, "64 KB": 65_536, "1 MB": 1_000_000, "weights P (microllama-tiny)": TINY_WEIGHTS,
         "statistics 2P + 56 (fp64)": 2 * TINY_WEIGHTS + 56, "64 MB": 64_000_000}


def _timed(fn, repeats: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    def ping_pong(nbytes: int) -> None:
        """One-way time of an nbytes message between rank 0 and rank 1 (half a round trip)."""
        buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    for _ in range(3):  # warm-up: connections, allocations
        ping_pong(64_000_000)
    latency = _timed(lambda: ping_pong(4), 50) / 2
    big = 64_000_000
    one_way = _timed(lambda: ping_pong(big), 5) / 2
    bandwidth = big / max(one_way - latency, 1e-9)
    model = Network("loopback", bandwidth, latency)
    rows = []
    for label, nbytes in SIZES.items():
        buf = torch.ones(max(nbytes // 4, 2), dtype=torch.float32)
        dist.all_reduce(buf)
        measured = _timed(lambda buf=buf: dist.all_reduce(buf), 20 if nbytes < 10**7 else 5)
        predicted = model.allreduce(world, nbytes)
        rows.append({"size": label, "bytes": nbytes, "measured_s": measured, "predicted_s": predicted,
                     "measured_over_predicted": measured / predicted})
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration.json").write_text(json.dumps(
            {"procs": world, "backend": args.backend, "latency_s": latency, "bandwidth_bytes_s": bandwidth,
             "allreduce": rows}, indent=1))
    dist.destroy_process_group()


def report(out: Path) -> str:
    cal = json.loads((out / "calibration.json").read_text())
    model = Network("loopback", cal["bandwidth_bytes_s"], cal["latency_s"])
    lines = [f"Calibrated on point-to-point messages ({cal['procs']} processes, {cal['backend']}, loopback): "
             f"latency {cal['latency_s'] * 1e6:.1f} us, bandwidth {cal['bandwidth_bytes_s'] / 1e6:.0f} MB/s "
             f"({cal['bandwidth_bytes_s'] * 8 / 1e9:.2f} Gbit/s).", "",
             "| all-reduce of | measured s | model s | measured / model |", "|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['measured_s']:.4g} | {r['predicted_s']:.4g} | {r['measured_over_predicted']:.2f} |"
              for r in cal["allreduce"]]
    dist_results = ROOT / "benchmarks" / "results" / "distributed" / "results.json"
    if dist_results.is_file():
        res = json.loads(dist_results.read_text())
        rounds = [(s, w, st) for s, w, st in zip(res["comm_s_per_round"], res["comm_weights_mb_per_round"],
                                                 res["comm_statistics_mb_per_round"]) if w > 0]
        if rounds:
            # on 2 processes a ring all-reduce sends its payload once per node: the MB sent are the payloads
            measured = statistics.median(s for s, _, _ in rounds)
            weights, stats = (statistics.median(r[i] for r in rounds) * 1e6 for i in (1, 2))
            predicted = model.allreduce(2, weights) + model.allreduce(2, stats) + model.allreduce(2, 8)
            lines += ["", f"Training rounds of `benchmarks.distributed` (rank 0, rounds whose trainer spans both "
                          f"processes, median of {len(rounds)}): {weights / 1e6:.1f} MB of weights and "
                          f"{stats / 1e6:.1f} MB of statistics all-reduced; measured {measured * 1e3:.1f} ms of "
                          f"collectives, the model predicts {predicted * 1e3:.1f} ms (measured / model "
                          f"{measured / predicted:.2f}). The measured time also holds the round's small "
                          "collectives (metrics, arrival marks) and waiting for the other process to finish "
                          "its inner steps, which the model leaves out."]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "network_check"))
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.procs),
           "-m", "benchmarks.network_check", "--worker", "--out", args.out, "--backend", args.backend]
    if run_child(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}) != 0:
        raise SystemExit("error: the torchrun workers failed (see above)")
    print(report(Path(args.out)))
    return 0


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
