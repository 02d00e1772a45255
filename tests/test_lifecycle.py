"""The lifecycle graph: every declared arrow works, everything else is refused unchanged."""

from __future__ import annotations

import math

import pytest
from lifecycle_paths import D0, P0, RID, ledger_in

from kvhandoff.core.errors import InvalidTransition, SequenceError
from kvhandoff.core.events import (
    CONSUMER_EVENTS,
    EVENT_TYPES,
    PRODUCER_EVENTS,
    Aborted,
    Admitted,
    ClientCancelled,
    Exported,
    FenceHeld,
    FinishedRecving,
    Forgotten,
    Freed,
    HeartbeatReceived,
    HeartbeatSent,
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
    Validated,
)
from kvhandoff.core.lifecycle import (
    D_GRAPH,
    P_GRAPH,
    TABLES,
    DState,
    PState,
    Verdict,
    apply,
    fold,
    read_verdict_of,
)
from kvhandoff.core.replay import state_hash

P, D = PState, DState
REL0 = dict(from_engine="decode-0", consumer_rank=0)
ADMIT = dict(remote_engine="prefill-0", remote_ranks=(0,), num_blocks=4, lease_s=10.0,
             lease_margin_s=0.5, local_request_id="local-1")

# (from state, event, fields, expected state) — one case per arrow of the graph.
LEGAL = [
    (P.NEW, PrefillStarted, {}, P.PREFILLING),
    (P.NEW, Exported, dict(lease_s=5.0, consumer_ranks=(0,)), P.EXPORTED),
    (P.PREFILLING, Exported, dict(lease_s=5.0, consumer_ranks=(0,)), P.EXPORTED),
    (P.PREFILLING, Aborted, dict(reason="client"), P.ABORTED),
    (P.EXPORTED, HeartbeatReceived, dict(from_engine="decode-0"), P.EXPORTED),
    (P.EXPORTED, ReleaseNotified, REL0, P.EXPORTED),  # one of two consumer ranks
    (P.EXPORTED, LeaseExpired, {"t": 50.0}, P.EXPIRED),
    (P.RELEASED, Freed, {}, P.FREED),
    (P.EXPIRED, Freed, {}, P.FREED),
    (P.ABORTED, Freed, {}, P.FREED),
    (P.FREED, Forgotten, {}, P.NEW),
    *[(s, cls, kw, s) for s in (P.NEW, P.PREFILLING, P.RELEASED, P.EXPIRED, P.ABORTED, P.FREED)
      for cls, kw in ((HeartbeatReceived, dict(from_engine="decode-0")), (ReleaseNotified, REL0))],
    (D.NEW, Admitted, ADMIT, D.ADMITTED),
    (D.ADMITTED, Validated, {}, D.VALIDATED),
    (D.ADMITTED, Rejected, dict(reason="block id out of range"), D.REJECTED),
    (D.ADMITTED, ClientCancelled, {}, D.CANCELLED),
    (D.VALIDATED, ClientCancelled, {}, D.CANCELLED),
    (D.VALIDATED, Rejected, dict(reason="failed before its reads"), D.REJECTED),
    (D.VALIDATED, ReadsPosted, dict(split_ranks=(0,)), D.READING),
    (D.VALIDATED, ReleaseSent, dict(notify_only=True), D.DONE),
    (D.READING, SplitCompleted, dict(split=0), D.READING),
    (D.READING, SplitFailed, dict(split=1, reason="timeout"), D.READING),
    (D.READING, ClientCancelled, {}, D.CANCELLED_READING),
    (D.CANCELLED_READING, SplitCompleted, dict(split=0), D.CANCELLED_READING),
    (D.CANCELLED_READING, SplitFailed, dict(split=0, reason="x"), D.CANCELLED_READING),
    (D.RECEIVED, ReleaseSent, dict(notify_only=False), D.DONE),
    (D.FAILED, ReleaseSent, dict(notify_only=True), D.DONE),
    (D.REJECTED, ReleaseSent, dict(notify_only=True), D.DONE),
    (D.CANCELLED, ReleaseSent, dict(notify_only=True), D.DONE),
    (D.DONE, Forgotten, {}, D.NEW),
    *[(s, ClientCancelled, {}, s) for s in (D.REJECTED, D.CANCELLED, D.CANCELLED_READING,
                                             D.RECEIVED, D.FAILED, D.DONE)],
    *[(s, LeaseAcknowledged, dict(p_rank=0, sent_at=0.0, time_left=1.0), s)
      for s in D if s is not D.NEW],
    (D.NEW, LeaseAcknowledged, dict(p_rank=0, sent_at=0.0, time_left=1.0), D.NEW),
    *[(s, FenceHeld, dict(p_rank=0, posted_at=10.0), s) for s in (D.READING, D.CANCELLED_READING)],
    *[(s, HeartbeatSent, {}, s) for s in (D.ADMITTED, D.VALIDATED, D.REJECTED, D.CANCELLED,
                                          D.READING, D.CANCELLED_READING)],
]


