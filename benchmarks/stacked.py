"""Stacked nodes against sequential ones (node_execution: stacked, distributed/stacked.py): aggregate tokens/s.

    python -m benchmarks.stacked [--device cpu|cuda] [--preset microllama-tiny] [--nodes 16] [--batches 1,4]
                                 [--steps 10] [--seq-len 128] [--precision fp32|bf16] [--repeats 3] [--profile]
                                 [--markdown FILE] [--json FILE]

For each micro-batch: N nodes of one device, each a round of --steps inner steps from its own weights on its own
batches, run one after another (Node.run: the sequential loop) and as one stacked group (StackedGroup), alternated
after a warm-up, median of --repeats; the ratio of their aggregate tokens/s (above 1: stacking pays). On CUDA
the peak memory of each (torch.cuda.max_memory_allocated over the round); on a CPU the memory plan's count of what
a stack holds at once (every node's gradients and activations, not one node's). --profile: where a stacked
round's time goes (torch.profiler, the top operators by self time).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
from datetime import datetime
from pathlib import Path

import psutil
import torch

from benchmarks.system import alternated_medians, sync, table
from cluster.memory_plan import plan_of_run
from distributed.stacked import StackedGroup
from fabrics.corpus import load_corpus
from fabrics.models import build_model, count_parameters
from fabrics.precision import build_precision
from node import Node, NodeJob
from trainers import TRAINERS
from utils.config import load_config
from utils.model_state import float_state

MiB = 2**20


def nodes_and_jobs(cfg, model, data, n: int, batch: int, steps: int, device: str, precision) -> tuple[list, list]:
    """N nodes of one device, each with its own weights (the start perturbed per node) and its own batches."""
    make = TRAINERS[cfg.distributed_algo].inner_optimizer_factory(cfg)
    nodes = [Node(i, device, copy.deepcopy(model).to(device), make, cfg.grad_clip, data.train, precision)
             for i in range(n)]
    gen = torch.Generator().manual_seed(0)
    jobs = []
    for i in range(n):
        torch.manual_seed(i)
        master = {k: v.detach() + 1e-3 * torch.randn_like(v) for k, v in float_state(model).items()}
        jobs.append(NodeJob(i, i, master, torch.randint(0, len(data.train), (steps, 1, batch), generator=gen), 0,
                            reset_optimizer=False))
    return nodes, jobs


def run_stacked(nodes, jobs) -> None:
    rounds = StackedGroup(nodes, jobs).steps()
    try:
        while True:
            next(rounds)
    except StopIteration:
        pass


def run_sequential(nodes, jobs) -> None:
    for node, job in zip(nodes, jobs):
        node.run(job)


def measure(cfg, model, data, n: int, batch: int, steps: int, repeats: int, device: str, precision) -> dict:
    """Both ways on the same nodes' rounds: median seconds, aggregate tokens/s, and CUDA peak memory."""
    sequential = nodes_and_jobs(cfg, model, data, n, batch, steps, device, precision)
    stacked = nodes_and_jobs(cfg, model, data, n, batch, steps, device, precision)
    ways = {"sequential": lambda: run_sequential(*sequential), "stacked": lambda: run_stacked(*stacked)}
    peaks = {}
    for name, run in ways.items():  # warm-up (allocator, kernels), and each way's peak memory
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(device)
        run()
        sync(device)
        peaks[name] = torch.cuda.max_memory_allocated(device) / MiB if device.startswith("cuda") else None
    times = alternated_medians(ways, repeats, device)
    tokens = sum(int(data.train.tokens_per_sequence[j.sample_indices.reshape(-1)].sum()) for j in sequential[1])
    seq_s, stk_s = times["sequential"], times["stacked"]
    return {"nodes": n, "batch": batch, "steps": steps, "tokens": tokens, "sequential_s": seq_s, "stacked_s": stk_s,
            "sequential_tokens_per_s": tokens / seq_s, "stacked_tokens_per_s": tokens / stk_s,
            "speedup": seq_s / stk_s, "sequential_peak_mib": peaks["sequential"], "stacked_peak_mib": peaks["stacked"]}


