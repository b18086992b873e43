"""Every method tuned alike: one Optuna study per variant, each its own quasi-random design over all its knobs, the
same number of trials, winners chosen on tuning seeds.

    python -m benchmarks.tune --config configs/compare_cpu.yaml --max_tokens 610427 --trials 16 --workers 2 \\
        --variants diloco_tuned_batch,adloco --diloco_batches 2,4,8 --seeds 10 --out logs/tune

Each variant is tuned in its own study over its own search space, every knob at once (declared beside it in
benchmarks/compare/variants.py: lr_inner log-uniform for every method; lr_outer and outer momentum for the Nesterov
outer steps; ETA, the merge interval and the starting batch for the adaptive AdLoCos; the batch for the constant-batch
methods' _tuned_batch studies). Every trial is real run.py runs on the tuning seeds (--tuning_seed, default
1000,1001) at the harness's token budget, and its objective is the report's measure averaged over them: the
validation metric at exactly the token budget. Each study's trials are the points of its own scrambled Halton
sequence (benchmarks/tune/points.py: seeded by the variant, the same on every machine), so no method gets a smarter
search and no two methods share their points. A best trial on the edge of a range is flagged (trials.csv's edge
column, and a warning), except at the top of a knob whose decisions its runs never made (ETA where no batch grew on
any tuning seed: every larger ETA runs the same), which the plateau column names instead; the around_best column
counts the values of each other knob that the trials near the best trial's lr ran.
--trials N is how many finished trials each study should hold: a second call continues the studies (to a larger N
too); a stop (Ctrl-C, SIGTERM, SIGHUP) loses only the trials in flight, which are marked
failed and run again by the next call, never counted twice. --workers K runs K trials (then K finalists' runs) at
once here, each with its share of the cores (cpu_threads); the finalists' runs go variant by variant, all seeds of
one before the next, in the order --variants names them. --storage URL shares the studies among processes on
several machines (claims.py says how).
A study is its config: it is named VARIANT@DIGEST of everything that changes its objective (the resolved config
without the tuned knobs, the token budget, the tuning seeds, the tuned ranges; claims.StudyIdentity), so a call with
another budget or other overrides on the same storage starts its own study (a line names what differs) and never
counts trials measured under another config.
The outputs in --out: trials.csv (variant, study, trial, point, state, objective, each tuned key, edge, plateau,
around_best, the cpu each trial ran on (a run's last digits depend on it), note, run directory; every study in
the storage, so a call naming a few variants keeps the others' rows)
and, with --seeds S, each variant's best trial run again on seeds 0..S-1 as VARIANT_tuned beside the untuned
VARIANT: the comparison harness's report (runs.csv, comparison.md with paired intervals) and what tuning changed
(changed.py: tuning_changed.csv); --untuned DIR:V1,... takes untuned runs from a finished report instead, and
--tuned_only runs none. Every other option is the comparison harness's (python -m benchmarks.compare --help).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from benchmarks.compare import compare
from benchmarks.compare.options import Options, build_parser, made
from benchmarks.compare.reader import read_run, value_at
from benchmarks.compare.runner import (
    RunFailed,
    RunJob,
    on_threads,
    resolved,
    run_on_workers,
    run_variant,
    runs_folder,
    sharing_cores,
    warm_start,
)
from benchmarks.compare.variants import Knob, Variant, catalogue, custom, select
from benchmarks.launch import STOPPED_BY, allow_children, forwarding_to
from benchmarks.tune.claims import (
    GRACE_S,
    StudyIdentity,
    claim,
    continued,
    fail,
    free_points,
    heartbeat,
    open_storage,
    open_study,
    other_studies,
    record,
    variant_of,
)
from benchmarks.tune.points import PointSampler, design_seed, distributions, ends
from run_dir.reader import RunFiles
from utils.config import ADDED_LATER, Config, load_config
from utils.errors import Interrupted, UserError, raise_interrupted
from utils.signals import honoured

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
TRIALS = "trials"  # the trials' runs: the harness's layout (runs_folder) under OUT/trials
optuna.logging.set_verbosity(optuna.logging.WARNING)  # its per-trial lines would bury the harness's own


@dataclasses.dataclass(frozen=True)
class Tuning:
    trials: int
    workers: int
    storage: str
    tuning_seeds: tuple[int, ...]  # every trial runs on each; its objective is their mean (winners on >= 2 seeds)
    tuned_only: bool = False  # the finalists without their untuned selves
    untuned: tuple[tuple[Path, list[str]], ...] = ()  # --untuned DIR:V1,V2,...: reports holding these untuned runs


def seed_list(text: str) -> tuple[int, ...]:
    """--tuning_seed: one or more whole numbers, comma-separated, each once."""
    try:
        seeds = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r} names a seed twice")
    return seeds


def parse_args(argv: list[str] | None) -> tuple[Options, Tuning]:
    p = build_parser()
    p.prog, p.description = "python -m benchmarks.tune", __doc__
    p.set_defaults(seeds=0, out=str(Path(__file__).resolve().parents[2] / "logs" / "tune"))
    p.add_argument("--trials", type=int, required=True, help="finished trials each variant's study should hold")
    p.add_argument("--storage", default="", help="a database URL or a journal file shared by several tune processes "
                   "(default: the SQLite file OUT/studies.db)")
    p.add_argument("--tuning_seed", type=seed_list, default=(1000, 1001), help="training_seeds of every trial, "
                   "comma-separated (default 1000,1001: a trial's objective is its mean over them, so a winner is "
                   "chosen on 2 seeds; --seeds' finalists "
                   "run on 0..S-1, fresh seeds)")
    p.add_argument("--tuned_only", action="store_true", help="with --seeds: run only the tuned finalists, not their "
                   "untuned selves (take those from --untuned reports)")
    p.add_argument("--untuned", action="append", default=[], help="with --seeds, DIR:V1,V2,...: a finished report of "
                   "the same regime whose runs of these variants are the untuned ones (not run again here; repeatable)")
    values = vars(p.parse_args(argv))
    # imported here, not at the top: `python -m benchmarks.tune.changed` would otherwise import it twice (runpy warns)
    from benchmarks.tune import changed

    try:
        sources = tuple(changed.parse_source(spec) for spec in values.pop("untuned"))
    except UserError as exc:
        p.error(str(exc))
    tuning = Tuning(values.pop("trials"), values["workers"],  # --workers: the harness's, trials at once here too
                    *(values.pop(k) for k in ("storage", "tuning_seed", "tuned_only")), untuned=sources)
    if tuning.trials < 1 or tuning.workers < 1:
        p.error("--trials and --workers must be at least 1")
    if not values["max_tokens"]:
        p.error("--max_tokens: give the token budget; every trial's objective is the metric at exactly that budget")
    for path, _ in sources:
        if not (path / "runs.csv").is_file():
            p.error(f"--untuned {path}: no runs.csv there (a finished report of benchmarks.compare)")
    if any(0 <= seed < values["seeds"] for seed in tuning.tuning_seeds):
        p.error(f"--tuning_seed {','.join(map(str, tuning.tuning_seeds))} holds one of the finalists' seeds "
                f"0..{values['seeds'] - 1}; the "
                "finalists must run on fresh seeds")
    return Options.from_parsed(values), tuning


def main(argv: list[str] | None = None) -> int:
    args, tuning = parse_args(argv)
    out = Path(args.out)
    try:
        base = load_config(args.config, list(args.overrides))
    except UserError as exc:
        raise SystemExit(f"error: {exc}") from None
    known = catalogue(base, args.batches, args.localsgd_lr)
    chosen = {**select(known, args.variants, args.diloco_batches, bool(args.cluster)),
              **custom(args.add_variant, known)}
    regimes = checked_regimes(args, chosen)
    knobs = knobs_of({**known, **chosen})
    made(runs_folder(out / TRIALS), "--out")  # only once the input is known good
    stop = threading.Event()
    forward = forwarding_to(stop)  # stop claiming, and stop the runs in flight (they checkpoint)
    allow_children()
    previous = {s: signal.signal(s, forward) for s in honoured(STOPS)}  # a SIGHUP nohup ignored stays ignored
    try:
        extra = warm_start(args, out)
        storage = open_storage(tuning.storage, out)
        direction = "maximize" if base.dataset == "imdb" else "minimize"
        identities = {name: continued(storage, identity_of(name, v, regimes[name], args, tuning, extra),
                                      LATER_DEFAULTS, frozenset(TRIAL_SKIPS)) for name, v in chosen.items()}
        for identity in identities.values():
            for line in other_studies(storage, identity, frozenset(TRIAL_SKIPS)):
                print(line)
        studies = {name: open_study(name, storage, direction,
                                    PointSampler(v.search, regimes[name], design_seed(name)), identities[name])
                   for name, v in chosen.items()}
        trial_args = sharing_cores(args, tuning.workers)
        errors: list[str] = []
        on_threads(tuning.workers, worker, studies, chosen, tuning, trial_args, out, extra, stop, errors)
        write_trials(studies, knobs, storage, out / "trials.csv", out)
        for study in studies.values():
            for number, words in best_point_ends(study, knobs, out).edges.items():
                print(f"warning: {study.study_name}: its best trial ({number}) sits on an edge ({words}); its value "
                      "and ranking are bounds: widen the range and run the study again")
        if errors or STOPPED_BY:
            return ended(errors, STOPPED_BY, "the trials in flight were stopped and marked failed; run the same "
                         "command again to go on (finished trials are kept)")
        # a point neither finished nor free is in flight in another process (this one ran until none was free)
        missing = {name: free_points(study, tuning.trials, in_flight=True) for name, study in studies.items()}
        if any(missing.values()):
            print("in flight in other processes: " + "; ".join(
                f"{name} points {', '.join(map(str, p))}" for name, p in missing.items() if p) +
                  (f"; the finalists run once every study holds {tuning.trials} finished trials" if args.seeds
                   else ""))
            return 0
        print(f"{tuning.trials} finished trials per variant: {out / 'trials.csv'}")
        if not args.seeds:
            return 0
        named, specs = finalist_variants(studies, chosen, tuning)
        runs = {**{n: v for n, v in chosen.items() if n in named or v.group == "custom"},  # --add_variant's: always
                **custom(specs, chosen)}
        jobs = [RunJob(name, runs[name].overrides, seed, tuple(extra)) for name in in_named_order(runs, args.variants)
                for seed in range(args.seeds)]
        run_on_workers(jobs, trial_args, out, tuning.workers, stop, errors)
        if errors or STOPPED_BY:
            return ended(errors, STOPPED_BY, "the finalists' runs in flight were stopped; run the same command again "
                         "to go on (finished runs are reused, stopped ones resume)")
        for s in honoured(STOPS):
            signal.signal(s, raise_interrupted)
        return report(named, specs, trial_args, tuning)
    except Interrupted as exc:
        print(f"stopped by {signal.Signals(exc.signum).name}: run the same command again to go on (finished runs "
              "are reused)", file=sys.stderr)
        return 128 + exc.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def ended(errors: list[str], stopped_by: list[int], stopped: str) -> int:
    """A worker's error (one line, exit 2) or a stop (128 + the signal, saying what the next call does)."""
    if errors:
        raise SystemExit(f"error: benchmarks.tune: {errors[0]}")
    print(f"stopped by {signal.Signals(stopped_by[0]).name}: {stopped}", file=sys.stderr)
    return 128 + stopped_by[0]


