"""D's engine as a specification: inputs in, effects out, no I/O and no clock.

`core.consumer.ConsumerEngine` is what the vLLM connector's D worker and the
simulator's D (one per rank) both drive; these tests feed it directly (time is
an argument) and check what it returns and what its event log says against
the rules of docs/lifecycle.md, not against its own code.
"""

from __future__ import annotations

import math

import pytest

from kvhandoff.core.consumer import ConsumerEngine, ParamsReused, RequestIdCollision
from kvhandoff.core.events import Side, Stream
from kvhandoff.core.fence import FENCE_READS, fence_of, fence_value
from kvhandoff.core.lifecycle import DState, Verdict
from kvhandoff.core.messages import MAX_IDS, HeartbeatAck, Release, decode, encode
from kvhandoff.core.policy import TimingConfig
from kvhandoff.core.replay import replay

D0 = Stream("decode-0", Side.D, 0)
P_AGENT = "prefill-0-agent-r0"
TIMING = TimingConfig(lease_s=12.0, heartbeat_interval_s=2.0, lease_margin_s=0.5,
                      read_timeout_s=20.0)


@pytest.fixture
def engine():
    log: list = []
    e = ConsumerEngine(D0, TIMING, sink=log.append)
    e.log = log
    return e


def _admit(e: ConsumerEngine, rid="r1", t=0.0, lease=12.0, token="tok", peer=P_AGENT):
    assert not e.check_unused(rid, "prefill-0")
    assert e.admit(rid, t, peer=peer, remote_engine="prefill-0", remote_ranks=(0,),
                   num_blocks=4, lease_s=lease, token=token, local_id=f"local-{rid}")


def _reading(e: ConsumerEngine, rid="r1", t=0.0, splits=1):
    _admit(e, rid, t)
    assert e.validated(rid, t)
    assert e.reads_posted(rid, t, (0,) * splits)


def _ack(t_sent: float, left: float, *rids: str, rank=0) -> HeartbeatAck:
    return HeartbeatAck("prefill-0", rank, t_sent, dict.fromkeys(rids or ("r1",), left))


def _beat(e: ConsumerEngine, now: float):
    """Poll and send every planned heartbeat; return the step."""
    step = e.poll(now)
    for peer, hb, urgent in step.heartbeats:
        e.heartbeat_sent(peer, hb, now, urgent)
    return step


def _state(e, rid="r1"):
    rec = e.state.record(D0, rid)
    return rec.state if rec is not None else None


def test_a_new_request_is_heartbeated_at_once_with_its_token(engine):
    _admit(engine)
    (peer, hb, _), = _beat(engine, 0.1).heartbeats
    assert peer == P_AGENT and hb.request_ids == ("r1",) and hb.tokens == ("tok",)
    assert hb.engine == "decode-0" and hb.rank == 0 and hb.sent_at == 0.1
    assert _beat(engine, 0.2).heartbeats == []  # not again before the period
    assert [p for p, *_ in _beat(engine, 0.1 + 2.0).heartbeats] == [P_AGENT]


def test_the_period_is_a_sixth_of_p_s_lease_when_that_is_shorter(engine):
    _admit(engine, lease=3.0)  # P grants 3 s: every 0.5 s, not D's 2 s
    _beat(engine, 0.0)
    engine.on_notification(P_AGENT, _ack(0.0, 3.0), 0.01)  # P answers (else D asks again)
    assert _beat(engine, 0.49).heartbeats == []
    assert _beat(engine, 0.5).heartbeats


def test_one_heartbeat_per_p_rank_names_every_request_due_there(engine):
    _admit(engine, "a")
    _admit(engine, "b")
    _admit(engine, "c", peer="prefill-0-agent-r1")
    sent = {peer: hb.request_ids for peer, hb, _ in _beat(engine, 0.0).heartbeats}
    assert sent == {P_AGENT: ("a", "b"), "prefill-0-agent-r1": ("c",)}


def _named(step) -> dict:
    return {peer: hb.request_ids for peer, hb, _ in step.heartbeats}


def test_between_keep_alives_a_new_request_is_asked_for_alone(engine):
    """One keep-alive per period names every request due at a P rank; an admission between
    two asks P about the new request only, and does not move the keep-alive."""
    _admit(engine, "a")
    assert _named(_beat(engine, 0.0)) == {P_AGENT: ("a",)}  # keep-alive
    engine.on_notification(P_AGENT, _ack(0.0, 12.0, "a"), 0.01)
    _admit(engine, "b", t=0.5)
    assert _named(_beat(engine, 0.5)) == {P_AGENT: ("b",)}  # ask
    engine.on_notification(P_AGENT, _ack(0.5, 12.0, "b"), 0.51)
    assert _beat(engine, 1.9).heartbeats == []
    assert _named(_beat(engine, 2.0)) == {P_AGENT: ("a", "b")}  # the keep-alive, on time
    assert engine.counts["heartbeats_sent"] == 3


