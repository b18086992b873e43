"""Checkpoints: everything that decides a run's future, written atomically and verified on resume.

    model_weights/<label>/                  label = outer_step_NNNN (periodic or on a stop) or final
        trainer_<t>.safetensors             each surviving trainer's fp32 master weights
        trainer_<t>_state.pt                its requested batch, sampler, counters, outer optimizer
        resume_state.pt                     the cluster: node inner optimizers and owners, counters, RNGs
        metadata.json                       label, trainers, final trainer
        final_model/                        (final only) the chosen model as a Hugging Face directory
        manifest.json                       written last: outer step, config hash, size + sha256 of each file

A checkpoint is written into `.<label>.tmp`, every file flushed to disk, the directory renamed into
place, and only then the manifest written (itself through a temporary file and a rename). A checkpoint
without a manifest is incomplete and never loaded; an interrupted or failed write leaves the previous
checkpoint as it was and removes its temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from utils.errors import UserError
from utils.model_state import load_float_state
from utils.safe_write import safetensors_save, torch_save, why_write_failed, write_atomic  # noqa: F401

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
RESUME_STATE = "resume_state.pt"
FORMAT = 2


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, no permission); the previous one is intact."""


@dataclass
class Checkpoint:
    """A complete, verified checkpoint directory."""

    path: Path
    outer_step: int
    manifest: dict[str, Any]
    skipped: list[str] = field(default_factory=list)  # newer checkpoints found damaged (latest_checkpoint)

    def trainer_weights(self, trainer_id: int) -> dict[str, torch.Tensor]:
        return load_trainer_weights(self.path / f"trainer_{trainer_id}.safetensors")

    def trainer_state(self, trainer_id: int) -> dict[str, Any]:
        return _torch_load(self.path / f"trainer_{trainer_id}_state.pt")

    def resume_state(self) -> dict[str, Any]:
        return _torch_load(self.path / RESUME_STATE)

    @property
    def trainers(self) -> list[int]:
        return list(self.manifest["trainers"])


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for damaged files
        raise UserError(f"checkpoint: {path} is not readable ({type(exc).__name__}: {str(exc)[:120]})") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - some filesystems do not open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def remove_stray_temporaries(weights_dir: Path) -> None:
    """Leftovers of a write that was killed (kill -9, power loss): never complete, safe to delete."""
    if weights_dir.is_dir():
        for stray in weights_dir.glob(".*.tmp"):
            shutil.rmtree(stray, ignore_errors=True) if stray.is_dir() else stray.unlink(missing_ok=True)
        for stray in weights_dir.glob(".*.old"):
            target = weights_dir / stray.name[1:-len(".old")]
            if (target / MANIFEST).is_file():
                shutil.rmtree(stray, ignore_errors=True)
            else:  # killed between the two renames: the previous checkpoint goes back in place
                shutil.rmtree(target, ignore_errors=True)
                os.replace(stray, target)


@dataclass(frozen=True)
class FinalModel:
    """The chosen trainer of a final checkpoint, written as a Hugging Face directory (final_model/) through
    `template`, a model of the run's architecture, with the run's tokenizer beside it when there is one."""
    trainer_id: int
    template: torch.nn.Module
    tokenizer: object = None


