"""Does AdLoCo help? The comparison harness: `python -m benchmarks.compare --help` (options.py) says what it runs.

Its parts, one concern each: variants.py (the variants as data: name, family, overrides), options.py (the command
line, parsed once into frozen Options), runner.py (each variant a run.py child process; finished runs reused),
reader.py (a finished run read back), report.py (comparison.md's tables, the CSV files, the plots) and
pricing.py (the runs on their own clock, and on the network cost model).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from pathlib import Path

from tqdm import tqdm

from algorithms.clock import ThroughputCurve
from benchmarks.compare import bundle
from benchmarks.compare.options import Options, build_parser, cluster_overrides, made, parse_networks
from benchmarks.compare.reader import (
    first_reaching,
    ran_shapes,
    read_run,
    value_at,
    within_budget,
)
from benchmarks.compare.report import summarise, write_outputs
from benchmarks.compare.runner import (
    RunFailed,
    RunJob,
    fault_row,
    run_on_workers,
    run_variant,
    runs_folder,
    sharing_cores,
    shown,
    warm_starts,
)
from benchmarks.compare.variants import (
    CLUSTER_VARIANTS,
    COMMUNICATION_VARIANTS,
    Variant,
    catalogue,
    custom,
    select,
    variants,
)
from benchmarks.launch import STOPPED_BY, allow_children, forwarding_to
from utils.config import load_config
from utils.errors import Interrupted, UserError, raise_interrupted
from utils.signals import honoured

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["main", "build_parser", "cluster_overrides", "variants", "catalogue", "Variant", "COMMUNICATION_VARIANTS",
           "CLUSTER_VARIANTS", "read_run", "ran_shapes", "value_at", "first_reaching", "Options"]


def main(argv: list[str] | None = None) -> int:
    args = Options.parse(argv)
    parse_networks(args)
    stops = honoured((signal.SIGINT, signal.SIGTERM, signal.SIGHUP))  # a SIGHUP nohup ignored stays ignored
    previous = {signum: signal.signal(signum, raise_interrupted) for signum in stops}
    try:
        return reprice(args) if args.reprice else compare(args)
    except Interrupted as stopped:  # SIGINT / SIGTERM / SIGHUP: the running child was stopped too
        print(f"stopped by {signal.Signals(stopped.signum).name}: the running variant was stopped too; run the same "
              "command again to go on (finished runs are reused)", file=sys.stderr)
        return 128 + stopped.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def bundled(args: Options) -> dict:
    """The options a bundle keeps: the harness's, with the paths inside the repository relative to it (a committed
    bundle names no machine's folders)."""
    options = dataclasses.asdict(args)
    for key in ("config", "out", "report_out", "pretrain_config", "init_from", "cluster", "throughput_curve"):
        path = Path(options[key]).resolve() if options[key] else None
        if path is not None and path.is_relative_to(ROOT):
            options[key] = str(path.relative_to(ROOT))
    return options


def reprice(args: Options) -> int:
    """--reprice REPORT: the report's runs read from its replay bundle and every table written again into
    --report_out on this command's pricing options (networks, throughput, model size); nothing trains."""
    with bundle.Bundle.open(Path(args.reprice)) as packed:
        own = {k: getattr(args, k) for k in bundle.PRICING_OPTIONS}
        stored = {f.name: packed.options.get(f.name, getattr(args, f.name)) for f in dataclasses.fields(Options)}
        options = Options.from_parsed({**stored, **{k: list(v) if isinstance(v, tuple) else v for k, v in own.items()},
                                       "reprice": "", "cluster": "", "out": args.reprice})
        options = dataclasses.replace(options, overrides=tuple(stored["overrides"]), reprice=args.reprice)
        parse_networks(options)
        config = Path(options.config) if Path(options.config).is_absolute() else ROOT / options.config
        try:
            base = load_config(config, list(options.overrides))
        except UserError as exc:
            raise SystemExit(f"error: --reprice {args.reprice}: the report's config: {exc}") from None
        results: dict[str, list[dict]] = {}
        for entry in packed.runs:
            run = within_budget(read_run(packed.run_dir(entry)), options.max_tokens)
            results.setdefault(entry["variant"], []).append(
                {**run, "seed": entry["seed"], "family": entry["family"], "constant_batch": entry["constant_batch"],
                 "ablates": tuple(entry.get("ablates", ())), **options.start_of(entry["seed"])})
        report_out = made(Path(args.report_out), "--report_out")
        print(write_outputs(summarise(results, base, options), results, options, report_out, packed.faults))
        run_dirs = {e["run"]: packed.run_dir(e) for e in packed.runs}
        run_dirs.update({f"{f['variant']}_seed{f['seed']}": packed.folder / f"{f['variant']}_seed{f['seed']}"
                         for f in packed.faults})
        bundle.write(report_out, results, packed.faults, {**packed.options, **own, "reprice": ""}, run_dirs)
    print(f"re-priced {sum(len(rs) for rs in results.values())} runs of {args.reprice} into {report_out} (nothing "
          "trained)")
    return 0