def test_an_ask_does_not_move_the_next_keep_alive(engine):
    _admit(engine, "a")
    _beat(engine, 0.0)
    engine.on_notification(P_AGENT, _ack(0.0, 12.0, "a"), 0.01)
    _admit(engine, "b", t=0.5)
    _beat(engine, 0.5)  # an ask
    assert engine.due_at == 2.0  # the keep-alive's period runs from 0.0, not from the ask


def test_only_the_keep_alive_a_poll_planned_restarts_the_period(engine):
    """A driver that sends an older poll's ask after a later poll planned the keep-alive
    (and that keep-alive's send failed) has not sent the keep-alive."""
    _admit(engine, "a")
    _beat(engine, 0.0)
    engine.on_notification(P_AGENT, _ack(0.0, 12.0, "a"), 0.01)
    _admit(engine, "b", t=1.9)
    (peer, ask, urgent), = engine.poll(1.9).heartbeats
    assert ask.request_ids == ("b",)
    (_, keep_alive, _), = engine.poll(2.0).heartbeats
    assert keep_alive.request_ids == ("a", "b")
    engine.heartbeat_sent(peer, ask, 2.0, urgent)  # the keep-alive is never sent
    assert _named(_beat(engine, 2.1)) == {P_AGENT: ("a", "b")}


def test_a_re_ask_names_only_the_requests_still_waiting_for_p(engine):
    _admit(engine, "a")  # keeps its lease with P, proven
    _reading(engine, "r1")
    _beat(engine, 0.0)
    engine.on_notification(P_AGENT, _ack(0.0, 12.0, "a"), 0.01)  # r1's answer is lost
    engine.split_done("r1", 0, 0.3)
    assert _named(_beat(engine, 0.3)) == {P_AGENT: ("r1",)}  # at once
    assert _beat(engine, 0.79).heartbeats == []
    assert _named(_beat(engine, 0.8)) == {P_AGENT: ("r1",)}  # a quarter period later


def test_a_request_p_has_not_vouched_for_within_a_period_rides_on_every_ask(engine):
    """Its keep-alive (or P's answer) was lost — no answer a quarter period after it
    should have come: the asks that get through carry it, so losing only keep-alives
    cannot starve its lease while other messages pass."""
    _admit(engine, "a")
    _beat(engine, 0.0)
    engine.on_notification(P_AGENT, _ack(0.0, 12.0, "a"), 0.01)
    _admit(engine, "b", t=1.0)
    _beat(engine, 1.0)
    engine.on_notification(P_AGENT, _ack(1.0, 12.0, "b"), 1.01)
    _beat(engine, 2.0)  # the keep-alive naming a and b: lost
    _admit(engine, "c", t=2.4)
    assert _named(_beat(engine, 2.4)) == {P_AGENT: ("c",)}  # its answer may still come
    _admit(engine, "d", t=2.5)
    assert _named(_beat(engine, 2.5)) == {P_AGENT: ("a", "d")}  # a: 2.5 s unvouched; b: 1.5 s


def test_confirmed_reads_are_reported_once_then_p_is_released_with_the_token(engine):
    _reading(engine)
    _beat(engine, 0.0)
    engine.on_notification(P_AGENT, _ack(0.0, 12.0), 0.01)
    assert engine.split_done("r1", 0, 0.5)
    step = engine.poll(0.5)
    (f,) = step.finished
    assert f.request_id == "r1" and f.ok and f.verdict is Verdict.CONFIRMED
    assert step.releases == [(P_AGENT, Release("r1", "decode-0", 0, "tok"))]
    assert _state(engine) is DState.DONE
    assert engine.poll(0.6).finished == []  # exactly once
    assert replay(engine.log).violations == []


def test_a_rank_with_no_split_of_its_own_completes_once_p_vouched_and_releases_p(engine):
    """Nothing to read on this rank (a local hit after all, or a shared host pool that is
    rank 0's): one empty split, drained at once; the request is reported and P released
    like any other, only once P's word covers it."""
    _admit(engine)
    assert engine.validated("r1", 0.0)
    _beat(engine, 0.0)
    assert engine.nothing_posted("r1", 0.0, 0)
    assert engine.poll(0.0).finished == []  # P has not vouched yet
    engine.on_notification(P_AGENT, _ack(0.0, 12.0), 0.01)
    step = engine.poll(0.02)
    (f,) = step.finished
    assert f.request_id == "r1" and f.ok
    assert step.releases == [(P_AGENT, Release("r1", "decode-0", 0, "tok"))]
    assert replay(engine.log).violations == []


def test_reads_that_drained_unproven_ask_p_at_once_then_every_quarter_period(engine):
    _reading(engine)
    _beat(engine, 0.0)  # its answer is lost
    engine.split_done("r1", 0, 0.3)
    step = _beat(engine, 0.3)
    assert step.finished == [] and [hb.request_ids for _, hb, u in step.heartbeats if u] == [
        ("r1",)]
    assert _beat(engine, 0.3 + 0.49).heartbeats == []
    assert _beat(engine, 0.3 + 0.5).heartbeats  # a quarter of the 2 s period
    engine.on_notification(P_AGENT, _ack(0.8, 11.0), 0.81)
    (f,) = engine.poll(0.82).finished
    assert f.ok


