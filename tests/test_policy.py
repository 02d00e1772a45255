"""Policy from the fold: heartbeats, expiry, freeing, and when D may trust its bytes."""

from __future__ import annotations

import pytest
from lifecycle_paths import D0, P0, RID, ledger_in

from kvhandoff.core import policy
from kvhandoff.core.events import (
    ClientCancelled,
    FinishedRecving,
    Freed,
    HeartbeatReceived,
    HeartbeatSent,
    LeaseAcknowledged,
    LeaseExpired,
    ReleaseNotified,
    ReleaseSent,
    SplitCompleted,
    SplitFailed,
)
from kvhandoff.core.lifecycle import DState, PState, Verdict


@pytest.mark.parametrize(("state", "due"), [
    (DState.ADMITTED, True), (DState.VALIDATED, True), (DState.READING, True),
    (DState.CANCELLED_READING, True), (DState.REJECTED, True), (DState.CANCELLED, True),
    (DState.RECEIVED, False), (DState.FAILED, False), (DState.DONE, False),
])
def test_heartbeat_rule_by_state(state, due):
    ledger = ledger_in(state)
    assert policy.heartbeat_due(ledger.state, D0) == ({"prefill-0": [RID]} if due else {})


def test_client_cancel_with_reads_in_flight_keeps_heartbeating_until_finished_recving():
    ledger = ledger_in(DState.READING)
    ledger.record(ClientCancelled, RID, 1.0)
    assert policy.heartbeat_due(ledger.state, D0) == {"prefill-0": [RID]}
    ledger.record(HeartbeatSent, RID, 1.0)
    ledger.record(LeaseAcknowledged, RID, 1.1, p_rank=0, sent_at=1.0, time_left=9.0)
    ledger.record(SplitCompleted, RID, 2.0, split=0)
    assert policy.heartbeat_due(ledger.state, D0) == {"prefill-0": [RID]}
    ledger.record(SplitCompleted, RID, 3.0, split=1)
    assert policy.reads_to_report(ledger.state, D0) == [RID]
    ledger.record(FinishedRecving, RID, 3.0)
    assert policy.heartbeat_due(ledger.state, D0) == {}


def test_notify_only_release_ends_heartbeats():
    ledger = ledger_in(DState.CANCELLED)
    ledger.record(ReleaseSent, RID, 1.0, notify_only=True)
    assert policy.heartbeat_due(ledger.state, D0) == {}


def test_lease_expiry_is_inclusive_of_the_deadline():
    ledger = ledger_in(PState.EXPORTED)  # exported at t=0.002 with a 10 s lease
    assert policy.expired_leases(ledger.state, P0, 10.0) == []
    assert policy.expired_leases(ledger.state, P0, 10.002) == [RID]
    ledger.record(HeartbeatReceived, RID, 9.0, from_engine="decode-0")
    assert policy.expired_leases(ledger.state, P0, 10.002) == []
    assert policy.expired_leases(ledger.state, P0, 19.0) == [RID]


@pytest.mark.parametrize(("state", "free"), [
    (PState.PREFILLING, False), (PState.EXPORTED, False), (PState.RELEASED, True),
    (PState.EXPIRED, True), (PState.ABORTED, True), (PState.FREED, False),
])
def test_to_free(state, free):
    assert policy.to_free(ledger_in(state).state, P0) == ([RID] if free else [])


def test_free_after_all_consumer_ranks_notified_exactly_once():
    ledger = ledger_in(PState.EXPORTED)
    ledger.record(ReleaseNotified, RID, 1.0, from_engine="decode-0", consumer_rank=1)
    ledger.record(ReleaseNotified, RID, 1.1, from_engine="decode-0", consumer_rank=1)
    assert policy.to_free(ledger.state, P0) == []
    ledger.record(ReleaseNotified, RID, 1.2, from_engine="decode-0", consumer_rank=0)
    assert policy.to_free(ledger.state, P0) == [RID]
    ledger.record(Freed, RID, 1.3)
    assert policy.to_free(ledger.state, P0) == []
    assert ledger.state.streams[P0].freed == 1


