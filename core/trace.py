"""A request timeline you can open: P's and D's event logs as spans, marks and arrows.

`timeline` turns the events of one or more logs into a `Timeline`:

* **spans** — P's ``prefill`` (``prefill_started`` → ``exported`` or
  ``aborted``) and ``lease`` (``exported`` → ``freed``, or ``forgotten``);
  D's ``request`` (``admitted`` → ``release_sent``, or ``forgotten``) and one
  ``split`` per READ split (``reads_posted`` → ``split_completed`` or
  ``split_failed``), labelled with the P engine and rank it reads, its cache
  group and the request's block count (the log records no byte counts).  A
  span still open at the end of its stream's log ends at that stream's last
  event, with ``ended_by`` empty (``"open": true`` in the trace);
* **marks** — every other event (heartbeats sent and received, releases,
  acknowledgements, cancels, expiries, rejections and aborts with their
  reason, ``finished_recving``, ``freed``, ``forgotten``, ...), with the
  event's own fields;
* **arrows** — ``heartbeat``: from D's ``heartbeat_sent`` to P's
  ``heartbeat_received`` of the same request; ``ack``: from that receipt to
  D's ``lease_acknowledged`` that echoes the heartbeat (its ``sent_at`` is the
  ``heartbeat_sent``'s time).  The log carries no heartbeat id, so a receipt is
  joined to the latest heartbeat D sent no later than it, for that request,
  from a D whose ``admitted`` named this P engine and rank, that no earlier
  receipt on the same P rank was joined to (at most 8 back); none: no arrow.

Times stay on each engine's own clock (seconds), as replay folds them, so
the cross-engine picture assumes comparable clocks (one host:
``CLOCK_MONOTONIC``; the simulator).

`trace_events` writes the timeline in the Chrome Trace Event Format (the JSON
that ui.perfetto.dev and chrome://tracing open): a process per stream (engine
rank), a thread per request on it; ``B``/``E`` for prefill, lease and D's
request (they never overlap on one thread), ``b``/``e`` with an ``id`` per
split (splits overlap), thread-scoped instants ``i`` for the marks, and flow
events ``s``/``f`` for the arrows, each right after the instant it starts or
ends at.  ``ts`` is the event's time in microseconds.  Strings from the log
(request ids, reasons) go in as they are: JSON escapes them.

Pure: no I/O (the command writes the file).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvhandoff.core.events import EXTRA_FIELDS, Event, Side, Stream
from kvhandoff.core.replay import merge_by_time

CATEGORY = "kvhandoff"
SPLIT_CATEGORY = "kvhandoff.read"
FLOW_CATEGORY = "kvhandoff.flow"
_JOIN_BACK = 8  # how far back a receipt looks for a heartbeat not yet joined


@dataclass(slots=True)
class Span:
    stream: Stream
    request_id: str
    name: str  # "prefill", "lease" (P); "request", "split" (D)
    start: float
    start_at: int  # position of the opening event in merged time order
    end: float = 0.0
    end_at: int = 0
    ended_by: str = ""  # the kind of the closing event; "" when open at the end of the log
    args: dict = field(default_factory=dict)
    end_args: dict = field(default_factory=dict)
    split: int = -1


@dataclass(frozen=True, slots=True)
class Mark:
    stream: Stream
    request_id: str
    kind: str
    t: float
    at: int  # position in merged time order
    args: dict


@dataclass(frozen=True, slots=True)
class Arrow:
    name: str  # "heartbeat" (D → P) or "ack" (P → D)
    src: Mark
    dst: Mark


@dataclass
class Timeline:
    streams: list[Stream]  # P streams, then D streams, each by (engine, rank)
    requests: dict[Stream, list[str]]  # each stream's requests, by first event
    spans: list[Span]
    marks: list[Mark]
    arrows: list[Arrow]
    end_at: int  # one past the last position (open spans close after it)

    def request_ids(self) -> list[str]:
        """Every request, by its first event on any stream."""
        first: dict[str, int] = {}
        for s in self.spans:
            first[s.request_id] = min(first.get(s.request_id, s.start_at), s.start_at)
        for m in self.marks:
            first[m.request_id] = min(first.get(m.request_id, m.at), m.at)
        return sorted(first, key=first.__getitem__)


def _fields(event: Event) -> dict:
    out = {}
    for name, _ in EXTRA_FIELDS[event.kind]:
        if name == "token":
            continue  # a release capability: not copied into a file made for sharing
        v = getattr(event, name)
        out[name] = list(v) if isinstance(v, tuple) else v
    out["seq"] = event.seq
    return out


_P_SPANS = {"prefill_started": "prefill", "exported": "lease"}


class _Builder:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.marks: list[Mark] = []
        self.main: dict[tuple[Stream, str], Span] = {}
        self.splits: dict[tuple[Stream, str], dict[int, Span]] = {}
        self.admitted: dict[tuple[Stream, str], Event] = {}
        self.requests: dict[Stream, list[str]] = {}
        self.seen: set[tuple[Stream, str]] = set()
        self.last: dict[Stream, tuple[float, int]] = {}
        # (request, P engine, P rank) -> [(t, mark)] of D's heartbeats that may reach it
        self.sends: dict[tuple[str, str, int], list[tuple[float, Mark]]] = {}

    def open(self, event: Event, at: int, name: str, args: dict, split: int = -1) -> Span:
        span = Span(event.stream, event.request_id, name, event.t, at, args=args, split=split)
        self.spans.append(span)
        return span

    def close(self, span: Span, event: Event, at: int, **end_args) -> None:
        span.end, span.end_at, span.ended_by = max(event.t, span.start), at, event.kind
        span.end_args.update(end_args)

    def close_main(self, key, event: Event, at: int, **end_args) -> Span | None:
        span = self.main.pop(key, None)
        if span is not None:
            self.close(span, event, at, **end_args)
        return span

    def mark(self, event: Event, at: int) -> Mark:
        m = Mark(event.stream, event.request_id, event.kind, event.t, at, _fields(event))
        self.marks.append(m)
        return m

    def add(self, event: Event, at: int) -> None:
        key = (event.stream, event.request_id)
        if key not in self.seen:
            self.seen.add(key)
            self.requests.setdefault(event.stream, []).append(event.request_id)
        self.last[event.stream] = (event.t, at)
        if event.stream.side is Side.P:
            self.add_p(event, at, key)
        else:
            self.add_d(event, at, key)

    def add_p(self, event: Event, at: int, key) -> None:
        kind = event.kind
        if kind in _P_SPANS:
            self.close_main(key, event, at)
            self.main[key] = self.open(event, at, _P_SPANS[kind], _fields(event))
            return
        if kind == "aborted":
            self.close_main(key, event, at, reason=event.reason)
        elif kind == "freed":
            span = self.main.get(key)
            if span is not None and span.name == "lease":
                self.close_main(key, event, at)
        elif kind == "forgotten":
            self.close_main(key, event, at)
        self.mark(event, at)

    def add_d(self, event: Event, at: int, key) -> None:
        kind = event.kind
        splits = self.splits.setdefault(key, {})
        if kind == "admitted":
            self.close_main(key, event, at)
            self.admitted[key] = event
            self.main[key] = self.open(event, at, "request", _fields(event))
            return
        if kind == "reads_posted":
            adm = self.admitted.get(key)
            groups = event.split_groups or (0,) * len(event.split_ranks)
            for i, (rank, group) in enumerate(zip(event.split_ranks, groups, strict=False)):
                if i in splits:
                    self.close(splits.pop(i), event, at)
                args = {"split": i, "p_engine": adm.remote_engine if adm else "",
                        "p_rank": rank, "group": group,
                        "request_blocks": adm.num_blocks if adm else 0, "seq": event.seq}
                splits[i] = self.open(event, at, "split", args, split=i)
            return
        if kind in ("split_completed", "split_failed") and event.split in splits:
            end = {"result": "completed"} if kind == "split_completed" else {
                "result": "failed", "reason": event.reason}
            self.close(splits.pop(event.split), event, at, **end, seq=event.seq)
            return
        if kind == "release_sent" and key in self.main:
            self.close_main(key, event, at, notify_only=event.notify_only, seq=event.seq)
            return
        if kind == "forgotten":
            self.close_main(key, event, at)
            for i in list(splits):
                self.close(splits.pop(i), event, at)
        mark = self.mark(event, at)
        if kind == "heartbeat_sent":
            adm = self.admitted.get(key)
            if adm is not None:
                for rank in set(adm.remote_ranks):
                    self.sends.setdefault((event.request_id, adm.remote_engine, rank),
                                          []).append((event.t, mark))

    def finish(self, end_at: int) -> None:
        """Close what is still open at its stream's last event."""
        for span in self.spans:
            if span.end_at == 0 and span.ended_by == "":
                t, _ = self.last[span.stream]
                span.end, span.end_at = max(t, span.start), end_at
                span.end_args["open"] = True

    def arrows(self) -> list[Arrow]:
        arrows: list[Arrow] = []
        joined: dict[tuple, Mark] = {}  # (D stream, request, sent t, P rank) -> receipt
        used: set[tuple] = set()
        for m in self.marks:  # in merged time order
            if m.kind != "heartbeat_received":
                continue
            key = (m.request_id, m.stream.engine, m.stream.rank)
            sends = self.sends.get(key)
            if not sends:
                continue
            i = bisect.bisect_right(sends, m.t, key=lambda s: s[0]) - 1
            for j in range(i, max(i - _JOIN_BACK, -1), -1):
                if (key, j) not in used:
                    used.add((key, j))
                    src = sends[j][1]
                    arrows.append(Arrow("heartbeat", src, m))
                    joined.setdefault((src.stream, m.request_id, src.t, m.stream.rank), m)
                    break
        for m in self.marks:
            if m.kind == "lease_acknowledged":
                receipt = joined.get((m.stream, m.request_id, m.args["sent_at"],
                                      m.args["p_rank"]))
                if receipt is not None:
                    arrows.append(Arrow("ack", receipt, m))
        return arrows