def test_a_cancel_with_reads_in_flight_keeps_heartbeating_until_they_drain(engine):
    _reading(engine)
    _beat(engine, 0.0)
    assert engine.cancel("r1", 1.0).releases == []  # the READ still owns P's blocks
    for t in (2.0, 4.0, 6.0):
        assert [hb.request_ids for _, hb, _ in _beat(engine, t).heartbeats] == [("r1",)]
    engine.split_done("r1", 0, 6.5)
    step = engine.poll(6.5)
    (f,) = step.finished  # a cancelled request's bytes go nowhere: no proof needed
    assert step.releases and _state(engine) is DState.DONE
    assert _beat(engine, 8.5).heartbeats == []


def test_a_cancel_before_any_read_releases_p_at_once(engine):
    _admit(engine)
    engine.validated("r1", 0.0)
    step = engine.cancel("r1", 0.5)
    assert step.releases == [(P_AGENT, Release("r1", "decode-0", 0, "tok"))]
    assert _state(engine) is DState.DONE


def test_a_read_past_its_deadline_is_failed_but_reported_only_once_it_drained(engine):
    _reading(engine)
    _beat(engine, 0.0)
    engine.on_notification(P_AGENT, _ack(0.0, 12.0), 0.01)
    # P answers alive every period: the deadline is read_timeout_s (20 s) after posting.
    for t in range(2, 20, 2):
        _beat(engine, float(t))
        engine.on_notification(P_AGENT, _ack(float(t), 12.0), t + 0.01)
    assert engine.poll(19.9).timed_out == []
    step = _beat(engine, 20.1)
    assert step.timed_out == ["r1"] and step.finished == []
    assert engine.in_flight("r1") == 1
    # Still heartbeated: the READ moves bytes into D's pages and reads P's blocks.
    assert [hb.request_ids for _, hb, _ in _beat(engine, 22.1).heartbeats] == [("r1",)]
    assert not engine.split_done("r1", 0, 25.0)  # drained now; already failed
    (f,) = engine.poll(25.0).finished
    assert not f.ok and f.verdict is Verdict.FAILED
    assert f.reason == "read timeout after 20.1s (read_timeout_s 20.0 after the post)", f.reason


def test_the_deadline_is_one_lease_after_p_last_vouched(engine):
    _reading(engine)
    _beat(engine, 0.0)
    engine.on_notification(P_AGENT, _ack(0.0, 12.0), 0.01)  # then P goes silent
    assert engine.poll(12.0).timed_out == []
    assert engine.poll(12.01).timed_out == ["r1"]


def test_reads_that_drained_unproven_fail_one_lease_after_the_post_naming_that_bound(engine):
    """P never answers: D reports the request failed at its read deadline, one lease (12 s)
    after the post, well before read_timeout_s (20 s); the reason names that bound (it said
    "within read_timeout_s" whichever bound applied)."""
    _reading(engine)
    engine.split_done("r1", 0, 0.3)
    for t in (0.3, 4.0, 8.0, 12.0):
        assert _beat(engine, t).finished == []
    (f,) = engine.poll(12.01).finished
    assert not f.ok and f.verdict is Verdict.PENDING, f
    assert f.reason == ("no answer from P proving it held the blocks 12.0s after the post "
                        "(lease_s 12.0 without word from P)"), f.reason


def test_a_read_p_never_answered_times_out_naming_the_lease(engine):
    _reading(engine)
    step = _beat(engine, 12.01)
    assert step.timed_out == ["r1"]
    engine.split_done("r1", 0, 12.5)
    (f,) = engine.poll(12.5).finished
    assert f.reason == "read timeout after 12.0s (lease_s 12.0 without word from P)", f.reason


def test_unproven_reads_reported_before_the_deadline_say_why(engine):
    """A cancel needs no proof, and `report_now` (vLLM 0.32's D) asks none: neither is a
    deadline that passed."""
    _reading(engine, "cancelled")
    _reading(engine, "now")
    for rid in ("cancelled", "now"):
        engine.split_done(rid, 0, 0.3)
    engine.cancel("cancelled", 0.3)
    finished = engine.poll(0.31).finished + engine.report_now("now", 0.32).finished
    reasons = {f.request_id: f.reason for f in finished}
    assert reasons == {"cancelled": "the client cancelled before P proved it held the blocks",
                       "now": "reported without P's word"}, reasons
    # only the cancel is abandoned (the connector logs it as such, not as a refused READ)
    assert {f.request_id: f.abandoned for f in finished} == {"cancelled": True, "now": False}


