"""Train AdLoCo: `python run.py [--config config.yaml] [key=value ...]`.

Reads the config (validated once), checks devices and paths, prepares data and the initial model,
builds the simulated cluster, runs the outer loop and leaves everything in logs/<model>_<dataset>_<date>/.

    python run.py --resume RUN_DIR [key=value ...]

continues a stopped run from its latest complete checkpoint, in the same run directory; only keys that
do not change what is computed may be given (num_outer_steps to extend it, logging, fault handling).
SIGINT / SIGTERM stop a run cleanly: a checkpoint of the last complete outer step, exit 130 / 143.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import yaml

from utils.config import RESUME_MAY_CHANGE, Config, load_config, parse_overrides
from utils.errors import ConfigError, RunStopped, TrainingFault, UserError
from utils.openmp import limit_openmp_spinning, openmp_waits
from utils.preflight import check_before_work

log = logging.getLogger("run")
TRACKER_CLOSE_TIMEOUT_S = 15.0
FILE_ONLY = {"file_only": True}  # main() prints these lines itself


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, like every other input error (argparse adds the usage)
        print(f"error: {message} (see python run.py --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config (default: config.yaml)")
    parser.add_argument("--resume", metavar="RUN_DIR", default=None,
                        help="continue the run in RUN_DIR from its latest complete checkpoint")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. num_outer_steps=5 lr_outer=0.7")
    return parser.parse_args(argv)


def build_tracker(cfg: Config, run_dir: Path, resume_step: int | None = None):
    """metrics.jsonl always; ClearML unless clearml_mode: off; TensorBoard when asked."""
    from training_logs.trackers import JsonlTracker, TensorBoardTracker, TrackerGroup

    trackers = [JsonlTracker(run_dir / "metrics.jsonl")]
    if cfg.clearml_mode != "off":
        from training_logs.clearml_tracker import ClearMLTracker

        try:
            trackers.append(ClearMLTracker(cfg.project_name, cfg.task_name, cfg.to_dict(), cfg.clearml_mode,
                                           cfg.clearml_timeout_s, run_dir, resume_step))
        except Exception as exc:  # e.g. an unwritable HOME: ClearML keeps its sessions in ~/.clearml
            from utils.safe_write import why_write_failed

            where = f" {exc.filename}" if isinstance(exc, OSError) and exc.filename else ""
            problem = f"ClearML could not start ({why_write_failed(exc)}{where})"
            if cfg.clearml_mode != "auto":
                raise ConfigError("clearml_mode", f"{problem}; run without it with clearml_mode=off, or give it a "
                                  "writable HOME") from None
            log.warning("%s; this run goes on without ClearML (metrics.jsonl has every scalar); "
                        "clearml_mode=off skips it", problem)
    if cfg.tensorboard:
        purge = resume_step + 1 if resume_step is not None else None
        trackers.append(TensorBoardTracker(run_dir / "tensorboard", purge_step=purge))
    return TrackerGroup(trackers)


# ----------------------------------------------------------------------------------------------
# Before any data work: devices, model limits


def request_cpu_kernels(cfg: Config) -> None:
    """torch picks its CPU kernels once, at its first operation: the choice must be in the environment before."""
    if cfg.cpu_capability != "auto":
        os.environ["ATEN_CPU_CAPABILITY"] = cfg.cpu_capability


def resolve_cpu_kernels(cfg: Config) -> Config:
    """The kernels and threads this process really uses; config.yaml then records them, so a plain --resume
    uses the same ones. A capability this CPU (or this already started process) cannot give is refused."""
    import torch

    actual = torch.backends.cpu.get_cpu_capability().lower()
    if cfg.cpu_capability not in ("auto", actual):
        raise ConfigError("cpu_capability", f"'{cfg.cpu_capability}' is not what torch uses in this process "
                          f"('{actual}'): this CPU lacks it, or torch started before it was set (set "
                          f"ATEN_CPU_CAPABILITY={cfg.cpu_capability} before Python starts)")
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    return cfg.replace(cpu_capability=actual)


def check_devices(cfg: Config) -> None:
    import torch

    for device in cfg.device_names:
        if not device.startswith("cuda"):
            continue
        if not torch.cuda.is_available():
            raise ConfigError("devices", f"'{device}' needs CUDA, which this torch ({torch.__version__}) cannot use "
                              "here; use devices: [cpu, cpu]")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ConfigError("devices", f"'{device}': this machine has {torch.cuda.device_count()} CUDA device(s)")


# ----------------------------------------------------------------------------------------------
# --resume


def resume_config(run_dir: Path, overrides: list[str], config_arg: str | None):
    """The run's own config with the allowed overrides, and its latest complete checkpoint."""
    from utils.checkpoint import latest_checkpoint

    if config_arg is not None:
        raise UserError("--config: a resumed run uses RUN_DIR/config.yaml; give changes as key=value")
    if not run_dir.is_dir():
        raise UserError(f"--resume: {run_dir} is not a directory")
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"--resume: {run_dir} has no config.yaml; is it a run directory?")
    fixed = sorted(k for k in parse_overrides(overrides) if k not in RESUME_MAY_CHANGE)
    pinned = sorted(k for k in parse_overrides(overrides) if k in ("run_name", "log_dir", "log_file"))
    if fixed:
        raise ConfigError(fixed[0], "cannot change when resuming: it would change what the run computes "
                          f"(allowed: {', '.join(sorted(RESUME_MAY_CHANGE - {'run_name', 'log_dir', 'log_file'}))})")
    if pinned:
        raise ConfigError(pinned[0], "cannot change when resuming: the run directory is given by --resume")
    cfg = load_config(run_dir / "config.yaml", overrides)
    saved = load_config(run_dir / "config.yaml").meaning()
    changed = sorted(k for k, v in cfg.meaning().items() if saved.get(k) != v)
    if changed:  # e.g. max_tokens, when it sets the length of linear_rampup's schedule
        raise ConfigError(changed[0], "cannot change when resuming: it would change what the run computes")
    checkpoint = latest_checkpoint(run_dir / "model_weights", cfg.meaning_hash())
    if checkpoint.path.name == "final" and checkpoint.outer_step >= cfg.num_outer_steps:
        raise ConfigError("num_outer_steps", f"the run in {run_dir} already finished its {checkpoint.outer_step} "
                          "outer steps; give a larger num_outer_steps to extend it")
    return cfg, checkpoint


