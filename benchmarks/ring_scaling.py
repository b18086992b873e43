"""Compressed outer syncs as the cluster grows: bytes per node and in all, and the time of one sync.

    python -m benchmarks.ring_scaling [--out benchmarks/results/ring_scaling] [--procs 2,4,8] [--repeats 5]

One trainer of n nodes syncs a microllama-tiny-sized pseudo-gradient (P = 7,148,032 bytes of fp32) once per
scheme: none (the fp32 ring all-reduce), bf16 / fp8 / int8 (a ring of quantized shards: algorithms/
outer_sync.py) and top-k 2% (all-gathered). Measured under `torchrun --standalone --nproc-per-node n` on this
machine for each n of --procs, through the torchrun backend's own collectives (distributed/torchrun_backend.py and
distributed/ring.py), whose counters give the bytes each rank sent; the same bytes by the accounting
(algorithms/traffic.py) must agree, and the network model (algorithms/network.py) prices them at n = 16 and
64 too. What matters here is bytes
and their ratio to fp32, set beside the physical floor (the payload's size over P); on 2 cores the times say
little about a real network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from algorithms.network import PRESETS, parse_network
from algorithms.outer_sync import OuterSync
from algorithms.traffic import SyncCost, Traffic
from benchmarks.launch import run_child

ROOT = Path(__file__).resolve().parents[1]

WEIGHT_BYTES = 7_148_032  # microllama-tiny's fp32 weights (P)
SCHEMES = ("none", "bf16", "fp8", "int8", "topk")
PRICED_AT = (2, 4, 8, 16, 64)


def accounted(scheme: str, n: int, numel: int = WEIGHT_BYTES // 4) -> int:
    """All nodes' bytes for one sync of a trainer of n nodes, by the accounting."""
    sync = OuterSync(scheme)
    traffic = Traffic()
    traffic.add(SyncCost(0 if sync.exact else sync.payload_bytes(numel), ring=sync.ring), n, 4 * numel)
    return traffic.allreduce_bytes


def priced(scheme: str, n: int, network: str, numel: int = WEIGHT_BYTES // 4) -> float:
    """Seconds of one sync on a preset network (the same SyncCost)."""
    sync = OuterSync(scheme)
    cost = SyncCost(0 if sync.exact else sync.payload_bytes(numel), ring=sync.ring)
    return cost.seconds(parse_network(network), n, WEIGHT_BYTES, 0.0)


def worker(out: Path, repeats: int) -> None:
    """One rank: every scheme's sync through TorchrunBackend's collectives; rank 0 writes what all sent."""
    import torch
    import torch.distributed as dist

    from algorithms.comm_plan import CommPlan
    from distributed.torchrun_backend import TorchrunBackend

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    numel = WEIGHT_BYTES // 4
    members = tuple(range(n))
    master = {"w": torch.zeros(numel)}
    delta = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 1e-3
    rows = {}
    for scheme in SCHEMES:
        sync = OuterSync(scheme)
        backend = TorchrunBackend([], rank, {"w": master["w"].shape}, plan=CommPlan(outer_sync=sync))
        payload = None if sync.exact else sync.encode(master, {"w": master["w"] - delta}, None)[0]

        def once(sync=sync, backend=backend, payload=payload):
            if sync.exact:
                return backend.net.all_reduce(master["w"] - delta, members, "weights")
            if sync.ring:
                return backend.ring.mean(master, payload, numel, members, list(members), None)
            return backend.net.all_gather(payload, members, "weights")

        once()  # warm-up: groups, buffers
        before = backend.net.sent["weights"]
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            once()
            times.append(time.perf_counter() - start)
        sent = (backend.net.sent["weights"] - before) / repeats
        everyone = [None] * n
        dist.all_gather_object(everyone, {"sent": sent, "seconds": statistics.median(times)})
        rows[scheme] = {"sent_per_rank": [e["sent"] for e in everyone],
                        "seconds": max(e["seconds"] for e in everyone)}
    if rank == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure(procs: list[int], repeats: int, tmp: Path) -> dict[int, dict]:
    measured = {}
    for n in procs:
        result = tmp / f"ring_{n}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               "-m", "benchmarks.ring_scaling", "--worker", str(result), "--repeats", str(repeats)]
        log = tmp / f"ring_{n}.log"
        code = run_child(cmd, log, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1200)
        if code != 0:
            raise SystemExit(f"error: torchrun with {n} processes failed:\n{log.read_text()[-3000:]}")
        measured[n] = json.loads(result.read_text())
    return measured


def report(measured: dict[int, dict]) -> tuple[list[dict], str]:
    rows = []
    for n in sorted(set(PRICED_AT) | set(measured)):
        fp32 = accounted("none", n)
        for scheme in SCHEMES:
            total = accounted(scheme, n)
            sync = OuterSync(scheme)
            row = {"nodes": n, "scheme": scheme, "bytes_all_nodes": total, "bytes_per_node": total / n,
                   "ratio_to_fp32": total / fp32,
                   "floor": sync.payload_bytes(WEIGHT_BYTES // 4) / WEIGHT_BYTES,
                   "travels_as": "ring all-reduce" if sync.exact else ("ring of quantized shards" if sync.ring
                                                                       else "all-gather"),
                   **{f"priced_s_{net}": priced(scheme, n, net) for net in PRESETS}}
            if n in measured:
                got = measured[n][scheme]
                row["measured_bytes_all_nodes"] = round(sum(got["sent_per_rank"]))
                row["measured_sync_s"] = got["seconds"]
            rows.append(row)
    lines = ["| nodes | scheme | travels as | bytes per node | ratio to fp32 | floor (payload / P) | measured bytes "
             "(all ranks) = accounted | measured sync (2 cores, loopback) | priced: " + " / ".join(PRESETS) + " |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        got = r.get("measured_bytes_all_nodes")
        check = "" if got is None else f"{got:,} {'=' if got == r['bytes_all_nodes'] else '!='}"
        timed = f"{r['measured_sync_s'] * 1e3:.1f} ms" if "measured_sync_s" in r else ""
        prices = " / ".join(f"{r[f'priced_s_{net}'] * 1e3:.1f}" for net in PRESETS) + " ms"
        lines.append(f"| {r['nodes']} | {r['scheme']} | {r['travels_as']} | {r['bytes_per_node'] / 1e6:.2f} MB | "
                     f"{r['ratio_to_fp32']:.3f} | {r['floor']:.3f} | {check} | {timed} | {prices} |")
    return rows, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "logs" / "ring_scaling"))
    p.add_argument("--procs", default="2,4,8", help="trainer sizes measured under torchrun (processes)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(Path(args.worker), args.repeats)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured = measure([int(n) for n in args.procs.split(",") if n], args.repeats, out)
    rows, table = report(measured)
    (out / "ring_scaling.json").write_text(json.dumps(rows, indent=1))
    (out / "ring_scaling.md").write_text(table + "\n")
    print(table)
    mismatched = [r for r in rows if "measured_bytes_all_nodes" in r and r["measured_bytes_all_nodes"] !=
                  r["bytes_all_nodes"]]
    if mismatched:
        print(f"error: measured bytes differ from the accounting for {len(mismatched)} rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
