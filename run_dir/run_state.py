"""Who owns a run directory, and how its run ended.

run.lock: an OS file lock (`fcntl.flock`) held for the life of the process that uses the directory.
The kernel releases it when that process ends in any way (exit, crash, SIGKILL), so a lock left behind
by a dead run never blocks a resume, and a PID reused by another program means nothing: ownership is
the lock, not the PID. The file's text (host, PID, process start time, when) only says who holds it,
for the error line. On a shared file system (NFS v4, Lustre, GPFS) flock is honoured across hosts.

status.json: written atomically when a run starts and again when it ends, so a scheduler script can
decide to requeue without parsing logs:
    {"state": "running" | "completed" | "stopped" | "fault" | "failed", "exit_code": ..., "signal": ...,
     "outer_step": ..., "checkpoint": ..., "resumable": ..., "error": "<the one-line error>", ...}
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from utils.errors import UserError

LOCK_FILE = "run.lock"
STATUS_FILE = "status.json"
# the other files a run leaves, named once (run_dir/reader.py reads them back); here, where importing loads no torch
REPORT = "model_training_report"  # the run's CSVs and plots
SUMMARY = "summary.json"  # written last, when a run completes
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
WEIGHTS = "model_weights"


def process_start_time(pid: int) -> str:
    """The kernel's start time of `pid` (clock ticks since boot), which a reused PID does not share."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


class RunDirInUse(UserError):
    """Another live process holds the run directory."""


class RunLock:
    """An exclusive, non-blocking flock on RUN_DIR/run.lock, held until release() or process exit."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def holder(self) -> str:
        """Who holds the lock, as its file says (for messages only)."""
        try:
            info = json.loads(self.path.read_text())
            return f"process {info['pid']} on host {info['host']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    def try_acquire(self) -> bool:
        """Take the lock if no live process holds it; False if one does. The directory must exist."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                    return False
                raise
            # The directory may have been moved, or the file replaced, between open and flock: the lock
            # counts only if it is on the file that is at the path now.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        pid = os.getpid()
        text = json.dumps({"host": socket.gethostname(), "pid": pid, "process_start": process_start_time(pid),
                           "since": time.strftime("%Y-%m-%dT%H:%M:%S")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, (text + "\n").encode(), 0)
        self._fd = fd
        return True

    def acquire(self) -> RunLock:
        if not self.try_acquire():
            raise RunDirInUse(f"run directory {self.run_dir} is in use by {self.holder()}; wait for it to end, "
                              "or stop it first")
        return self

    def release(self) -> None:
        """Unlock and close. The file stays: deleting it would let a waiting process lock an orphan inode."""
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def in_use(run_dir: Path) -> str | None:
    """Who holds `run_dir` now (None: nobody). Probes with the lock itself, then lets go."""
    if not (Path(run_dir) / LOCK_FILE).is_file():
        return None
    probe = RunLock(run_dir)
    try:
        if probe.try_acquire():
            probe.release()
            return None
    except OSError:
        return None
    return probe.holder()


# ----------------------------------------------------------------------------------------------
# status.json


def write_status(run_dir: Path, state: str, **fields: Any) -> None:
    """Replace RUN_DIR/status.json atomically; a failure to write it is never what ends a run."""
    from utils.checkpoint import write_atomic

    record = {"state": state, **fields, "host": socket.gethostname(), "pid": os.getpid(),
              "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        write_atomic(Path(run_dir) / STATUS_FILE, json.dumps(record, indent=2) + "\n")
    except OSError:
        pass


def read_status(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
