"""Typed errors of the lifecycle core.  Each names what was expected and found."""

from __future__ import annotations

from kvhandoff.core.safelog import bounded_repr


class LifecycleError(Exception):
    """Base class of every error the core raises."""


class InvalidTransition(LifecycleError):
    """An event that the lifecycle graph does not allow in the current state."""

    def __init__(self, state: str, event: str, request_id: str, detail: str = "") -> None:
        self.state, self.event, self.request_id, self.detail = state, event, request_id, detail
        msg = f"request {request_id!r}: event {event} is not allowed in state {state}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class SequenceError(LifecycleError):
    """A stream's sequence numbers are not consecutive (a gap or a repeat)."""

    def __init__(self, stream: str, expected: int, found: int) -> None:
        self.stream, self.expected, self.found = stream, expected, found
        super().__init__(f"stream {stream}: expected sequence {expected}, found {found}")


class GeometryMismatch(LifecycleError):
    """Transfer parameters or layouts that cannot be mapped onto each other."""

    def __init__(self, what: str, expected: object, found: object) -> None:
        self.what, self.expected, self.found = what, expected, found
        super().__init__(f"{what}: expected {bounded_repr(expected)}, found {bounded_repr(found)}")


class MalformedMessage(LifecycleError):
    """A notification or transfer parameter that does not parse."""


class LogCorrupt(LifecycleError):
    """An event log line that cannot be read, with the file and line that failed."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        super().__init__(f"{path}:{line}: {reason}")
