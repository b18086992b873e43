"""Running the variants: each a run.py child process, a finished run with the same config reused, the warm start."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import threading
from pathlib import Path

from benchmarks.compare.options import ROOT, Options
from benchmarks.compare.reader import damage
from benchmarks.launch import STOPPED_BY, run_child
from run_dir.reader import RunFiles
from run_dir.run_state import in_use
from training_logs.records import TrainerRow
from utils.config import WHERE_KEYS, Config, load_config
from utils.errors import TrainingFault


def resolved(cfg: Config) -> dict:
    """A config's values as its config.yaml records them (cpu_capability auto: the kernels torch uses here, which
    the harness's children inherit), without the keys that only place files (WHERE_KEYS: a finished run is reused
    across them)."""
    values = {k: v for k, v in cfg.to_dict().items() if k not in WHERE_KEYS}
    if values.get("cpu_capability") == "auto":
        import torch

        values["cpu_capability"] = torch.backends.cpu.get_cpu_capability().lower()
    return values


def finished_config(run_dir: Path) -> Config | None:
    """A run directory's config in today's meaning (run_dir/run_config.py's migrations: a run written before a key
    existed reads as what it ran), or None when it cannot be read (unreadable, or keys of another version)."""
    try:
        return RunFiles(run_dir).config()
    except Exception:
        return None


def config_changes(had: Config | None, wanted: dict) -> list[str]:
    """How a finished run's config (`finished_config`) differs from the one asked for (`resolved`), as 'key: was
    -> now'; [] = the same."""
    if had is None:
        return ["config.yaml: unreadable"]
    was = resolved(had)
    return [f"{k}: {was.get(k)!r} -> {wanted.get(k)!r}" for k in sorted(set(was) | set(wanted))
            if was.get(k) != wanted.get(k)]


STOP_KEYS = ("max_tokens", "num_outer_steps")


def stops_where_asked(run_dir: Path, changes: list[str], had: Config, wanted: Config) -> bool:
    """A finished run that differs from the one asked for only in when it stops (max_tokens, num_outer_steps:
    neither changes a step's numbers, unless max_tokens sets linear_rampup's length, which Config.meaning
    counts) is that run when it stopped at the outer step the asked-for budget stops at: the first step
    that reached max_tokens, or num_outer_steps."""
    if any(not change.startswith(tuple(f"{k}:" for k in STOP_KEYS)) for change in changes):
        return False
    if had.meaning() != wanted.meaning():
        return False
    return stopped_at_budget(run_dir, wanted)


def stopped_at_budget(run_dir: Path, wanted: Config) -> bool:
    """The finished run's last outer step is where `wanted`'s budget stops: the first step that reached its
    max_tokens, or its num_outer_steps."""
    rows = RunFiles(run_dir).records(TrainerRow) or []
    tokens = {r.outer_step: r.global_tokens or 0 for r in rows}
    last = max(tokens, default=0)
    for step in range(1, last + 1):
        if step == wanted.num_outer_steps or (wanted.max_tokens and tokens.get(step, 0) >= wanted.max_tokens):
            return step == last
    return False


def clear_run_dir(run_dir: Path) -> None:
    """Remove a run directory to redo it, unless a live process holds it (another harness, a run.py)."""
    holder = in_use(run_dir)
    if holder:
        raise SystemExit(f"error: {run_dir} is in use by {holder}; stop that run or use another --out")
    shutil.rmtree(run_dir)


# What only the simulated clock reads (docs/clock.md): a finished run that differs in these alone has the same
# numbers, so it is re-priced on the new clock, not retrained. Device speeds count only without
# inner_steps_by_speed (which sets inner steps from them); a measured curve is measured by training's process.
CLOCK_ONLY_KEYS = ("network", "throughput", "node_tokens_per_s", "target_metric")


def without(values: dict, keys: tuple[str, ...]) -> dict:
    return {k: v for k, v in values.items() if k not in keys}


