"""What tuning changed: each tuned finalist (VARIANT_tuned) against its untuned self, seed by seed.

    python -m benchmarks.tune.changed --tuned benchmarks/results/tuned_scratch \\
        --untuned benchmarks/results/compare_paper:diloco_b2,diloco_b4,ddp,snoo [--untuned DIR ...]

Both sides are reports of the comparison harness (their runs.csv: one row per variant and seed, `at_budget` the
metric at exactly the token budget). The untuned VARIANT comes from the tuned report itself when it ran there
(benchmarks.tune --seeds S runs both), else from the first --untuned report that lists it after its colon: naming
the variants is the caller's statement that they ran the same config there (a report made with another request
cap, say, has other AdLoCo runs but the same constant batches). The reports must share the token budget (their
budgets.csv) and the seeds pair by number. Writes tuning_changed.csv and appends its section to comparison.md
(replacing an earlier one) in the tuned report.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
from pathlib import Path

from benchmarks.compare.seeds import paired_interval
from benchmarks.compare.shared import table
from utils.errors import UserError

HEADING = "## What tuning changed"
SUFFIX = "_tuned"


def read_report(report: Path) -> tuple[float, dict[str, dict[int, float]]]:
    """(token budget, {variant: {seed: at_budget}}) of one harness report."""
    try:
        with (report / "budgets.csv").open() as f:
            budget = next(float(r["budget"]) for r in csv.DictReader(f) if r["axis"] == "tokens")
        with (report / "runs.csv").open() as f:
            rows = list(csv.DictReader(f))
    except (OSError, StopIteration, KeyError) as exc:
        raise UserError(f"{report}: not a finished harness report with a token budget ({exc})") from None
    values: dict[str, dict[int, float]] = {}
    for r in rows:
        values.setdefault(r["variant"], {})[int(r["seed"])] = float(r["at_budget"])
    return budget, values


def parse_source(spec: str) -> tuple[Path, list[str]]:
    path, _, names = spec.partition(":")
    if not names:
        raise UserError(f"--untuned {spec}: name the variants it ran with the same config, DIR:V1,V2,...")
    return Path(path), [n for n in names.split(",") if n]


def rows(tuned: Path, sources: list[tuple[Path, list[str]]]) -> list[dict]:
    """Per tuned finalist: its untuned self's source, the seeds paired, both means and the paired 95% interval of
    tuned - untuned (below 0: tuning lowered the perplexity)."""
    budget, mine = read_report(tuned)
    pools = [(tuned, list(mine), mine)]
    for path, names in sources:
        their_budget, theirs = read_report(path)
        if their_budget != budget:
            raise UserError(f"--untuned {path}: token budget {their_budget:.0f}, the tuned report's is {budget:.0f}")
        missing = [n for n in names if n not in theirs]
        if missing:
            raise UserError(f"--untuned {path}: no {', '.join(missing)} in its runs.csv")
        pools.append((path, names, theirs))
    out = []
    for name in mine:
        if not name.endswith(SUFFIX):
            continue
        base = name[:-len(SUFFIX)]
        found = next(((path, pool[base]) for path, names, pool in pools if base in names and base in pool), None)
        if found is None:
            out.append({"variant": base, "untuned_from": "not run", "pairs": 0})
            continue
        path, untuned = found
        seeds = sorted(set(mine[name]) & set(untuned))
        diffs = [mine[name][s] - untuned[s] for s in seeds]
        if not diffs:
            out.append({"variant": base, "untuned_from": "this report" if path == tuned else from_report(tuned, path),
                        "pairs": 0})
            continue
        mean, low, high = paired_interval(diffs)
        # one pair has no interval: its cells stay empty (not nan, and never "established")
        interval = ({"ci95_low": low, "ci95_high": high, "interval_contains_0": low <= 0 <= high}
                    if len(diffs) > 1 else {})
        out.append({"variant": base, "untuned_from": "this report" if path == tuned else from_report(tuned, path),
                    "pairs": len(seeds), "untuned_mean": statistics.mean(untuned[s] for s in seeds),
                    "tuned_mean": statistics.mean(mine[name][s] for s in seeds), "mean_difference": mean, **interval})
    return out


def from_report(tuned: Path, path: Path) -> str:
    """Another report's folder as seen from the tuned one (../compare_paper): a committed table names no machine's
    absolute paths, and the link still resolves in any checkout."""
    return os.path.relpath(path.resolve(), tuned.resolve())


COLUMNS = ["variant", "untuned_from", "pairs", "untuned_mean", "tuned_mean", "mean_difference", "ci95_low",
           "ci95_high", "interval_contains_0"]


def write(tuned: Path, sources: list[tuple[Path, list[str]]]) -> list[dict]:
    """tuning_changed.csv and comparison.md's section in the tuned report."""
    found = rows(tuned, sources)
    with (tuned / "tuning_changed.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        w.writeheader()
        w.writerows(found)
    section = [HEADING, "",
               "Each tuned finalist (VARIANT_tuned: its study's best trial) against the same variant untuned, seed "
               "by seed, at the token budget: tuned - untuned, paired t 95% interval (below 0: tuning lowered the "
               "metric). untuned_from: where the untuned runs come from (another report, relative to this one's "
               "folder: the same config, seeds paired by number). With fewer than 2 pairs no interval exists: its "
               "cells are empty, and the difference is not established.", "",
               *table([{c: r.get(c, "") for c in COLUMNS} for r in found], COLUMNS), ""]
    md = tuned / "comparison.md"
    text = md.read_text() if md.exists() else ""
    text = text.split(f"\n{HEADING}\n")[0].rstrip("\n") + "\n\n" if HEADING in text else text
    md.write_text(text + "\n".join(section))
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune.changed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tuned", required=True, help="the report of benchmarks.tune --seeds S (its --out)")
    p.add_argument("--untuned", action="append", default=[], help="DIR:V1,V2,...: a report whose runs of these "
                   "variants are the untuned ones (repeatable; the first that names a variant wins)")
    args = p.parse_args(argv)
    try:
        found = write(Path(args.tuned), [parse_source(s) for s in args.untuned])
    except UserError as exc:
        raise SystemExit(f"error: {exc}") from None
    print("\n".join(table([{c: r.get(c, "") for c in COLUMNS} for r in found], COLUMNS)))
    return 0


if __name__ == "__main__":
    import sys

    from utils.errors import exit_on_input_error

    sys.exit(exit_on_input_error(main))
