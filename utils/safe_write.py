"""Writes that fail in words a user acts on ("disk full", "read-only file system") and leave no part behind.

torch.save reports a failed write as a RuntimeError without its errno, safetensors as its own error type
with the errno in its text: both are turned back into the OSError they were.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` all at once: readers see the old or the new file, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _WriteRecorder:
    """A file for torch.save that keeps the OSError of a failed write: torch reports it as a RuntimeError
    without the errno ("unexpected pos ..."), which would hide a full disk."""

    def __init__(self, file) -> None:
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise


def torch_save(obj: Any, path: Path) -> None:
    """torch.save to `path`; a failed write raises the OSError (with its errno and the file name)."""
    with open(path, "wb") as f:
        recorder = _WriteRecorder(f)
        try:
            torch.save(obj, recorder)
        except RuntimeError:
            if recorder.error is None:
                raise
            raise OSError(recorder.error.errno, recorder.error.strerror, str(path)) from None


def safetensors_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file; a failed write raises an OSError with the errno its message carries."""
    try:
        save_file(tensors, str(path))
    except Exception as exc:
        found = re.search(r"os error (\d+)", str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


WRITE_FAILURES = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EFBIG: "file too large",
                  errno.EROFS: "read-only file system", errno.EACCES: "permission denied"}


def why_write_failed(exc: BaseException) -> str:
    """A failed write in the words a user acts on: 'disk full', 'read-only file system', ..."""
    if isinstance(exc, OSError):
        return WRITE_FAILURES.get(exc.errno, exc.strerror or str(exc))
    text = str(exc)
    found = re.search(r"os error (\d+)", text)
    if found is not None and int(found.group(1)) in WRITE_FAILURES:
        return WRITE_FAILURES[int(found.group(1))]
    return f"{type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}"