def test_a_cancelled_request_whose_read_failed_or_p_freed_is_not_merely_abandoned(engine):
    """The client's cancel excuses only the missing proof: a READ that failed, or P's word
    that it freed the blocks under the READ, is still reported as what it is."""
    _reading(engine, "failed")
    _reading(engine, "gone")
    engine.split_done("failed", 0, 0.3, ok=False)
    engine.on_notification(P_AGENT, _ack(0.0, 0.0, "gone"), 0.2)  # P: "gone"
    engine.split_done("gone", 0, 0.3)
    for rid in ("failed", "gone"):
        engine.cancel(rid, 0.3)
    finished = {f.request_id: f for f in engine.poll(0.31).finished}
    assert set(finished) == {"failed", "gone"}, finished
    assert finished["failed"].verdict is Verdict.FAILED
    assert finished["gone"].verdict is Verdict.UNSAFE
    assert not any(f.ok or f.abandoned for f in finished.values()), finished


def test_a_cancelled_request_the_driver_gave_up_is_not_merely_abandoned(engine):
    """The driver's give-up (an error of its own) is a failure whatever the client did."""
    _reading(engine)
    engine.split_done("r1", 0, 0.3)
    engine.cancel("r1", 0.3)  # (not polled: the give-up comes first)
    (f,) = engine.give_up("r1", 0.3, "boom").finished
    assert not f.ok and not f.abandoned and f.reason == "given up: boom", f


def test_an_answer_from_another_agent_proves_nothing(engine):
    _reading(engine)
    _beat(engine, 0.0)
    engine.on_notification("someone-else", _ack(0.0, 12.0), 0.01)
    engine.split_done("r1", 0, 0.5)
    assert engine.poll(0.5).finished == []  # still waits for P's own word
    assert engine.counts["notifications_ignored"] == 1


def test_a_released_or_gone_answer_after_the_read_fails_it(engine):
    _reading(engine)
    _beat(engine, 0.0)
    engine.split_done("r1", 0, 0.5)
    _beat(engine, 0.5)
    engine.on_notification(P_AGENT, _ack(0.5, -1.0), 0.6)  # P: gone
    (f,) = engine.poll(0.6).finished
    assert not f.ok and f.verdict is Verdict.UNSAFE


def test_parameters_are_single_use_and_a_collision_is_named(engine):
    _admit(engine)
    with pytest.raises(ParamsReused, match="single-use"):
        engine.check_unused("r1", "prefill-0")
    assert engine.check_unused("r1", "prefill-0", cleanup=True)  # a clean-up: nothing to do
    with pytest.raises(RequestIdCollision, match="prefill-9"):
        engine.check_unused("r1", "prefill-9")


def test_a_finished_request_is_forgotten_two_leases_after_it_ended(engine):
    _admit(engine)
    engine.validated("r1", 0.0)
    engine.cancel("r1", 1.0)
    assert engine.forget(1.0 + 2 * 12.0) == []
    assert engine.forget(1.0 + 2 * 12.0 + 0.1) == ["r1"]
    assert not engine.check_unused("r1", "prefill-0")  # a re-use is a new request now


def test_give_up_with_reads_in_flight_waits_for_them(engine):
    _reading(engine, splits=2)
    engine.split_done("r1", 0, 0.2)
    assert engine.give_up("r1", 0.3, "driver error").releases == []
    assert engine.poll(0.4).finished == []  # split 1 still moves bytes
    engine.split_done("r1", 1, 0.9)
    (f,) = engine.poll(0.9).finished
    assert not f.ok


def test_due_at_names_the_next_heartbeat_and_the_next_deadline(engine):
    assert engine.due_at == math.inf  # nothing to do
    _reading(engine)
    _beat(engine, 0.0)
    assert engine.due_at == 0.5  # a quarter period: ask again if P does not answer by then
    engine.on_notification(P_AGENT, _ack(0.0, 12.0), 0.0)
    engine.poll(0.0)
    assert engine.due_at == 2.0  # answered: the next period


def test_refused_events_are_counted_never_raised(engine):
    assert not engine.validated("nope", 0.0)
    assert engine.counts["refused_events"] == 1


# --- the fence (docs/lifecycle.md, "The fence") ---------------------------------------

SLOT = 7


def _fenced(e: ConsumerEngine, rid="r1", t=0.0, token="tok"):
    assert e.admit(rid, t, peer=P_AGENT, remote_engine="prefill-0", remote_ranks=(0,),
                   num_blocks=4, lease_s=12.0, token=token, local_id=f"local-{rid}",
                   fence_slot=SLOT, fence_slots=64)
    assert e.validated(rid, t)
    assert e.reads_posted(rid, t, (0, 0))


def test_with_a_fence_a_new_request_is_not_asked_about_it_waits_for_the_keep_alive(engine):
    _fenced(engine, "r1")
    assert [hb.request_ids for _, hb, _ in _beat(engine, 0.0).heartbeats] == [("r1",)]  # first
    engine.on_notification(P_AGENT, _ack(0.0, 10.0), 0.01)
    _fenced(engine, "r2", t=0.5)
    assert _beat(engine, 0.5).heartbeats == []  # no ask: the fence will prove its READs
    assert [hb.request_ids for _, hb, _ in _beat(engine, 2.0).heartbeats] == [("r1", "r2")]


