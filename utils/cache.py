"""cache_dir: a speed-up, never a reason to stop a run.

Every entry (the corpus wheel, tokenizers, packed corpora, measured throughput curves) is written through a
temporary file and a rename, so readers only ever see complete entries, and a read-only cache holding a
complete entry is still read. When a write fails (a full disk, a quota, a read-only file system, a cache_dir
that is a file), the entry is dropped, the run goes on with what it built in memory or a temporary directory,
and it says so once, in one line naming cache_dir and the reason; it then stops trying to write there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from utils.safe_write import why_write_failed

log = logging.getLogger(__name__)

_unwritable: dict[Path, str] = {}  # cache roots this process could not write, and why


def cache_refused(root: Path) -> str | None:
    """Why writes to this cache root stopped in this process (None: they did not)."""
    return _unwritable.get(Path(root).expanduser())


def store(root: Path, path: Path, write: Callable[[Path], None], what: str) -> bool:
    """Write the cache entry `path` (under `root`) by `write(tmp)` and a rename; False (and, the first time, one
    warning line) when the cache cannot take it. Nothing partial is left behind."""
    root = Path(root).expanduser()
    if root in _unwritable:
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
        return True
    except Exception as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        _unwritable[root] = why = why_write_failed(exc)
        log.warning("cache_dir %s: could not cache %s (%s); nothing more is cached this run, which goes on "
                    "with what it builds in memory or a temporary directory", root, what, why)
        return False


def forget_refusals() -> None:
    """For tests and long-lived processes: try writing to every cache again."""
    _unwritable.clear()
