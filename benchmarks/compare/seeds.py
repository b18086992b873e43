"""Per-seed results and paired statistics: runs.csv (one row per variant and seed), paired differences against a
reference variant with 95% confidence intervals, the paper's own comparison (steps and simulated time to three
targets against DiLoCo at AdLoCo's starting batch), and each ablation against the method it ablates (tokens, steps
and simulated time to the method's targets).

Pairing: every variant runs the same seeds, and in the embedded-corpus regimes the seed also picks the validation
documents and the tokenizer, so seeds differ by an offset common to every variant; the per-seed difference removes
it. The interval is the paired t interval: mean difference +- t(0.975, n - 1) x sd / sqrt(n).
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

from benchmarks.compare.reader import first_reaching, last_within_budget, value_at
from benchmarks.compare.shared import table
from run_dir.reader import RunFiles

# Student's t, two-sided 95% (t at 0.975) by degrees of freedom; above 30, 30's (slightly conservative)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}
# the paper's comparison: targets the starting-batch DiLoCo reaches at these shares of the token budget
TARGET_SHARES = {"early": 0.25, "middle": 0.5, "late": 1.0}


def paired_interval(differences: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of the paired t 95% interval; (mean, nan, nan) with fewer than two pairs."""
    mean = statistics.mean(differences)
    if len(differences) < 2:
        return mean, math.nan, math.nan
    half = T975[min(len(differences) - 1, 30)] * statistics.stdev(differences) / math.sqrt(len(differences))
    return mean, mean - half, mean + half


def starting_batch(run: dict) -> int:
    return int(RunFiles(Path(run["run_dir"])).config_as_written().get("initial_batch_size", 1))


def paper_targets(reference: list[dict], budget: float, higher: bool) -> dict[str, float]:
    """Three targets along the run: the value every seed of the reference DiLoCo has reached at 1/4, 1/2 and all
    of the token budget (its worst seed's value there), so the reference reaches each by then."""
    worst = min if higher else max
    return {label: worst(value_at(r["curve"], "tokens", min(share * budget, last_within_budget(r["curve"])["tokens"]),
                                  log_scale=not higher)[0] for r in reference)
            for label, share in TARGET_SHARES.items()}


def run_rows(results: dict[str, list[dict]], budget: float, targets: dict[str, float], higher: bool) -> list[dict]:
    """runs.csv: one row per variant and seed."""
    rows = []
    for name, runs in results.items():
        for i, r in enumerate(runs):
            seed = r.get("seed", i)  # a run that stopped on a training fault leaves a gap in its variant's seeds
            at_budget, in_budget = value_at(r["curve"], "tokens", budget, log_scale=not higher)
            last = r["curve"][-1]
            row = {"variant": name, "seed": seed, **({"start": r["start"]} if "start" in r else {}),
                   "final": r["final"], "at_budget": at_budget,
                   "reached_budget": in_budget, "best_seen": r["best_seen"], "tokens": last["tokens"],
                   "steps": last["steps"], "rounds": last["rounds"], "sim_time_s": last["sim_time"]}
            row.update(reached(r, targets, higher))
            row.update({"bytes_needed": last["bytes"], "weights_bytes": last["weights_bytes"],
                        "statistics_bytes": last["statistics_bytes"], "starting_batch": starting_batch(r),
                        "largest_requested_batch": max(r["requested_batches"]), "merges": len(r["merges"])})
            rows.append(row)
    return rows


def reached(run: dict, targets: dict[str, float], higher: bool) -> dict[str, float | None]:
    """Tokens, optimizer steps and simulated time at which a run first reaches each target (None: not within the
    token budget), at the finest grain its evaluations give."""
    curve = run.get("fine_curve", run["curve"])
    return {f"{key}_to_{label}": first_reaching(curve, target, key, higher)
            for label, target in targets.items() for key in ("tokens", "steps", "sim_time")}


def paired_p(differences: list[float]) -> float:
    """The two-sided p-value of the paired t test that the mean difference is 0 (nan with fewer than two pairs)."""
    if len(differences) < 2:
        return math.nan
    sd = statistics.stdev(differences)
    if sd == 0:
        return 0.0 if statistics.mean(differences) else 1.0
    from scipy.stats import t

    score = statistics.mean(differences) / (sd / math.sqrt(len(differences)))
    return float(2 * t.sf(abs(score), len(differences) - 1))