def test_drained_reads_post_one_fence_read_and_the_request_s_value_proves_them(engine):
    _fenced(engine)
    _beat(engine, 0.0)
    engine.split_done("r1", 0, 0.2)
    assert engine.poll(0.25).fences == []  # a split still reads: no fence yet
    engine.split_done("r1", 1, 0.3)
    step = engine.poll(0.3)
    value = fence_value("r1", "tok")
    assert step.fences == [("r1", P_AGENT, 0, SLOT, 0.3)] and step.heartbeats == []
    assert engine.poll(0.31).fences == []  # posted once
    assert engine.fence_read("r1", value, 0.32, 0.3)
    (f,), = [_beat(engine, 0.32).finished]
    assert f.ok and f.verdict is Verdict.CONFIRMED
    (event,) = [e for e in engine.log if e.kind == "fence_held"]
    assert event.p_rank == 0 and event.posted_at == 0.3  # posted after both splits drained
    assert replay(engine.log).violations == []


@pytest.mark.parametrize("value", [None, 0, 12345], ids=["read failed", "cleared", "another"])
def test_a_fence_that_does_not_hold_the_request_s_value_proves_nothing_d_reads_it_again_and_asks_p(
        engine, value):
    _fenced(engine)
    _beat(engine, 0.0)
    engine.split_done("r1", 0, 0.2)
    engine.split_done("r1", 1, 0.3)
    assert engine.poll(0.3).fences
    assert not engine.fence_read("r1", value, 0.4, 0.3)
    assert not engine.fence_read("r1", fence_value("r1", "tok"), 0.41, 0.3)  # none in flight
    step = _beat(engine, 0.4)
    assert step.finished == [] and step.fences == [("r1", P_AGENT, 0, SLOT, 0.4)]  # again
    assert [hb.request_ids for _, hb, _ in step.heartbeats] == [("r1",)]  # and P is asked
    assert step.heartbeats[0][2]  # urgent: the bytes wait for P's word
    engine.on_notification(P_AGENT, _ack(0.4, 10.0), 0.5)
    (f,) = engine.poll(0.5).finished
    assert f.ok


def test_the_second_fence_read_proves_what_the_first_could_not(engine):
    """P's worker may write the slot a step after D got the parameters: a later read finds
    the value, posted after the first came back (and so after the READs drained)."""
    _fenced(engine)
    _beat(engine, 0.0)
    engine.split_done("r1", 0, 0.2)
    engine.split_done("r1", 1, 0.3)
    engine.poll(0.3)
    assert not engine.fence_read("r1", 0, 0.35, 0.3)
    assert _beat(engine, 0.36).fences
    assert engine.fence_read("r1", fence_value("r1", "tok"), 0.37, 0.36)
    (f,) = engine.poll(0.37).finished
    assert f.ok
    (event,) = [e for e in engine.log if e.kind == "fence_held"]
    assert event.posted_at == 0.36


def test_d_reads_a_fence_at_most_fence_reads_times(engine):
    _fenced(engine)
    engine.split_done("r1", 0, 0.2)
    engine.split_done("r1", 1, 0.3)
    reads = 0
    for i in range(10):
        now = 0.3 + i * 0.01
        for rid, *_, planned in engine.poll(now).fences:
            reads += 1
            engine.fence_read(rid, 0, now, planned)
    assert reads == FENCE_READS


def test_no_fence_without_a_slot_p_has_or_without_a_token(engine):
    assert fence_of("r1", "", SLOT) is None and fence_of("r1", "tok", None) is None
    for rid, token, slot in (("r1", "", SLOT), ("r2", "tok", None), ("r4", "tok", 64)):
        assert engine.admit(rid, 0.0, peer=P_AGENT, remote_engine="prefill-0",
                            remote_ranks=(0,), num_blocks=4, lease_s=12.0, token=token,
                            fence_slot=slot, fence_slots=64)  # r4: a slot P does not have
    (_, hb, _), = _beat(engine, 0.0).heartbeats
    assert hb.request_ids == ("r1", "r2", "r4")
    engine.on_notification(P_AGENT, _ack(0.0, 10.0, "r1", "r2", "r4"), 0.01)
    _admit(engine, "r3", 0.5)
    assert [hb.request_ids for _, hb, _ in _beat(engine, 0.5).heartbeats] == [("r3",)]  # asked


def test_a_fence_read_that_lands_after_the_request_gave_up_is_ignored(engine):
    _fenced(engine)
    _beat(engine, 0.0)
    engine.split_done("r1", 0, 0.2)
    engine.split_done("r1", 1, 0.3)
    assert engine.poll(0.3).fences
    (f,) = engine.poll(30.0).finished  # past read_timeout_s: reported failed, unproven
    assert not f.ok
    assert not engine.fence_read("r1", fence_value("r1", "tok"), 30.1, 0.3)
    assert engine.counts["refused_events"] == 0


