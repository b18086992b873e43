"""Measuring a throughput curve: tokens/s of one node against its micro-batch and accumulation steps.

`benchmarks.system --curve` writes the file the simulated clock reads (algorithms/clock.py); config
`throughput: measured` measures the same once per device kind, model and sequence length, and caches it.
Each point is the median of `repeats` timed optimizer steps (after one warm-up): `accumulation` forward and
backward passes of `micro_batch` full sequences of random tokens, then the optimizer step, on a replica.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from algorithms.clock import ThroughputCurve
from utils import cache

log = logging.getLogger(__name__)


def curve_batches(largest: int) -> list[int]:
    """Micro-batches to measure: powers of two below `largest`, and `largest` itself."""
    out, b = [], 1
    while b < largest:
        out.append(b)
        b *= 2
    return [*out, largest]


def _sync(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def measure_curve(model: torch.nn.Module, make_optimizer: Callable, device: str, seq_len: int, largest: int,
                  accumulations: tuple[int, ...] = (1, 2, 4), repeats: int = 3,
                  autocast: Callable = contextlib.nullcontext) -> ThroughputCurve:
    """The curve of a fresh replica of `model` on `device`, micro-batches 1 .. `largest` (powers of two);
    autocast: the run's precision context (fabrics/precision.py)."""
    replica = copy.deepcopy(model).to(device).train()
    params = [p for p in replica.parameters() if p.requires_grad]
    optimizer = make_optimizer(params)
    vocab = int(getattr(replica.config, "vocab_size", 256))
    generator = torch.Generator().manual_seed(0)  # the tokens do not matter to the timing; fixed, so runs agree
    points = []
    for micro_batch in curve_batches(largest):
        ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=generator).to(device)
        # language models predict the next token; a classifier (bert) one label per sequence
        labels = torch.zeros(micro_batch, dtype=torch.long, device=device) \
            if getattr(replica.config, "model_type", "") == "bert" else ids
        for accumulation in accumulations:
            times = []
            for i in range(repeats + 1):  # the first is a warm-up (allocations, kernel choice)
                _sync(device)
                start = time.perf_counter()
                for _ in range(accumulation):
                    with autocast():
                        loss = replica(input_ids=ids, labels=labels).loss
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                _sync(device)
                if i:
                    times.append(time.perf_counter() - start)
            points.append((micro_batch, accumulation, accumulation * micro_batch * seq_len / statistics.median(times)))
            log.info("throughput %s: micro-batch %d x %d -> %.0f tokens/s", device, micro_batch, accumulation,
                     points[-1][2])
    del replica, optimizer
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ThroughputCurve(tuple(points), f"measured on {device_kind(device)}")


def device_kind(device: str) -> str:
    """What the curve depends on: the CPU model or the GPU's name."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"cpu {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def cached_curve(cache_dir: Path, key: dict, measure: Callable[[], ThroughputCurve]
                 ) -> tuple[ThroughputCurve, Path | None]:
    """The curve cached under `key` (device kind, model, sequence length, precision, largest micro-batch), or
    measured now and cached (its path; None when the cache could not take it: utils/cache.py)."""
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir).expanduser() / "throughput" / f"{name}.json"
    if path.is_file():
        try:
            return ThroughputCurve.load(path), path
        except ValueError:
            log.warning("throughput: the cached curve %s is unreadable; measuring again", path)
    curve = measure()
    about = curve.to_dict(**key, source=curve.source)
    if cache.store(cache_dir, path, lambda tmp: tmp.write_text(json.dumps(about, indent=1)),
                   "the measured throughput curve"):
        return ThroughputCurve.load(path), path
    return curve, None  # not cached: this run uses it from memory
