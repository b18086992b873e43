"""Batch-size measures of the report: optimizer steps to the target against the best constant batch (the measure
Merrill et al. 2025 use for batch-size warmup), the critical batch size the constant-batch sweep implies (Zhang
et al. 2025: the batch beyond which the steps to the target fall more than 20% short of linear scaling), and a
plot of each variant's requested batch against tokens."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.compare.reader import first_reaching
from benchmarks.compare.shared import plt_

LINEAR_SCALING_SLACK = 1.2  # Zhang et al.'s 20%


def steps_to_target(runs: list[dict], target: float, higher: bool) -> float | None:
    """Mean optimizer steps in sequence (rounds x H) to the target over seeds; None unless every seed reached it."""
    reach = [first_reaching(r.get("fine_curve", r["curve"]), target, "steps", higher) for r in runs]
    return statistics.mean(reach) if reach and all(v is not None for v in reach) else None


def sweep(results: dict[str, list[dict]], target: float, higher: bool) -> list[tuple[int, float | None]]:
    """The constant-batch sweep (diloco_bB): (B, steps to the target), by B."""
    return sorted((runs[0]["constant_batch"], steps_to_target(runs, target, higher))
                  for runs in results.values() if runs[0].get("constant_batch"))


def critical_batch(points: list[tuple[int, float | None]]) -> tuple[int | None, str]:
    """Zhang et al.'s critical batch from a sweep: the largest B whose steps to the target stay within 20% of linear
    scaling from the smallest batch that reached it, S(B) <= 1.2 S(B0) B0 / B. (B or None, how the sweep brackets
    it, in words)."""
    reached = [(b, s) for b, s in points if s is not None]
    if len(reached) < 2:
        return None, "needs two constant batches that reach the target"
    b0, s0 = reached[0]
    within = [(b, s) for b, s in reached if s <= LINEAR_SCALING_SLACK * s0 * b0 / b]
    largest = within[-1][0]
    beyond = next(((b, s) for b, s in reached if b > largest), None)
    if beyond is None:
        return largest, f">= {largest}: the largest batch of the sweep still scales within 20%"
    b, s = beyond
    return largest, (f"between {largest} and {b}: batch {b} needs {s:.4g} steps, {s / (s0 * b0 / b):.2f}x linear "
                     f"scaling from batch {b0}")


def rows(results: dict[str, list[dict]], target: float, higher: bool) -> tuple[list[dict], str]:
    """Per variant: steps to the target and their ratio to the best constant batch's; the critical batch in words."""
    points = sweep(results, target, higher)
    best = min((s for _, s in points if s is not None), default=None)
    out = []
    for name, runs in results.items():
        steps = steps_to_target(runs, target, higher)
        out.append({"variant": name, "steps_to_target": steps,
                    "steps_vs_best_constant": steps / best if steps is not None and best else None})
    batch, words = critical_batch(points)
    return out, f"critical batch (per node): {words}" if batch is not None else f"critical batch: {words}"


def plot(results: dict[str, list[dict]], out: Path) -> Path:
    """Each variant's requested batch (of the best model alive) against tokens, seed 0."""
    plt = plt_()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, runs in results.items():
        curve = runs[0]["curve"]
        ax.step([p["tokens"] for p in curve], [p["batch"] for p in curve], where="post",
                ls="-" if runs[0]["family"] == "adloco" else "--", label=name)
    ax.set(xlabel="tokens seen (all trainers)", ylabel="requested batch per node (best model alive)", yscale="log",
           title="Requested batch against tokens (seed 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "requested_batch_vs_tokens.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
