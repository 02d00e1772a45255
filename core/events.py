"""Lifecycle events of both halves of a KV hand-off.

Every step of a transfer is one frozen, slotted event.  Each carries the
transfer's request id (P's request id: D logs the remote request id so the two
halves join), the stream that wrote it (engine, side, rank), the stream's
sequence number and the time, which is always an argument: the core never
reads a clock.

``EVENT_TYPES`` maps each event's wire name to its class; the event log and
the lifecycle graph both read it.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import ClassVar, NamedTuple


class Side(StrEnum):
    P = "P"  # producer: prefill engine, owns the source blocks
    D = "D"  # consumer: decode engine, READs the blocks


class Stream(NamedTuple):
    """Who wrote an event: one engine, one side, one rank.

    A named tuple rather than a dataclass: it keys every lookup of the fold,
    and a tuple hashes in C.
    """

    engine: str
    side: Side
    rank: int = 0

    def __str__(self) -> str:
        return f"{self.engine}/{self.side}{self.rank}"


@dataclass(frozen=True, slots=True)
class Event:
    request_id: str
    stream: Stream
    seq: int
    t: float
    kind: ClassVar[str] = "event"


# --- producer (P) half -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillStarted(Event):
    kind: ClassVar[str] = "prefill_started"


@dataclass(frozen=True, slots=True)
class Exported(Event):
    """Prefill done; the blocks are pinned until released or ``t + lease_s``.

    ``token`` is the release capability P handed out with the transfer
    parameters: heartbeats and releases that do not carry it are ignored and
    counted, so a stray engine cannot free a lease it does not hold.  Empty
    means no check (the first engine to heartbeat or release binds).
    """

    lease_s: float = 30.0
    consumer_ranks: tuple[int, ...] = (0,)
    num_blocks: int = 0
    token: str = ""
    fence_slot: int = -1  # the export's fence slot (`core.fence`); -1: none
    kind: ClassVar[str] = "exported"


@dataclass(frozen=True, slots=True)
class HeartbeatReceived(Event):
    """A consumer asked P to keep the request's blocks alive.

    ``from_engine`` names the sender as P's transport knows it (the adapters
    use the peer agent, unique per process), never what the message claims:
    a restarted or duplicate consumer is then a different peer.
    """

    from_engine: str = ""
    token: str = ""
    kind: ClassVar[str] = "heartbeat_received"


@dataclass(frozen=True, slots=True)
class ReleaseNotified(Event):
    """A consumer rank says it is done with the request's blocks (sender as for heartbeats)."""

    from_engine: str = ""
    consumer_rank: int = 0
    token: str = ""
    kind: ClassVar[str] = "release_notified"


@dataclass(frozen=True, slots=True)
class LeaseExpired(Event):
    kind: ClassVar[str] = "lease_expired"


@dataclass(frozen=True, slots=True)
class Aborted(Event):
    """The request ended on P before it was exported (client abort, error)."""

    reason: str = ""
    kind: ClassVar[str] = "aborted"


@dataclass(frozen=True, slots=True)
class Freed(Event):
    """P returned the request's blocks to its pool (exactly once)."""

    kind: ClassVar[str] = "freed"


# --- consumer (D) half -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admitted(Event):
    """D accepted a request whose KV lives on P (``remote_engine``)."""

    remote_engine: str = ""
    remote_ranks: tuple[int, ...] = (0,)
    num_blocks: int = 0
    lease_s: float = 30.0
    lease_margin_s: float = 1.0
    local_request_id: str = ""
    kind: ClassVar[str] = "admitted"


@dataclass(frozen=True, slots=True)
class Validated(Event):
    kind: ClassVar[str] = "validated"


@dataclass(frozen=True, slots=True)
class Rejected(Event):
    reason: str = ""
    kind: ClassVar[str] = "rejected"


