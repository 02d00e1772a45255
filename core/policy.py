"""Policy as pure functions of the fold: what to heartbeat, what to free, what is safe.

Adapters and simulations call these with the current time; nothing here
keeps state of its own, so the decision is always the one the event log
implies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass

from kvhandoff.core.events import Stream
from kvhandoff.core.lifecycle import (
    HEARTBEAT_STATES,
    READING_STATES,
    TERMINAL,
    ConsumerRecord,
    LifecycleState,
    ProducerRecord,
    PState,
    Record,
    Verdict,
    read_verdict_of,
)

__all__ = [
    "TimingConfig", "Verdict", "heartbeat_due", "heartbeat_plan", "next_heartbeat", "report_due",
    "last_vouched", "MIN_LEASE_S", "MAX_LEASE_S", "MIN_MARGIN_S", "TimingError",
    "heartbeat_period", "read_deadline", "expired_leases", "to_free",
    "to_forget", "forgotten_when_freed", "lease_time_left", "read_verdict", "reads_to_report",
]

# D heartbeats a P rank this many times per lease of the requests it covers (vLLM's
# NixlConnector: lease // 6): five of six heartbeats may be lost before a lease lapses.
HEARTBEATS_PER_LEASE = 6
# A finished record is remembered this many leases after it ended (`to_forget`).
REMEMBER_LEASES = 2
# The shortest lease a P grants and a D accepts in transfer parameters (which clients can
# write): D heartbeats every sixth of the shortest lease it holds from a P rank, so one
# request with a lease of a microsecond made D heartbeat that rank, naming every request
# it holds there, at every poll.
MIN_LEASE_S = 1.0
# The longest: D remembers a request two leases after it ends (parameters single-use).
MAX_LEASE_S = 86400.0
# D's smallest margin on P's reported time left.  P's lease ends at its deadline (it
# expires and frees at ``t >= deadline``), so D's bound must end before it: with no margin
# a READ completing at that very instant was confirmed, and a margin far below a clock
# value's float resolution (1e-12 s at an uptime of 11 days) is no margin either.
MIN_MARGIN_S = 0.001


class TimingError(ValueError):
    """A timing setting out of range: names it, what was expected and what was found."""

    def __init__(self, name: str, expected: str, found: object) -> None:
        self.name, self.expected, self.found = name, expected, found
        super().__init__(f"{name}: expected {expected}, found {found!r}")

_TO_FREE = frozenset({PState.RELEASED, PState.EXPIRED, PState.ABORTED})


@dataclass(frozen=True, slots=True)
class TimingConfig:
    """Every lifecycle timing setting, one name each, for every caller.

    The connector builds it from its extra config (`HandoffConfig.timing`),
    the simulator from a run's config (`RunConfig.timing`); the engines read
    nothing else.  Seconds on the engine's own clock.
    """

    lease_s: float = 30.0  # P: how long exported blocks stay pinned without a heartbeat
    heartbeat_interval_s: float = 5.0  # D: heartbeat each P rank at most this far apart
    lease_margin_s: float = 1.0  # D: safety margin on the time left P reports
    read_timeout_s: float = 30.0  # D: give up on READs (or on P's proof) after this

    def __post_init__(self) -> None:
        if not self.lease_s > 0:
            raise TimingError("lease_s", "> 0", self.lease_s)
        if not 0 < self.heartbeat_interval_s:
            raise TimingError("heartbeat_interval_s", "> 0", self.heartbeat_interval_s)
        if not MIN_MARGIN_S <= self.lease_margin_s < self.lease_s:
            raise TimingError("lease_margin_s", f">= {MIN_MARGIN_S:g} and < lease_s "
                              f"({self.lease_s:g})", self.lease_margin_s)
        if not self.read_timeout_s > 0:
            raise TimingError("read_timeout_s", "> 0", self.read_timeout_s)


def _records(state: LifecycleState, stream: Stream):
    ss = state.streams.get(stream)
    return () if ss is None else ss.requests.items()


def heartbeat_due(state: LifecycleState, stream: Stream) -> dict[str, list[str]]:
    """D: the requests to heartbeat now, grouped by remote (P) engine.

    A request is heartbeated from admission until its reads drained
    (finished_recving) or a notify-only release went out; a client cancel
    with reads in flight keeps it here.
    """
    due: dict[str, list[str]] = {}
    for rid, rec in _records(state, stream):
        if rec.state in HEARTBEAT_STATES:
            due.setdefault(rec.remote_engine, []).append(rid)
    return due


def heartbeat_period(interval_s: float, leases: Iterable[float]) -> float:
    """D: how often to heartbeat one P rank: D's own ``interval_s``, or a sixth of the
    shortest lease among the requests due there when that is shorter.

    The leases are P's (they travel in each request's parameters): a P that
    grants 4 s must hear from D every 2/3 s, whatever D's own setting says,
    or its lease lapses between two heartbeats while a READ still runs.
    """
    return min((interval_s, *(lease / HEARTBEATS_PER_LEASE for lease in leases)))


def heartbeat_plan(due: Mapping[Hashable, list[str]], now: float,
                   last_sent: Mapping[Hashable, float], last_asked: Mapping[Hashable, float],
                   periods: Mapping[Hashable, float], fresh: set[str],
                   awaiting: Mapping[Hashable, list[str]], reasked: set[Hashable],
                   vouched: Callable[[str], float],
                   unanswered: Mapping[Hashable, float] | None = None,
                   ) -> list[tuple[Hashable, list[str], bool, bool]]:
    """D: which P ranks (``peer``) to heartbeat now, and which of their requests to name.

    Two kinds of heartbeat, both one per peer (the engine sends one naming more than
    `core.messages.MAX_IDS` requests as several messages):

    * the **keep-alive**, once per period (`heartbeat_period`; ``periods`` per
      peer) since the last one (``last_sent``), names every request due at
      that peer (``due``: `heartbeat_due` grouped by the P rank a request
      reads);
    * the **ask**, between keep-alives, names only the requests that want
      P's word now: one just admitted (``fresh``: P's answer is what proves the
      source alive when its READ completes), one whose READs drained and wait
      only for that word (``awaiting``, per peer) — at once, then every
      quarter period since the last message there (``last_asked``) while it
      still waits (``reasked``: an acknowledgement can be lost like any
      notification) — and, riding along, any request due there that P has not
      vouched for within a period and a quarter (``vouched(rid)``: when P last
      answered it alive, its admission before that; a keep-alive is taken as
      lost when its answer is a quarter period late, as for the re-ask), so a
      request whose keep-alives are the messages being lost is carried by the
      asks that get through.  A keep-alive P has not answered for a quarter
      period (``unanswered``: per peer, when it was sent) is itself a reason
      to ask, every quarter period, naming the requests P has not vouched for
      since: with the fence nothing else may ask, and a lease must not hang on
      the next keep-alive alone.

    A busy peer therefore costs one keep-alive naming everything per period
    plus asks naming only what is new, not every request on every message.
    Returns (peer, request ids, urgent, keep-alive).
    """
    plan = []
    unanswered = unanswered or {}
    for peer, rids in due.items():
        period = periods[peer]
        waiting = awaiting.get(peer, ())
        quiet = now - last_asked.get(peer, -math.inf) >= period / 4
        urgent = bool(waiting) and (peer not in reasked or quiet)
        if now - last_sent.get(peer, -math.inf) >= period:
            plan.append((peer, rids, urgent, True))
            continue
        new = [rid for rid in rids if rid in fresh]
        lost = unanswered.get(peer)
        lost = lost if lost is not None and quiet and now - lost >= period / 4 else None
        if urgent or new or lost is not None:
            named = set(new).union(waiting)
            named.update(rid for rid in rids if now - vouched(rid) >= period * 1.25
                         or lost is not None and vouched(rid) <= lost)
            if named:  # (a lost keep-alive whose requests P vouched for since: nothing)
                plan.append((peer, [rid for rid in rids if rid in named], urgent, False))
    return plan


def next_heartbeat(due: Mapping[Hashable, list[str]], last_sent: Mapping[Hashable, float],
                   last_asked: Mapping[Hashable, float], periods: Mapping[Hashable, float],
                   awaiting: Mapping[Hashable, list[str]], reasked: set[Hashable],
                   unanswered: Mapping[Hashable, float] | None = None) -> float:
    """D: the earliest time `heartbeat_plan` names a peer, with nothing new happening.

    (A request just admitted, or just drained, is something new: the driver
    polls after admitting or completing, and that poll asks at once.  An
    unvouched request rides on asks; an unanswered keep-alive wakes its own.)
    """
    at = math.inf
    unanswered = unanswered or {}
    for peer in due:
        period = periods[peer]
        at = min(at, last_sent.get(peer, -math.inf) + period)
        if awaiting.get(peer) and peer in reasked:
            at = min(at, last_asked.get(peer, -math.inf) + period / 4)
        lost = unanswered.get(peer)
        if lost is not None:
            at = min(at, max(lost, last_asked.get(peer, -math.inf)) + period / 4)
    return at


def last_vouched(rec: ConsumerRecord) -> float:
    """D: when P last answered a heartbeat for ``rec`` alive (the heartbeat's send time, on
    D's clock), or the request's admission when it never has."""
    return max(rec.held_at.values(), default=rec.t0)


def report_due(rec: ConsumerRecord, now: float, timing: TimingConfig) -> bool:
    """D: whether a request whose READs all drained is reported (``finished_recving``) now.

    When its verdict is known (CONFIRMED, UNSAFE or FAILED); when the client
    cancelled it (its bytes go nowhere, no proof is needed); or past
    `read_deadline` with P's proof still missing (the verdict stays unproven
    and the request fails instead of waiting).  The caller also waits for a
    READ already failed by the deadline but still moving bytes into D's pages.
    """
    if rec.state not in READING_STATES or not rec.drained:
        return False
    return (rec.cancelled or read_verdict_of(rec) is not Verdict.PENDING
            or now > read_deadline(rec, timing.read_timeout_s))


def release_retry_at(first_failed: float, failed_at: float, interval_s: float,
                     lease_s: float) -> float | None:
    """D: when a release whose send failed at ``failed_at`` (its first failure at
    ``first_failed``) is sent again: a quarter heartbeat interval later (as a heartbeat
    P has not answered is asked again), for as long as P may still hold the blocks, a
    lease (the request's) after the first failure: P has freed them by lease then.
    None once given up.  D sends a release once (`ReleaseSent`); P's lease is for a
    release lost on the way, and would otherwise hold the blocks a whole lease for one
    D could not send."""
    at = failed_at + interval_s / 4
    return at if at < first_failed + lease_s else None


def read_deadline(rec: ConsumerRecord, timeout_s: float) -> float:
    """D: when a request's READs are given up (failed) if they have not drained, or drained
    with no proof, on D's clock.

    D's own ``timeout_s`` runs from the posting; it is cut short when P has
    not vouched for the lease for a whole lease (the request's) since the
    later of the posting and the latest heartbeat that P rank answered alive
    (the stalest rank among those still owing: a split in flight, or one
    completed later than that rank's proven bound): past that, P may have
    freed the source, and waiting longer only holds D's pages for bytes D
    would refuse.  While P keeps answering, a READ may run longer than one
    lease.
    """
    if timeout_s == math.inf:  # no timeout (vLLM 0.32's D): READs run until the fabric ends them
        return math.inf
    return min(rec.posted_at + timeout_s, _lease_bound(rec))


def _lease_bound(rec: ConsumerRecord) -> float:
    """`read_deadline`'s second bound: one lease after P last vouched for the stalest rank."""
    owing = [r for r, done in zip(rec.split_ranks, rec.split_done, strict=True)
             if done is None or (done != "" and done > rec.safe_until.get(r, -math.inf))]
    last_proof = min((rec.held_at.get(r, -math.inf) for r in owing or rec.split_ranks),
                     default=-math.inf)
    return max(rec.posted_at, last_proof) + rec.lease_s


def read_deadline_bound(rec: ConsumerRecord, timeout_s: float) -> str:
    """Which of `read_deadline`'s two bounds it is, in words (a failure's reason)."""
    if rec.posted_at + timeout_s <= _lease_bound(rec):
        return f"read_timeout_s {timeout_s} after the post"
    return f"lease_s {rec.lease_s} without word from P"


def expired_leases(state: LifecycleState, stream: Stream, t: float) -> list[str]:
    """P: exported requests whose lease deadline has passed at ``t``."""
    return [rid for rid, rec in _records(state, stream)
            if rec.state is PState.EXPORTED and t >= rec.deadline]


def to_free(state: LifecycleState, stream: Stream) -> list[str]:
    """P: requests whose blocks must be freed now (released, expired or aborted)."""
    return [rid for rid, rec in _records(state, stream) if rec.state in _TO_FREE]


def to_forget(state: LifecycleState, stream: Stream, t: float, lease_s: float) -> list[str]:
    """Finished records (FREED / DONE) to forget at ``t``: ended ``REMEMBER_LEASES`` leases
    ago, or on P released by D (`forgotten_when_freed`).

    The lease is the engine's own ``lease_s`` or the request's, whichever is
    longer.  Until then a late heartbeat gets a precise answer (on P: counted
    late when the lease had run out), and on D the request's transfer
    parameters stay single-use for as long as P may still hold its blocks.
    Forgetting is an event (`Forgotten`).
    """
    return [rid for rid, rec in _records(state, stream)
            if rec.state in TERMINAL
            and (forgotten_when_freed(rec)
                 or t - rec.t_end > REMEMBER_LEASES * max(lease_s, rec.lease_s))]


def forgotten_when_freed(rec: Record) -> bool:
    """P: a request its consumer released is forgotten as soon as its blocks are freed.

    Every consumer rank said it is done reading, so nothing D sends later can
    change what P does: a heartbeat that crossed the release is answered
    "gone" rather than "released", which D treats alike (P let go), and a
    repeated release is counted as ``unknown_request``.  Keeping such records
    would cost a hot P about 60 s (two leases) of its whole release rate in
    memory.  An expired or aborted request is remembered (`to_forget`): a late
    heartbeat for it is counted (``heartbeats_late``) and answered precisely.
    """
    return isinstance(rec, ProducerRecord) and rec.state is PState.FREED and rec.ended == "released"


def lease_time_left(state: LifecycleState, stream: Stream, request_id: str, t: float, *,
                    engine: str | None = None, token: str | None = None) -> float:
    """P's answer to a heartbeat: > 0 alive (seconds left), 0 released, < 0 gone.

    Pass the asking ``engine`` and the ``token`` it presented: an asker that
    is not the request's consumer is told "gone", never "released", so it
    cannot mistake another engine's release for the end of its own reads.
    A request this stream has not recorded as exported yet is also "gone":
    an adapter whose heartbeats can overtake its own export (vLLM's P logs
    the export a step after it hands out the parameters) holds such answers
    until the export is recorded.
    """
    rec = state.record(stream, request_id)
    if not isinstance(rec, ProducerRecord):
        return -1.0
    if (token is not None and rec.token and token != rec.token) or (
            engine is not None and rec.consumer and engine != rec.consumer):
        return -1.0
    if rec.state is PState.EXPORTED:
        return rec.deadline - t if t < rec.deadline else -1.0
    return 0.0 if rec.state is PState.RELEASED or rec.ended == "released" else -1.0


def read_verdict(state: LifecycleState, stream: Stream, request_id: str) -> Verdict:
    """D: may the request's completed reads be reported as received?"""
    rec = state.record(stream, request_id)
    if not isinstance(rec, ConsumerRecord) or rec.state not in READING_STATES:
        raise KeyError(f"{stream}: request {request_id!r} has no reads in progress")
    return read_verdict_of(rec)


def reads_to_report(state: LifecycleState, stream: Stream) -> list[str]:
    """D: requests whose reads drained with a verdict (not PENDING): report finished_recving."""
    return [rid for rid, rec in _records(state, stream)
            if rec.state in READING_STATES
            and read_verdict_of(rec) is not Verdict.PENDING
            and rec.drained]
