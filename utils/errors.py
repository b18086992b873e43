"""User-facing errors: the command-line tools print them as one line and exit with code 2, no traceback."""

import sys
from collections.abc import Callable


class UserError(Exception):
    """A mistake in the user's input (config, paths, data, checkpoints), not a bug."""


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or an out-of-range value."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key '{key}': {message}")
        self.key = key


class DataError(UserError):
    """Data could not be found, fetched or parsed."""


def exit_code_of(action: Callable[[], object]) -> int:
    """Run a command-line action: 0 on success, 2 with a one-line message for a UserError."""
    try:
        action()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
