"""Experiment trackers behind one small interface.

    log(metrics, step)            scalars; keys are "<group>/<name>" (trainer_0/val_perplexity, global/...)
    log_image(name, path, step)   a PNG plot
    log_artifact(name, obj)       a file path or a dict (metrics CSV, final summary)
    close()

JsonlTracker keeps every scalar on disk; TensorBoardTracker writes event files; ClearMLTracker
(training_logs/clearml_tracker.py) reports to a ClearML server or an offline session.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def split_key(key: str) -> tuple[str, str]:
    """'trainer_0/val_perplexity' -> (title 'val_perplexity', series 'trainer_0')."""
    group, _, name = key.partition("/")
    return (name, group) if name else (group, "global")


class Tracker:
    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_image(self, name: str, path: Path, step: int) -> None:
        pass

    def log_artifact(self, name: str, obj: Path | dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlTracker(Tracker):
    """One JSON object per call: {"step": ..., "metrics": {...}} in metrics.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path, self._lock = path, threading.Lock()
        self._file = path.open("a", encoding="utf-8")

    def log(self, metrics, step):
        with self._lock:
            self._file.write(json.dumps({"step": step, "metrics": metrics}) + "\n")
            self._file.flush()

    def close(self):
        with self._lock:
            self._file.close()


class TensorBoardTracker(Tracker):
    """The same scalars as TensorBoard event files (tag = the metric key), for users without ClearML."""

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step (a resume): TensorBoard hides the interrupted run's events from this step on
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        self.log_dir = log_dir

    def log(self, metrics, step):
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_image(self, name, path, step):
        import matplotlib.image as mpimg

        self.writer.add_image(f"plots/{name}", mpimg.imread(path)[..., :3], step, dataformats="HWC")

    def close(self):
        self.writer.flush()
        self.writer.close()


class TrackerGroup(Tracker):
    """Fans every call out; a failing tracker is reported once and dropped, training goes on."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = list(trackers)

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # a tracker must never stop training
                log.warning("%s failed in %s (%s); it is switched off", type(tracker).__name__, method, exc)
                self.trackers.remove(tracker)

    def log(self, metrics, step):
        self._each("log", metrics, step)

    def log_image(self, name, path, step):
        self._each("log_image", name, path, step)

    def log_artifact(self, name, obj):
        self._each("log_artifact", name, obj)

    def close(self):
        self._each("close")
