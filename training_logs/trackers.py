"""Experiment trackers behind one small interface: log(metrics, step) and close().

ClearML and TensorBoard trackers plug in here; JsonlTracker keeps every logged scalar on disk.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path


class Tracker:
    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

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


class TrackerGroup(Tracker):
    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, metrics, step):
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def close(self):
        for tracker in self.trackers:
            tracker.close()
