"""Small helpers: seeding (the console and the run's log are set up by training_logs/training_monitoring.py)."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_seeds(seed: int) -> None:
    """Seed the global generators (model init uses its own fork; data uses per-trainer generators)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