def _ledger(state):
    if state in (P.NEW, D.NEW):
        from kvhandoff.core.ledger import Ledger
        from kvhandoff.core.lifecycle import LifecycleState
        return Ledger(P0 if isinstance(state, PState) else D0, LifecycleState())
    return ledger_in(state)


def _state_of(ledger):
    rec = ledger.state.record(ledger.stream, RID)
    return rec.state if rec is not None else (P.NEW if ledger.stream.side is Side.P else D.NEW)


@pytest.mark.parametrize(("source", "event", "fields", "dest"), LEGAL,
                         ids=[f"{c[0]}-{c[1].kind}-{c[3]}" for c in LEGAL])
def test_each_legal_transition(source, event, fields, dest):
    ledger = _ledger(source)
    assert _state_of(ledger) is source
    fields = dict(fields)
    ledger.record(event, RID, fields.pop("t", 20.0), **fields)
    assert _state_of(ledger) is dest


def test_final_release_notification_releases_and_conditional_finish():
    ledger = ledger_in(P.RELEASED)
    assert _state_of(ledger) is P.RELEASED  # both expected consumer ranks notified
    assert _state_of(ledger_in(D.RECEIVED)) is D.RECEIVED  # acked lease: confirmed
    assert _state_of(ledger_in(D.FAILED)) is D.FAILED  # a split failed


def test_every_arrow_of_the_graph_has_a_case():
    covered = {(src, ev.kind, dst) for src, ev, _, dst in LEGAL}
    covered |= {(P.EXPORTED, "release_notified", P.RELEASED),
                (D.READING, "finished_recving", D.RECEIVED),
                (D.READING, "finished_recving", D.FAILED),
                (D.CANCELLED_READING, "finished_recving", D.RECEIVED),
                (D.CANCELLED_READING, "finished_recving", D.FAILED)}
    declared = {(src, trig, src if dst == "=" else dst)
                for graph in (P_GRAPH, D_GRAPH) for trig, srcs, dst, _, _ in graph for src in srcs}
    assert declared <= covered, declared - covered


def _illegal_cases():
    for side, events, states in ((Side.P, PRODUCER_EVENTS + CONSUMER_EVENTS, PState),
                                 (Side.D, CONSUMER_EVENTS + PRODUCER_EVENTS, DState)):
        for state in states:
            for cls in events:
                if (state, cls.kind) not in TABLES[side]:
                    yield state, cls


ILLEGAL = list(_illegal_cases())


@pytest.mark.parametrize(("state", "event"), ILLEGAL,
                         ids=[f"{s}-{e.kind}" for s, e in ILLEGAL])
def test_illegal_transition_raises_and_changes_nothing(state, event):
    ledger = _ledger(state)
    before = state_hash(ledger.state)
    with pytest.raises(InvalidTransition) as info:
        ledger.record(event, RID, 30.0)
    assert info.value.state == state and info.value.event == event.kind
    assert str(state) in str(info.value) and event.kind in str(info.value)
    assert state_hash(ledger.state) == before
    # the refused event consumed no sequence number
    ledger.record(*((HeartbeatReceived, RID, 31.0) if ledger.stream.side is Side.P
                    else (LeaseAcknowledged, RID, 31.0)))


def test_illegal_sample_is_large():
    assert len(ILLEGAL) > 100
    assert len(EVENT_TYPES) == 20


