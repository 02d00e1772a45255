"""Event paths that bring one request into each lifecycle state (shared by tests)."""

from __future__ import annotations

from kvhandoff.core.events import (
    Aborted,
    Admitted,
    ClientCancelled,
    Exported,
    FinishedRecving,
    Freed,
    LeaseAcknowledged,
    LeaseExpired,
    PrefillStarted,
    ReadsPosted,
    Rejected,
    ReleaseNotified,
    ReleaseSent,
    Side,
    SplitCompleted,
    SplitFailed,
    Stream,
    Validated,
)
from kvhandoff.core.ledger import Ledger
from kvhandoff.core.lifecycle import DState, LifecycleState, PState

P0 = Stream("prefill-0", Side.P, 0)
D0 = Stream("decode-0", Side.D, 0)
RID = "req-1"

EXPORT = (Exported, dict(lease_s=10.0, consumer_ranks=(0, 1), num_blocks=4))
ADMIT = (Admitted, dict(remote_engine="prefill-0", remote_ranks=(0,), num_blocks=4, lease_s=10.0,
                        lease_margin_s=0.5, local_request_id="local-1"))

P_PATHS: dict[PState, list] = {
    PState.PREFILLING: [(PrefillStarted, {})],
    PState.EXPORTED: [(PrefillStarted, {}), EXPORT],
    PState.RELEASED: [(PrefillStarted, {}), EXPORT,
                      (ReleaseNotified, dict(from_engine="decode-0", consumer_rank=0)),
                      (ReleaseNotified, dict(from_engine="decode-0", consumer_rank=1))],
    PState.EXPIRED: [(PrefillStarted, {}), EXPORT, (LeaseExpired, {"t": 100.0})],
    PState.ABORTED: [(PrefillStarted, {}), (Aborted, dict(reason="client"))],
}
P_PATHS[PState.FREED] = [*P_PATHS[PState.RELEASED], (Freed, {})]

_READING = [ADMIT, (Validated, {}), (ReadsPosted, dict(split_ranks=(0, 0)))]
_ACK = (LeaseAcknowledged, dict(p_rank=0, sent_at=0.001, time_left=10.0))  # at admission
D_PATHS: dict[DState, list] = {
    DState.ADMITTED: [ADMIT],
    DState.VALIDATED: [ADMIT, (Validated, {})],
    DState.REJECTED: [ADMIT, (Rejected, dict(reason="bad geometry"))],
    DState.CANCELLED: [ADMIT, (ClientCancelled, {})],
    DState.READING: _READING,
    DState.CANCELLED_READING: [*_READING, (ClientCancelled, {})],
    DState.RECEIVED: [*_READING, _ACK, (SplitCompleted, dict(split=0)),
                      (SplitCompleted, dict(split=1)), (FinishedRecving, {})],
    DState.FAILED: [*_READING, (SplitFailed, dict(split=0, reason="peer lost")),
                    (SplitCompleted, dict(split=1)), (FinishedRecving, {})],
}
D_PATHS[DState.DONE] = [*D_PATHS[DState.RECEIVED], (ReleaseSent, dict(notify_only=False))]


def ledger_in(state, sink=None) -> Ledger:
    """A ledger whose request ``RID`` has been driven into ``state`` (each event to ``sink``)."""
    side = Side.P if isinstance(state, PState) else Side.D
    paths = P_PATHS if side is Side.P else D_PATHS
    ledger = Ledger(P0 if side is Side.P else D0, LifecycleState(), sink=sink)
    t = 0.0
    for cls, fields in paths[state]:
        fields = dict(fields)
        t = fields.pop("t", t + 0.001)
        ledger.record(cls, RID, t, **fields)
    return ledger
