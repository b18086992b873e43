"""Batch-size measures of the report: optimizer steps to the target against the best constant batch (the measure
Merrill et al. 2025 use for batch-size warmup), the critical batch size each constant-batch sweep implies (the
largest batch whose tokens to a target stay within 20% of the token-optimal batch's: where tokens are fewest, not
anchored at any batch), at the report's target and at five targets along training, with a fit of McCandlish et
al.'s S(B) = S_min (1 + B_noise / B) and its interval, and plots of each variant's requested batch against tokens and
of tokens to each target against the batch."""

from __future__ import annotations

import math
import random
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.compare.reader import first_reaching, value_at
from benchmarks.compare.shared import plt_, save_figure

Point = tuple[int, float | None, float]  # (B, steps to the target or None, the run's steps)


def by_seed(runs: list[dict], target: float, key: str, higher: bool) -> list[float] | None:
    """Each seed's `key` (steps: optimizer steps in sequence, rounds x H; tokens) at the target, within the budget;
    None unless every seed reached it."""
    reach = [first_reaching(r.get("fine_curve", r["curve"]), target, key, higher) for r in runs]
    return reach if reach and all(v is not None for v in reach) else None


def steps_to_target(runs: list[dict], target: float, higher: bool) -> float | None:
    """Mean optimizer steps in sequence (rounds x H) to the target over seeds; None unless every seed reached it."""
    reach = by_seed(runs, target, "steps", higher)
    return statistics.mean(reach) if reach else None


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
    measured = {series: at_target(points, target, higher) for series, points in sweeps(results).items()}
    words = [f"{series}: {at.in_words}; {at.b_noise_words}" for series, at in measured.items()]
    return out, "critical batch (per node; the largest within 20% of the token-optimal batch's tokens, and S(B)'s " + \
        "B_noise) of " + "; of ".join(words)


# where along training the critical batch is measured (issue 58): at these shares of the token budget, the best value
# any batch of the sweep has reached with every seed by then. No batch anchors it: each target is the sweep's own
# envelope, and each batch's tokens to it are compared with the fewest any batch needed
ALONG_TRAINING = (("20%", 0.2), ("35%", 0.35), ("50%", 0.5), ("65%", 0.65), ("80%", 0.8))
TOKEN_SLACK = 1.2  # the critical batch: the largest within 20% of the token-optimal batch's tokens


def tokens_to_target(runs: list[dict], target: float, higher: bool) -> float | None:
    """Mean tokens to the target over seeds (within the budget); None unless every seed reached it."""
    reach = by_seed(runs, target, "tokens", higher)
    return statistics.mean(reach) if reach else None


def fewest_tokens(points: list[tuple[int, float | None]]) -> tuple[int, float] | None:
    """The token-optimal batch of (B, tokens to the target or None) and its tokens (the smaller batch on a tie)."""
    reached = [(b, t) for b, t in points if t is not None]
    return min(reached, key=lambda p: (p[1], p[0])) if reached else None


def token_optimal(points: list[tuple[int, float | None]]) -> tuple[int | None, str]:
    """The critical batch of one sweep at one target from (B, tokens to the target or None), by B: the largest batch
    whose tokens stay within 20% of the token-optimal batch's (the batch that needs fewest). A lower bound when the
    sweep's largest batch is still within. (B or None, in words)."""
    reached = [(b, t) for b, t in points if t is not None]
    if len(points) < 2 or not reached:
        return None, "needs two constant batches, one of them reaching the target"
    best_b, best_t = fewest_tokens(points)
    within = sorted(b for b, t in reached if t <= TOKEN_SLACK * best_t)
    critical = within[-1]
    words = f"token-optimal batch {best_b} ({best_t:.4g} tokens); within 20%: {', '.join(map(str, within))}"
    if critical == max(b for b, _ in points):
        return critical, f">= {critical}: {words} (the sweep's largest batch is within 20%: a lower bound)"
    return critical, f"{critical}: {words}"


# S(B) = S_min (1 + B_noise / B) (McCandlish et al. 2018): steps to a target against the batch; B_noise is the batch
# beyond which more batch buys few steps. Fitted from the token-optimal batch up: the model's tokens B * S(B) rise with
# B, so it cannot describe the small batches that need more tokens than the optimum (a U-shaped sweep's left arm)
FIT_MIN_BATCHES = 3  # two batches fit any S_min and B_noise exactly: a third is the model's first check
FIT_RESAMPLES = 2000  # seed bootstrap resamples of the interval (a fixed RNG: the same interval every time)


@dataclass(frozen=True)
class NoiseScale:
    """A fit of S(B) = S_min (1 + B_noise / B) to one sweep's mean steps to one target, with a 95% seed-bootstrap
    interval of B_noise (inf: steps fell as fast as 1/B, i.e. no batch of the sweep was past B_noise; no interval
    from one seed)."""
    b_noise: float
    s_min: float
    low: float | None
    high: float | None
    batches: tuple[int, ...]

    def words(self) -> str:
        def num(v: float) -> str:
            return "inf" if math.isinf(v) else f"{v:.3g}"
        interval = (f"95% seed bootstrap {num(self.low)} to {num(self.high)}" if self.low is not None else
                    "one seed: no interval")
        return (f"B_noise {num(self.b_noise)} ({interval}; S_min {self.s_min:.4g} steps; fitted to batches "
                f"{', '.join(map(str, self.batches))})")