def checked_regimes(args: Options, chosen: dict[str, Variant]) -> dict:
    """Every variant's config, checked at both ends of its ranges before any run (one line if one is refused)."""
    regimes = {}
    for name, v in chosen.items():
        try:
            cfg = load_config(args.config, [*args.overrides, *v.overrides])
            for end in (0, 1):
                load_config(args.config, [*args.overrides, *v.overrides, *(
                    f"{k}={ends(d)[end]}" for k, d in distributions(v.search, cfg).items())])
        except UserError as exc:
            raise SystemExit(f"error: variant {name}: {exc}") from None
        regimes[name] = cfg
    return regimes


# each key added after studies were stored, at its default (it does there what the runs before it did)
LATER_DEFAULTS = {k: v for k, v in json.loads(json.dumps(Config().to_dict(), default=str)).items() if k in ADDED_LATER}
MACHINE_KEYS = ("cpu_threads", "cpu_capability")  # each machine's kernels: last digits only (docs/running.md)
# What a trial's runs skip: a trial's objective reads only the end-of-round curve (the metric at the budget), and
# neither a mid-round evaluation (tests/test_end_to_end.py) nor a PNG plot changes a training number, so its runs make
# none: with an evaluation every 2 of 10 inner steps and plots every 4 outer steps, about 60% of a nano trial's time.
# These keys are no part of a study's identity, so a study stored when trials still made them goes on; the finalists
# keep them (steps and time to a target read the mid-round evaluations).
TRIAL_SKIPS = {"eval_every_inner_steps": 0, "plot_every": 0}


