"""Claiming a run directory: a fresh one under log_dir, or the one run_name names (refused while a live process
holds it, or when it holds checkpoints; the stub of a failed run is moved aside, never deleted)."""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path

from run_dir.run_state import RunDirInUse, RunLock, in_use
from utils.config import Config
from utils.errors import UserError


def check_run_name(cfg: Config) -> None:
    """A named run directory that already holds a run (or something else) is refused now, not after loading."""
    if cfg.run_name:
        problem = refused_run_name(Path(cfg.log_dir).expanduser() / cfg.run_name)
        if problem:
            raise UserError(problem)


def make_run_dir(log_dir: str, run_name: str, model: str, dataset: str) -> tuple[Path, RunLock]:
    """A fresh run directory under log_dir (`~` expanded), returned with its lock held.

    Without run_name the name is <model>_<dataset>_<date>, with _2, _3, ... when runs start in the same
    second. With run_name, a directory that a live process holds is refused (never moved or written),
    and so is one that holds checkpoints (continue it with --resume) or is not a run directory; a run
    directory without checkpoints (the stub of a failed run) is locked, then renamed to
    <run_name>.failed_<date>, never deleted.
    """
    root = Path(log_dir).expanduser()
    stamp = datetime.now().strftime("%Y_%m_%d_%H_%M_%S")
    try:
        root.mkdir(parents=True, exist_ok=True)
        if run_name:
            path = root / run_name
            problem = refused_run_name(path)
            if problem:
                raise UserError(problem)
            if path.is_dir() and any(path.iterdir()):
                stub = _claim_named(path)  # a live run keeps its directory; the lock moves with it
                try:
                    problem = refused_run_name(path, held=True)  # it may have written a checkpoint before we locked
                    if problem:
                        raise UserError(problem)
                    aside = _unique(root / f"{run_name}.failed_{stamp}")
                    path.rename(aside)
                finally:
                    stub.release()
                logging.getLogger(__name__).warning("run_name: %s held a run without checkpoints; moved to %s",
                                                    path, aside)
            path.mkdir(exist_ok=True)
            return path, _claim_named(path)
        base = f"{Path(model).name or model}_{dataset}_{stamp}"
        for i in range(1, 1000):
            path = root / (base if i == 1 else f"{base}_{i}")
            try:
                path.mkdir()  # atomic: two runs starting together never get the same directory
                return path, RunLock(path).acquire()
            except FileExistsError:
                continue
        raise UserError(f"log_dir: could not find a free run directory name in {root}")
    except OSError as exc:
        raise UserError(f"log_dir: cannot create a run directory in {root} ({exc.strerror or exc})") from None


def _claim_named(path: Path) -> RunLock:
    """The lock of a run directory named by run_name; another process that won the race is refused by key."""
    try:
        return RunLock(path).acquire()
    except RunDirInUse as exc:
        raise UserError(f"run_name: {exc}") from None


def refused_run_name(path: Path, held: bool = False) -> str | None:
    """Why a named run directory cannot be used for a new run (None: it can). held: this process holds its lock."""
    from utils.checkpoint import MANIFEST

    if path.exists() and not path.is_dir():
        return f"run_name: {path} exists and is not a directory"
    if path.is_dir() and any(path.iterdir()):
        holder = None if held else in_use(path)
        if holder:
            return f"run_name: run directory {path} is in use by {holder}; choose another run_name or wait"
        if any((path / "model_weights").glob(f"*/{MANIFEST}")):
            return (f"run_name: {path} holds a run with checkpoints; continue it with "
                    f"`python run.py --resume {path}` or choose another run_name")
        if not (path / "config.yaml").is_file():
            return f"run_name: {path} already exists and is not a run directory; choose another run_name"
    return None


def _unique(path: Path) -> Path:
    candidate, i = path, 1
    while candidate.exists():
        i += 1
        candidate = path.with_name(f"{path.name}_{i}")
    return candidate
