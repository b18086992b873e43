"""A run's lifecycle around the training: the run directory claimed and locked, the log file, config.yaml and
status.json, the trackers and the logger, summary.json, how an ending is recorded, and the rank roles under
torchrun (rank 0 writes the run directory; the other ranks log warnings only and write to a scratch place).

    with RunSession(cfg, resume, env, stop) as session:
        logger = session.open_logger(classification)
        ...
        session.complete(summary)
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
from pathlib import Path

import yaml

from run_dir.run_state import CONFIG, METRICS, REPORT, SUMMARY
from utils.config import Config
from utils.errors import ConfigError, RunStopped, TrainingFault, UserError
from utils.openmp import openmp_waits

log = logging.getLogger("run")
TRACKER_CLOSE_TIMEOUT_S = 15.0
FILE_ONLY = {"file_only": True}  # main() prints these lines itself


class RunSession:
    """resume: (run directory, checkpoint) to continue, or None for a new run directory.
    env: the torchrun environment (None: one process)."""

    def __init__(self, cfg: Config, resume: tuple[Path, object] | None, env, stop) -> None:
        self.cfg, self.env, self.stop = cfg, env, stop
        self.writes = env is None or env.is_main  # under torchrun only rank 0 writes the run directory
        self.checkpoint = resume[1] if resume is not None else None
        self._resume_dir = resume[0] if resume is not None else None
        self.run_dir: Path | None = None
        self.logger = None
        self.lock = None
        self.scratch: Path | None = None

    @property
    def resume_step(self) -> int | None:
        return self.checkpoint.outer_step if self.checkpoint is not None else None

    def _claim(self):
        """The run directory, locked for the life of this process (under torchrun: rank 0's, shared)."""
        from run_dir.claim import make_run_dir
        from run_dir.run_state import RunLock

        if self._resume_dir is not None:
            def claim():
                return self._resume_dir, RunLock(self._resume_dir).acquire()
        else:
            def claim():
                return make_run_dir(self.cfg.log_dir, self.cfg.run_name, self.cfg.model_config.name, self.cfg.dataset)
        if self.env is None:
            return claim()
        from distributed import torchrun

        return torchrun.shared_run_dir(self.env, claim)  # rank 0 claims it and tells the others (its error too)

    def __enter__(self) -> RunSession:
        self.run_dir, self.lock = self._claim()
        self.scratch = None if self.writes else Path(tempfile.mkdtemp(prefix="adloco_rank"))  # logs go nowhere
        self.stop.install()
        try:
            self._start()
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def _start(self) -> None:
        """The log file, config.yaml, status.json "running", and the run's first lines."""
        from run_dir.run_state import write_status
        from training_logs.csv_files import cut_jsonl
        from training_logs.training_monitoring import setup_logging
        from utils.checkpoint import write_atomic

        cfg, run_dir, checkpoint = self.cfg, self.run_dir, self.checkpoint
        setup_logging(run_dir / cfg.log_file if self.writes else None)
        if not self.writes:
            logging.getLogger().setLevel(logging.WARNING)
            share_errors(run_dir / cfg.log_file, self.env.rank)
        if self.writes:
            write_atomic(run_dir / CONFIG, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            write_status(run_dir, "running", exit_code=None, signal=None, outer_step=self.resume_step,
                         checkpoint=str(checkpoint.path) if checkpoint is not None else None,
                         resumable=checkpoint is not None, error=None, message=None)
            if checkpoint is not None:
                cut_jsonl(run_dir / METRICS, self.resume_step)
        if checkpoint is not None:
            for problem in checkpoint.skipped if self.writes else []:  # damaged newer ones: said, not passed over
                log.warning("resume: skipped a damaged newer checkpoint: %s", problem)
            log.info("resuming %s from %s (after outer step %d)", run_dir, checkpoint.path, self.resume_step)
        else:
            log.info("run directory: %s", run_dir)
        if self.env is not None:
            log.info("torchrun: %d processes, this is rank %d (node %d)", self.env.world_size, self.env.rank,
                     self.env.rank)
        log.info("cpu kernels: %s, %d threads (cpu_capability, cpu_threads; the last digits of a run depend on them); "
                 "idle threads: %s", cfg.cpu_capability, threads(), openmp_waits())
        # the whole config in the run's log (not on the console): the log alone says what ran
        log.info("config (as config.yaml records it):\n%s", yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(),
                 extra=FILE_ONLY)
        for warning in cfg.warnings():
            log.warning("config: %s", warning)

    def open_logger(self, classification: bool):
        """The trackers (rank 0 only), the memory monitor and the training logger."""
        from training_logs.memory_monitor import MemoryMonitor
        from training_logs.trackers import TrackerGroup
        from training_logs.training_monitoring import TrainingLogger

        cfg, writes = self.cfg, self.writes
        out_dir = self.run_dir if writes else self.scratch
        tracker = build_tracker(cfg, self.run_dir, self.resume_step) if writes else TrackerGroup([])
        self.stop.install()  # again: ClearML's Task.init installs handlers of its own that swallow SIGTERM
        step = self.resume_step if writes else None
        memory = MemoryMonitor(out_dir / "memory_report", cfg.device_names, cfg.memory_sample_interval_s, step)
        self.logger = TrainingLogger(out_dir / REPORT, tracker, memory,
                                     "val_accuracy" if classification else "val_perplexity", classification, step,
                                     cfg.num_outer_steps)
        return self.logger

    def complete(self, summary: dict) -> None:
        """summary.json, status.json "completed" and the run's last lines."""
        from run_dir.run_state import write_status
        from utils.checkpoint import write_atomic

        cfg, run_dir = self.cfg, self.run_dir
        if self.stop.requested:
            log.warning("%s arrived during the final checkpoint; the run is complete", self.stop.name)
        summary["cpu_kernels"] = {"capability": cfg.cpu_capability, "threads": threads(),
                                  "idle_threads": openmp_waits()}
        self.logger.finish(summary)
        if self.writes:  # while the lock is held: nothing of this run is written after another may take the directory
            write_atomic(run_dir / SUMMARY, json.dumps(summary, indent=2))
            final = run_dir / "model_weights" / "final"
            extendable = final_resumable(final)
            write_status(run_dir, "completed", exit_code=0, outer_step=summary["outer_steps"], checkpoint=str(final),
                         resumable=False, extendable=extendable, final_metric=summary["final_metric"],
                         message=f"completed; `python run.py --resume {run_dir} num_outer_steps=N` (N > "
                         f"{summary['outer_steps']}) trains it on" if extendable else "completed")
        log.info("final model: trainer %d, %s %.4g (start %.4g); %s, %s, accumulation used: %s; %s, %s, %s; %.0f s",
                 summary["final_trainer"], summary["metric"], summary["final_metric"],
                 summary["initial_metric"], plural(summary["merges"], "merge"),
                 plural(summary["batch_increases"], "batch increase"), summary["accumulation_used"],
                 plural(summary["rounds"], "round"), plural(summary["syncs"], "sync"), sent_line(summary),
                 summary["wall_time_s"])
        if summary["capped_requests"]:
            log.warning("the batch test was capped by max_requested_batch %d in %s (it asked for up to %d): the "
                        "batches followed the cap, not the test", cfg.max_requested_batch,
                        plural(summary["capped_requests"], "decision"), summary["largest_capped_request"])
        log.info("outputs in %s", run_dir)

    def __exit__(self, exc_type, exc: BaseException | None, tb) -> None:
        try:
            if exc is not None:
                self._ended_by(exc)
        finally:
            if self.logger is not None:
                close_within(self.logger.close, TRACKER_CLOSE_TIMEOUT_S, "the trackers")
                self.logger = None
            if self.writes and self.lock is not None:
                self.lock.release()
                self.lock = None
            self.stop.uninstall()
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)
                self.scratch = None
            if self.env is not None:
                from distributed import torchrun

                torchrun.finish()
                self.env = None

    def _ended_by(self, exc: BaseException) -> None:
        """The run's own log says why it ended (under torchrun, any rank's own error, with its traceback);
        status.json records it (rank 0). A rank's own error is the group's first cause (distributed/liveness.py)."""
        from distributed.liveness import GroupFailure

        # a node fault (TrainingFault) and a stop are decided by every rank together: no rank's own
        own = not isinstance(exc, (RunStopped, GroupFailure, TrainingFault)) and isinstance(exc, Exception)
        if isinstance(exc, RunStopped):
            exc.run_dir = self.run_dir
            log.warning("%s; resume with: python run.py --resume %s", exc, self.run_dir, extra=FILE_ONLY)
        elif isinstance(exc, UserError) and (own or self.writes):
            log.error("%s", exc, extra=FILE_ONLY)
        elif own:
            log.exception("run failed", extra=FILE_ONLY)  # the traceback goes to the log; main prints one line
        if own and self.env is not None:
            from distributed import torchrun

            torchrun.record_cause(self.env.rank, ending_of(exc)[2])
        if self.writes:
            record_ending(self.run_dir, exc, resumed=self.checkpoint is not None)


def build_tracker(cfg: Config, run_dir: Path, resume_step: int | None = None):
    """metrics.jsonl always; ClearML unless clearml_mode: off; TensorBoard when asked."""
    from training_logs.trackers import JsonlTracker, TensorBoardTracker, TrackerGroup

    trackers = [JsonlTracker(run_dir / METRICS)]
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


def close_within(action, seconds: float, what: str) -> None:
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


def threads() -> int:
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
    where = log_path()
    return "failed", 1, (f"error: internal error ({type(exc).__name__}: {str(exc)[:200]})"
                         + (f"; traceback in {where}" if where else ""))


def record_ending(run_dir: Path, exc: BaseException, resumed: bool) -> None:
    """status.json for a run that did not complete: what ended it, where it can resume from (resumed: this
    process resumed it from a checkpoint; a new run stopped during set-up has nothing to resume)."""
    from run_dir.run_state import write_status
    from utils.checkpoint import MANIFEST
    from utils.signals import signal_name

    state, code, line = ending_of(exc, resuming=str(run_dir) if resumed else None)
    complete = sorted((run_dir / "model_weights").glob(f"outer_step_*/{MANIFEST}"))  # NNNN: sorted by step
    latest = complete[-1].parent if complete else None
    fields = {"exit_code": code, "signal": None, "outer_step": int(latest.name.rsplit("_", 1)[1]) if latest else None,
              "checkpoint": str(latest) if latest else None, "resumable": latest is not None,
              "error": line if state in ("failed", "fault") else None, "message": line}
    if state == "stopped":
        fields["signal"] = signal_name(code - 128)
    write_status(run_dir, state, **fields)


def sent_line(summary: dict) -> str:
    """What the run sent, as its final line says it: the bytes its method needs (weights, and the batch test's
    statistics when it decides with them), and statistics sent for the log only apart."""
    line = f"{summary['total_traffic_bytes'] / 1e6:.1f} MB communicated"
    if summary["statistics_bytes"]:
        line += (f" ({summary['weights_traffic_bytes'] / 1e6:.1f} MB weights + {summary['statistics_bytes'] / 1e6:.1f} "
                 "MB batch-test statistics)")
    if summary["logged_statistics_bytes"]:
        line += f"; {summary['logged_statistics_bytes'] / 1e6:.1f} MB of statistics for the log only, not counted"
    return line


def final_resumable(final: Path) -> bool:
    """Whether a completed run's final checkpoint holds the state a --resume with more outer steps needs."""
    from utils.checkpoint import MANIFEST

    try:
        return bool(json.loads((final / MANIFEST).read_text()).get("resumable"))
    except (OSError, ValueError):
        return False


def share_errors(log_file: Path, rank: int) -> None:
    """A torchrun rank other than 0 writes nothing of the run's, but its own errors, with their tracebacks, go to
    the run's log too, marked with its rank, when the run directory is on this machine's file system."""
    if not log_file.parent.is_dir():
        return
    handler = logging.FileHandler(log_file, encoding="utf-8", delay=True)  # opened at the first error only
    handler.setLevel(logging.ERROR)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)


def log_path() -> str | None:
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None
