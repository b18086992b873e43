"""Batch-size measures of the report: optimizer steps to the target against the best constant batch (the measure
Merrill et al. 2025 use for batch-size warmup), the critical batch size each constant-batch sweep implies (Zhang
et al. 2025: the batch beyond which the steps to the target fall more than 20% short of linear scaling), at the
report's target and at three targets along training, and a plot of each variant's requested batch against
tokens."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from benchmarks.compare.reader import first_reaching, value_at
from benchmarks.compare.shared import plt_

LINEAR_SCALING_SLACK = 1.2  # Zhang et al.'s 20%
Point = tuple[int, float | None, float]  # (B, steps to the target or None, the run's steps)


def steps_to_target(runs: list[dict], target: float, higher: bool) -> float | None:
    """Mean optimizer steps in sequence (rounds x H) to the target over seeds; None unless every seed reached it."""
    reach = [first_reaching(r.get("fine_curve", r["curve"]), target, "steps", higher) for r in runs]
    return statistics.mean(reach) if reach and all(v is not None for v in reach) else None


def series_of(name: str) -> str:
    """The constant-batch sweep a variant belongs to: its name without its batch (diloco_b4 -> diloco,
    diloco_nesterov_b8_tuned -> diloco_nesterov_tuned). Tuned and untuned batches, plain and Nesterov outer steps
    are separate sweeps: a critical batch compares batches under one recipe."""
    return re.sub(r"_b\d+(?=_|$)", "", name)


def sweeps(results: dict[str, list[dict]]) -> dict[str, list[tuple[int, list[dict]]]]:
    """Every constant-batch sweep of the report: series -> [(B, its runs)], by B."""
    out: dict[str, list[tuple[int, list[dict]]]] = {}
    for name, runs in results.items():
        if runs[0].get("constant_batch"):
            out.setdefault(series_of(name), []).append((runs[0]["constant_batch"], runs))
    return {series: sorted(points, key=lambda p: p[0]) for series, points in out.items()}


def sweep_points(points: list[tuple[int, list[dict]]], target: float, higher: bool) -> list[Point]:
    """(B, steps to the target or None, the fewest steps a seed ran) for each batch of one sweep."""
    return [(b, steps_to_target(runs, target, higher), min(r["curve"][-1]["steps"] for r in runs))
            for b, runs in points]


def critical_batch(points: list[Point]) -> tuple[int | None, str]:
    """Zhang et al.'s critical batch from one sweep of (B, steps to the target or None, the run's steps), by B: the
    largest B up to which every batch's steps to the target stay within 20% of linear scaling from the smallest
    batch that reached it, S(B) <= 1.2 S(B0) B0 / B. A batch that never reached the target is beyond it when its run
    had more steps than that bound, and undecided otherwise (its budget ended first). (B or None, in words)."""
    reached = [(b, s) for b, s, _ in points if s is not None]
    if not reached or len(points) < 2:
        return None, "needs two constant batches, one of them reaching the target"
    b0, s0 = reached[0]
    largest = b0
    for b, s, total in points:
        if b <= b0:
            continue
        linear = s0 * b0 / b
        if s is not None and s <= LINEAR_SCALING_SLACK * linear:
            largest = b
            continue
        if s is not None:
            return largest, (f"between {largest} and {b}: batch {b} needs {s:.4g} steps, {s / linear:.2f}x linear "
                             f"scaling from batch {b0}")
        if total > LINEAR_SCALING_SLACK * linear:
            return largest, (f"between {largest} and {b}: batch {b} did not reach it in its {total:.4g} steps, "
                             f"{total / linear:.2f}x linear scaling from batch {b0}")
        return largest, (f">= {largest}; batch {b} is undecided: its run ended at {total:.4g} steps, before 1.2x "
                         f"linear scaling from batch {b0} ({LINEAR_SCALING_SLACK * linear:.4g})")
    return largest, f">= {largest}: the largest batch of the sweep still scales within 20%"


def rows(results: dict[str, list[dict]], target: float, higher: bool) -> tuple[list[dict], str]:
    """Per variant: steps to the target and their ratio to the best constant batch's; each sweep's critical batch
    in words."""
    found = {series: sweep_points(points, target, higher) for series, points in sweeps(results).items()}
    best = min((s for points in found.values() for _, s, _ in points if s is not None), default=None)
    out = []
    for name, runs in results.items():
        steps = steps_to_target(runs, target, higher)
        out.append({"variant": name, "steps_to_target": steps,
                    "steps_vs_best_constant": steps / best if steps is not None and best else None})
    if not found:
        return out, "critical batch: needs a constant-batch sweep (diloco_bB)"
    words = [f"{series}: {critical_batch(points)[1]}" for series, points in found.items()]
    return out, "critical batch (per node) of " + "; of ".join(words)


# where along training the critical batch is measured: the sweep's smallest batch's metric (its worst seed's)
# after these shares of the token budget. Late is 80%, not 100%: at the smallest batch's final value, linear
# scaling's 1.2x bound would exceed a larger batch's whole run (its steps are B0 / B of the smallest's at a matched
# token budget), so a batch that had not reached it could be neither inside nor beyond
ALONG_TRAINING = (("early", 0.2), ("middle", 0.5), ("late", 0.8))


def along_training(results: dict[str, list[dict]], budget: float, higher: bool) -> list[dict]:
    """Each sweep's critical batch at three targets along training (ALONG_TRAINING): whether it grows as training
    goes on (Zhang et al. 2025 find it grows with the data seen)."""
    out = []
    for series, points in sweeps(results).items():
        smallest_runs = points[0][1]
        for when, share in ALONG_TRAINING:
            # the worst seed's value: every seed of the smallest batch reaches it by then
            target = (min if higher else max)(value_at(r["curve"], "tokens", share * budget,
                                                       log_scale=not higher)[0] for r in smallest_runs)
            batch, words = critical_batch(sweep_points(points, target, higher))
            out.append({"sweep": series, "when": when, "tokens": share * budget, "target": target,
                        "critical_batch": batch, "in_words": words})
    return out


def grows(rows: list[dict]) -> list[str]:
    """One sentence per sweep: does its critical batch grow from the early target to the late one?"""
    sentences = []
    for series in dict.fromkeys(r["sweep"] for r in rows):
        found = [r for r in rows if r["sweep"] == series]
        early, late = found[0]["critical_batch"], found[-1]["critical_batch"]
        if early is None or late is None:
            sentences.append(f"{series}: not measured at every target ({found[0]['in_words']})")
            continue
        path = " -> ".join(str(r["critical_batch"]) for r in found)
        verdict = "grows" if late > early else "does not grow" if late == early else "shrinks"
        lower = " (a lower bound where the sweep's largest batch still scaled or was undecided)" if any(
            r["in_words"].startswith(">=") for r in found) else ""
        sentences.append(f"{series}: the critical batch {verdict} along training ({path}, early to late){lower}")
    return sentences


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