def save_checkpoint(weights_dir: Path, label: str, outer_step: int, trainers: dict, resume_state: dict | None,
                    config_hash: str, final: FinalModel | None = None, config: dict | None = None) -> Path:
    """Write a complete checkpoint atomically; a CheckpointWriteError (previous one intact) if it cannot.
    config: the settings behind config_hash (Config.meaning), so a refused resume can name what changed."""
    final_id = final.trainer_id if final is not None else None
    target = weights_dir / label
    tmp = weights_dir / f".{label}.tmp"
    old = weights_dir / f".{label}.old"
    try:
        weights_dir.mkdir(parents=True, exist_ok=True)
        remove_stray_temporaries(weights_dir)
        tmp.mkdir()
        for t, trainer in trainers.items():
            safetensors_save({k: v.detach().contiguous() for k, v in trainer.master.items()},
                             tmp / f"trainer_{t}.safetensors")
            torch_save(trainer.state_dict(), tmp / f"trainer_{t}_state.pt")
        if resume_state is not None:
            torch_save(resume_state, tmp / RESUME_STATE)
        if final is not None:
            load_float_state(final.template, trainers[final_id].master)
            final.template.save_pretrained(tmp / "final_model")
            if final.tokenizer is not None:
                final.tokenizer.save_pretrained(tmp / "final_model")
        meta = {"label": label, "outer_step": outer_step, "trainers": sorted(trainers), "final_trainer": final_id}
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2))
        _fsync_tree(tmp)
        files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        if target.exists():
            os.replace(target, old)  # kept until the new one is in place
        os.replace(tmp, target)
        manifest = {"format": FORMAT, "complete": True, "label": label, "outer_step": outer_step,
                    "config_hash": config_hash, "trainers": sorted(trainers), "resumable": resume_state is not None,
                    "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": config, "files": files}
        write_atomic(target / MANIFEST, json.dumps(manifest, indent=2))
        _fsync_dir(weights_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:  # a failed or interrupted write leaves no temporary directory behind
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists():  # the new one never got its manifest: the previous one of this label goes back
            shutil.rmtree(target, ignore_errors=True)
            os.replace(old, target)
        if not isinstance(exc, Exception):  # an interrupt: the caller handles it
            raise
        where = (exc.filename if isinstance(exc, OSError) else None) or tmp
        reason = why_write_failed(exc)
        raise CheckpointWriteError(f"checkpoint: cannot write {where} ({reason}); the previous checkpoint in "
                                   f"{weights_dir} is intact") from None
    return target


def expected_checkpoint_bytes(params: int, trainers: int, nodes: int, outer_momentum: bool, final: bool = False) -> int:
    """The tensor bytes of one checkpoint (docs/running.md: "What a checkpoint holds"): per trainer its fp32 masters
    (4P) and, with outer momentum, its momentum buffer (4P); per node its AdamW moments (8P); final adds the
    chosen model as a Hugging Face directory (4P). Headers, RNG states and counters add a few KB."""
    units = trainers * (2 if outer_momentum else 1) + 2 * nodes + (1 if final else 0)
    return 4 * params * units


def prune_checkpoints(weights_dir: Path, keep: int, newest: Path) -> list[Path]:
    """keep_checkpoints: after `newest` was written, keep the newest `keep` complete checkpoints (0 = all).

    Nothing is deleted unless `newest` verifies in full (every file's size and sha256), so the checkpoint a
    resume would use always stays; `final` is never deleted; directories without a manifest are not
    checkpoints and are left alone. Returns what was deleted."""
    if keep <= 0:
        return []
    try:
        verify(newest)
    except UserError as exc:
        log.warning("keep_checkpoints: nothing pruned, the newest checkpoint does not verify (%s)", exc)
        return []
    complete = []
    for path in weights_dir.iterdir():
        if path.is_dir() and not path.name.startswith(".") and (path / MANIFEST).is_file():
            try:
                step = int(json.loads((path / MANIFEST).read_text())["outer_step"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            complete.append((step, path.name == "final", path))
    complete.sort(key=lambda c: (c[0], c[1]), reverse=True)
    removed = []
    for _, is_final, path in complete[keep:]:
        if is_final or path == newest:
            continue
        old = weights_dir / f".{path.name}.pruned.tmp"
        os.replace(path, old)  # out of sight at once; a kill during the delete leaves only a stray temporary
        shutil.rmtree(old, ignore_errors=True)
        removed.append(path)
    return removed


def check_files(root: Path, files: dict[str, dict], deep: bool) -> None:
    """Each manifest entry {name: {bytes, sha256}} against the file under root: present, its size, and (deep)
    its sha256; a UserError naming the first file that differs."""
    for name, info in files.items():
        file = root / name
        if not file.is_file():
            raise UserError(f"checkpoint: {file} is missing")
        if file.stat().st_size != info["bytes"]:
            raise UserError(f"checkpoint: {file} has {file.stat().st_size} bytes, the manifest says {info['bytes']} "
                            "(truncated or overwritten)")
        if deep and _sha256(file) != info["sha256"]:
            raise UserError(f"checkpoint: {file} does not match its sha256 in the manifest (corrupted)")


class ConfigMismatch(UserError):
    """A checkpoint of other settings; `config`: the settings it recorded (None: written before they were)."""

    def __init__(self, message: str, path: Path, config: dict | None) -> None:
        super().__init__(message)
        self.path, self.config = path, config


def verify(path: Path, config_hash: str | tuple[str, ...] | None = None, deep: bool = True) -> Checkpoint:
    """The checkpoint at `path` if it is complete and its files are intact; a UserError saying what is wrong.
    config_hash: the config hash it must carry (or any of several: Config.meaning_hashes)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise UserError(f"checkpoint: {path} is incomplete (no {MANIFEST}; its write was interrupted)")
    try:
        manifest = json.loads(manifest_path.read_text())
        outer_step = int(manifest["outer_step"])
        files = dict(manifest["files"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise UserError(f"checkpoint: {manifest_path} is damaged (not a checkpoint manifest)") from None
    if manifest.get("format") != FORMAT or not manifest.get("resumable"):
        raise UserError(f"checkpoint: {path} was written by another version or holds no resume state")
    hashes = (config_hash,) if isinstance(config_hash, str) else config_hash
    if hashes is not None and manifest.get("config_hash") not in hashes:
        raise ConfigMismatch(f"checkpoint: {path} belongs to another configuration (config hash "
                             f"{manifest.get('config_hash')}, this run's is {hashes[0]})", path, manifest.get("config"))
    check_files(path, files, deep)
    return Checkpoint(path, outer_step, manifest)


def verify_part(path: Path) -> Path | None:
    """A file or directory inside a checkpoint (trainer_0.safetensors, final_model/) against the checkpoint's
    manifest: size and sha256 of each of its files. Returns the checkpoint directory, or None when `path`
    is not inside one (a model directory from elsewhere has no manifest to check against)."""
    path = path.resolve()
    root = next((p for p in [path, *path.parents] if (p / MANIFEST).is_file()), None)
    if root is None:
        return None
    checkpoint = root.parent.name == "model_weights" or (root / "metadata.json").is_file()
    if not checkpoint:
        return None
    try:
        files = dict(json.loads((root / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise UserError(f"checkpoint: {root / MANIFEST} is damaged (not a checkpoint manifest)") from None
    inside = path.relative_to(root)
    chosen = {name: info for name, info in files.items()
              if path == root or Path(name) == inside or inside in Path(name).parents}
    if not chosen and path.is_file():
        raise UserError(f"checkpoint: {path} is not listed in {root / MANIFEST}")
    check_files(root, chosen, deep=True)
    return root


def latest_checkpoint(weights_dir: Path, config_hash: str | tuple[str, ...]) -> Checkpoint:
    """The newest complete checkpoint; the damaged newer ones are listed in its `skipped` (the run reports them).
    A checkpoint whose manifest is missing or unreadable still counts by its name (outer_step_NNNN; final is the
    newest), so a damaged newer one is reported, never passed over in silence."""
    candidates = []
    for path in weights_dir.iterdir() if weights_dir.is_dir() else []:
        if path.is_dir() and not path.name.startswith("."):
            try:
                step = int(json.loads((path / MANIFEST).read_text())["outer_step"])
            except (OSError, ValueError, KeyError, TypeError):  # incomplete or damaged: its name says its place
                step = _step_of_name(path.name)
            candidates.append((step, path.name == "final", path))
    problems = []
    for _, _, path in sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True):
        try:
            checkpoint = verify(path, config_hash)
        except UserError as exc:
            if isinstance(exc, ConfigMismatch):
                raise
            problems.append(str(exc).removeprefix("checkpoint: "))
            continue
        checkpoint.skipped = problems
        return checkpoint
    detail = f": {'; '.join(problems)}" if problems else ""
    raise UserError(f"--resume: no complete checkpoint in {weights_dir}{detail}")


def _step_of_name(name: str) -> float:
    """outer_step_0004 -> 4; final -> after every step; anything else -> before every checkpoint."""
    if name == "final":
        return math.inf
    prefix, _, digits = name.rpartition("_")
    return int(digits) if prefix == "outer_step" and digits.isdigit() else -1


def load_trainer_weights(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint: file not found: {path}")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise UserError(f"checkpoint: {path} is not a readable safetensors file ({exc})") from None
