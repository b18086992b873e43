"""Clean stops on every catchable signal that would end the process.

The first signal asks the run to stop: nodes leave their round at the next inner step, the cluster
goes back to the state at the end of the last complete outer step, writes a checkpoint, closes the
trackers and exits with 128 + the signal number. A second signal exits at once. Handlers are installed
after the trackers, so ClearML's own handlers (which swallow SIGTERM) never see the signal.

Which signals, and why each one arrives:
    SIGINT   130  Ctrl-C
    SIGTERM  143  kill, a scheduler's stop (SLURM at the time limit, Kubernetes), torchrun forwarding
    SIGHUP   129  the terminal or SSH session closed
    SIGUSR1  138  SLURM's --signal=USR1@<seconds> warning before the time limit (others use it too)
    SIGUSR2  140  the same, for schedulers and scripts that prefer USR2
    SIGQUIT  131  Ctrl-\\ (a stop with a checkpoint rather than a core dump)
    SIGXCPU  152  a CPU-time limit (ulimit -t, SLURM/PBS CPU limits) about to be enforced
    SIGPWR   158  a UPS's power-failure warning (Linux)
A SIGHUP that was ignored when the process started (nohup, or a parent that set it so) stays ignored
(`honoured`): the user asked the run to survive a closed terminal. Only SIGHUP: a non-interactive shell also
starts background jobs with SIGINT and SIGQUIT ignored, and a stop a scheduler or a test sends with those must
still stop the run.
Ignored by Python already (they end nothing): SIGPIPE, SIGXFSZ. Left alone: SIGALRM, SIGPROF, SIGVTALRM
(timers and profilers of libraries use them) and SIGKILL / SIGSTOP, which no process can catch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

STOP_SIGNALS = tuple(getattr(signal, name) for name in
                     ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGXCPU", "SIGPWR")
                     if hasattr(signal, name))
NAMES = {signum: signal.Signals(signum).name for signum in STOP_SIGNALS}
KEPT_IGNORED = (signal.SIGHUP,)  # nohup's: a run started under it must survive the logout
# What the kernel sends a tool's run.py child when the tool dies (stop_with_parent): a signal of its own, so that its
# repeats are told from a second SIGTERM by their number alone. getppid() cannot tell them: the kernel sends it once
# for each exiting thread of the dead tool, handing the child to the next live thread of the same process first.
PARENT_DEATH_SIGNAL: int | None = signal.SIGRTMIN + 1 if hasattr(signal, "SIGRTMIN") else None


def honoured(signals: tuple[int, ...]) -> tuple[int, ...]:
    """The stop signals to handle: all of `signals` but a SIGHUP ignored now (nohup), which stays ignored."""
    return tuple(s for s in signals if not (s in KEPT_IGNORED and signal.getsignal(s) == signal.SIG_IGN))


def signal_name(signum: int | None) -> str:
    if signum is None:
        return "no signal"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


class StopRequested(BaseException):  # like KeyboardInterrupt: passes through `except Exception`
    """Raised in the main thread when a stop arrives while nothing can checkpoint (set-up, data loading)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


class StopSignals:
    """Holds the stop request; `event` is shared with the nodes, which poll it between inner steps."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self.can_checkpoint = False  # True while the outer loop runs: it turns the request into a checkpoint
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    @property
    def name(self) -> str:
        return signal_name(self.signum)

    def _handle(self, signum: int, frame) -> None:
        if signum == PARENT_DEATH_SIGNAL:
            if self.event.is_set():
                return  # the tool's death again (once per exiting thread of the dead tool) or after a stop: one stop
            signum = signal.SIGTERM  # the tool's death stops its child as the tool's own SIGTERM would
        if self.event.is_set():  # the second signal: no more waiting
            print(f"\n{signal_name(signum)} again: exiting now without a checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        self.event.set()
        if not self.can_checkpoint:
            raise StopRequested(signum)
        print(f"\n{signal_name(signum)}: stopping after a checkpoint of the last complete outer step "
              "(signal again to exit at once)", file=sys.stderr, flush=True)

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (*honoured(STOP_SIGNALS), *([PARENT_DEATH_SIGNAL] if PARENT_DEATH_SIGNAL else [])):
                previous = signal.signal(signum, self._handle)
                self._previous.setdefault(signum, previous)  # the handlers from before the first install
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


PARENT_ENV = "ADLOCO_STOP_WITH_PARENT"  # set by a tool that runs run.py as its child: the tool's pid
_parent: list[int] = []  # the tool's pid, once stop_with_parent armed the parent-death signal


def parent_gone() -> bool:
    """The tool that started this run has died (stop_with_parent armed, and this process was re-parented)."""
    return bool(_parent) and os.getppid() != _parent[0]


def stop_with_parent() -> None:
    """A child of a tool (benchmarks.compare / benchmarks.tune set PARENT_ENV to their pid): stop as on SIGTERM (a
    checkpoint, exit 143) when the tool dies, even by SIGKILL, which the tool cannot forward. The children run in
    sessions of their own (a Ctrl-C reaches the tool alone, which passes it on), so nothing else would end them:
    Linux's parent-death signal (prctl PR_SET_PDEATHSIG) does, as PARENT_DEATH_SIGNAL. The kernel sends it once for
    each of the dead tool's threads (the child is handed to the next live one first), so its repeats are one stop,
    not a second signal (StopSignals._handle). Elsewhere nothing changes. Call it after the stop handlers are
    installed: a tool that died before this ran ends the child at once."""
    parent = os.environ.pop(PARENT_ENV, None)  # not inherited by this run's own children
    if not parent or not sys.platform.startswith("linux") or PARENT_DEATH_SIGNAL is None:
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL))
    except (OSError, AttributeError):  # no prctl (a libc without it): the tool's own forwarding is all there is
        return
    _parent[:] = [int(parent)]
    if parent_gone():  # the tool died before the prctl: its signal is lost, so send it now
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)