def numbers_of(values: dict) -> dict:
    """A resolved config without what only the clock reads."""
    out = {k: v for k, v in values.items() if k not in CLOCK_ONLY_KEYS}
    if values.get("throughput") == "measured":
        out["throughput"] = "measured"
    if not values.get("inner_steps_by_speed"):
        out["devices"] = [{"device": d, "memory_mb": 0.0} if isinstance(d, str) else
                          {k: v for k, v in d.items() if k != "speed"} for d in values.get("devices", [])]
    return out


def runs_folder(out: Path) -> Path:
    """Where the harness places its runs: out/runs/NAME (a run named VARIANT_seedS), each run's log beside it as
    NAME.out. benchmarks.tune's trials are runs of the harness under out/trials."""
    return out / "runs"


def run_variant(name: str, overrides: list[str], seed: int, args: Options, out: Path, extra: list[str]
                ) -> tuple[Path, Config | None]:
    """One variant and seed, run (or its finished run reused when its config is the same): its run directory, and
    the config to re-price it on when it differs from the finished run only in what the clock reads (else None)."""
    run_name = f"{name}_seed{seed}"
    run_dir, log = runs_folder(out) / run_name, runs_folder(out) / f"{run_name}.out"
    run = RunFiles(run_dir)
    run_args = [*args.overrides, *extra, *overrides, f"training_seed={seed}", f"log_dir={runs_folder(out)}",
                f"run_name={run_name}", "clearml_mode=off", f"max_tokens={args.max_tokens}",
                f"num_outer_steps={args.max_outer_steps}", "save_weights_every=0"]
    wanted_config = load_config(args.config, run_args)  # the variant's config, derived once
    wanted = resolved(wanted_config)
    if run.finished and not args.rerun:
        problem = damage(run_dir)
        if problem:  # a damaged finished run: said, never overwritten by a harness that cannot read it
            raise SystemExit(f"error: {run_dir}: a finished run whose {problem}; nothing was changed: move it away "
                             "or remove it to run it again (or give --rerun)")
        had_config = finished_config(run_dir)
        changes = config_changes(had_config, wanted)
        if not changes:
            return run_dir, None  # finished earlier with this very config: resume the comparison, not redo it
        if had_config is not None and stops_where_asked(run_dir, changes, had_config, wanted_config):
            print(f"{run_name}: reusing {run_dir}: it ran the same, and stopped where this budget stops it")
            return run_dir, None
        # only what the clock reads differs, and perhaps when it stops (the budget run, now under a cluster file)
        stop_changed = any(change.startswith(tuple(f"{k}:" for k in STOP_KEYS)) for change in changes)
        if had_config is not None and without(numbers_of(resolved(had_config)), STOP_KEYS) == without(
                numbers_of(wanted), STOP_KEYS) and had_config.meaning().get("rampup_tokens") == \
                wanted_config.meaning().get("rampup_tokens") and (
                not stop_changed or stopped_at_budget(run_dir, wanted_config)):
            keys = ", ".join(k for k in (c.split(":", 1)[0] for c in changes) if k not in STOP_KEYS)
            print(f"{run_name}: re-pricing {run_dir} on the new clock, not retraining: it differs only in what the "
                  f"clock reads ({keys})" + (", and stopped where this budget stops it" if stop_changed else ""))
            return run_dir, wanted_config
        shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
        print(f"{run_name}: the finished run in {run_dir} was made with another config ({shown}); running it again")
    status = run.status() or {}
    same = status.get("state") in ("fault", "stopped") and not args.rerun and not config_changes(
        finished_config(run_dir), wanted)  # an earlier run of this very config, ended before its budget
    if same and status["state"] == "fault":
        # it diverged (or hit another training fault) with this very config: the same seed does the same again, so
        # the outcome is reused, not trained twice
        raise RunFailed(TrainingFault.exit_code, f"variant {name} (seed {seed}) stopped on a training fault earlier, "
                        f"with this config (reused, not run again; {run.status_path})")
    if same and status["state"] == "stopped" and status.get("resumable"):
        # stopped earlier (a signal to the harness, or to the run): go on from its checkpoint, exactly
        print(f"{run_name}: resuming the stopped run in {run_dir} from its checkpoint (outer step "
              f"{status.get('outer_step')})")
        code = run_child([sys.executable, str(ROOT / "run.py"), "--resume", str(run_dir)], log, append=True)
        if code == 0:
            return run_dir, None
        if code >= 128 or STOPPED_BY:  # stopped again (its checkpoint kept for the next call), not a failed resume
            raise RunFailed(code, f"{run_name} was stopped while it resumed; the next call resumes it again")
        if code == TrainingFault.exit_code:  # it diverged after resuming: a resume is exact, so a run from the
            # start would diverge at the same step; the outcome stands (the run's status.json says where)
            raise RunFailed(code, f"variant {name} (seed {seed}) stopped on a training fault after it resumed "
                                  f"(not run again from the start; see {log})")
        print(f"{run_name}: it did not resume (see {log}); running it again")
    if run_dir.exists():
        clear_run_dir(run_dir)
    cmd = [sys.executable, str(ROOT / "run.py"), "--config", args.config, *run_args]
    code = run_child(cmd, log)
    if code != 0:
        raise RunFailed(code, f"variant {name} (seed {seed}) failed (exit {code}); see {log}")
    return run_dir, None


