"""Who is to blame when a torchrun collective fails: a rank that did not arrive (hung), or one whose process ended.

Both are read from torchrun's store, which outlives the worker processes (the elastic agent hosts it):
- arrival marks: each rank marks every world collective it reaches; on a failure, the ranks without a mark
  for that collective did not arrive (hung, dead, or on another machine);
- process records: each rank records its host, PID and process start time. The first rank to see a
  collective fail looks for peers whose processes are gone (on its own machine) and records them with
  `compare_set`, before torchrun stops the rest of the group; every later rank reads that record, so no
  line blames the ranks that were only torn down;
- the first cause: a rank that ends by an error of its own (not a failed collective: a bug, a fault it
  raised) records its one line before its process ends (`record_cause`), so every other rank's line and
  status.json name that error, and nobody is told that torchrun --max-restarts would cure it.

Only errors raised by a torch.distributed call are collective failures (`collective()` marks them); any
other exception on a rank is that rank's own.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from run_dir.run_state import process_start_time
from utils.errors import UserError

FIRST_CAUSE = "first_cause"
ENDING_S = 2.0  # how long a failed collective waits to see a killed peer's process end (it takes milliseconds)


class CollectiveError(RuntimeError):
    """A torch.distributed call failed (a peer died, hung or left): not an error of this rank's own code."""


@contextmanager
def collective() -> Iterator[None]:
    """Around a torch.distributed call (or a wait on one): its RuntimeError becomes a CollectiveError."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        raise CollectiveError(str(exc)) from exc


class GroupFailure(UserError):
    """A collective failed on this rank because of another rank: the line says whose fault it was."""

    exit_code = 1


class Liveness:
    def __init__(self, store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size, self.phase = store, rank, world_size, 0
        if store is not None:
            store.set(f"process/{rank}", f"{socket.gethostname()} {os.getpid()} {process_start_time(os.getpid())}")

    def arrive(self) -> None:
        """Mark this rank as having reached the next world collective (read only when one fails)."""
        self.phase += 1
        if self.store is not None:
            self.store.set(f"arrived/{self.phase}/{self.rank}", "1")

    def absent(self) -> list[int]:
        """The ranks that did not reach the current world collective."""
        if self.store is None:
            return []
        try:
            return [r for r in range(self.world_size) if not self.store.check([f"arrived/{self.phase}/{r}"])]
        except RuntimeError:  # the store went with the process that hosted it
            return []

    def first_cause(self) -> str:
        """The error a rank recorded as its own before its process ended ("" when none did)."""
        if self.store is None:
            return ""
        try:
            if not self.store.check([FIRST_CAUSE]):
                return ""
            cause = self.store.get(FIRST_CAUSE)
            return cause.decode() if isinstance(cause, bytes) else str(cause)
        except (RuntimeError, ValueError):  # the store went with the process that hosted it
            return ""

    def gone(self, rank: int) -> bool:
        """Whether `rank`'s process has ended (known for the ranks on this machine only)."""
        key = f"process/{rank}"
        if not self.store.check([key]):  # it never got this far
            return False
        host, pid, started = self.store.get(key).decode().split()
        if host != socket.gethostname():
            return False
        try:
            process = psutil.Process(int(pid))
            return (process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
                    or process_start_time(int(pid)) != started)
        except psutil.NoSuchProcess:
            return True

    def ended_first(self, wait_s: float = ENDING_S) -> list[int]:
        """The rank(s) whose process ended first, as the store records it (see the module's docstring). A killed
        peer's sockets close while its process is still ending, so a collective can fail before the peer is seen
        gone: look again for up to `wait_s` (the failure path only) before recording. A rank that was only hung
        leaves nobody gone: the empty record then keeps later ranks from blaming the ones torchrun tears down."""
        if self.store is None:
            return []
        try:
            deadline = time.monotonic() + wait_s
            while True:
                gone = " ".join(str(r) for r in range(self.world_size) if r != self.rank and self.gone(r))
                if gone or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            first = self.store.compare_set("ended_first", "", gone)
            return [int(r) for r in (first.decode() if isinstance(first, bytes) else first).split()]
        except (RuntimeError, ValueError):  # the store went with the process that hosted it
            return []


def record_cause(store, rank: int, line: str) -> None:
    """`rank` ends by an error of its own (`line`, as its console prints it): the first recorded is the group's
    first cause."""
    try:
        store.compare_set(FIRST_CAUSE, "", f"rank {rank} failed first: {line.removeprefix('error: ')}")
    except (RuntimeError, ValueError):  # the store went with the process that hosted it
        pass


def collective_failed(rank: int, exc: RuntimeError, absent: list[int] | None = None,
                      ended: list[int] | None = None, cause: str = "") -> GroupFailure:
    """One line: which rank saw it and why. A rank that recorded an error of its own is named with that error
    (the first cause; restarting would meet it again, so no --max-restarts advice); otherwise whose process
    ended first (the rest of the group was then stopped by torchrun), or which ranks did not arrive (hung, or
    on another machine), and what to do."""
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if cause:
        return GroupFailure(f"rank {rank}: a collective failed because {cause}")
    hung = "timed out" in detail.lower() or "timeout" in detail.lower()
    if ended:
        why = f"{_rank_words(ended)} process ended first, and the group was stopped"
    else:
        who = f"rank {', '.join(map(str, absent))}" if absent else "another process"
        why = f"{who} did not answer within dist_timeout_s (hung?)" if hung else f"{who} died or left"
    return GroupFailure(f"rank {rank}: a collective failed, {why} ({detail[:160]}); with torchrun --max-restarts "
                        "the group restarts and resumes from the latest checkpoint")


def _rank_words(ranks: list[int]) -> str:
    return f"rank {ranks[0]}'s" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}'s"