def by_start(differences: list[tuple[float, int | None]]) -> list[float]:
    """The interval's units: each paired difference (with its run's warm start), or, where the runs came from
    several warm starts, each start's mean difference over its seeds. Seeds of one start share its model, so they
    are not independent of each other; the starts are (a two-level design: the interval is over starts)."""
    starts: dict[int | None, list[float]] = {}
    for difference, start in differences:
        starts.setdefault(start, []).append(difference)
    if len(starts) < 2 or None in starts:
        return [d for d, _ in differences]
    return [statistics.mean(ds) for _, ds in sorted(starts.items())]


def paired_rows(rows: list[dict], reference: str, key: str = "at_budget", only: set[str] | None = None) -> list[dict]:
    """Each variant (or those in `only`) against the reference, seed by seed: mean difference, 95% interval, whether
    it contains 0, and the test's p-value (corrected for the report's many comparisons by holm()). Runs from several
    warm starts: the interval and test are over the starts' mean differences (by_start; `starts` says how many)."""
    ref = {r["seed"]: r[key] for r in rows if r["variant"] == reference}
    out = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        pairs = [(r[key] - ref[r["seed"]], r.get("start")) for r in rows if r["variant"] == name and r["seed"] in ref]
        if name == reference or len(pairs) < 2 or (only is not None and name not in only):
            continue
        units = by_start(pairs)
        mean, low, high = paired_interval(units)
        row = {"variant": name, "vs": reference, "pairs": len(pairs), "mean_difference": mean,
               "ci95_low": low, "ci95_high": high, "interval_contains_0": low <= 0 <= high, "p_value": paired_p(units)}
        if len(units) != len(pairs) or any(start is not None for _, start in pairs):
            row["starts"] = len(units)
        out.append(row)
    return out


def holm(rows: list[dict], alpha: float = 0.05) -> list[dict]:
    """Holm's step-down correction over every comparison in `rows` (in place): holm_p, the adjusted p-value
    (the i-th smallest p times m - i + 1, made non-decreasing, at most 1), and holm_established (holm_p < alpha).
    It controls the chance of any false finding among the report's comparisons at alpha."""
    ranked = sorted(rows, key=lambda r: r["p_value"])
    running = 0.0
    for i, row in enumerate(ranked):
        running = max(running, min(1.0, (len(ranked) - i) * row["p_value"]))
        row["holm_p"], row["holm_established"] = running, running < alpha
    return rows


PRIMARY_SEEDS = 10  # a primary comparison rests on at least this many seeds


