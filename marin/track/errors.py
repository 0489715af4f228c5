"""The first line of an error message: what every one-line report (stderr, logs, MLflow tags) shows."""
from __future__ import annotations


def first_line(message) -> str:
    """The first non-blank line of `str(message)`, stripped. An exception with no message gives
    its type's name; an empty or blank string gives ''."""
    for line in str(message).splitlines():
        if line.strip():
            return line.strip()
    return type(message).__name__ if isinstance(message, BaseException) else ""
