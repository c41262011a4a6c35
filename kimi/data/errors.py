"""The one error bad data ends in, and how a low-level error is worded inside its message.

Its own module so the sources (:mod:`kimi.data.sources`) and the checks (:mod:`kimi.data.checks`) can both
raise it without importing each other for it.
"""

from __future__ import annotations


class DataError(ValueError):
    """Data that cannot be used as configured; the message says what to change."""


def one_line(e: BaseException) -> str:
    """``e``'s message on one line (a DataError is one line, so the CLI can print it as is)."""
    return " ".join(str(e).split()) or type(e).__name__
