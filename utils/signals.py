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
            for signum in STOP_SIGNALS:
                previous = signal.signal(signum, self._handle)
                self._previous.setdefault(signum, previous)  # the handlers from before the first install
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
