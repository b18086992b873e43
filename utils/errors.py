"""User-facing errors: run.py prints them as one line and exits with code 2, no traceback."""


class UserError(Exception):
    """A mistake in the user's input (config, paths, data, checkpoints), not a bug."""


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or an out-of-range value."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key '{key}': {message}")
        self.key = key


class DataError(UserError):
    """Data could not be found, fetched or parsed."""
