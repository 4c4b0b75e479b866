"""The errors a user meets, each one line that says what is wrong and how to fix it. The CLIs print them
without a traceback (`MLXRL_DEBUG=1` shows it) and exit with status 2."""

from __future__ import annotations


class MlxrlError(Exception):
    """A user-facing error: its message is one line that says what is wrong and how to fix it.
    The CLIs print it without a traceback and exit with status 2."""


class ConfigError(MlxrlError, ValueError):
    """A bad config value or file: one line naming the field (or the file and line)."""


class DataError(MlxrlError, ValueError):
    """A bad dataset, file, row or image: one line naming the file and line, or the row."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (a user's function's, a library's), for a one-line error."""
    return (str(e).strip().splitlines() or [""])[0]
