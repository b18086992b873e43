"""step_loss_log.csv: one row per node per inner optimizer step, safe to call from many threads.

Each call appends whole rows under one lock and flushes, so rows are never lost, split or duplicated,
whatever the thread timing.
"""

from __future__ import annotations

import csv
import threading
from pathlib import Path

from training_logs.records import StepLoss, columns

COLUMNS = columns(StepLoss)


class StepLossLogger:
    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        from training_logs.csv_files import start_csv

        self.path = path
        self._lock = threading.Lock()
        start_csv(path, COLUMNS, resume_step)
        self._file = path.open("a", newline="")
        self._writer = csv.writer(self._file)

    def log(self, rows: list[dict]) -> None:
        with self._lock:
            for row in rows:
                self._writer.writerow([row[c] for c in COLUMNS])
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
