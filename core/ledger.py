"""The ledger: the one way adapters and simulations record lifecycle events.

A `Ledger` owns one stream's sequence numbers.  ``record`` builds the event,
folds it into the shared `LifecycleState` (which refuses illegal events
before anything is written) and hands it to the sink (an event log writer),
so the log and the live state can never disagree.  (No log line per event:
the event log is the record; structlog is for what needs a human.)
"""

from __future__ import annotations

from collections.abc import Callable

from kvhandoff.core.events import Event, Stream
from kvhandoff.core.lifecycle import LifecycleState, apply


class Ledger:
    __slots__ = ("stream", "state", "sink", "_seq")

    def __init__(self, stream: Stream, state: LifecycleState | None = None,
                 sink: Callable[[Event], None] | None = None) -> None:
        self.stream = stream
        self.state = state if state is not None else LifecycleState()
        self.sink = sink
        self._seq = self.state.stream(stream).last_seq + 1

    def record(self, event_type: type[Event], request_id: str, t: float, **fields) -> Event:
        """Build, fold and log one event; raises `InvalidTransition` and logs nothing if refused."""
        event = event_type(request_id, self.stream, self._seq, t, **fields)
        apply(self.state, event)
        self._seq += 1
        if self.sink is not None:
            self.sink(event)
        return event
