"""The ledger: the one way adapters and simulations record lifecycle events.

A `Ledger` owns one stream's sequence numbers.  ``record`` builds the event,
folds it into the shared `LifecycleState` (which refuses illegal events
before anything is written) and hands it to the sink (an event log writer),
so the log and the live state can never disagree.  (No log line per event:
the event log is the record; structlog is for what needs a human.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import MISSING, fields

from kvhandoff.core.errors import LifecycleError
from kvhandoff.core.events import EVENT_TYPES, Event, Stream
from kvhandoff.core.lifecycle import LifecycleState, apply
from kvhandoff.core.safelog import get_logger
from kvhandoff.core.slots import slot_builder

log = get_logger(__name__)


def _maker(cls: type[Event]) -> Callable[..., Event]:
    """``make(request_id, stream, seq, t, own)``: the event ``cls(request_id, stream, seq, t,
    **own)`` builds (`core.slots`), each field's default as the dataclass declares it.
    ``own``, the event's own fields, is the dict the caller's keyword arguments were
    collected in: read in place, not unpacked into one more call.  A key the event does
    not have, or a required field missing, goes to the keyword form, which raises the
    `TypeError` a call with those keywords raises."""
    namespace: dict = {}
    params, values, own_values, required = [], {}, {}, []
    for i, f in enumerate(fields(cls)):
        values[f.name] = f.name
        if f.default is MISSING:
            params.append(f.name)
        else:
            namespace[f"d{i}"] = f.default
            params.append(f"{f.name}=d{i}")
        if i >= 4:  # after request_id, stream, seq, t: the event's own fields
            if f.default is MISSING:
                required.append(f.name)
                own_values[f.name] = f"own[{f.name!r}]"
            else:
                own_values[f.name] = f"own.get({f.name!r}, d{i})"
    make = slot_builder(cls, ", ".join(params), values, namespace)
    namespace.update(make=make, own_names=frozenset(own_values))
    check = "not own.keys() <= own_names" + "".join(f" or {n!r} not in own" for n in required)
    header = {name: name for name in ("request_id", "stream", "seq", "t")}
    return slot_builder(cls, "request_id, stream, seq, t, own", header | own_values, namespace,
                        guard=f"if {check}: return make(request_id, stream, seq, t, **own)")


_MAKERS: dict[type[Event], Callable[..., Event]] = {cls: _maker(cls)
                                                    for cls in EVENT_TYPES.values()}


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
        return self.record_fields(event_type, request_id, t, fields)

    def record_fields(self, event_type: type[Event], request_id: str, t: float,
                      fields: dict) -> Event:
        """`record` with the event's own fields as a dict (what ``**fields`` collected)."""
        make = _MAKERS.get(event_type)
        if make is None:  # another Event subclass: its own __init__
            event = event_type(request_id, self.stream, self._seq, t, **fields)
        else:
            event = make(request_id, self.stream, self._seq, t, fields)
        apply(self.state, event)
        self._seq += 1
        if self.sink is not None:
            self.sink(event)
        return event


class LedgerEngine:
    """What P's and D's engines share: one stream's ledger, its fold, and counters.

    ``_record`` never raises: an event the fold refuses is a bug of the
    driver or a hostile peer; it is logged (``<side>.refused_event``), counted
    (``counts["refused_events"]``) and leaves the state unchanged.
    """

    side = ""  # "producer" or "consumer": names the log line

    def __init__(self, stream: Stream, state: LifecycleState | None = None,
                 sink: Callable[[Event], None] | None = None) -> None:
        self.stream = stream
        self.ledger = Ledger(stream, state, sink)
        self.state = self.ledger.state
        self.counts: Counter[str] = Counter()
        # This stream's fold (created by the ledger, never replaced): its records by id.
        self._ss = self.state.stream(stream)
        self._records = self._ss.requests

    def _rec(self, rid: str):
        return self._records.get(rid)

    def _record(self, event_type: type[Event], rid: str, t: float, **fields) -> bool:
        try:
            self.ledger.record_fields(event_type, rid, t, fields)
            return True
        except LifecycleError as exc:
            self._refused(event_type, rid, exc)
            return False

    def _refused(self, event_type: type[Event], rid: str, exc: LifecycleError) -> None:
        self.counts["refused_events"] += 1
        log.error(f"{self.side}.refused_event", stream=str(self.stream), request_id=rid,
                  event_kind=event_type.kind, error=str(exc))
