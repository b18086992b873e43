"""Where the studies of a storage stand, read without running anything: one line per study, and trials.csv
rewritten from the storage (as the tuner writes it at the end of a call), while workers may still be running.

    python -m benchmarks.tune.status --storage benchmarks/results/tuned_nano_joint/studies.journal

A study's line: its name (VARIANT@DIGEST), its finished, running and failed trials, when a trial last started, and
its best finished trial with its knobs, its edge or plateau (trials.csv's columns) and how the search met its lr.
--csv PATH writes trials.csv there (default: beside a journal file; --csv '' writes none). It reads a journal
without its lock, as Optuna does, so workers appending to it are never held up; a line half written at that moment
is left for the next look (Optuna reads only whole lines).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import optuna
from optuna.trial import TrialState

from benchmarks.compare.variants import catalogue
from benchmarks.launch import ROOT
from benchmarks.tune import around_best, best_point_ends, finished, knobs_of, write_trials
from benchmarks.tune.claims import open_storage
from utils.config import load_config
from utils.errors import exit_on_input_error


def study_line(study: optuna.Study, knobs: dict, out: Path | None = None) -> str:
    """One study's standing in one line (`out`: the tuner's --out, where trial runs are looked for)."""
    trials = study.get_trials(deepcopy=False)
    count = {state: sum(t.state == state for t in trials) for state in (TrialState.COMPLETE, TrialState.RUNNING,
                                                                        TrialState.FAIL)}
    started = max((t.datetime_start for t in trials if t.datetime_start), default=None)
    line = (f"{study.study_name}: {count[TrialState.COMPLETE]} finished, {count[TrialState.RUNNING]} running, "
            f"{count[TrialState.FAIL]} failed" + (f"; last started {started:%Y-%m-%d %H:%M}" if started else ""))
    _, best = finished(study)
    if best is None:
        return line + "; no finished trial yet"
    ends = best_point_ends(study, knobs, out)
    knob_values = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.params.items())
    line += f"; best {best.value:.4g} (trial {best.number}, point {best.user_attrs.get('point', '?')}: {knob_values})"
    for label, words in (("edge", ends.edges.get(best.number)), ("plateau", ends.plateaus.get(best.number)),
                         ("around its lr", around_best(study).get(best.number))):
        if words:
            line += f"; {label}: {words}"
    return line


def open_for_reading(url: str) -> optuna.storages.BaseStorage:
    """The storage of --storage, for reading: a journal file as it is (the tuner's check of its last line is for
    appending, and a worker may be writing that line now), a database URL as the tuner opens it."""
    if "://" in url:
        return open_storage(url, Path.cwd())
    from optuna.storages.journal import JournalFileBackend

    if not Path(url).is_file():
        raise SystemExit(f"error: --storage: no journal file at {url}")
    return optuna.storages.JournalStorage(JournalFileBackend(str(Path(url).resolve())))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--storage", required=True, help="the tuner's --storage: a journal file or a database URL")
    p.add_argument("--csv", default=None, help="where to write trials.csv (default: beside a journal file; '' none)")
    args = p.parse_args(argv)
    storage = open_for_reading(args.storage)
    summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    if not summaries:
        raise SystemExit(f"error: --storage: {args.storage} holds no study")
    # what a knob decides is the same in every variant (Knob.decides); its ranges are read from each trial
    knobs = knobs_of(catalogue(load_config(ROOT / "config.yaml"), [1, 2], 1e-3))
    # a journal lies in the tuner's --out, with the trials' runs under it
    out = Path(args.storage).parent if "://" not in args.storage else None
    for summary in summaries:
        print(study_line(optuna.load_study(study_name=summary.study_name, storage=storage), knobs, out), flush=True)
    default = out / "trials.csv" if out is not None else None
    path = default if args.csv is None else (Path(args.csv) if args.csv else None)
    if path is not None:
        write_trials({}, knobs, storage, path, out)
        print(f"trials.csv: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_input_error(main))