@dataclass(frozen=True, slots=True)
class ReadsPosted(Event):
    """D posted one READ per split; split i reads cache group ``split_groups[i]`` from P rank
    ``split_ranks[i]``.

    Splits are numbered in this order; (rank, group) says what each one
    reads (a key may repeat where several READs share it).  ``split_groups``
    empty means every split reads group 0 (a model with one KV cache group,
    and every log written before hybrid models were supported).
    """

    split_ranks: tuple[int, ...] = (0,)
    split_groups: tuple[int, ...] = ()
    kind: ClassVar[str] = "reads_posted"


@dataclass(frozen=True, slots=True)
class SplitCompleted(Event):
    split: int = 0
    kind: ClassVar[str] = "split_completed"


@dataclass(frozen=True, slots=True)
class SplitFailed(Event):
    split: int = 0
    reason: str = ""
    kind: ClassVar[str] = "split_failed"


@dataclass(frozen=True, slots=True)
class ClientCancelled(Event):
    kind: ClassVar[str] = "client_cancelled"


@dataclass(frozen=True, slots=True)
class LeaseAcknowledged(Event):
    """P answered a heartbeat D sent at ``sent_at`` (D's clock).

    ``time_left`` > 0: the lease was alive with that much left when P read the
    heartbeat; ``time_left`` == 0: P released the request on its consumers'
    notifications; ``time_left`` < 0: P no longer holds the blocks for any
    other reason (expired, aborted, unknown, another asker).  D's fold takes
    both 0 and < 0 as "gone": D releases only after its reads drained, so a
    release P heard while D still asks did not follow D's reads.
    """

    p_rank: int = 0
    sent_at: float = 0.0
    time_left: float = -1.0
    kind: ClassVar[str] = "lease_acknowledged"


@dataclass(frozen=True, slots=True)
class FenceHeld(Event):
    """D read P rank ``p_rank``'s fence slot for this request, posted at ``posted_at`` (D's
    clock, after every READ from that rank drained), and found the request's value there:
    P held the source at a time after ``posted_at`` (`core.fence`)."""

    p_rank: int = 0
    posted_at: float = 0.0
    kind: ClassVar[str] = "fence_held"


@dataclass(frozen=True, slots=True)
class FinishedRecving(Event):
    """The worker reported the request's reads drained (exactly once)."""

    kind: ClassVar[str] = "finished_recving"


@dataclass(frozen=True, slots=True)
class ReleaseSent(Event):
    """D told P it is done: ``notify_only`` when no read carried the release."""

    notify_only: bool = False
    kind: ClassVar[str] = "release_sent"


@dataclass(frozen=True, slots=True)
class HeartbeatSent(Event):
    kind: ClassVar[str] = "heartbeat_sent"


# --- both halves ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Forgotten(Event):
    """The engine dropped a finished record (FREED on P, DONE on D) to bound its memory.

    Forgetting is logged like every other change, so a replay forgets the
    request at the same point as the live engine did and the two folds stay
    equal.  After it the request id is unknown again (NEW): a later request
    under the same id is a new request.  When an engine forgets is policy
    (`core.policy.to_forget`).
    """

    kind: ClassVar[str] = "forgotten"


PRODUCER_EVENTS: tuple[type[Event], ...] = (
    PrefillStarted, Exported, HeartbeatReceived, ReleaseNotified, LeaseExpired, Aborted, Freed,
    Forgotten,
)
CONSUMER_EVENTS: tuple[type[Event], ...] = (
    Admitted, Validated, Rejected, ReadsPosted, SplitCompleted, SplitFailed, ClientCancelled,
    LeaseAcknowledged, FenceHeld, FinishedRecving, ReleaseSent, HeartbeatSent, Forgotten,
)
EVENT_TYPES: dict[str, type[Event]] = {c.kind: c for c in PRODUCER_EVENTS + CONSUMER_EVENTS}

# Field names and types beyond the common header, per event kind (for the log).
COMMON_FIELDS = ("request_id", "stream", "seq", "t")
EXTRA_FIELDS: dict[str, tuple[tuple[str, object], ...]] = {
    kind: tuple((f.name, typing.get_type_hints(cls)[f.name])
                for f in fields(cls) if f.name not in COMMON_FIELDS)
    for kind, cls in EVENT_TYPES.items()
}