@pytest.mark.parametrize(("state", "event", "fields", "reason"), [
    (P.EXPORTED, LeaseExpired, {"t": 5.0}, "lease runs until"),
    (P.RELEASED, Freed, {}, None),
    (P.FREED, Freed, {}, None),  # a second free is refused: exactly once
    (D.READING, FinishedRecving, {}, "splits still in flight"),
    (D.READING, SplitCompleted, dict(split=7), "split 7 of 2"),
    (D.RECEIVED, FinishedRecving, {}, None),  # reported once only
    (D.VALIDATED, ReadsPosted, dict(split_ranks=()), "no splits"),
    (D.VALIDATED, ReadsPosted, dict(split_ranks=(0, 0), split_groups=(1,)),
     "1 split_groups for 2 splits"),
    (D.VALIDATED, ReleaseSent, dict(notify_only=False), "no guard holds"),
    (D.NEW, Admitted, dict(remote_engine=""), "remote_engine=''"),
])
def test_guarded_events_are_refused_with_a_reason(state, event, fields, reason):
    ledger = _ledger(state)
    if state is P.RELEASED:
        ledger.record(Freed, RID, 1.0)
    before = state_hash(ledger.state)
    fields = dict(fields)
    if reason is None:
        with pytest.raises(InvalidTransition):
            ledger.record(event, RID, fields.pop("t", 1.0), **fields)
    else:
        with pytest.raises(InvalidTransition, match=reason):
            ledger.record(event, RID, fields.pop("t", 1.0), **fields)
    assert state_hash(ledger.state) == before


def test_double_split_completion_is_refused():
    ledger = ledger_in(D.READING)
    ledger.record(SplitCompleted, RID, 1.0, split=0)
    with pytest.raises(InvalidTransition, match="already finished"):
        ledger.record(SplitCompleted, RID, 1.1, split=0)


def test_sequence_gap_and_repeat_are_refused():
    ledger = ledger_in(P.EXPORTED)
    ss = ledger.state.streams[P0]
    for seq in (ss.last_seq, ss.last_seq + 2):
        with pytest.raises(SequenceError):
            apply(ledger.state, HeartbeatReceived(RID, P0, seq, 1.0, from_engine="decode-0"))
    assert ss.last_seq == 1


def test_heartbeat_extends_the_lease_and_binds_the_consumer():
    ledger = ledger_in(P.EXPORTED)
    rec = ledger.state.record(P0, RID)
    assert rec.deadline == pytest.approx(10.002)
    ledger.record(HeartbeatReceived, RID, 8.0, from_engine="decode-0")
    assert rec.deadline == pytest.approx(18.0) and rec.consumer == "decode-0"
    ledger.record(HeartbeatReceived, RID, 9.0, from_engine="decode-9")  # forged peer
    assert rec.deadline == pytest.approx(18.0)
    assert ledger.state.streams[P0].ignored["wrong_peer"] == 1


def test_stale_and_duplicate_notifications_change_nothing_and_are_counted():
    ledger = ledger_in(P.EXPORTED)
    ledger.record(ReleaseNotified, RID, 1.0, **REL0)
    before = state_hash(ledger.state)
    ledger.record(ReleaseNotified, RID, 1.1, **REL0)  # duplicate
    ledger.record(ReleaseNotified, RID, 1.2, from_engine="decode-0", consumer_rank=5)  # unexpected
    ledger.record(ReleaseNotified, "unknown", 1.3, **REL0)
    ignored = ledger.state.streams[P0].ignored
    assert dict(ignored) == {"duplicate_release": 1, "unexpected_rank": 1, "unknown_request": 1}
    rec = ledger.state.record(P0, RID)
    assert rec.notified == (0,) and rec.state is P.EXPORTED
    assert before != state_hash(ledger.state)  # only the counters moved


def test_a_forgotten_record_is_unknown_again_in_the_live_fold_and_in_replay():
    for state, stream in ((P.FREED, P0), (D.DONE, D0)):
        logged: list = []
        ledger = ledger_in(state, sink=logged.append)
        ledger.record(Forgotten, RID, 30.0)
        assert ledger.state.record(stream, RID) is None  # memory bounded
        if stream.side is Side.P:
            with pytest.raises(InvalidTransition):  # a second free of a forgotten request fails
                ledger.record(Freed, RID, 31.0)
            ledger.record(HeartbeatReceived, RID, 31.0, from_engine="decode-0")
            assert ledger.state.streams[P0].ignored["unknown_request"] == 1
        else:  # the same id again is a new request
            ledger.record(Admitted, RID, 31.0, **ADMIT)
            assert ledger.state.record(D0, RID).state is D.ADMITTED
        # The log holds the forgetting: its fold equals the live state.
        assert state_hash(fold(logged)) == state_hash(ledger.state)


