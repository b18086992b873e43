"""User-facing errors: the command-line tools print them as one line and exit non-zero, no traceback.

Exit codes: 2 a mistake in the input (UserError), 3 a fault during training (TrainingFault),
128 + signal number after a clean stop on SIGINT (130) or SIGTERM (143).
"""

import sys
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


def exit_code_of(action: Callable[[], object]) -> int:
    """Run a command-line action: 0 on success, the error's exit code with a one-line message for a UserError."""
    try:
        action()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0
