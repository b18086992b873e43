"""Small helpers: seeding, logging set-up, run directories."""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


def set_seeds(seed: int) -> None:
    """Seed the global generators (model init uses its own fork; data uses per-trainer generators)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


class _TqdmHandler(logging.StreamHandler):
    """Console lines that do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:  # pragma: no cover - logging must never crash training
            self.handleError(record)


def setup_logging(log_file: Path | None) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO)
    console = _TqdmHandler()
    console.setFormatter(logging.Formatter("%(message)s"))
    # records with extra={"file_only": True}: the run's log keeps them; the console gets them from main()
    console.addFilter(lambda record: not getattr(record, "file_only", False))
    root.addHandler(console)
    if log_file is not None:
        file_handler = logging.FileHandler(log_file, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(file_handler)
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
