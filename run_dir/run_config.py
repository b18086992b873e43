"""A run directory's config.yaml, read in today's meaning: the migrations of keys whose meaning or default
changed after runs were written (fragment_alpha on 2026-11-24, statistics_comm on 2026-11-25)."""

from __future__ import annotations

from pathlib import Path

import yaml

from utils.config import Config, load_config
from utils.errors import ConfigError


def load_run_config(path: str | Path, overrides: list[str] | None = None, *, resuming: bool = False) -> Config:
    """A run directory's config.yaml, read in today's meaning of fragment_alpha and statistics_comm.

    One written before 2026-11-24 (it names fragment_alpha but not fragment_alpha_weighs) meant by fragment_alpha
    the weight of the global copy. Without streaming that value did nothing: it reads as 0 (take the global
    copy, as the run did). With streaming a resume is refused, not reinterpreted; a reader (the harness, a
    benchmark) gets 1 - alpha, the same mix in today's terms."""
    cfg = load_config(path, overrides)
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if "statistics_comm" not in raw and not any(o.startswith("statistics_comm=") for o in overrides or []):
        cfg = cfg.replace(statistics_comm="fp64")  # written before the key: the run sent the fp64 reference
    if "fragment_alpha" not in raw or "fragment_alpha_weighs" in raw:
        return cfg
    old = float(raw["fragment_alpha"])
    if not (cfg.sync_fragments > 1 or cfg.sync_delay > 0):
        return cfg.replace(fragment_alpha=0.0)
    if resuming:
        raise ConfigError("fragment_alpha", f"{path} was written when fragment_alpha weighed the global copy "
                          f"({old} of the global weights); it now weighs the local copy (torchft's "
                          "fragment_update_alpha), so this streaming run cannot resume: start a new run with "
                          f"fragment_alpha={1 - old:g} for the same mix")
    return cfg.replace(fragment_alpha=1.0 - old)