def identity_of(name: str, variant: Variant, cfg, args: Options, tuning: Tuning, extra: list[str]) -> StudyIdentity:
    """What this variant's trials are measured under: the config every trial resolves to (the harness's overrides,
    the warm start, the variant's own), without the tuned knobs, the places files go (WHERE_KEYS), the machine's
    kernel choice (so that machines of several kinds share one study) and what trials skip (TRIAL_SKIPS); the
    budget, the tuning seed and each tuned knob's range (a wider range is another study: its points are other
    points)."""
    tuned = distributions(variant.search, cfg)
    values = resolved(load_config(args.config, [*args.overrides, *extra, *variant.overrides,
                                                f"training_seed={tuning.tuning_seeds[0]}",
                                                f"max_tokens={args.max_tokens}",
                                                f"num_outer_steps={args.max_outer_steps}"]))
    config = {k: v for k, v in values.items()
              if k not in tuned and k not in MACHINE_KEYS and k not in TRIAL_SKIPS and k != "training_seed"}
    search = {k: list(d.choices) if isinstance(d, CategoricalDistribution) else
              [d.low, d.high, "log" if d.log else "linear"] for k, d in tuned.items()}
    return StudyIdentity(name, {"config": config, "search": search, "tuning_seeds": list(tuning.tuning_seeds)})


