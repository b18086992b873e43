"""Clean stops on SIGINT and SIGTERM.

The first signal asks the run to stop: nodes leave their round at the next inner step, the cluster
goes back to the state at the end of the last complete outer step, writes a checkpoint, closes the
trackers and exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM). A second signal
exits at once. Handlers are installed after the trackers, so ClearML's own handlers (which swallow
SIGTERM) never see the signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class StopRequested(BaseException):  # like KeyboardInterrupt: passes through `except Exception`
    """Raised in the main thread when a stop arrives while nothing can checkpoint (set-up, data loading)."""

    def __init__(self, signum: int) -> None:
        super().__init__(NAMES.get(signum, str(signum)))
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
        return NAMES.get(self.signum, str(self.signum))

    def _handle(self, signum: int, frame) -> None:
        if self.event.is_set():  # the second signal: no more waiting
            print(f"\n{NAMES.get(signum, signum)} again: exiting now without a checkpoint", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)
        self.signum = signum
        self.event.set()
        if not self.can_checkpoint:
            raise StopRequested(signum)
        print(f"\n{NAMES.get(signum, signum)}: stopping after a checkpoint of the last complete outer step "
              "(signal again to exit at once)", file=sys.stderr, flush=True)

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in NAMES:
                previous = signal.signal(signum, self._handle)
                self._previous.setdefault(signum, previous)  # the handlers from before the first install
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