def run_ahead(jobs: list[RunJob], args: Options, out: Path) -> None:
    """--workers K: the report's runs on K threads (runner.run_on_workers). A signal stops them all (each run
    checkpoints) and is raised here as main's Interrupted; a run's own error ends in its one line."""
    stop, errors = threading.Event(), []
    allow_children()
    forward = forwarding_to(stop)
    previous = {s: signal.signal(s, forward) for s in honoured((signal.SIGINT, signal.SIGTERM, signal.SIGHUP))}
    try:
        run_on_workers(jobs, args, out, args.workers, stop, errors)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if STOPPED_BY:
        raise Interrupted(STOPPED_BY[0])
    if errors:
        raise SystemExit(f"error: {errors[0]}")


def compare(args: Options) -> int:
    """Every chosen variant and seed at the same token budget, then the report."""
    out = Path(args.out)
    if args.throughput_curve:
        try:
            problems = ThroughputCurve.load(args.throughput_curve).shape_problems()
        except ValueError as exc:
            raise SystemExit(f"error: --throughput_curve: {exc}") from None
        if problems:
            print(f"warning: --throughput_curve: {args.throughput_curve} {'; '.join(problems)}; the network model "
                  "uses it as given", file=sys.stderr)
    try:  # a missing --config, a mistyped override, a bad value in --cluster: one line, before anything is written
        base = load_config(args.config, list(args.overrides))
    except UserError as exc:
        raise SystemExit(f"error: {exc}") from None
    known = catalogue(base, args.batches, args.localsgd_lr)
    added = custom(args.add_variant, known)
    for v in added.values():  # a bad override fails here, in one line, before any run
        try:
            load_config(args.config, [*args.overrides, *v.overrides])
        except UserError as exc:
            raise SystemExit(f"error: --add_variant {v.name}: {exc}") from None
    chosen = {**select(known, args.variants, args.diloco_batches, bool(args.cluster)), **added}
    named = set(args.variants.split(","))
    budget = [f"max_tokens={args.max_tokens or 1}", f"num_outer_steps={args.max_outer_steps}"]  # as run_variant sets
    for name, v in list(chosen.items()):  # a config the regime refuses fails here, in one line, before any run
        try:
            load_config(args.config, [*args.overrides, *v.overrides, *budget])
        except UserError as exc:
            if name in named or v.group != "paper":
                raise SystemExit(f"error: variant {name}: {exc}") from None
            print(f"{name}: left out of this regime: {exc}")  # an ablation of --variants paper that cannot run here
            del chosen[name]
    made(runs_folder(out), "--out")
    starts = warm_starts(args, out)
    extra = starts[0] if starts else []
    args = dataclasses.replace(args, warm_from=", ".join(shown(Path(s[0].split("=", 1)[1]), out) for s in starts))
    if not args.max_tokens:
        # the budget: what AdLoCo itself consumes in the configured number of outer steps; that run stops where the
        # budget does, so it is reused below as AdLoCo seed 0 (runner.stops_where_asked)
        steps = min(base.num_outer_steps, args.max_outer_steps)
        budget_args = dataclasses.replace(args, max_tokens=0, max_outer_steps=steps)
        first = read_run(*run_variant("adloco", list(chosen["adloco"].overrides) if "adloco" in chosen else [], 0,
                                      budget_args, out, extra))
        args = dataclasses.replace(args, max_tokens=first["curve"][-1]["tokens"])
        print(f"token budget: {args.max_tokens} tokens (AdLoCo, {steps} outer steps, seed 0)")
    results: dict[str, list[dict]] = {}
    faults: list[dict] = []  # runs that stopped on a training fault (diverged): an outcome, reported apart
    jobs = [(name, seed) for name in chosen for seed in range(args.seeds)]
    if args.workers > 1:  # every run first, K at once; the loop below then reuses each (or meets its fault again)
        args = sharing_cores(args, args.workers)
        run_ahead([RunJob(name, chosen[name].overrides, seed, tuple(starts[seed % len(starts)]) if starts else ())
                   for name, seed in jobs], args, out)
    for name, seed in tqdm(jobs, desc="runs", unit="run"):
        try:
            run = within_budget(read_run(*run_variant(name, list(chosen[name].overrides), seed, args, out,
                                                      starts[seed % len(starts)] if starts else [])), args.max_tokens)
        except RunFailed as exc:
            if not exc.training_fault:
                raise
            faults.append(fault_row(name, seed, runs_folder(out) / f"{name}_seed{seed}"))
            print(f"{name} seed {seed}: {faults[-1]['error']}; reported among the faults, its other seeds without it")
            continue
        results.setdefault(name, []).append({**run, "seed": seed, "family": chosen[name].family,
                                             "constant_batch": chosen[name].constant_batch,
                                             "ablates": chosen[name].ablates, **args.start_of(seed)})
    if not results:
        raise SystemExit("error: every run stopped on a training fault (see each run's status.json); no report")
    report_out = Path(args.report_out) if args.report_out else out
    made(report_out, "--report_out" if args.report_out else "--out")
    print(write_outputs(summarise(results, base, args), results, args, report_out, faults))
    run_dirs = {Path(r["run_dir"]).name: Path(r["run_dir"]) for rs in results.values() for r in rs}
    run_dirs.update({f"{f['variant']}_seed{f['seed']}": runs_folder(out) / f"{f['variant']}_seed{f['seed']}"
                     for f in faults})
    packed = bundle.write(report_out, results, faults, bundled(args), run_dirs)
    print(f"replay bundle (re-price it without retraining: --reprice {report_out}): {packed}")
    return 0