@pytest.mark.parametrize(("state", "t", "left"), [
    (PState.EXPORTED, 4.0, 6.002), (PState.EXPORTED, 11.0, -1.0), (PState.RELEASED, 4.0, 0.0),
    (PState.FREED, 4.0, 0.0), (PState.EXPIRED, 200.0, -1.0), (PState.ABORTED, 1.0, -1.0),
])
def test_lease_time_left_answers_heartbeats(state, t, left):
    assert policy.lease_time_left(ledger_in(state).state, P0, RID, t) == pytest.approx(left)


def test_expired_then_freed_answers_gone():
    ledger = ledger_in(PState.EXPORTED)
    ledger.record(LeaseExpired, RID, 20.0)
    ledger.record(Freed, RID, 20.0)
    assert policy.lease_time_left(ledger.state, P0, RID, 21.0) == -1.0
    assert policy.lease_time_left(ledger.state, P0, "never-seen", 21.0) == -1.0


def _reading(*acks):
    ledger = ledger_in(DState.READING)  # margin 0.5, lease 10, two splits on P rank 0
    for t, sent_at, left in acks:
        _ack(ledger, t, sent_at, left)
    return ledger


def _ack(ledger, t, sent_at, left):
    """D sent a heartbeat at ``sent_at``; P's answer arrives at ``t``."""
    ledger.record(HeartbeatSent, RID, sent_at)
    ledger.record(LeaseAcknowledged, RID, t, p_rank=0, sent_at=sent_at, time_left=left)


def test_verdict_pending_while_reads_in_flight():
    assert policy.read_verdict(_reading().state, D0, RID) is Verdict.PENDING


def test_verdict_confirmed_when_reads_finish_inside_the_acknowledged_lease():
    ledger = _reading((1.0, 0.9, 5.0))  # safe until 0.9 + 5.0 - 0.5 = 5.4
    ledger.record(SplitCompleted, RID, 5.0, split=0)
    ledger.record(SplitCompleted, RID, 5.4, split=1)
    assert policy.read_verdict(ledger.state, D0, RID) is Verdict.CONFIRMED


def test_verdict_waits_for_a_later_ack_when_a_read_finishes_after_the_proven_deadline():
    ledger = _reading((1.0, 0.9, 5.0))
    ledger.record(SplitCompleted, RID, 5.0, split=0)
    ledger.record(SplitCompleted, RID, 6.0, split=1)
    assert policy.read_verdict(ledger.state, D0, RID) is Verdict.PENDING
    assert policy.reads_to_report(ledger.state, D0) == []
    # heartbeat sent at 6.5 (after the read) answered "alive": P held the blocks throughout
    _ack(ledger, 6.6, 6.5, 0.2)
    assert policy.read_verdict(ledger.state, D0, RID) is Verdict.CONFIRMED


def test_verdict_unsafe_when_p_says_gone_after_an_unproven_completion():
    ledger = _reading((1.0, 0.9, 5.0))
    ledger.record(SplitCompleted, RID, 5.0, split=0)
    ledger.record(SplitCompleted, RID, 9.0, split=1)
    _ack(ledger, 9.2, 9.1, -1.0)
    assert policy.read_verdict(ledger.state, D0, RID) is Verdict.UNSAFE
    assert policy.reads_to_report(ledger.state, D0) == [RID]
    ledger.record(FinishedRecving, RID, 9.3)
    assert ledger.state.record(D0, RID).state is DState.FAILED


def test_a_released_answer_while_d_still_reads_proves_nothing():
    # D releases only after its reads drained: "released" heard while it still
    # reads means a stale or early release freed P, maybe under these reads.
    ledger = _reading((1.0, 0.9, 5.0), (2.0, 1.9, 0.0))  # proven until 5.4, then "released"
    ledger.record(SplitCompleted, RID, 5.0, split=0)
    ledger.record(SplitCompleted, RID, 6.0, split=1)
    assert policy.read_verdict(ledger.state, D0, RID) is Verdict.UNSAFE