def test_a_keep_alive_p_does_not_answer_is_followed_by_an_ask_every_quarter_period(engine):
    """With the fence D asks nothing at admission, so a lost keep-alive (or its lost answer)
    must not leave the lease to the next keep-alive alone: D asks again a quarter period
    later, and every quarter period, until P answers."""
    _fenced(engine)
    assert [hb.request_ids for _, hb, _ in _beat(engine, 0.0).heartbeats] == [("r1",)]
    assert _beat(engine, 0.49).heartbeats == []
    assert engine.due_at == 0.5
    (peer, hb, urgent), = _beat(engine, 0.5).heartbeats  # no answer: ask
    assert hb.request_ids == ("r1",) and not urgent
    assert _beat(engine, 0.99).heartbeats == []
    (_, hb, _), = _beat(engine, 1.0).heartbeats  # still none: again
    engine.on_notification(P_AGENT, _ack(1.0, 10.0), 1.1)
    assert _beat(engine, 1.5).heartbeats == [] and engine.due_at == 2.0  # answered
    assert [hb.request_ids for _, hb, _ in _beat(engine, 2.0).heartbeats] == [("r1",)]


def test_an_answer_from_another_agent_does_not_count_as_p_s(engine):
    _fenced(engine)
    _beat(engine, 0.0)
    engine.on_notification("impostor", _ack(0.0, 10.0), 0.1)
    assert [hb.request_ids for _, hb, _ in _beat(engine, 0.5).heartbeats] == [("r1",)]


def test_a_late_answer_to_an_earlier_fence_read_proves_nothing(engine):
    """A fence READ that lands after its request was reported, forgotten and admitted again
    (the same parameters) is another READ's answer: it must not vouch for the new READs."""
    _fenced(engine)
    engine.split_done("r1", 0, 0.2)
    engine.split_done("r1", 1, 0.3)
    (*_, first), = engine.poll(0.3).fences
    assert not engine.fence_read("r1", 0, 0.4, first)  # missed: read again
    (*_, second), = engine.poll(0.5).fences
    assert not engine.fence_read("r1", fence_value("r1", "tok"), 0.6, first)  # the first's
    assert engine.counts["fences_held"] == 0
    assert engine.fence_read("r1", fence_value("r1", "tok"), 0.7, second)


def test_an_unanswered_keep_alive_asks_nothing_about_requests_admitted_since(engine):
    _admit(engine, "r1")
    _beat(engine, 0.0)  # the keep-alive names r1; P never answers it
    engine.cancel("r1", 0.1)  # r1 leaves (released notify-only before any READ)
    _fenced(engine, "r2", t=0.2)
    assert _beat(engine, 0.5).heartbeats == []  # r2 came after the keep-alive: no empty ask


def test_a_heartbeat_the_driver_did_not_send_is_planned_again_at_the_next_poll(engine):
    """A poll that decided something is followed by a full one: what the driver could not
    carry out (a send that failed) is decided again, not forgotten until ``due_at``."""
    _reading(engine)
    _beat(engine, 0.0)
    engine.on_notification(P_AGENT, _ack(0.0, 0.3), 0.0)  # answered; proves nothing past 0.3
    engine.split_done("r1", 0, 0.5)  # drained, unproven: ask P at once
    for t in (0.6, 0.7):
        assert [(hb.request_ids, urgent) for _, hb, urgent in engine.poll(t).heartbeats] == [
            (("r1",), True)]


def test_a_poll_with_nothing_new_before_due_at_decides_nothing_and_changes_nothing(engine):
    """Between inputs, polling earlier than ``due_at`` is free: no effect, no event, and
    the next input is heard (an acknowledgement moves the request on at once)."""
    _reading(engine)
    engine.split_done("r1", 0, 0.2)
    step = _beat(engine, 0.3)  # drained, unproven: asks P at once
    assert step.heartbeats and not step.finished
    due, events = engine.due_at, len(engine.log)
    for t in (0.31, 0.4, due - 0.01):
        assert engine.poll(t) == engine.poll(t).__class__()
    assert len(engine.log) == events and engine.due_at == due
    engine.on_notification(P_AGENT, _ack(0.3, 11.0), 0.41)
    assert [f.request_id for f in engine.poll(0.42).finished] == ["r1"]


def test_a_heartbeat_sent_moves_only_the_record_s_last_heartbeat(engine):
    """The engine keeps what `poll` found per request until the request's next event, except
    a heartbeat sent, which the fold must keep from touching anything else (deadlines,
    proofs and state are computed from the other fields)."""
    import copy

    _reading(engine)
    engine.on_notification(P_AGENT, _ack(0.0, 12.0), 0.1)
    before = copy.deepcopy(engine.state.record(D0, "r1"))
    _beat(engine, 2.5)
    after = engine.state.record(D0, "r1")
    changed = {name for name in type(after).__slots__
               if getattr(after, name) != getattr(before, name)}
    assert changed == {"last_heartbeat"} and after.last_heartbeat == 2.5