def primary_pairs(results: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """The report's primary comparisons, declared before any number: the paper's AdLoCo and ours, each against
    DiLoCo at its own starting batch and against DiLoCo with its batch tuned (benchmarks.tune's
    diloco_tuned_batch_tuned, else diloco_tuned_batch), tuned finalists against tuned ones where the report has
    them. Only the pairs whose two variants are in the report; with none of them, each ablation against its method
    (ablation_pairs)."""
    pairs = []
    for base in ("adloco_paper", "adloco"):
        for name in (f"{base}_tuned", base):
            if name not in results:
                continue
            tuned = name.endswith("_tuned")
            start = starting_reference(name, starting_batch(results[name][0]), results)
            batch_tuned = next((r for r in (("diloco_tuned_batch_tuned",) if tuned else ()) + ("diloco_tuned_batch",)
                                if r in results), "")
            pairs += [(name, ref) for ref in (start, batch_tuned) if ref in results]
            break
    return pairs or ablation_pairs(results)


def ablation_pairs(results: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """Each ablation in the report (benchmarks.compare.variants: Variant.ablates) against the method it ablates (and
    switch mode's matched control against always_accumulate too), where both are in the report. They are the primary
    comparisons of a report that holds no DiLoCo pair (switch mode's ablations, say), and among the Holm-corrected
    ones of a report that does."""
    return [(name, method) for name, runs in results.items() for method in runs[0].get("ablates", ())
            if method in results]


def best_constant(results: dict[str, list[dict]], rows: list[dict], higher: bool) -> str:
    """The best constant batch of every sweep in the report (tuned, Nesterov, plain) by its mean value at the token
    budget ("" with fewer than two)."""
    sweep = [name for name, runs in results.items() if runs[0].get("constant_batch")]
    if len(sweep) < 2:
        return ""
    means = {name: statistics.mean(r["at_budget"] for r in rows if r["variant"] == name) for name in sweep}
    return (max if higher else min)(means, key=means.get)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def starting_reference(name: str, start: int, results: dict[str, list[dict]]) -> str:
    """DiLoCo at a variant's starting batch: a tuned variant's is the tuned diloco_bB (benchmarks.tune's
    VARIANT_tuned) when the report has it, else the plain diloco_bB (which may not be in the report)."""
    tuned = [f"diloco_b{start}_tuned"] if name.endswith("_tuned") else []
    return next((r for r in (*tuned, f"diloco_b{start}") if r in results), f"diloco_b{start}")


def paper_rows(rows: list[dict], results: dict[str, list[dict]]) -> list[dict]:
    """Each AdLoCo-family variant against DiLoCo at its own starting batch (diloco_bB in the same report), and
    against DiLoCo with its batch tuned where that is one of its primary comparisons (primary_pairs): steps and
    simulated time to each target, per seed paired, as a ratio (below 1: AdLoCo needs less)."""
    batch_tuned = {name: ref for name, ref in primary_pairs(results) if ref.startswith("diloco_tuned_batch")}
    out = []
    for name, runs in results.items():
        if runs[0]["family"] != "adloco":
            continue
        start = starting_reference(name, starting_batch(runs[0]), results)
        if start not in results:
            out.append({"variant": name, "vs": f"{start} (not in this report)",
                        **{f"{k}_{t}": "-" for t in TARGET_SHARES for k in ("steps", "sim_time")}})
        mine = {r["seed"]: r for r in rows if r["variant"] == name}
        for reference in (start, batch_tuned.get(name, "")):
            if reference not in results:
                continue
            theirs = {r["seed"]: r for r in rows if r["variant"] == reference}
            out.append({"variant": name, "vs": reference, **ratios(mine, theirs, ("steps", "sim_time"))})
    return out


def ratios(mine: dict, theirs: dict, keys: tuple[str, ...]) -> dict[str, float | str]:
    """Per target and key, the mean over the paired seeds of mine's `{key}_to_{label}` over theirs (each seed's
    reached()); "k/n seeds" where only k of the n pairs both reached it."""
    cells: dict[str, float | str] = {}
    for label in TARGET_SHARES:
        for key in keys:
            pairs = [_ratio(mine[s][f"{key}_to_{label}"], theirs[s][f"{key}_to_{label}"]) for s in mine if s in theirs]
            got = [v for v in pairs if v is not None]
            cells[f"{key}_{label}"] = (statistics.mean(got) if len(got) == len(pairs) and got
                                       else f"{len(got)}/{len(pairs)} seeds")
    return cells


ABLATION_KEYS = ("tokens", "steps", "sim_time")  # per token, per optimizer step, per simulated second


def ablation_rows(results: dict[str, list[dict]], budget: float, higher: bool) -> tuple[list[dict], dict]:
    """Each ablation against its method (ablation_pairs), to the method's own targets (paper_targets: what every
    seed of the method has reached at 1/4, 1/2 and all of the budget): per seed paired, the ablation's tokens,
    optimizer steps and simulated time to each target over the method's (below 1: the ablation needs less).
    Returns the rows and each method's targets."""
    targets = {method: paper_targets(results[method], budget, higher) for _, method in ablation_pairs(results)}
    out = []
    for name, method in ablation_pairs(results):
        mine, theirs = ({r.get("seed", i): reached(r, targets[method], higher) for i, r in enumerate(results[v])}
                        for v in (name, method))
        out.append({"variant": name, "vs": method, **ratios(mine, theirs, ABLATION_KEYS)})
    return out, targets


def ablation_section(results: dict[str, list[dict]], budget: float, metric: str, higher: bool) -> list[str]:
    """comparison.md's section of each ablation against its method, per token, per step and per simulated second."""
    rows, targets = ablation_rows(results, budget, higher)
    if not rows:
        return []
    said = "; ".join(f"{method}: " + ", ".join(f"{k} {v:.4g}" for k, v in t.items()) for method, t in targets.items())
    return ["## Each ablation against its method: tokens, steps and simulated time to the method's targets", "",
            f"Targets: the {metric} every seed of the method has reached at 1/4, 1/2 and all of the token budget "
            f"({said}). Each cell: the mean over seeds of the ablation's tokens (per token), optimizer steps (per "
            "step) or simulated seconds to the target over its method's, seed by seed (below 1: the ablation needs "
            "less); k/n seeds: only k pairs both reached it within the budget. The value at the budget, per seed "
            "paired, is in the comparisons above.", "",
            *table(rows, ["variant", "vs", *(f"{k}_{t}" for t in TARGET_SHARES for k in ABLATION_KEYS)]), ""]


def write_runs_csv(rows: list[dict], out: Path) -> Path:
    path = out / "runs.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def paper_section(results: dict[str, list[dict]], rows: list[dict], metric: str, diloco_start: str,
                  targets: dict[str, float]) -> list[str]:
    """comparison.md's section of the paper's comparison: each AdLoCo's steps and simulated time to the targets
    that every seed of DiLoCo at the starting batch reached, over DiLoCo's (paper_rows), with the clock they were
    priced on and the grain at which steps count."""
    run_config = RunFiles(Path(next(iter(results.values()))[0]["run_dir"])).config_as_written()
    h = int(run_config.get("num_inner_steps", 1))
    every = min(r.get("evaluated_every", h) for runs in results.values() for r in runs)
    first = next(iter(results.values()))[0]
    summary = first.get("summary", {})
    clock = summary.get("clock") if summary.get("repriced") else None
    clock_words = (f"re-priced on {clock['network']}, {clock['throughput']}" if clock else
                   f"{run_config.get('network', '?')} network, " + (
                       f"a flat {run_config.get('node_tokens_per_s', '?')} tokens/s per node"
                       if run_config.get("throughput", "flat") == "flat" else f"throughput {run_config['throughput']}"))
    synced = all(r.get("synced_mid_round", True) for runs in results.values() for r in runs)
    scored = ("each trainer's synced model within a round (its outer step on a copy, on its nodes' mean)" if synced
              else "each trainer's first node's own weights within a round (runs made before the synced rule)")
    granularity = (f"one evaluation per outer step, so steps count in whole rounds of H = {h} inner steps"
                   if every >= h else f"an evaluation every {every} inner steps (eval_every_inner_steps: {scored}, "
                   f"the trainer's after each outer step; H = {h})")
    return ["## The paper's comparison: AdLoCo against DiLoCo at its starting batch (and with its batch tuned)",
            "",
            f"Targets along the run: the {metric} every seed of {diloco_start} has reached at 1/4, 1/2 and all "
            "of the token budget (" + ", ".join(f"{k} {v:.4g}" for k, v in targets.items()) + "). Each cell: "
            "the mean over seeds of AdLoCo's optimizer steps (or simulated seconds, on the runs' clock: "
            f"{clock_words}) to the target over DiLoCo's, seed by seed (below 1: AdLoCo needs less); "
            "k/n seeds: only k pairs reached it. Where the report holds DiLoCo with its batch tuned, each "
            f"AdLoCo's second row compares it with that, to the same targets. Granularity: {granularity}.", "",
            *table(paper_rows(rows, results), ["variant", "vs", *(f"{k}_{t}" for t in TARGET_SHARES
                                                                  for k in ("steps", "sim_time"))]), ""]


def sections(results: dict[str, list[dict]], metric: str, budget: float, reference: str, out: Path) -> list[str]:
    """runs.csv, and comparison.md's sections: paired differences and the paper's comparison."""
    higher = metric == "val_accuracy"
    starts = {starting_batch(runs[0]) for runs in results.values() if runs[0]["family"] == "adloco"}
    diloco_start = next((r for b in sorted(starts) for r in (f"diloco_b{b}", f"diloco_b{b}_tuned") if r in results),
                        "")
    targets = paper_targets(results[diloco_start], budget, higher) if diloco_start else {}
    rows = run_rows(results, budget, targets, higher)
    write_runs_csv(rows, out)
    lines = [f"## Per seed, paired (runs.csv: one row per variant and seed; {metric} at the token budget "
             f"{budget:.6g})", "",
             "Each variant's per-seed difference from the reference at matched tokens (`at_budget`, the value at "
             "exactly the token budget, never a final that overshot it); paired t 95% interval (mean difference "
             "+- t(0.975, n-1) sd / sqrt(n)); `interval_contains_0: True` marks a difference the seeds do not "
             "establish.", ""]
    starts = len({r["start"] for r in rows if "start" in r})
    if starts > 1:
        lines += [f"The runs start from {starts} pretrained models (seed s from start s mod {starts}; runs.csv's "
                  "`start`). Seeds of one start share its model, so the unit of every interval and test below is the "
                  "start, not the seed: n is the number of starts (`starts`), each contributing its mean paired "
                  "difference over its seeds (`pairs` counts the seeds).", ""]
    columns = ["variant", "vs", "pairs", *(["starts"] if starts > 1 else []), "mean_difference", "ci95_low",
               "ci95_high", "interval_contains_0", "p_value"]
    primary = primary_pairs(results)
    ablation_report = bool(primary) and primary == ablation_pairs(results)
    lines += ["### Primary comparisons (declared before the numbers)", "",
              ("Each ablation against the method it ablates (the report holds no DiLoCo to compare the methods with); "
               if ablation_report else
               "The paper's AdLoCo and ours, each against DiLoCo at its own starting batch and against DiLoCo with its "
               "batch tuned inside the same trial budget (`diloco_tuned_batch`), where the report holds them; ") +
              f"uncorrected, and each should rest on at least {PRIMARY_SEEDS} seeds.", ""]
    primary_rows = [row for name, ref in primary for row in paired_rows(rows, ref, only={name})]
    for row in primary_rows:
        row["note"] = "" if row["pairs"] >= PRIMARY_SEEDS else f"only {row['pairs']} seeds (< {PRIMARY_SEEDS})"
    lines += ([*table(primary_rows, [*columns, "note"]), ""] if primary_rows else
              ["None in this report (it holds neither pair).", ""])

    def others(against: str) -> list[dict]:
        """Each variant against `against`, less the declared pairs: a primary comparison is shown once,
        uncorrected, and is not one of the comparisons Holm's correction counts."""
        return [row for row in paired_rows(rows, against) if (row["variant"], row["vs"]) not in primary]

    secondary = others(reference) if reference and any(r["variant"] == reference for r in rows) else []
    best = best_constant(results, rows, higher)
    post_hoc = others(best) if best and best != reference else []
    ablated = [row for name, method in ablation_pairs(results) if (name, method) not in primary
               for row in paired_rows(rows, method, only={name})]
    holm([*secondary, *post_hoc, *ablated])  # every other comparison of the report, corrected together
    lines += ["### Every other comparison (Holm-corrected within the report)", "",
              f"holm_p: Holm's adjusted p-value over the report's {len(secondary) + len(post_hoc) + len(ablated)} "
              "other comparisons (holm_established: below 0.05); the interval and p_value columns are uncorrected.",
              ""]
    if secondary:
        lines += [*table(secondary, [*columns, "holm_p", "holm_established"]), ""]
    if ablated:
        lines += ["Each ablation against the method it ablates:", "",
                  *table(ablated, [*columns, "holm_p", "holm_established"]), ""]
    if post_hoc:
        lines += [f"Against the best constant batch at the budget ({best}), chosen after the fact on these same "
                  "evaluation seeds (best-of-N: a winner's curse favours it; the primary comparison is the batch tuned "
                  "on tuning seeds):", "",
                  *table(post_hoc, [*columns, "holm_p", "holm_established"]), ""]
    if targets:
        lines += paper_section(results, rows, metric, diloco_start, targets)
    return lines + ablation_section(results, budget, metric, higher)