def worker(studies: dict[str, optuna.Study], chosen: dict[str, Variant], tuning: Tuning, args: Options, out: Path,
           extra: list[str], stop: threading.Event, errors: list[str]) -> None:
    """Claim and run trials, variant after variant, until every point is finished or in flight, or a stop; an
    error of the tool itself stops every worker (the trial in flight marked failed, its point free)."""
    try:
        run_trials(studies, chosen, tuning, args, out, extra, stop)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        stop.set()
    except SystemExit as exc:  # a one-line refusal (a run directory in use, ...): a thread would drop it silently
        errors.append(str(exc).removeprefix("error: "))
        stop.set()


def run_trials(studies: dict[str, optuna.Study], chosen: dict[str, Variant], tuning: Tuning, args: Options,
               out: Path, extra: list[str], stop: threading.Event) -> None:
    for name, study in studies.items():
        while not stop.is_set():
            claimed = claim(study, tuning.trials, stop)
            if claimed is None:
                break
            trial, point = claimed
            print(f"{study.study_name} point {point}: running; {progress(study, tuning.trials)}", flush=True)
            params = {key: trial.suggest_categorical(key, d.choices) if isinstance(d, CategoricalDistribution)
                      else trial.suggest_float(key, d.low, d.high, log=d.log)
                      for key, d in distributions(chosen[name].search, study.sampler.cfg).items()}
            alive = threading.Event()
            threading.Thread(target=heartbeat, args=(study, trial, alive), daemon=True).start()
            run_dirs = []
            try:
                for seed in tuning.tuning_seeds:  # the study's name in the run's: no two studies share a directory
                    run_dirs.append(run_variant(f"{study.study_name}_p{point}", [*chosen[name].overrides, *(
                        f"{k}={v}" for k, v in {**params, **TRIAL_SKIPS}.items())], seed, args, out / TRIALS,
                        extra)[0])
            except RunFailed as exc:
                if not (exc.training_fault or stop.is_set()):  # the tool's error or bad input, not the method's
                    fail(study, trial, f"{exc} (not the method's outcome); its point runs again on the next call")
                    raise RuntimeError(str(exc)) from None  # a thread ignores SystemExit: the worker reports this
                failed = str(exc)
                run_dirs = None
            except BaseException:
                fail(study, trial, "the tool failed while it ran; its point runs again on the next call")
                raise
            finally:
                alive.set()
            if stop.is_set():  # stopped: not finished; the next call runs this point again
                fail(study, trial, "stopped by a signal; its point runs again on the next call")
                return
            if run_dirs is None:  # a training fault on a seed (a non-finite loss, ...): finished, the worst value
                value, attrs = -math.inf if study.direction.name == "MAXIMIZE" else math.inf, {"note": failed}
            else:
                per_seed = [value_at(read_run(d)["curve"], "tokens", args.max_tokens) for d in run_dirs]
                value = sum(v for v, _ in per_seed) / len(per_seed)  # the mean over the tuning seeds
                attrs = {"run_dir": str(run_dirs[0]), "run_dirs": [str(d) for d in run_dirs],
                         "per_seed": [v for v, _ in per_seed], "decided": decided_counts(chosen[name], run_dirs)}
                if not all(reached for _, reached in per_seed):
                    attrs["note"] = "a seed ended below the token budget: its last value"
            if not record(study, trial, value, attrs):  # another host's worker judged it lost while it ran
                print(f"{study.study_name} point {point}: its trial was judged lost while it ran (silent "
                      f"{GRACE_S:.0f} s); its finished runs are reused when the point runs again", flush=True)
                continue
            outcome = "a training fault" if run_dirs is None else f"{value:.4g}"
            print(f"{study.study_name} point {point}: {outcome}; {progress(study, tuning.trials)}", flush=True)


