"""Domain errors: what went wrong and how to fix it. The CLI prints them without a traceback."""

from __future__ import annotations


class ServelensError(Exception):
    """An error a user can act on: ``message`` says what was wrong, ``hint`` how to fix it."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class ConfigError(ServelensError):
    """The configuration is invalid or incomplete."""


class DataNotFoundError(ServelensError):
    """Input data (a trace, a profile, a lake) is not where it was looked for."""
