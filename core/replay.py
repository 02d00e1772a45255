"""Replay: fold P's and D's logs together, check the invariants, show timelines.

The fold of each stream is independent; the cross-engine checks need one
clock, so replay merges all events by time (each stream keeps its own order)
and assumes the engines' clocks are comparable — true for engines on one
host (CLOCK_MONOTONIC) and in the simulator.

Invariants checked (ARCHITECTURE.md):

* ``transition`` — every event is legal in its request's state and is its
  stream's next sequence number (a second ``freed`` is reported as
  ``double_free``, a second ``finished_recving`` as ``transition``).
* ``heartbeat_gap`` — D went longer than the request's lease without a
  heartbeat while the request was in a heartbeat state (e.g. a cancelled
  request whose reads were still in flight).
* ``served_freed`` — D accepted a request's bytes (RECEIVED, not cancelled)
  although one of its reads completed after P freed the source blocks, for
  any reason, D's own releases included: D releases only after
  ``finished_recving`` (docs/lifecycle.md), so a free on a release that
  followed the reads can never precede their completion in the log; one
  that does was a stale or early release.
* ``served_unproven`` — D accepted a request's bytes although no
  acknowledgement in its log proves that P held the source when a read
  completed: an answer ``time_left > 0`` to a heartbeat D had sent at
  ``sent_at`` proves the lease until ``sent_at + max(min(time_left, lease)
  − margin, 0)``; after an answer ``<= 0`` (P let go) only the latest
  ``sent_at`` P answered alive stays proven; a fence D read holding the
  request's value (``fence_held``) proves the source held when it was posted
  (docs/lifecycle.md, "The fence").  Checked from the log's events, not from
  the fold's verdict.
* ``fence_after_free`` — D's log says the fence held the request's value
  when it was posted, after P's log freed the request there: P cleared the
  slot before that free, so the fence lied (a transport or driver bug).
* ``leak`` — an exported request that P still held one lease after its
  deadline, at the end of P's log.

``freed_under_read`` (P freed blocks while a read of them was in flight) is
counted, not a violation by itself: a partition longer than the lease makes
it legitimate for P; what must never follow is ``served_freed``.

``missing_producers`` names the P engines that D's requests read from but
whose log was not given: the cross-engine checks could not look at them.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, groupby, islice
from operator import attrgetter, le

from kvhandoff.core.errors import InvalidTransition, LifecycleError
from kvhandoff.core.events import (
    EXTRA_FIELDS,
    Event,
    Freed,
    Side,
    Stream,
)
from kvhandoff.core.lifecycle import (
    HEARTBEAT_STATES,
    ConsumerRecord,
    DState,
    LifecycleState,
    ProducerRecord,
    PState,
    apply,
    gc_paused,
)
from kvhandoff.core.policy import REMEMBER_LEASES
from kvhandoff.core.safelog import printable

_TIME = attrgetter("t")
_STREAM = attrgetter("stream")


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    event: str  # "engine/SIDErank#seq kind request" of the event that showed it
    detail: str

    def as_dict(self) -> dict:
        return {"invariant": self.invariant, "event": self.event, "detail": self.detail}


class ProofLedger:
    """What P's acknowledgements prove, kept apart from the fold's verdict.

    ``note`` takes each acknowledgement D folded; ``proven_until`` is the
    latest time (D's clock) at which P provably held the source of one P
    rank's reads: an answer ``time_left > 0`` to a heartbeat sent at
    ``sent_at`` proves ``sent_at + max(min(time_left, lease) − margin, 0)``;
    once the rank answered ``<= 0`` (P let go) only the latest ``sent_at`` it
    answered alive stays proven.  Replay and the simulator both check what D
    served against it, so a wrong verdict in the core cannot vouch for itself.
    """

    __slots__ = ("_until", "_held")

    def __init__(self) -> None:
        self._until: dict = {}
        self._held: dict = {}  # key -> (latest sent_at answered alive, P let go)

    def note(self, key, sent_at: float, time_left: float, lease_s: float, margin_s: float) -> None:
        held, let_go = self._held.get(key, (-math.inf, False))
        if time_left > 0:
            until = sent_at if let_go else sent_at + max(min(time_left, lease_s) - margin_s, 0.0)
            self._held[key] = (max(held, sent_at), let_go)
            self._until[key] = max(self._until.get(key, -math.inf), until)
        else:
            self._held[key] = (held, True)
            self._until[key] = min(self._until.get(key, -math.inf), held)

    def fence(self, key, posted_at: float) -> None:
        """D read the fence, posted at ``posted_at``, and found the request's value: P held the
        source then (`core.fence`), whatever it answered before or after."""
        held, let_go = self._held.get(key, (-math.inf, False))
        self._held[key] = (max(held, posted_at), let_go)
        self._until[key] = max(self._until.get(key, -math.inf), posted_at)

    def drop(self, key) -> None:
        """Forget what was proven for ``key`` (its request id was forgotten: a re-use is new)."""
        self._until.pop(key, None)
        self._held.pop(key, None)

    def proven_until(self, key) -> float:
        return self._until.get(key, -math.inf)

    def unproven(self, key_of_rank, rec: ConsumerRecord) -> list[tuple[int, float, float]]:
        """(P rank, completion, proven until) of each completed split the proofs do not cover."""
        out = []
        for rank, done in zip(rec.split_ranks, rec.split_done, strict=True):
            proven = self.proven_until(key_of_rank(rank))
            if not isinstance(done, float) or done > proven:
                out.append((rank, done, proven))
        return out


@dataclass
class Replay:
    state: LifecycleState
    events: int = 0
    violations: list[Violation] = field(default_factory=list)
    freed_under_read: int = 0
    timeline: list[tuple[Event, str]] = field(default_factory=list)
    # Last gap reported per (D stream, request): kept here, not in the folded
    # record, so the state (and its hash) stays exactly the fold of the log.
    gap_reported_at: dict = field(default_factory=dict)
    # What P's acknowledgements prove, derived here from the events.
    proofs: ProofLedger = field(default_factory=lambda: ProofLedger())
    # P engines D's admissions named (kept past a record's `forgotten`).
    named_producers: set = field(default_factory=set)
    # (D stream, request) -> its keys in ``proofs`` (dropped when it is forgotten).
    proof_keys: dict = field(default_factory=dict)
    # request id -> the D streams holding a record of it (admitted, not forgotten): where a
    # P free looks for READs in flight, instead of in every D stream.
    readers: dict = field(default_factory=dict)

    def missing_producers(self) -> list[str]:
        """P engines named by D's requests whose log is not among the replayed ones."""
        producers = {s.engine for s in self.state.streams if s.side is Side.P}
        return sorted(self.named_producers - producers)

    def summary(self) -> dict:
        states: Counter[str] = Counter()
        requests: set[str] = set()
        ignored: Counter[str] = Counter()
        for ss in self.state.streams.values():
            ignored.update(ss.ignored)
            for rid, rec in ss.requests.items():
                requests.add(rid)
                states[f"{ss.stream.side.value}:{rec.state.value}"] += 1
        return {
            "events": self.events,
            "requests": len(requests),
            "states": dict(sorted(states.items())),
            "violations": [v.as_dict() for v in self.violations],
            "state_hash": state_hash(self.state),
            "freed_under_read": self.freed_under_read,
            "ignored_notifications": sum(ignored.values()),
            "ignored_by_reason": dict(sorted(ignored.items())),
            "missing_producers": self.missing_producers(),
        }


def describe(event: Event) -> str:
    """``engine/SIDErank#seq kind request``: a violation's ``event``, as the log wrote it.

    Kept exact (``--json`` carries it as it is); the text output passes it
    through `printable`, like every other string that came from a log.
    """
    return f"{event.stream}#{event.seq} {event.kind} {event.request_id}"


def state_hash(state: LifecycleState) -> str:
    """A stable hash of the folded state (independent of dict order and process)."""
    h = hashlib.blake2b(digest_size=16)
    for stream in sorted(state.streams):
        ss = state.streams[stream]
        if ss.last_seq < 0:
            continue  # a stream that has written nothing yet is no state
        h.update(repr((tuple(stream), ss.last_seq, sorted(ss.ignored.items()), ss.freed)).encode())
        for rid in sorted(ss.requests):
            h.update(repr((rid, ss.requests[rid].key())).encode())
    return h.hexdigest()


def merge_by_time(events: Sequence[Event]) -> list[Event]:
    """All events in time order; each stream's events stay in sequence order."""
    return _merge(_per_stream(events))


def _per_stream(events: Sequence[Event]) -> dict[Stream, list[Event]]:
    """Each stream's events in their order, streams in order of first appearance."""
    per_stream: dict = {}
    for stream, run in groupby(events, key=_STREAM):  # a log's events come in runs
        per_stream.setdefault(stream, []).extend(run)
    return per_stream


def _merge(per_stream: dict[Stream, list[Event]]) -> list[Event]:
    # A stable sort of the streams laid end to end is the same order as heapq.merge's
    # (ties go to the earlier stream, then to the earlier event) when each stream is in
    # time order, as engines write them; timsort merges those runs in C.
    runs = per_stream.values()
    if all(_in_time_order(run) for run in runs):
        return sorted(chain.from_iterable(runs), key=_TIME)
    return list(heapq.merge(*runs, key=_TIME))


def _in_time_order(run: list[Event]) -> bool:
    times = list(map(_TIME, run))
    return all(map(le, times, islice(times, 1, None)))


def replay(events: Sequence[Event], *, request: str | None = None, until: int | None = None,
           keep_timeline: bool = False) -> Replay:
    """Fold ``events`` (from one or several logs) and check the invariants."""
    if until is not None:
        events = [e for e in events if e.seq <= until]
    per_stream = _per_stream(events)
    ordered = _merge(per_stream)
    result = Replay(LifecycleState())
    timeline = result.timeline if keep_timeline else None
    with gc_paused():  # records and checks are acyclic: no cyclic GC rescans while they grow
        folded = _fold_and_check(result, ordered, request, timeline)
    result.events = folded
    # Each stream's last event in time order is its last one (the merge keeps stream order).
    _check_leaks(result, {stream: run[-1].t for stream, run in per_stream.items()})
    return result


def _fold_and_check(result: Replay, ordered: list[Event], request: str | None,
                    timeline: list | None) -> int:
    """The fold of ``ordered`` into ``result`` with the cross checks; the events folded."""
    state = result.state
    streams, violations = state.streams, result.violations
    # P's free time per (P engine, P rank, request), for the cross checks: kept as long as
    # P would remember a finished record (two of the request's leases), also when P forgot
    # it sooner (a released request is forgotten as it is freed), and dropped then so the
    # checks' memory stays bounded on a long log; ``expiring``: (until, key, free time).
    freed_at: dict[tuple[str, int, str], float] = {}
    expiring: list[tuple[float, tuple[str, int, str], float]] = []
    readers = result.readers
    folded = 0
    for event in ordered:
        t = event.t
        while expiring and expiring[0][0] < t:
            _, key, t_free = heapq.heappop(expiring)
            if freed_at.get(key) == t_free:
                del freed_at[key]
        try:
            apply(state, event)
        except InvalidTransition as e:
            freed_before = isinstance(event, Freed) and (
                e.state == PState.FREED
                or (event.stream.engine, event.stream.rank, event.request_id) in freed_at)
            name = "double_free" if freed_before else "transition"
            violations.append(Violation(name, describe(event), str(e)))
            _skip(state, event)
            continue
        except LifecycleError as e:
            violations.append(Violation("transition", describe(event), str(e)))
            _skip(state, event)
            continue
        folded += 1
        stream, rid, kind = event.stream, event.request_id, event.kind
        ss = streams[stream]
        rec = ss.requests.get(rid)
        if timeline is not None and (request is None or rid == request):
            timeline.append((event, rec.state.value if rec is not None else "-"))
        if kind == "forgotten":  # the id is unknown again: so are D's cross checks
            _forget(result, event)
        elif stream.side is Side.P:
            if kind == "freed":
                key = (stream.engine, stream.rank, rid)
                freed_at[key] = t
                heapq.heappush(expiring, (t + REMEMBER_LEASES * rec.lease_s, key, t))
                result.freed_under_read += _reads_in_flight(readers.get(rid, {}), event)
            elif kind == "prefill_started" or kind == "exported":  # the id names a new request
                freed_at.pop((stream.engine, stream.rank, rid), None)
        elif rec is not None:  # a D stream's records are all ConsumerRecords
            if kind == "admitted":
                result.named_producers.add(rec.remote_engine)
                readers.setdefault(rid, {})[stream] = ss
            _check_consumer(result, freed_at, event, rec)
    return folded


def _forget(result: Replay, event: Event) -> None:
    stream, rid = event.stream, event.request_id
    if stream.side is Side.P:
        return  # P's free time stays in ``freed_at`` until it expires (`_fold_and_check`)
    result.gap_reported_at.pop((stream, rid), None)
    for key in result.proof_keys.pop((stream, rid), ()):
        result.proofs.drop(key)
    holders = result.readers.get(rid)
    if holders is not None:
        holders.pop(stream, None)
        if not holders:
            del result.readers[rid]


def _skip(state: LifecycleState, event: Event) -> None:
    # Keep folding past a bad event so one run reports every violation.
    ss = state.stream(event.stream)
    ss.last_seq = max(ss.last_seq, event.seq)


def _reads_in_flight(holders: dict, freed: Event) -> int:
    """D records of ``freed``'s request, among the D streams in ``holders``, with a READ of
    the freeing P rank still in flight."""
    engine, rank, rid = freed.stream.engine, freed.stream.rank, freed.request_id
    count = 0
    for ss in holders.values():
        rec = ss.requests.get(rid)
        if (rec is not None and rec.remote_engine == engine
                and any(r == rank and d is None for r, d in zip(rec.split_ranks, rec.split_done,
                                                                 strict=True))):
            count += 1
    return count


def _check_consumer(result: Replay, freed_at: dict, event: Event, rec: ConsumerRecord) -> None:
    kind = event.kind
    if kind == "lease_acknowledged" and rec.t0 <= event.sent_at <= rec.last_heartbeat:
        # (an answer that echoes no heartbeat D sent for this request proves nothing)
        key = (event.stream, event.request_id, event.p_rank)
        result.proofs.note(key, event.sent_at, event.time_left, rec.lease_s, rec.margin)
        result.proof_keys.setdefault((event.stream, event.request_id), set()).add(key)
    elif kind == "fence_held":
        key = (event.stream, event.request_id, event.p_rank)
        result.proofs.fence(key, event.posted_at)
        result.proof_keys.setdefault((event.stream, event.request_id), set()).add(key)
        t_free = freed_at.get((rec.remote_engine, event.p_rank, event.request_id))
        if t_free is not None and event.posted_at > t_free:
            result.violations.append(Violation(
                "fence_after_free", describe(event),
                f"the fence of {rec.remote_engine} rank {event.p_rank}, posted at "
                f"t={event.posted_at}, held the request's value after P freed it at t={t_free}"))
    # A gap counts from the later of the last heartbeat and the last report, so
    # none is reported unless the one from the last heartbeat alone is too long.
    if event.t - rec.last_heartbeat > rec.lease_s and (
            rec.state in HEARTBEAT_STATES or kind == "finished_recving"):
        key = (event.stream, event.request_id)
        gap = event.t - max(rec.last_heartbeat, result.gap_reported_at.get(key, -math.inf))
        if gap > rec.lease_s:
            result.violations.append(Violation(
                "heartbeat_gap", describe(event),
                f"no heartbeat for {gap:.3f}s (lease {rec.lease_s}s) while in {rec.state.value}"))
            result.gap_reported_at[key] = event.t  # report each gap once
    if rec.state is DState.RECEIVED and kind == "finished_recving" and not rec.cancelled:
        for rank, done in zip(rec.split_ranks, rec.split_done, strict=True):
            t_free = freed_at.get((rec.remote_engine, rank, event.request_id))
            if t_free is not None and isinstance(done, float) and done > t_free:
                result.violations.append(Violation(
                    "served_freed", describe(event),
                    f"read from {rec.remote_engine} rank {rank} completed at t={done} "
                    f"after P freed the source at t={t_free}"))
        for rank, done, proven in result.proofs.unproven(
                lambda r: (event.stream, event.request_id, r), rec):
            result.violations.append(Violation(
                "served_unproven", describe(event),
                f"read from {rec.remote_engine} rank {rank} completed at t={done}; "
                f"P's acknowledgements prove the source held until t={proven}"))


def _check_leaks(result: Replay, last_t: dict) -> None:
    for ss in result.state.streams.values():
        if ss.stream.side is not Side.P:
            continue
        end = last_t.get(ss.stream, 0.0)
        for rid, rec in ss.requests.items():
            if (isinstance(rec, ProducerRecord) and rec.state is PState.EXPORTED
                    and rec.deadline + rec.lease_s < end):
                result.violations.append(Violation(
                    "leak", f"{ss.stream} {rid}",
                    f"lease ended at t={rec.deadline}, still held at t={end}"))


def render_timeline(timeline: Iterable[tuple[Event, str]]) -> str:
    """Human-readable per-request timeline: one line per event, every string from the
    log passed through `printable`."""
    lines: list[str] = []
    rows = sorted(timeline, key=lambda row: (row[0].request_id, row[0].t))
    for rid, group in groupby(rows, key=lambda row: row[0].request_id):
        lines.append(f"request {printable(rid)}")
        for event, state in group:
            extras = " ".join(f"{name}={printable(getattr(event, name))}"
                              for name, _ in EXTRA_FIELDS[event.kind])
            lines.append(f"  t={event.t:<12.6f} {printable(event.stream):<16} "
                         f"{printable(event.kind):<18} -> {printable(state):<17} "
                         f"{extras}".rstrip())
    return "\n".join(lines)
