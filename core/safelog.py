"""Text a client or a peer wrote, made safe to show: `printable`, and kvhandoff's loggers.

Request ids, engine ids, NIXL agent names, reasons and error messages reach
kvhandoff's log lines and its commands' output, and clients or peers write
some of them (vLLM builds its request id from the client's ``request_id`` or
``X-Request-Id``; a peer names its own NIXL agent).  vLLM does not configure
structlog, so under ``vllm serve`` structlog's default console renderer writes
a string value as it is unless it holds a space, ``=``, a quote or a line
break: an escape sequence (``ESC [1A ESC [2K``), ``\\x85`` or ``\\u2028`` in an
id would move the operator's cursor and draw a line of the client's choosing.

Every kvhandoff module logs through `get_logger` (tests/test_safelog.py
checks that none calls ``structlog.get_logger`` itself): before structlog sees
a call, each string value longer than `MAX_CHARS` is cut (its length said), so
a peer's 10 MB string is not 10 MB of log, and one that is not printable or
holds a backslash goes through `printable` (a backslash too, so that an
escaped ``\\x1b`` and a client's literal one read differently).  Other values
(numbers, lists of ids) are shown by structlog with ``repr``, which escapes
but does not cut.
"""

from __future__ import annotations

import reprlib

import structlog

MAX_CHARS = 500  # of one string value in a log line


def printable(text: object) -> str:
    """``text`` safe for a terminal line: unchanged unless it holds a backslash or a
    character that is not printable.

    Each such character is written as Python's ``repr`` writes it (``\\n``,
    ``\\r``, ``\\x1b``, ``\\x85``, ``\\u2028``, ``\\\\``), so no newline, carriage
    return, escape sequence or other C0/C1 control, Unicode line or paragraph
    separator or format character reaches the terminal raw, one event stays one
    line, and the escaped text still names exactly one string.  Ordinary ids
    (printable, no backslash) print unchanged, non-ASCII letters included.
    """
    s = str(text)
    if s.isprintable() and "\\" not in s:
        return s
    return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in s)


def shown(text: str, limit: int = MAX_CHARS) -> str:
    """``text`` for one log field: its first ``limit`` characters through `printable` (cut
    first: escaping costs a pass over what is escaped, and a client picks the length),
    and its length when it was longer."""
    head = text[:limit]
    if not head.isprintable() or "\\" in head:
        head = printable(head)
    return head if len(text) <= limit else f"{head}... ({len(text)} chars)"


_BOUNDED = reprlib.Repr()  # Python 3.11's takes no keywords
_BOUNDED.maxlevel, _BOUNDED.maxstring, _BOUNDED.maxother = 3, 120, 120
_BOUNDED.maxdict = _BOUNDED.maxlist = _BOUNDED.maxtuple = _BOUNDED.maxset = 8


def bounded_repr(value: object) -> str:
    """``repr(value)`` bounded (reprlib: a long string or list shows its ends), for an
    error message that names a value a client or peer sent: a 10 MB field is not
    10 MB of error message, logged and pickled to every worker."""
    return _BOUNDED.repr(value)


def _safe(fields: dict) -> dict:
    for value in fields.values():
        if type(value) is str and (len(value) > MAX_CHARS or not value.isprintable()
                                   or "\\" in value):
            return {k: shown(v) if type(v) is str else v for k, v in fields.items()}
    return fields


class SafeLogger:
    """structlog's logger for ``name`` (configured as the host process configures
    structlog), with every string field shown safe (`shown`)."""

    __slots__ = ("_log",)

    def __init__(self, name: str) -> None:
        self._log = structlog.get_logger(name)

    def debug(self, event: str, **fields) -> None:
        self._log.debug(event, **_safe(fields))

    def info(self, event: str, **fields) -> None:
        self._log.info(event, **_safe(fields))

    def warning(self, event: str, **fields) -> None:
        self._log.warning(event, **_safe(fields))

    def error(self, event: str, **fields) -> None:
        self._log.error(event, **_safe(fields))

    def critical(self, event: str, **fields) -> None:
        self._log.critical(event, **_safe(fields))

    def exception(self, event: str, **fields) -> None:
        self._log.exception(event, **_safe(fields))


def get_logger(name: str) -> SafeLogger:
    return SafeLogger(name)