def test_once_p_let_go_only_what_it_held_when_it_read_a_heartbeat_stays_proven():
    # The lease bound assumes nothing but D's own post-drain release ends the
    # lease early; a "released" or "gone" answer says something else did.
    ledger = _reading((1.0, 0.9, 5.0), (2.0, 1.9, 5.0))  # held at 1.9, lease proven to 6.4
    ledger.record(SplitCompleted, RID, 1.5, split=0)
    _ack(ledger, 3.1, 3.0, 0.0)
    ledger.record(SplitCompleted, RID, 2.5, split=1)
    assert policy.read_verdict(ledger.state, D0, RID) is Verdict.UNSAFE
    assert ledger.state.record(D0, RID).safe_until == {0: 1.9}
    _ack(ledger, 3.3, 3.2, 4.0)  # any answer after P let go proves only its sent_at
    assert ledger.state.record(D0, RID).safe_until == {0: 3.2}
    assert policy.read_verdict(ledger.state, D0, RID) is Verdict.CONFIRMED


def test_failed_split_still_waits_for_the_others_to_drain():
    ledger = _reading((1.0, 0.9, 5.0))
    ledger.record(SplitFailed, RID, 1.5, split=0, reason="remote disconnect")
    assert policy.read_verdict(ledger.state, D0, RID) is Verdict.FAILED
    assert policy.reads_to_report(ledger.state, D0) == []  # split 1 still owns the pages
    assert policy.heartbeat_due(ledger.state, D0) == {"prefill-0": [RID]}
    ledger.record(SplitCompleted, RID, 2.0, split=1)
    assert policy.reads_to_report(ledger.state, D0) == [RID]


def test_read_verdict_of_a_request_without_reads_is_a_key_error():
    with pytest.raises(KeyError, match="no reads in progress"):
        policy.read_verdict(ledger_in(DState.ADMITTED).state, D0, RID)


def test_lease_time_left_tells_a_stray_asker_gone_not_released():
    ledger = ledger_in(PState.RELEASED)  # released on decode-0's notifications
    assert policy.lease_time_left(ledger.state, P0, RID, 4.0, engine="decode-0") == 0.0
    assert policy.lease_time_left(ledger.state, P0, RID, 4.0, engine="decode-9") == -1.0


def test_lease_time_left_checks_the_token_when_p_minted_one():
    from kvhandoff.core.events import Exported
    from kvhandoff.core.ledger import Ledger
    from kvhandoff.core.lifecycle import LifecycleState

    ledger = Ledger(P0, LifecycleState())
    ledger.record(Exported, RID, 0.0, lease_s=5.0, consumer_ranks=(0,), token="secret")
    assert policy.lease_time_left(ledger.state, P0, RID, 1.0, token="secret") == 4.0
    assert policy.lease_time_left(ledger.state, P0, RID, 1.0, token="wrong") == -1.0


def test_forged_or_garbled_acks_grant_nothing():
    ledger = ledger_in(DState.READING)  # last heartbeat: admission, t=0.001; lease 10
    ledger.record(LeaseAcknowledged, RID, 1.0, p_rank=0, sent_at=1e12, time_left=5.0)
    assert ledger.state.record(D0, RID).safe_until == {}  # echoes no heartbeat D sent
    assert ledger.state.streams[D0].ignored["implausible_ack"] == 1
    _ack(ledger, 2.0, 1.5, 1e9)  # more than a lease: capped
    assert ledger.state.record(D0, RID).safe_until == {0: 1.5 + 10.0 - 0.5}


def test_heartbeat_period_is_d_s_interval_or_a_sixth_of_the_shortest_lease_it_covers():
    assert policy.heartbeat_period(5.0, [30.0, 60.0]) == 5.0  # D's own setting bounds it
    assert policy.heartbeat_period(5.0, [30.0, 4.0, 12.0]) == pytest.approx(4.0 / 6)
    assert policy.heartbeat_period(5.0, []) == 5.0  # nothing due: D's own


