"""The one launcher of child processes for the harness, the tuner and the probes (run.py runs, torchrun worlds, a
busy loop): each child starts in a session of its own, registered, so that a stop of the parent reaches it once (it
checkpoints and exits; SIGKILL after 120 s), and (utils.signals PARENT_ENV) a run.py child (`python run.py ...`)
stops by itself, with its checkpoint, if the parent dies outright. A torchrun world does not get PARENT_ENV: its
workers' parent is torchrun, not this process. Once the parent is stopped, no child starts.

    with child(cmd, log=path) as proc:   # watch it: read its output, poll its memory, wait4 its usage
        ...
    code = run_child(cmd, path)          # or just run it to its end
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

from utils.errors import Interrupted
from utils.signals import PARENT_ENV

ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 120

# the children alive now: a tool whose children run in worker threads (benchmarks.tune), where no signal arrives as
# an exception, forwards its signal to them from the main thread (stop_children); after that no child starts, so a
# stop that lands between two children (a resume that failed, the next trial) is not lost
LIVE_CHILDREN: set[subprocess.Popen] = set()
STOPPED_BY: list[int] = []
CHILDREN_LOCK = threading.RLock()  # re-entrant: the signal handler may interrupt the main thread inside `child`


class Stopped(Exception):
    """The parent was stopped before this child could start."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum} before the child started")
        self.signum = signum


def stop_children(signum: int) -> None:
    """Forward a stop to every live child, once, and start no child after it (benchmarks.tune's signal handler)."""
    with CHILDREN_LOCK:
        STOPPED_BY.append(signum)
        for proc in list(LIVE_CHILDREN):
            proc.send_signal(signum)


def forwarding_to(stop: threading.Event):
    """The signal handler of a tool whose children run in worker threads (benchmarks.tune, benchmarks.compare
    --workers): in the main thread, stop taking work (`stop`) and forward the signal to the children in flight, which
    checkpoint; STOPPED_BY records it, the one record of a stop."""
    def forward(signum, frame) -> None:
        stop.set()
        stop_children(signum)

    return forward


def allow_children() -> None:
    """A new call of the tool (in the same process, as tests do): children may start again."""
    with CHILDREN_LOCK:
        STOPPED_BY.clear()


@contextlib.contextmanager
def child(cmd: list[str], log: Path | None = None, append: bool = False, env: dict[str, str] | None = None,
          capture: bool = False) -> Iterator[subprocess.Popen]:
    """A started child, in ROOT. Its stdout and stderr go to `log` (appended with `append`), to a pipe the block
    reads (`capture`, text), or to the parent's. env: the child's whole environment (default: the parent's). A block
    left by an exception (a signal, a KeyboardInterrupt, an error) stops the child first, with the same signal
    (SIGTERM for an error); the block ends with the child reaped. Raises Stopped once the parent was stopped."""
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(log.open("a" if append else "w")) if log is not None else None
        with CHILDREN_LOCK:
            if STOPPED_BY:
                raise Stopped(STOPPED_BY[0])
            env = dict(os.environ if env is None else env)
            if len(cmd) > 1 and Path(cmd[1]).name == "run.py":
                env[PARENT_ENV] = str(os.getpid())
            proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, env=env,
                                    stdout=subprocess.PIPE if capture else out,
                                    stderr=subprocess.STDOUT if capture or out is not None else None,
                                    text=capture or None)
            LIVE_CHILDREN.add(proc)
        try:
            yield proc
            proc.wait()
        except BaseException as exc:
            signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGTERM
            if proc.poll() is None:
                proc.send_signal(signum)
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            raise
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
            LIVE_CHILDREN.discard(proc)


def run_child(cmd: list[str], log: Path | None = None, append: bool = False, env: dict[str, str] | None = None,
              timeout: float | None = None) -> int:
    """Run one child to its end: its exit code (128 + the signal when the parent was stopped before it started;
    124 when it ran past `timeout` seconds and was stopped, as `timeout(1)` says)."""
    try:
        with child(cmd, log, append, env) as proc:
            return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:  # `child` stopped it on the way out, as on any error
        return 124
    except Stopped as stopped:
        return 128 + stopped.signum