def test_a_release_the_driver_could_not_send_is_planned_again_every_quarter_period(engine):
    """D sends a release once (one `ReleaseSent`); a send that failed is planned again a
    quarter heartbeat period later, then after each failure, until one goes: P frees on
    it, not a lease later.  Only the first failure asks the driver to log it; the
    retries log no event; ``due_at`` names the retry."""
    _admit(engine)
    engine.validated("r1", 0.0)
    (release,) = engine.cancel("r1", 1.0).releases
    assert engine.release_unsent(*release, 1.0) is True  # the first failure: logged
    events = len(engine.log)
    assert engine.due_at == 1.0 + TIMING.heartbeat_interval_s / 4
    assert engine.poll(1.4).releases == []
    step = engine.poll(1.5)
    assert step.releases == [release]
    assert engine.release_unsent(*release, 1.5) is False  # a retry that failed: quiet
    assert engine.poll(1.9).releases == [] and engine.poll(2.0).releases == [release]
    assert engine.poll(2.5).releases == []  # that one went: never again
    assert engine.due_at == math.inf
    assert len(engine.log) == events and [e.kind for e in engine.log].count("release_sent") == 1


def test_a_release_that_cannot_be_sent_is_given_up_a_lease_after_its_first_failure(engine):
    """P frees by lease then anyway; and a peer the driver dropped (``retry=False``) gets
    nothing more."""
    _admit(engine)
    _admit(engine, "r2")
    engine.validated("r1", 0.0)
    engine.validated("r2", 0.0)
    (r1,) = engine.cancel("r1", 0.0).releases
    (r2,) = engine.cancel("r2", 0.0).releases
    engine.release_unsent(*r1, 0.0)
    assert engine.release_unsent(*r2, 0.0, retry=False) is True
    sent = []
    t = 0.0
    while t < 2 * TIMING.lease_s:
        t += 0.1
        for peer, release in engine.poll(t).releases:
            sent.append(t)
            assert (peer, release) == r1
            engine.release_unsent(peer, release, t)
    quarter = TIMING.heartbeat_interval_s / 4
    gaps = [b - a for a, b in zip([0.0, *sent], sent, strict=False)]
    assert all(quarter - 1e-9 <= g <= quarter + 0.1 + 1e-9 for g in gaps), gaps  # per poll
    assert TIMING.lease_s - quarter - 0.1 <= max(sent) < TIMING.lease_s  # for a lease


def test_a_release_of_a_request_forgotten_or_admitted_again_is_never_retried(engine):
    """A driver that reports a failed send of a release this engine no longer acts for
    (the request forgotten and its id admitted again) gets nothing planned: the old
    release, with the old token, would reach P for the new request."""
    _admit(engine)
    engine.validated("r1", 0.0)
    (old,) = engine.cancel("r1", 0.0).releases
    assert engine.forget(3 * TIMING.lease_s) == ["r1"]
    _admit(engine, t=3 * TIMING.lease_s, token="tok-2")
    now = 3 * TIMING.lease_s + 0.1
    engine.release_unsent(*old, now)
    t = now
    while t < now + 2.0:
        t += 0.1
        assert engine.poll(t).releases == []
    assert _state(engine) is DState.ADMITTED  # the new request, untouched


def test_more_requests_due_at_one_p_rank_than_a_message_may_name_go_as_several(engine):
    """P refuses a heartbeat naming more than MAX_IDS requests: D sends them as several
    heartbeats in one poll, every request named once, each with its token."""
    rids = [f"r{i:05d}" for i in range(MAX_IDS + 5)]
    for rid in rids:
        assert engine.admit(rid, 0.0, peer=P_AGENT, remote_engine="prefill-0",
                            remote_ranks=(0,), num_blocks=1, lease_s=12.0, token=f"t-{rid}",
                            local_id=f"local-{rid}")
    beats = [hb for _, hb, _ in _beat(engine, 0.1).heartbeats]
    assert [len(hb.request_ids) for hb in beats] == [MAX_IDS, 5]
    assert [rid for hb in beats for rid in hb.request_ids] == rids
    assert all(hb.tokens == tuple(f"t-{rid}" for rid in hb.request_ids) for hb in beats)
    for hb in beats:  # each decodes at P, and P's answer to each at D
        assert decode(encode(hb)) == hb
        engine.on_notification(P_AGENT, decode(encode(HeartbeatAck(
            "prefill-0", 0, hb.sent_at, dict.fromkeys(hb.request_ids, 12.0)))), 0.2)
    assert engine.counts["notifications_ignored"] == 0
    assert _beat(engine, 0.3).heartbeats == []  # the keep-alive went, as one interval's