def test_read_deadline_runs_from_the_posting_and_is_cut_to_a_lease_without_word_from_p():
    ledger = ledger_in(DState.READING)  # lease 10 s, two splits from P rank 0
    rec = ledger.state.record(D0, RID)
    posted = rec.posted_at
    assert policy.read_deadline(rec, 30.0) == posted + 10.0  # P silent: one lease
    assert policy.read_deadline(rec, 5.0) == posted + 5.0  # D's own timeout first
    ledger.record(HeartbeatSent, RID, 8.0)
    ledger.record(LeaseAcknowledged, RID, 8.1, p_rank=0, sent_at=8.0, time_left=10.0)
    assert policy.read_deadline(rec, 30.0) == 18.0  # P vouched at 8: a READ may run on
    ledger.record(SplitCompleted, RID, 9.0, split=0)
    assert policy.read_deadline(rec, 30.0) == 18.0


def test_read_deadline_follows_the_stalest_p_rank_still_read():
    from kvhandoff.core.events import Admitted, ReadsPosted, Validated
    from kvhandoff.core.ledger import Ledger

    ledger = Ledger(D0)
    ledger.record(Admitted, RID, 0.0, remote_engine="prefill-0", remote_ranks=(0, 1),
                  num_blocks=2, lease_s=10.0, lease_margin_s=0.5)
    ledger.record(Validated, RID, 0.0)
    ledger.record(ReadsPosted, RID, 1.0, split_ranks=(0, 1))
    ledger.record(HeartbeatSent, RID, 6.0)
    ledger.record(LeaseAcknowledged, RID, 6.1, p_rank=0, sent_at=6.0, time_left=10.0)
    rec = ledger.state.record(D0, RID)
    assert policy.read_deadline(rec, 30.0) == 11.0  # rank 1 never answered
    ledger.record(SplitCompleted, RID, 7.0, split=1)
    assert policy.read_deadline(rec, 30.0) == 11.0  # rank 1 drained, but unproven
    ledger.record(SplitCompleted, RID, 7.5, split=0)
    assert policy.read_deadline(rec, 30.0) == 11.0  # drained: every rank counts


def _finished(state):
    if state is PState.FREED:  # a lease that ran out, then freed (a released one: below)
        ledger = ledger_in(PState.EXPIRED)
        ledger.record(Freed, RID, 100.001)
        return ledger
    return ledger_in(state)


@pytest.mark.parametrize("state", [PState.FREED, DState.DONE])
def test_finished_records_are_forgotten_two_leases_after_they_ended(state):
    ledger = _finished(state)  # the request's lease: 10 s
    stream = P0 if isinstance(state, PState) else D0
    ended = ledger.state.record(stream, RID).t_end
    assert policy.to_forget(ledger.state, stream, ended + 20.0, 3.0) == []
    assert policy.to_forget(ledger.state, stream, ended + 20.01, 3.0) == [RID]
    assert policy.to_forget(ledger.state, stream, ended + 20.01, 30.0) == []  # own lease longer
    assert policy.to_forget(ledger.state, stream, ended + 60.01, 30.0) == [RID]


@pytest.mark.parametrize("state", [s for s in (*PState, *DState)
                                   if s not in (PState.NEW, DState.NEW, PState.FREED, DState.DONE)])
def test_unfinished_records_are_never_forgotten(state):
    ledger = ledger_in(state)
    stream = P0 if isinstance(state, PState) else D0
    assert policy.to_forget(ledger.state, stream, 1e9, 1.0) == []


def test_p_forgets_a_request_its_consumer_released_as_soon_as_it_is_freed():
    ledger = ledger_in(PState.FREED)  # every consumer rank released, then freed
    rec = ledger.state.record(P0, RID)
    assert policy.forgotten_when_freed(rec)
    assert policy.to_forget(ledger.state, P0, rec.t_end, 30.0) == [RID]
    released = ledger_in(PState.RELEASED)  # not freed yet: the blocks are still P's
    assert not policy.forgotten_when_freed(released.state.record(P0, RID))
    assert policy.to_forget(released.state, P0, 1e9, 1.0) == []
    expired = _finished(PState.FREED)
    assert not policy.forgotten_when_freed(expired.state.record(P0, RID))