def profile(cfg, model, data, n: int, batch: int, steps: int, device: str, precision, rows: int = 12) -> str:
    """A stacked round's top operators by self time (after a warm-up round)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    nodes, jobs = nodes_and_jobs(cfg, model, data, n, batch, steps, device, precision)
    run_stacked(nodes, jobs)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with torch_profile(activities=activities) as prof:
        run_stacked(nodes, jobs)
        sync(device)
    key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def planned_memory(model, cfg, batch: int) -> list:
    """What the memory plan (cluster/memory_plan.py) counts on the device, sequential against stacked (MiB): every
    node's weights and AdamW state either way; one node's gradients and activations at a time, or every node's."""
    plans = [plan_of_run(cfg.replace(node_execution=way, max_batch_size=batch), model, batch, "cpu").devices[0]
             for way in ("sequential", "stacked")]
    return [batch, *(p.planned_bytes / MiB for p in plans), plans[1].planned_bytes / plans[0].planned_bytes]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="config.yaml")
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="microllama-tiny")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--batches", default="1,4", help="micro-batches per node, comma-separated")
    p.add_argument("--steps", type=int, default=10, help="inner steps per round")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="where a stacked round's time goes (first micro-batch)")
    p.add_argument("--markdown", default="", help="append the tables to this file")
    p.add_argument("--json", default="", help="write the numbers to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA device here")
    batches = [int(b) for b in args.batches.split(",") if b]
    if not batches or min(batches) < 1 or args.nodes < 2 or args.steps < 1 or args.repeats < 1:
        raise SystemExit("error: --batches, --nodes (at least 2), --steps and --repeats must be positive")
    torch.manual_seed(0)
    cfg = load_config(args.config, ["clearml_mode=off", f"model_config.name={args.preset}", f"devices=[{device}]",
                                    f"nodes_per_gpu={args.nodes}", "num_init_trainers=1",
                                    f"seq_len={args.seq_len}", f"precision={args.precision}"])
    data = load_corpus(cfg)
    model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id)
    precision = build_precision(args.precision)
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else \
        f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} CPUs, {torch.get_num_threads()} threads"
    results = [measure(cfg, model, data, args.nodes, b, args.steps, args.repeats, device, precision)
               for b in batches]
    out = [f"## Stacked nodes ({datetime.now():%Y-%m-%d %H:%M}, {where}, torch {torch.__version__}; "
           f"{args.nodes} x {args.preset} ({count_parameters(model) / 1e6:.2f}M parameters), seq_len {cfg.seq_len}, "
           f"{args.precision}, {args.steps} inner steps per round)", "",
           table("Aggregate tokens/s of the device's nodes: sequential (Node.run, one after another) against stacked "
                 "(one vmap'd group); median of repeats after a warm-up, alternated",
                 ["micro-batch", "sequential s", "stacked s", "sequential tokens/s", "stacked tokens/s",
                  "stacked / sequential", *(["sequential peak MiB", "stacked peak MiB"]
                                            if device.startswith("cuda") else [])],
                 [[r["batch"], r["sequential_s"], r["stacked_s"], r["sequential_tokens_per_s"],
                   r["stacked_tokens_per_s"], r["speedup"],
                   *([r["sequential_peak_mib"], r["stacked_peak_mib"]] if device.startswith("cuda") else [])]
                  for r in results])]
    if not device.startswith("cuda"):
        out.append(table("Memory the plan counts on the device (cluster/memory_plan.py): every node's weights and "
                         "AdamW state, plus one node's gradients and activations (sequential) or every node's "
                         "(stacked)", ["micro-batch", "sequential MiB", "stacked MiB", "stacked / sequential"],
                         [planned_memory(model, cfg, b) for b in batches]))
    if args.profile:
        out += [f"### Where a stacked round's time goes (micro-batch {batches[0]}; torch.profiler, self time)", "",
                "```", profile(cfg, model, data, args.nodes, batches[0], args.steps, device, precision), "```", ""]
    text = "\n".join(out)
    print(text)
    if args.markdown:
        with Path(args.markdown).open("a") as f:
            f.write(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "preset": args.preset, "nodes": args.nodes,
                                               "precision": args.precision, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