def progress(study: optuna.Study, trials: int) -> str:
    """A study's progress in words: finished and running trials, and the best finished value so far."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    running = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if "point" in t.user_attrs]
    finite = [t for t in done if t.value is not None and math.isfinite(t.value)]
    pick = max if study.direction.name == "MAXIMIZE" else min
    best = pick(finite, key=lambda t: t.value) if finite else None
    return (f"{len(done)} of {trials} finished, {len(running)} running" +
            (f"; best so far {best.value:.4g} (point {best.user_attrs.get('point')})" if best else ""))


def knobs_of(variants: dict[str, Variant]) -> dict[str, Knob]:
    """The variants' tuned knobs by key, for what a key decides (Knob.decides: the same in every variant that tunes
    it); ranges may differ by variant (merge_frequency: the paper's reaches 24), so edges read each trial's own
    distribution, never this."""
    return {k.key: k for v in variants.values() for k in v.search}


def write_trials(studies: dict[str, optuna.Study], knobs: dict[str, Knob], storage: optuna.storages.BaseStorage,
                 path: Path, out: Path | None = None) -> None:
    """Every study in the storage, in the storage's order (the order the studies were created), whichever call
    writes it: a call that names some variants keeps the rows of the rest, and the tuner and benchmarks.tune.status
    write the same bytes from the same storage (the table is the storage's, not the call's). The study column says
    which study (VARIANT@DIGEST of its config, benchmarks.tune.claims.StudyIdentity) each row belongs to: rows of two
    studies of one variant were measured under different configs and are never to be ranked together. `out`: the
    tuner's --out, where the trials' runs are looked for (best_point_ends)."""
    mine = {study.study_name: (name, study) for name, study in studies.items()}
    every = [mine.get(summary.study_name) or (variant_of(summary), optuna.load_study(
                 study_name=summary.study_name, storage=storage))
             for summary in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    keys = list(dict.fromkeys(key for _, study in every for t in study.get_trials(deepcopy=False) for key in t.params))
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "study", "trial", "point", "state", "objective", *keys, "edge", "plateau",
                    "around_best", "cpu", "note", "run_dir"])
        for name, study in every:
            ends, around = best_point_ends(study, knobs, out), around_best(study)
            for t in study.get_trials(deepcopy=False):
                w.writerow([name, study.study_name, t.number, t.user_attrs.get("point", ""), t.state.name,
                            "" if t.value is None else t.value, *(t.params.get(k, "") for k in keys),
                            ends.edges.get(t.number, ""), ends.plateaus.get(t.number, ""), around.get(t.number, ""),
                            t.user_attrs.get("cpu", ""), t.user_attrs.get("note", ""),
                            shown_from(t.user_attrs.get("run_dir", ""), path.parent)])


EDGE = 0.1  # the outer tenth of a range (log ranges in log space): a best point there is a bound, not an optimum


@dataclasses.dataclass(frozen=True)
class BestPointEnds:
    """Where a study's best finished trial sits at an end of its ranges (trial number -> words): edges, in the outer
    tenth of a range, at the largest or smallest value sampled, or at a discrete knob's first or last choice (its
    value and ranking are bounds: widen the range and run it again); plateaus, at the top of a knob whose decisions
    its runs never made (Knob.decides: ETA where no batch grew), so every larger value runs the same and the range
    holds the optimum."""
    edges: dict[int, str]
    plateaus: dict[int, str]


def finished(study: optuna.Study) -> tuple[list[optuna.trial.FrozenTrial], optuna.trial.FrozenTrial | None]:
    """A study's finished trials with a finite value, and the best of them (None when there is none)."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None and math.isfinite(t.value)]
    pick = max if study.direction.name == "MAXIMIZE" else min
    return done, (pick(done, key=lambda t: t.value) if done else None)