def test_release_token_keeps_strays_from_freeing_a_live_lease():
    ledger = _ledger(P.NEW)
    ledger.record(Exported, RID, 0.0, lease_s=5.0, consumer_ranks=(0,), token="t0k")
    ledger.record(ReleaseNotified, RID, 1.0, from_engine="decode-stray", consumer_rank=0)
    ledger.record(HeartbeatReceived, RID, 1.0, from_engine="decode-stray", token="guess")
    rec = ledger.state.record(P0, RID)
    assert rec.state is P.EXPORTED and rec.consumer == "" and rec.deadline == 5.0
    assert ledger.state.streams[P0].ignored["bad_token"] == 2
    ledger.record(ReleaseNotified, RID, 1.1, from_engine="decode-0", consumer_rank=0, token="t0k")
    assert rec.state is P.RELEASED and rec.consumer == "decode-0"


def test_lease_times_are_math():
    ledger = ledger_in(P.PREFILLING)
    assert ledger.state.record(P0, RID).deadline == math.inf


# --- the fence (docs/lifecycle.md, "The fence") --------------------------------------


def _drained_reads(ack: bool = False):
    """A request whose two splits from P rank 0 completed at t=1 and t=2, unproven."""
    ledger = ledger_in(D.READING)
    if ack:  # P answered a heartbeat sent at t=0: alive, 10 s left (bound 0 + 10 - 0.5)
        ledger.record(LeaseAcknowledged, RID, 0.5, p_rank=0, sent_at=0.001, time_left=10.0)
    ledger.record(SplitCompleted, RID, 1.0, split=0)
    ledger.record(SplitCompleted, RID, 2.0, split=1)
    return ledger


def test_a_fence_posted_after_the_reads_drained_proves_them_without_p_s_answer():
    ledger = _drained_reads()
    rec = ledger.state.record(D0, RID)
    assert read_verdict_of(rec) is Verdict.PENDING
    ledger.record(FenceHeld, RID, 2.5, p_rank=0, posted_at=2.0)
    assert read_verdict_of(ledger.state.record(D0, RID)) is Verdict.CONFIRMED
    ledger.record(FinishedRecving, RID, 2.6)
    assert _state_of(ledger) is D.RECEIVED


def test_a_fence_posted_before_a_split_completed_does_not_prove_that_split():
    ledger = _drained_reads()
    ledger.record(FenceHeld, RID, 2.5, p_rank=0, posted_at=1.5)  # split 1 completed at 2.0
    assert read_verdict_of(ledger.state.record(D0, RID)) is Verdict.PENDING


def test_a_fence_still_proves_what_it_saw_after_p_answered_gone():
    """P's "gone" (a lease that ran out after the fence was read, or a reordered answer)
    cannot undo what the fence saw: P held the source when the slot was read."""
    ledger = _drained_reads()
    ledger.record(FenceHeld, RID, 2.5, p_rank=0, posted_at=2.0)
    ledger.record(LeaseAcknowledged, RID, 2.7, p_rank=0, sent_at=0.001, time_left=-1.0)
    assert ledger.state.record(D0, RID).gone == (0,)  # P's "gone" was taken
    assert read_verdict_of(ledger.state.record(D0, RID)) is Verdict.CONFIRMED


@pytest.mark.parametrize(("fields", "why"), [
    (dict(p_rank=0, posted_at=3.0), "posted after it was read"),
    (dict(p_rank=1, posted_at=2.0), "a rank the request does not read"),
])
def test_a_fence_that_cannot_be_true_is_refused(fields, why):
    ledger = _drained_reads()
    before = state_hash(ledger.state)
    with pytest.raises(InvalidTransition):
        ledger.record(FenceHeld, RID, 2.5, **fields)
    assert state_hash(ledger.state) == before, why


def test_an_answer_to_a_heartbeat_sent_before_admission_proves_nothing():
    """Found by the worker-pair test of parameters re-used after D forgot them, once the
    fence let the first life end before P's answer to its keep-alive arrived: that late
    answer ("alive, a lease left") is about the earlier life of the id, which P has freed
    since; it must not vouch for the new life's READ."""
    ledger = ledger_in(D.READING)  # admitted at t=0.001
    rec = ledger.state.record(D0, RID)
    ledger.record(LeaseAcknowledged, RID, 0.5, p_rank=0, sent_at=0.0, time_left=10.0)
    assert rec.safe_until == {} and ledger.state.streams[D0].ignored["implausible_ack"] == 1