class RunFailed(SystemExit):
    """A variant's run.py exited non-zero: `exit_code` 3 is a training fault (it diverged, ...), an outcome of the
    method; 1 (an internal error) and 2 (bad input) are the tool's or the user's, not the method's."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    @property
    def training_fault(self) -> bool:
        return self.exit_code == TrainingFault.exit_code


def fault_row(name: str, seed: int, run_dir: Path) -> dict:
    """A run that stopped on a training fault, as the report lists it: where (the last good outer step and the
    tokens seen by then) and why (status.json's error, without its checkpoint path)."""
    run = RunFiles(run_dir)
    status = run.status() or {}
    error = str(status.get("error") or "a training fault").removeprefix("error: ").split("; stopped")[0]
    rows = run.records_if_any(TrainerRow)
    return {"variant": name, "seed": seed, "last_good_step": status.get("outer_step"),
            "tokens": max((r.global_tokens or 0 for r in rows), default=0), "error": error}


def warm_start(args: Options, out: Path) -> list[str]:
    """Phase 1 of the warm-start workflow: the overrides that start every variant from the first pretrained model
    (benchmarks.tune's trials all start there)."""
    return next(iter(warm_starts(args, out)), [])


def pretrained(args: Options, out: Path, start: int) -> Path:
    """Phase 1, start `start`: the pretraining run (reused when finished with the same config). Start 0 is
    <out>/pretrain with the pretraining config's own seed; start i its seed + i in <out>/pretrain_start{i}."""
    run_name = "pretrain" if start == 0 else f"pretrain_start{start}"
    run_dir = out / run_name
    seeded = [f"training_seed={load_config(args.pretrain_config, list(args.pretrain_set)).training_seed + start}"
              ] if start else []
    pretrain_args = [*args.pretrain_set, *seeded, f"log_dir={out}", f"run_name={run_name}", "clearml_mode=off",
                     "save_weights_every=0"]
    finished = RunFiles(run_dir).finished
    changes = config_changes(finished_config(run_dir), resolved(load_config(args.pretrain_config, pretrain_args))
                             ) if finished else []
    if changes:
        print(f"phase 1: the pretrained start in {run_dir} was made with another config "
              f"({'; '.join(changes[:4])}); pretraining again")
    if not finished or changes:
        if run_dir.exists():
            clear_run_dir(run_dir)
        cmd = [sys.executable, str(ROOT / "run.py"), "--config", args.pretrain_config, *pretrain_args]
        print(f"phase 1: pretraining start {start} ({args.pretrain_config}) into {run_dir}")
        if run_child(cmd, out / f"{run_name}.out") != 0:
            raise SystemExit(f"error: --pretrain_config: phase 1 failed; see {out / f'{run_name}.out'}")
    return run_dir


def warm_starts(args: Options, out: Path) -> list[list[str]]:
    """Phase 1: one list of overrides per pretrained start (--pretrain_starts of --pretrain_config, or each run
    directory of --init_from); [] when the runs start from scratch. Seed s starts from start s mod K."""
    if args.pretrain_config:
        sources = [pretrained(args, out, i) for i in range(args.pretrain_starts)]
    elif args.init_from:
        sources = [Path(p) for p in args.init_from.split(",") if p]
    else:
        return []
    starts = []
    for init_from in sources:
        model_dir = (RunFiles(init_from).weights / "final" / "final_model").resolve()
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"error: --init_from: {model_dir} holds no final model (config.json); give a finished "
                             "run directory")
        summary = RunFiles(init_from).summary_or_empty()
        print(f"warm start {len(starts)} from {model_dir} ({summary.get('metric', 'metric')} "
              f"{summary.get('final_metric', '?')} on its own data)")
        starts.append([f"model_config.name={model_dir}", "model_config.pretrained=true", "tokenizer=auto"])
    return starts


