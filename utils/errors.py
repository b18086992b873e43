"""User-facing errors: the command-line tools print them as one line and exit non-zero, no traceback.

Exit codes: 2 a mistake in the input (UserError), 3 a fault during training (TrainingFault),
128 + signal number after a clean stop on SIGINT (130) or SIGTERM (143).
"""

import os
import sys
import threading
from collections.abc import Callable


class UserError(Exception):
    """A mistake in the user's input (config, paths, data, checkpoints), not a bug."""

    exit_code = 2


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or an out-of-range value."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key '{key}': {message}")
        self.key = key


class DataError(UserError):
    """Data could not be found, fetched or parsed."""


class TrainingFault(UserError):
    """Training stopped on a fault (on_node_fault: stop); the last good state is checkpointed."""

    exit_code = 3


class RunStopped(Exception):
    """A clean stop on SIGINT / SIGTERM after a checkpoint was written."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class Interrupted(BaseException):
    """A signal to a command-line tool (SIGTERM, SIGHUP; SIGINT where the tool asks), raised where it runs so
    its cleanup (finally) happens."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def raise_interrupted(signum, frame) -> None:
    """A signal handler: the signal as an Interrupted exception where the main thread is."""
    raise Interrupted(signum)


def exit_code_of(action: Callable[[], object], interrupted: str = "stopped") -> int:
    """Run a command-line action: 0 on success; otherwise one line on stderr, no traceback, and the exit code
    of the error: a UserError's own, 2 for a file that cannot be read or written, 128 + the signal for Ctrl-C
    (SIGINT), SIGTERM or SIGHUP (after the action's own cleanup), 1 for anything else (a bug; its traceback
    goes to the log at DEBUG level)."""
    import logging
    import signal

    previous = {}
    if threading.current_thread() is threading.main_thread():
        from utils.signals import honoured

        previous = {signum: signal.signal(signum, raise_interrupted)
                    for signum in honoured((signal.SIGTERM, signal.SIGHUP))}
    try:
        action()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"interrupted by {signal.Signals(signum).name}; {interrupted}", file=sys.stderr)
        return 128 + signum
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        print(f"error: cannot read or write{where} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    except Exception as exc:
        logging.getLogger(__name__).debug("unexpected error", exc_info=True)
        print(f"error: internal error ({type(exc).__name__}: {str(exc)[:200]})", file=sys.stderr)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def exit_on_input_error(main: Callable[[], int]) -> int:
    """A tool's `python -m` entry: its input errors (SystemExit("error: ...") raised before any work) end in that
    one line on stderr and exit 2, like run.py's; any other SystemExit keeps its code. A reader that closes the
    output early (`| head`) ends it in one line and exit 2 too, not a BrokenPipeError traceback."""
    try:
        return main()
    except SystemExit as exc:
        if isinstance(exc.code, str) and exc.code.startswith("error:"):
            print(exc.code, file=sys.stderr)
            return 2
        raise
    except BrokenPipeError:  # `... | head`: the reader left; stdout goes nowhere now, so the exit's flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("error: the output was closed before it ended (a pipe to head?); what was read is incomplete",
              file=sys.stderr)
        return 2