def test_give_up_after_every_read_drained_reports_the_request_at_once_not_served(engine):
    """The driver's error while the bytes wait only for P's word: reported failed now (no
    proof: nothing served) and P released, rather than waiting and logging it received
    while the driver tells vLLM it failed."""
    _reading(engine)
    engine.split_done("r1", 0, 0.2)
    _beat(engine, 0.2)
    step = engine.give_up("r1", 0.3, "driver error")
    (f,) = step.finished
    assert (f.request_id, f.ok, f.reason) == ("r1", False, "given up: driver error")
    assert _state(engine) is DState.DONE  # failed, and P released (notify-only)
    (peer, release), = step.releases
    assert peer == P_AGENT and release.token == "tok"
    engine.on_notification(P_AGENT, _ack(0.2, 11.0), 0.4)  # P's word, too late to matter
    assert engine.poll(0.5).finished == [] and engine.give_up("r1", 0.6, "again").finished == []
    assert replay(engine.log).violations == []


def _many_due(e: ConsumerEngine, n: int) -> list[str]:
    rids = [f"r{i:05d}" for i in range(n)]
    for rid in rids:
        assert e.admit(rid, 0.0, peer=P_AGENT, remote_engine="prefill-0", remote_ranks=(0,),
                       num_blocks=1, lease_s=12.0, token="tok", local_id=f"local-{rid}")
    return rids


def _answer(e: ConsumerEngine, hb, t: float) -> None:
    e.on_notification(P_AGENT, HeartbeatAck("prefill-0", 0, hb.sent_at,
                                            dict.fromkeys(hb.request_ids, 12.0)), t)


def _first_named(e: ConsumerEngine, rids: set[str], start: float, until: float) -> float:
    """When D next names one of ``rids`` (every heartbeat sent and left unanswered)."""
    t = start
    while t < until:
        for peer, hb, urgent in e.poll(t).heartbeats:
            e.heartbeat_sent(peer, hb, t, urgent)
            if rids & set(hb.request_ids):
                return t
        t = round(t + 0.05, 2)
    return math.inf


@pytest.mark.parametrize("lost", ["answer", "send"])
def test_a_lost_message_of_a_keep_alive_in_several_is_made_up_as_for_one(engine, lost):
    """Past MAX_IDS requests a keep-alive is several messages: P's answer to one of them
    lost is asked about a quarter period later, and one the driver could not send goes
    again at the next poll, as for a keep-alive of one message (period 2 s here)."""
    _many_due(engine, MAX_IDS + 5)
    for peer, hb, urgent in engine.poll(0.1).heartbeats:
        engine.heartbeat_sent(peer, hb, 0.1, urgent)
        _answer(engine, hb, 0.15)
    beats = engine.poll(2.1).heartbeats
    assert len(beats) == 2  # the keep-alive, as two messages
    for i, (peer, hb, urgent) in enumerate(beats):
        if lost == "send" and i == 0:
            continue  # the driver could not send it
        engine.heartbeat_sent(peer, hb, 2.1, urgent)
        if not (lost == "answer" and i == 1):
            _answer(engine, hb, 2.15)
    missing = set(beats[0 if lost == "send" else 1][1].request_ids)
    named = _first_named(engine, missing, 2.2, 4.0)
    assert named <= (2.2 if lost == "send" else 2.1 + 2.0 / 4 + 0.05)


@pytest.mark.parametrize("t0", [0.0, 1e6])  # 1e6: `time.monotonic()` after 11 days up
def test_a_read_completing_at_the_instant_p_s_lease_ended_is_not_proven(t0):
    """P's lease ends at its deadline: P expires and frees at ``t >= deadline``.  With no
    lease margin, D's bound from P's answer was that very deadline, and D confirmed a READ
    that completed at the instant P freed; so it did with a margin below the clock's float
    resolution (1e-12 s at t = 1e6).  The margin is at least 1 ms, and with the smallest
    one the READ waits for more proof."""
    from kvhandoff.core.policy import MIN_MARGIN_S, TimingError
    from kvhandoff.core.producer import ProducerEngine

    for margin in (0.0, 1e-12, MIN_MARGIN_S / 2):
        with pytest.raises(TimingError, match="lease_margin_s: expected >= 0.001"):
            TimingConfig(lease_s=10.0, heartbeat_interval_s=5.0, lease_margin_s=margin)
    p = ProducerEngine(Stream("prefill-0", Side.P, 0), lease_s=10.0)
    d = ConsumerEngine(D0, TimingConfig(lease_s=10.0, heartbeat_interval_s=5.0,
                                        lease_margin_s=MIN_MARGIN_S))
    p.exported("r1", t0, 4, (0,), token="tok")
    assert d.admit("r1", t0, peer=P_AGENT, remote_engine="prefill-0", remote_ranks=(0,),
                   num_blocks=4, lease_s=10.0, token="tok")
    assert d.validated("r1", t0) and d.reads_posted("r1", t0, (0,))
    peer, hb, urgent = _beat(d, t0 + 4.0).heartbeats[0]
    (_, ack), = p.on_notification("decode-0", decode(encode(hb)), t0 + 4.0).acks
    d.on_notification(P_AGENT, decode(encode(ack)), t0 + 4.0)  # P holds it 10 s more
    assert p.poll(t0 + 14.0).freed == ["r1"]  # no later heartbeat got through
    d.split_done("r1", 0, t0 + 14.0)
    assert not [f for f in d.poll(t0 + 14.0).finished if f.ok]