def fit_steps(batches: list[int], steps: list[float]) -> tuple[float, float]:
    """Least squares of S = S_min + (S_min B_noise) / B (linear in 1/B), equal weight per batch: (S_min, B_noise).
    B_noise is inf when S_min <= 0 (steps fall at least as fast as 1/B) and 0 when steps grow with B."""
    x = [1 / b for b in batches]
    x_mean, y_mean = statistics.fmean(x), statistics.fmean(steps)
    slope = sum((xi - x_mean) * (yi - y_mean) for xi, yi in zip(x, steps)) / sum((xi - x_mean) ** 2 for xi in x)
    s_min = y_mean - slope * x_mean
    if s_min <= 0:
        return s_min, math.inf
    return s_min, max(slope, 0.0) / s_min


def noise_scale(points: list[tuple[int, list[float] | None]], from_batch: int) -> tuple[NoiseScale | None, str]:
    """Fit S(B) to (B, each seed's steps to the target, or None where a seed did not reach it) for the batches from
    the token-optimal one (from_batch) up that every seed reached; the interval resamples the seeds, by position
    (seed i of every batch together: the batches' runs share their seeds). (the fit or None, in words)."""
    used = [(b, s) for b, s in points if b >= from_batch and s]
    if len(used) < FIT_MIN_BATCHES:
        return None, (f"no B_noise fit: {len(used)} batch(es) from the token-optimal {from_batch} up reached the "
                      f"target with every seed; the fit needs {FIT_MIN_BATCHES}")
    batches = [b for b, _ in used]
    s_min, b_noise = fit_steps(batches, [statistics.fmean(s) for _, s in used])
    rng = random.Random(0)
    seeds = min(len(s) for _, s in used)
    draws = []
    for _ in range(FIT_RESAMPLES if seeds > 1 else 0):
        picks = [rng.randrange(seeds) for _ in range(seeds)]
        draws.append(fit_steps(batches, [statistics.fmean(s[i] for i in picks) for _, s in used])[1])
    draws.sort()  # inf sorts last: an open upper end when enough resamples fell as fast as 1/B
    low, high = (draws[int(0.025 * (len(draws) - 1))], draws[math.ceil(0.975 * (len(draws) - 1))]) if draws else \
        (None, None)
    fit = NoiseScale(b_noise, s_min, low, high, tuple(batches))
    return fit, fit.words()


@dataclass(frozen=True)
class AtTarget:
    """One sweep at one target: each batch's mean tokens to it (None: not every seed reached it within the budget),
    the critical batch by the token-optimal rule, and S(B)'s fit from the token-optimal batch up, each in words."""
    tokens: list[tuple[int, float | None]]
    critical_batch: int | None
    in_words: str
    fit: NoiseScale | None
    b_noise_words: str


def at_target(points: list[tuple[int, list[dict]]], target: float, higher: bool) -> AtTarget:
    """One sweep's batches (B, its runs) measured at one target."""
    tokens = [(b, tokens_to_target(runs, target, higher)) for b, runs in points]
    batch, words = token_optimal(tokens)
    optimal = fewest_tokens(tokens)
    fit, fit_words = (noise_scale([(b, by_seed(runs, target, "steps", higher)) for b, runs in points], optimal[0])
                      if optimal else (None, "no B_noise fit: no batch reached the target"))
    return AtTarget(tokens, batch, words, fit, fit_words)


def along_training(results: dict[str, list[dict]], budget: float, higher: bool) -> list[dict]:
    """Each sweep's tokens to five targets along training per batch (ALONG_TRAINING), and its critical batch at each
    by the token-optimal rule: whether it grows as training goes on (Zhang et al. 2025 find it grows with the data
    seen); beside it, S(B)'s B_noise fitted from the token-optimal batch up, with its seed-bootstrap interval."""
    out = []
    for series, points in sweeps(results).items():
        for when, share in ALONG_TRAINING:
            worst = min if higher else max  # a batch's worst seed: every seed has reached it by then
            target = (max if higher else min)(
                worst(value_at(r["curve"], "tokens", share * budget, log_scale=not higher)[0] for r in runs)
                for _, runs in points)
            at = at_target(points, target, higher)
            out.append({"sweep": series, "when": when, "tokens": share * budget, "target": target,
                        "tokens_by_batch": "; ".join(f"{b}: {t:.4g}" if t is not None else f"{b}: not reached"
                                                     for b, t in at.tokens),
                        "critical_batch": at.critical_batch, "in_words": at.in_words,
                        "b_noise": at.fit.b_noise if at.fit else None, "b_noise_words": at.b_noise_words})
    return out


def plot_tokens_to_target(rows: list[dict], out: Path) -> Path | None:
    """Tokens to each target against the batch, one line per target and sweep (log-log)."""
    if not rows:
        return None
    plt = plt_()
    fig, ax = plt.subplots(figsize=(8, 5))
    batches = set()
    for r in rows:
        pairs = [cell.split(": ") for cell in r["tokens_by_batch"].split("; ")]
        batches |= {int(b) for b, _ in pairs}
        points = [(int(b), float(t)) for b, t in pairs if t != "not reached"]
        if points:
            ax.plot(*zip(*points), marker="o", label=f"{r['sweep']} {r['when']} (target {r['target']:.4g})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    ax.minorticks_off()
    ax.set(yscale="log", xlabel="constant batch per node",
           ylabel="tokens to the target (mean over seeds)",
           title="Tokens to each target against the batch (critical: the largest within 20% of the fewest)")
    return save_figure(fig, ax, out / "tokens_to_target_vs_batch.png", legend_fontsize=6)


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
        lower = " (a lower bound where the sweep's largest batch was within 20% of the fewest tokens)" if any(
            r["in_words"].startswith(">=") for r in found) else ""
        fitted = " -> ".join(f"{r['b_noise']:.3g}" if r["b_noise"] is not None else "no fit" for r in found)
        sentences.append(f"{series}: the critical batch {verdict} along training ({path}, early to late){lower}; "
                         f"S(B)'s B_noise {fitted}")
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
    return save_figure(fig, ax, out / "requested_batch_vs_tokens.png")