def shown(path: Path, out: Path | None = None) -> str:
    """A path as the report shows it: relative to the repository when inside it, else to the report's folder `out`
    when inside that (a harness run from a worktree of the repository writing into another checkout)."""
    if path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    if out is not None and path.is_relative_to(out.resolve()):
        return f"{path.relative_to(out.resolve())} (in the report's folder)"
    return str(path)


@dataclasses.dataclass(frozen=True)
class RunJob:
    """One run of a report: a variant's overrides on one seed, from its warm start (`extra`, or none)."""
    name: str
    overrides: tuple[str, ...]
    seed: int
    extra: tuple[str, ...] = ()


def sharing_cores(args: Options, workers: int) -> Options:
    """K runs at once on this machine: each on cores / K threads (cpu_threads), unless the command gives its own."""
    if any(o.startswith("cpu_threads=") for o in args.overrides):
        return args
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return dataclasses.replace(args, overrides=(*args.overrides, f"cpu_threads={max(1, cores // workers)}"))


def on_threads(workers: int, target, *args) -> None:
    """`workers` threads of target(*args), joined with a timeout, so that signals reach the main thread's handler."""
    threads = [threading.Thread(target=target, args=args, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(0.2)


def run_on_workers(jobs: list[RunJob], args: Options, out: Path, workers: int, stop: threading.Event,
                   errors: list[str]) -> None:
    """Every job on `workers` threads, each a run.py child (finished runs reused), before a report that then reuses
    them all. A run that stops on a training fault (diverged) is an outcome: the report lists it. A run that fails
    otherwise stops the others (errors gets its line); a stop (the caller's signal handler sets `stop` and forwards
    the signal to the children: benchmarks.launch.stop_children) ends them too."""
    jobs = list(jobs)
    lock = threading.Lock()
    runs_folder(out).mkdir(parents=True, exist_ok=True)

    def work() -> None:  # one thread: take the next run until none is left, a failure or a stop
        while not stop.is_set():
            with lock:
                if not jobs:
                    return
                job = jobs.pop(0)
            try:
                run_variant(job.name, list(job.overrides), job.seed, args, out, list(job.extra))
            except RunFailed as exc:
                if exc.training_fault and not stop.is_set():  # diverged: an outcome, which the report lists
                    print(f"{job.name} seed {job.seed}: stopped on a training fault; the report lists it")
                    continue
                if not stop.is_set():
                    errors.append(str(exc))
                    stop.set()
                return
            except Exception as exc:  # the tool's own error: one line, every worker stops
                errors.append(f"{type(exc).__name__}: {exc}")
                stop.set()
                return
            except SystemExit as exc:  # a one-line refusal (a run directory in use, ...): never lost in a thread
                errors.append(str(exc).removeprefix("error: "))
                stop.set()
                return

    on_threads(workers, work)