def timeline(events: Sequence[Event]) -> Timeline:
    """Spans, marks and arrows of ``events`` (from one or several logs)."""
    ordered = merge_by_time(events)
    b = _Builder()
    for at, event in enumerate(ordered, start=1):
        b.add(event, at)
    end_at = len(ordered) + 1
    b.finish(end_at)
    streams = sorted(b.requests, key=lambda s: (s.side is not Side.P, s.engine, s.rank))
    return Timeline(streams, b.requests, b.spans, b.marks, b.arrows(), end_at)


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def trace_events(events: Sequence[Event] | Timeline) -> list[dict]:
    """The Chrome Trace Event Format events of ``events`` (see the module docstring)."""
    tl = events if isinstance(events, Timeline) else timeline(events)
    pid = {s: i for i, s in enumerate(tl.streams, start=1)}
    tid = {(s, rid): i for s in tl.streams for i, rid in enumerate(tl.requests[s], start=1)}
    out: list[dict] = []
    for s in tl.streams:
        p = pid[s]
        out.append({"ph": "M", "name": "process_name", "pid": p, "args": {"name": str(s)}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": p, "args": {"sort_index": p}})
        for rid in tl.requests[s]:
            t = tid[s, rid]
            out.append({"ph": "M", "name": "thread_name", "pid": p, "tid": t,
                        "args": {"name": rid}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": p, "tid": t,
                        "args": {"sort_index": t}})
    # (position, order within it, event): a closing E before the B the same event
    # opens, the instant before the flow events bound to it.
    timed: list[tuple[int, int, int, dict]] = []
    for n, span in enumerate(tl.spans):
        where = {"pid": pid[span.stream], "tid": tid[span.stream, span.request_id]}
        if span.name == "split":
            name = f"{span.request_id} split {span.split}"
            ids = {"cat": SPLIT_CATEGORY, "id": n + 1}
            begin, end = "b", "e"
        else:
            name, ids = span.name, {"cat": CATEGORY}
            begin, end = "B", "E"
        end_args = {"ended_by": span.ended_by, **span.end_args} if span.ended_by else span.end_args
        timed.append((span.start_at, 1, n, {"ph": begin, "name": name, **ids, **where,
                                             "ts": _us(span.start), "args": span.args}))
        timed.append((span.end_at, 0, -n, {"ph": end, "name": name, **ids, **where,
                                            "ts": _us(span.end), "args": end_args}))
    flows_from: dict[int, list[tuple[int, Arrow]]] = {}
    flows_to: dict[int, list[tuple[int, Arrow]]] = {}
    for n, arrow in enumerate(tl.arrows, start=1):
        flows_from.setdefault(id(arrow.src), []).append((n, arrow))
        flows_to.setdefault(id(arrow.dst), []).append((n, arrow))
    for m in tl.marks:
        where = {"pid": pid[m.stream], "tid": tid[m.stream, m.request_id], "ts": _us(m.t)}
        timed.append((m.at, 2, 0, {"ph": "i", "s": "t", "name": m.kind, "cat": CATEGORY,
                                   **where, "args": m.args}))
        for n, arrow in flows_to.get(id(m), ()):
            timed.append((m.at, 3, n, {"ph": "f", "bp": "e", "name": arrow.name,
                                       "cat": FLOW_CATEGORY, "id": n, **where}))
        for n, arrow in flows_from.get(id(m), ()):
            timed.append((m.at, 4, n, {"ph": "s", "name": arrow.name, "cat": FLOW_CATEGORY,
                                       "id": n, **where}))
    timed.sort(key=lambda x: x[:3])
    out.extend(e for *_, e in timed)
    return out