# ----------------------------------------------------------------------------------------------


def _close_within(action, seconds: float, what: str) -> None:
    """Trackers can hang (a ClearML upload); a stop must still end in time."""
    done = threading.Event()

    def target() -> None:
        try:
            action()
        finally:
            done.set()

    threading.Thread(target=target, name="close", daemon=True).start()
    if not done.wait(seconds):
        log.warning("%s did not close within %.0f s; exiting without waiting", what, seconds)


def train(cfg: Config, resume: tuple[Path, object] | None = None, stop=None) -> tuple[Path, dict]:
    """Train from scratch, or continue `resume` = (run directory, checkpoint). Returns (run_dir, summary)."""
    from distributed import torchrun

    env = torchrun.from_environ()
    if env is not None:
        torchrun.check(cfg, env)
    check_devices(cfg)
    request_cpu_kernels(cfg)  # for direct callers; main() has done it before torch was imported
    cfg = resolve_cpu_kernels(cfg)
    check_before_work(cfg, resuming=resume is not None)  # model, data paths, run_name: before any data work
    # Heavy imports after validation, so config errors come back instantly.
    from cluster import ClusterController
    from fabrics.corpus import load_corpus
    from fabrics.models import build_model, count_parameters
    from training_logs.csv_files import cut_jsonl
    from training_logs.memory_monitor import MemoryMonitor
    from training_logs.training_monitoring import TrainingLogger
    from utils.checkpoint import write_atomic
    from utils.run_state import RunLock, write_status
    from utils.signals import StopSignals
    from utils.utils import make_run_dir, set_seeds, setup_logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stop = stop or StopSignals()
    checkpoint = None
    writes = env is None or env.is_main  # under torchrun only rank 0 writes the run directory
    if env is not None:
        torchrun.init(cfg, env)
        torchrun.agree_on_config(cfg)  # before the run directory is claimed: a mismatch touches nothing
    if resume is not None:
        run_dir, checkpoint = resume

        def claim():  # the run directory, locked for the life of this process
            return run_dir, RunLock(run_dir).acquire()
    else:
        def claim():
            return make_run_dir(cfg.log_dir, cfg.run_name, cfg.model_config.name, cfg.dataset)
    # under torchrun rank 0 claims the directory and tells the others (its error too)
    run_dir, lock = claim() if env is None else torchrun.shared_run_dir(env, claim)
    logger = None
    scratch = None if writes else Path(tempfile.mkdtemp(prefix="adloco_rank"))  # other ranks' logs go nowhere
    stop.install()
    try:
        setup_logging(run_dir / cfg.log_file if writes else None)
        if not writes:
            logging.getLogger().setLevel(logging.WARNING)
        resume_step = checkpoint.outer_step if checkpoint is not None else None
        if writes:
            write_atomic(run_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            write_status(run_dir, "running", exit_code=None, signal=None, outer_step=resume_step,
                         checkpoint=str(checkpoint.path) if checkpoint is not None else None,
                         resumable=checkpoint is not None, error=None, message=None)
            if checkpoint is not None:
                cut_jsonl(run_dir / "metrics.jsonl", resume_step)
        if checkpoint is not None:
            log.info("resuming %s from %s (after outer step %d)", run_dir, checkpoint.path, resume_step)
        else:
            log.info("run directory: %s", run_dir)
        if env is not None:
            log.info("torchrun: %d processes, this is rank %d (node %d)", env.world_size, env.rank, env.rank)
        log.info("cpu kernels: %s, %d threads (cpu_capability, cpu_threads; the last digits of a run depend on them); "
                 "idle threads: %s", cfg.cpu_capability, _threads(), openmp_waits())
        # the whole config in the run's log (not on the console): the log alone says what ran
        log.info("config (as config.yaml records it):\n%s", yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(),
                 extra=FILE_ONLY)
        for warning in cfg.warnings():
            log.warning("config: %s", warning)
        set_seeds(cfg.training_seed)
        data = load_corpus(cfg)
        log.info("data: %s", data.description)
        if env is not None:
            torchrun.agree_on_data(data.fingerprint())
        model = build_model(cfg, len(data.tokenizer), data.tokenizer.pad_token_id)
        log.info("model: %s (%s), %.2fM parameters", cfg.model_config.name, type(model).__name__,
                 count_parameters(model) / 1e6)
        out_dir = run_dir if writes else scratch
        if writes:
            tracker = build_tracker(cfg, run_dir, resume_step)
        else:
            from training_logs.trackers import TrackerGroup

            tracker = TrackerGroup([])
        stop.install()  # again: ClearML's Task.init installs handlers of its own that swallow SIGTERM
        classification = data.val.labels is not None
        memory = MemoryMonitor(out_dir / "memory_report", cfg.device_names, tracker, cfg.memory_sample_interval_s,
                               resume_step if writes else None)
        logger = TrainingLogger(out_dir / "model_training_report", tracker, memory,
                                "val_accuracy" if classification else "val_perplexity", classification,
                                resume_step if writes else None)
        cluster = ClusterController(cfg, model, data, logger, run_dir / "model_weights", checkpoint, stop, env)
        summary = cluster.train()
        if stop.requested:
            log.warning("%s arrived during the final checkpoint; the run is complete", stop.name)
        summary["cpu_kernels"] = {"capability": cfg.cpu_capability, "threads": _threads(),
                                  "idle_threads": openmp_waits()}
        logger.finish(summary)
        if writes:  # while the lock is held: nothing of this run is written after another may take the directory
            write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
            write_status(run_dir, "completed", exit_code=0, outer_step=summary["outer_steps"],
                         checkpoint=str(run_dir / "model_weights" / "final"), resumable=False,
                         final_metric=summary["final_metric"])
        log.info("final model: trainer %d, %s %.4g (start %.4g); %s, %s, accumulation used: %s; %s, %s, %.1f "
                 "MB communicated; %.0f s", summary["final_trainer"], summary["metric"], summary["final_metric"],
                 summary["initial_metric"], plural(summary["merges"], "merge"),
                 plural(summary["batch_increases"], "batch increase"), summary["accumulation_used"],
                 plural(summary["rounds"], "round"), plural(summary["syncs"], "sync"),
                 summary["bytes_communicated"] / 1e6, summary["wall_time_s"])
        if summary["capped_requests"]:
            log.warning("the batch test was capped by max_requested_batch %d in %s (it asked for up to %d): the "
                        "batches followed the cap, not the test", cfg.max_requested_batch,
                        plural(summary["capped_requests"], "decision"), summary["largest_capped_request"])
        log.info("outputs in %s", run_dir)
    except BaseException as exc:
        if isinstance(exc, RunStopped):
            exc.run_dir = run_dir
            log.warning("%s; resume with: python run.py --resume %s", exc, run_dir, extra=FILE_ONLY)
        elif isinstance(exc, UserError):
            log.error("%s", exc, extra=FILE_ONLY)  # the run's own log says why it ended
        elif isinstance(exc, Exception):
            log.exception("run failed", extra=FILE_ONLY)  # the traceback goes to the log; main prints one line
        if writes:
            record_ending(run_dir, exc)
        raise
    finally:
        if logger is not None:
            _close_within(logger.close, TRACKER_CLOSE_TIMEOUT_S, "the trackers")
        if writes:
            lock.release()
        stop.uninstall()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        if env is not None:
            torchrun.finish()
    return run_dir, summary


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def ending_of(exc: BaseException, resuming: str | None = None) -> tuple[str, int, str]:
    """How an exception ends a run: (state for status.json, exit code, the one line printed on stderr)."""
    from utils.signals import StopRequested, signal_name

    if isinstance(exc, RunStopped):
        where = getattr(exc, "run_dir", "RUN_DIR")
        return "stopped", exc.exit_code, f"{exc}; resume with: python run.py --resume {where}"
    if isinstance(exc, TrainingFault):
        return "fault", exc.exit_code, f"error: {exc}"
    if isinstance(exc, UserError):
        return "failed", exc.exit_code, f"error: {exc}"
    if isinstance(exc, (StopRequested, KeyboardInterrupt)):
        signum = getattr(exc, "signum", 2)
        if resuming:
            line = (f"stopped by {signal_name(signum)} before training resumed; the checkpoints in {resuming} "
                    "are unchanged")
        else:
            line = f"stopped by {signal_name(signum)} before training started; nothing to resume"
        return "stopped", 128 + signum, line
    if isinstance(exc, OSError):
        from utils.safe_write import why_write_failed

        where = f" {exc.filename}" if exc.filename else ""
        return "failed", 2, f"error: cannot write or read{where} ({why_write_failed(exc)})"
    where = _log_path()
    return "failed", 1, (f"error: internal error ({type(exc).__name__}: {str(exc)[:200]})"
                         + (f"; traceback in {where}" if where else ""))


def record_ending(run_dir: Path, exc: BaseException) -> None:
    """status.json for a run that did not complete: what ended it, where it can resume from."""
    from utils.checkpoint import MANIFEST
    from utils.run_state import write_status
    from utils.signals import signal_name

    state, code, line = ending_of(exc, resuming=str(run_dir))
    complete = sorted((run_dir / "model_weights").glob(f"outer_step_*/{MANIFEST}"))  # NNNN: sorted by step
    latest = complete[-1].parent if complete else None
    fields = {"exit_code": code, "signal": None, "outer_step": int(latest.name.rsplit("_", 1)[1]) if latest else None,
              "checkpoint": str(latest) if latest else None, "resumable": latest is not None,
              "error": line if state in ("failed", "fault") else None, "message": line}
    if state == "stopped":
        fields["signal"] = signal_name(code - 128)
    write_status(run_dir, state, **fields)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 bad input, 3 training fault, 1 unexpected error, 130 / 143 stopped by a signal."""
    from utils.signals import StopSignals

    limit_openmp_spinning()  # before anything loads torch
    args = parse_args(argv)
    stop = StopSignals().install()  # from the start: a signal during set-up ends the process in one line too
    try:
        if args.resume:
            run_dir = Path(args.resume).expanduser()
            cfg, checkpoint = resume_config(run_dir, args.overrides, args.config)
            request_cpu_kernels(cfg)
            train(cfg, (run_dir, checkpoint), stop)
        else:
            from distributed.torchrun import restarted_run

            cfg = load_config(args.config or "config.yaml", args.overrides)
            request_cpu_kernels(cfg)
            run_dir = restarted_run(cfg.log_dir)  # torchrun --max-restarts: continue where the group died
            if run_dir is not None:
                print(f"torchrun restarted the processes: resuming {run_dir}", file=sys.stderr)
                cfg, checkpoint = resume_config(run_dir, [], None)
                request_cpu_kernels(cfg)
                train(cfg, (run_dir, checkpoint), stop)
            else:
                train(cfg, None, stop)
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        _, code, line = ending_of(exc, resuming=args.resume)
        # one write: under torchrun several processes end at once on one terminal, and print() writes the
        # text and the newline apart, so their lines could run together
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()
        return code
    return 0


def _log_path() -> str | None:
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None


if __name__ == "__main__":
    code = main()
    if code >= 128:  # stopped by a signal: nothing left to wait for (tracker threads, atexit hooks)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