def best_point_ends(study: optuna.Study, knobs: dict[str, Knob], out: Path | None = None) -> BestPointEnds:
    """The best trial's knobs at an end of their range (edges) or past the end where nothing changes (plateaus).
    `out`: the tuner's --out, where a trial's runs are looked for when the journal's absolute path is not there (a
    checkout at another path, its runs unpacked from a tarball)."""
    done, best = finished(study)
    if best is None:
        return BestPointEnds({}, {})
    edge, plateau = [], []
    for key, value in best.params.items():
        dist = best.distributions[key]
        if isinstance(dist, CategoricalDistribution):
            if len(dist.choices) > 1 and value in (min(dist.choices), max(dist.choices)):
                edge.append(f"{key} {value}: its {'largest' if value == max(dist.choices) else 'smallest'} choice")
            continue
        low, high, at = ((math.log(dist.low), math.log(dist.high), math.log(value)) if dist.log
                         else (dist.low, dist.high, value))
        share = (at - low) / (high - low) if high > low else 0.5
        sampled = {t.params[key] for t in done if key in t.params}
        if share < EDGE or share > 1 - EDGE:
            words = f"{key} {value:.4g}: the {'top' if share > 0.5 else 'bottom'} tenth of its range"
        elif len(sampled) > 2 and value in (max(sampled), min(sampled)):
            words = f"{key} {value:.4g}: the {'largest' if value == max(sampled) else 'smallest'} sampled"
        else:
            continue
        decides = knobs[key].decides if key in knobs else ""
        if share > 0.5 and decides and never_decided(best, decides, out):
            plateau.append(f"{words}, where {decides} is 0 on every tuning seed (every larger {key} runs the same)")
        else:
            edge.append(words)
    return BestPointEnds({best.number: "; ".join(edge)} if edge else {},
                         {best.number: "; ".join(plateau)} if plateau else {})


NEAR = 2.0  # "near the best lr": within this factor of it


def around_best(study: optuna.Study) -> dict[int, str]:
    """How the search met the best trial's lr (trial number -> words): the finished trials within a factor of 2 of
    its lr_inner, and how many distinct values of each other knob they ran (issue 58 asks for at least 3 of each:
    else a knob was never searched at the best lr, the coupling the joint design removes); a note when fewer."""
    done, best = finished(study)
    if best is None or "lr_inner" not in best.params or len(best.params) < 2:
        return {}
    lr = best.params["lr_inner"]
    near = [t for t in done if "lr_inner" in t.params and 1 / NEAR <= t.params["lr_inner"] / lr <= NEAR]
    counts = {k: len({t.params[k] for t in near if k in t.params}) for k in best.params if k != "lr_inner"}
    few = [k for k, n in counts.items() if n < 3]
    ran = ", ".join(f"{n} value{'s' * (n != 1)} of {k}" for k, n in counts.items())
    return {best.number: f"{len(near)} trial{'s' * (len(near) != 1)} within {NEAR:g}x of its lr_inner ran {ran}"
            + (f"; fewer than 3 of {', '.join(few)}" if few else "")}


def seed_counts(run_dirs: list, counts: list[str]) -> dict[str, list]:
    """Each count from each run's summary.json (None where a summary lacks it)."""
    summaries = [RunFiles(Path(d)).summary() for d in run_dirs] if counts else []
    return {count: [summary.get(count) for summary in summaries] for count in counts}


def decided_counts(variant: Variant, run_dirs: list[Path]) -> dict[str, list]:
    """What the variant's knobs decide (Knob.decides), per tuning seed: kept in the trial's record, so that the
    journal alone says whether an end of a range is a plateau (run directories are not committed)."""
    return seed_counts(run_dirs, sorted({knob.decides for knob in variant.search if knob.decides}))


def never_decided(trial: optuna.trial.FrozenTrial, count: str, out: Path | None = None) -> bool:
    """Whether every tuning seed's run of the trial reports 0 for `count`: from the trial's record
    (decided_counts), else from each run's summary.json (trials recorded before 2026-11-29), found where the
    journal says or else under `out` (trial_run_dir); False when neither says (then the end stays an edge)."""
    recorded = trial.user_attrs.get("decided", {}).get(count)
    if not recorded:
        try:
            recorded = seed_counts([trial_run_dir(d, out) for d in trial.user_attrs.get("run_dirs", [])],
                                   [count])[count]
        except (OSError, ValueError):
            return False
    return bool(recorded) and all(value == 0 for value in recorded)


def trial_run_dir(recorded: str, out: Path | None) -> Path:
    """A trial's run directory: the journal's absolute path where it exists, else the same run in the tuner's
    layout under `out` (out/trials/runs/NAME, as run_trials places it), so that a checkout at another path than
    the one that ran the trial reads the runs it unpacked."""
    path = Path(recorded)
    if path.exists() or out is None:
        return path
    return runs_folder(out / TRIALS) / path.name


def shown_from(run_dir: str, folder: Path) -> str:
    """A trial's run directory relative to the table's folder when inside it: no machine's absolute path in a
    committed table (the journal keeps the absolute one, which the tool reads)."""
    if not run_dir or not Path(run_dir).resolve().is_relative_to(folder.resolve()):
        return run_dir
    return os.path.relpath(Path(run_dir).resolve(), folder.resolve())


def in_named_order(runs: dict, wanted: str) -> list[str]:
    """The finalists' run order: variant by variant as --variants names them (a finalist VARIANT_tuned where its
    VARIANT stands; the rest, named by a group, after them in the catalogue's order), so a long call that stops
    midway leaves the variants named first complete on every seed."""
    names = [n for n in wanted.split(",") if n]

    def rank(name: str) -> int:
        base = name.removesuffix("_tuned")
        return names.index(base) if base in names else len(names)
    return sorted(runs, key=rank)  # stable: the catalogue's order among equals


def finalist_variants(studies: dict[str, optuna.Study], chosen: dict[str, Variant], tuning: Tuning
                      ) -> tuple[list[str], tuple[str, ...]]:
    """The finalists: the untuned variants that run beside the tuned ones (none with --tuned_only; not those an
    --untuned report holds), and each variant's best trial as an --add_variant spec, VARIANT_tuned=VARIANT:..."""
    specs = []
    for name, study in studies.items():
        best = study.best_trial
        specs.append(f"{name}_tuned={name}:" + " ".join(f"{k}={v}" for k, v in best.params.items()))
        print(f"{name}: best trial {best.number} (point {best.user_attrs['point']}): {best.value:.4g} at "
              + ", ".join(f"{k}={v}" for k, v in best.params.items()))
    elsewhere = {name for _, names in tuning.untuned for name in names}
    named = [name for name, v in chosen.items()  # --add_variant's come back by their own spec
             if v.group != "custom" and not tuning.tuned_only and name not in elsewhere]
    return named, tuple(specs)


def report(named: list[str], specs: tuple[str, ...], args: Options, tuning: Tuning) -> int:
    """The harness's report over the finalists (every run reused), and what tuning changed (changed.py)."""
    code = compare(dataclasses.replace(args, variants=",".join(named), add_variant=(*args.add_variant, *specs),
                                       workers=1))  # every run is made: the report only reads them
    if code == 0:
        from benchmarks.tune import changed

        where = Path(args.report_out) if args.report_out else Path(args.out)
        changed.write(where, list(tuning.untuned))
        print(f"what tuning changed: {where / 'tuning_changed.csv'}")
    return code
