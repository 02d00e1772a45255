"""P's engine as a specification: inputs in, effects out, no I/O and no clock.

`core.producer.ProducerEngine` is what the vLLM connector's P worker and the
simulator's P both drive; these tests feed it directly (time is an argument)
and check what it returns and what its event log says against the rules of
docs/lifecycle.md, not against its own code.
"""

from __future__ import annotations

import pytest

from kvhandoff.core.events import Side, Stream
from kvhandoff.core.fence import CLEARED, FenceSlots, fence_value
from kvhandoff.core.lifecycle import PState, fold
from kvhandoff.core.messages import Heartbeat, HeartbeatAck, Release
from kvhandoff.core.producer import ProducerEngine
from kvhandoff.core.replay import replay, state_hash

P0 = Stream("prefill-0", Side.P, 0)
LEASE = 10.0
D_AGENT = "decode-0-agent"


@pytest.fixture
def engine():
    log: list = []
    e = ProducerEngine(P0, LEASE, sink=log.append)
    e.log = log  # what the engine wrote, for the replay checks
    return e


def _exported(e: ProducerEngine, rid: str = "r1", t: float = 0.0, ranks=(0,), token="tok"):
    e.prefill_started(rid, t)
    assert e.exported(rid, t, 4, ranks, token)


def _hb(rids, sent_at=0.0, tokens=None) -> Heartbeat:
    return Heartbeat("decode-0", 0, sent_at, tuple(rids), tuple(tokens or ("tok",) * len(rids)))


def _state(e: ProducerEngine, rid: str) -> PState | None:
    rec = e.state.record(P0, rid)
    return rec.state if rec is not None else None


def test_a_heartbeat_is_answered_with_the_time_left_and_extends_the_lease(engine):
    _exported(engine)
    step = engine.on_notification(D_AGENT, _hb(["r1"], sent_at=3.9), 4.0)
    (peer, ack), = step.acks
    assert peer == D_AGENT and isinstance(ack, HeartbeatAck)
    assert ack.sent_at == 3.9 and ack.time_left == {"r1": LEASE}  # now 4 + 10, asked at 4
    assert engine.state.record(P0, "r1").deadline == 4.0 + LEASE
    assert engine.poll(4.0 + LEASE - 0.001).freed == []  # alive until the new deadline


def test_every_consumer_rank_s_release_frees_exactly_once(engine):
    _exported(engine, ranks=(0, 1))
    engine.on_notification(D_AGENT, Release("r1", "decode-0", 0, "tok"), 1.0)
    assert engine.poll(1.0).freed == []  # rank 1 still reads
    engine.on_notification(D_AGENT, Release("r1", "decode-0", 1, "tok"), 2.0)
    assert engine.poll(2.0).freed == ["r1"]
    assert engine.poll(3.0).freed == []  # once
    assert engine.counts["frees"] == 1 and engine.counts["leases_released"] == 1


def test_a_release_without_the_token_or_from_another_peer_frees_nothing(engine):
    _exported(engine)
    engine.on_notification(D_AGENT, _hb(["r1"]), 0.5)  # binds the request to D_AGENT
    engine.on_notification(D_AGENT, Release("r1", "decode-0", 0, "guess"), 1.0)
    engine.on_notification("stranger", Release("r1", "decode-0", 0, "tok"), 1.0)
    assert engine.poll(1.0).freed == [] and _state(engine, "r1") is PState.EXPORTED
    (_, ack), = engine.on_notification("stranger", _hb(["r1"]), 1.5).acks
    assert ack.time_left == {"r1": -1.0}  # a stranger is told "gone", never "alive"


def test_an_unheard_lease_expires_at_its_deadline_and_is_freed_once(engine):
    _exported(engine, t=1.0)
    assert engine.poll(1.0 + LEASE - 0.001).freed == []
    step = engine.poll(1.0 + LEASE)
    assert step.freed == ["r1"] and step.expired == ["r1"]
    (_, ack), = engine.on_notification(D_AGENT, _hb(["r1"]), 12.0).acks
    assert ack.time_left == {"r1": -1.0}  # gone, and no heartbeat revives it


def test_a_heartbeat_that_overtakes_its_export_is_answered_once_exported(engine):
    engine.prefill_started("r1", 0.0)
    assert engine.on_notification(D_AGENT, _hb(["r1"], sent_at=0.1), 0.2).acks == []
    engine.exported("r1", 0.3, 4, (0,), "tok")
    (_, ack), = engine.poll(0.4).acks
    assert ack.sent_at == 0.1 and ack.time_left["r1"] > 0


def test_a_release_that_overtakes_its_export_frees_once_exported(engine):
    """Found by the simulator (scenario ``release_overtakes_export``)."""
    engine.prefill_started("r1", 0.0)
    engine.on_notification(D_AGENT, Release("r1", "decode-0", 0, "tok"), 0.2)
    assert engine.poll(0.25).freed == []  # nothing exported: the host engine holds the blocks
    engine.exported("r1", 0.3, 4, (0,), "tok")
    assert engine.poll(0.4).freed == ["r1"] and engine.poll(0.5).freed == []  # once
    assert engine.counts["leases_released"] == 1 and engine.counts["leases_expired"] == 0
    assert replay(engine.log).violations == []


def test_a_heartbeat_repeated_while_p_prefills_is_held_once_and_answered_once(engine):
    """A D repeating itself (every quarter interval, say) for an id P still prefills costs
    P one held message, not one per repeat; the answer echoes the latest one sent."""
    engine.prefill_started("r1", 0.0)
    for i in range(1000):
        assert engine.on_notification(D_AGENT, _hb(["r1"], sent_at=0.1 + i * 1e-3),
                                      0.2 + i * 1e-3).acks == []
        assert engine.poll(0.2 + i * 1e-3).acks == []
    assert len(engine._deferred) == 1
    engine.exported("r1", 2.0, 4, (0,), "tok")
    (_, ack), = engine.poll(2.1).acks
    assert ack.sent_at == pytest.approx(0.1 + 999e-3) and ack.time_left["r1"] > 0
    assert engine.poll(2.2).acks == []


def test_a_heartbeat_is_answered_now_for_what_is_exported_and_later_for_what_prefills(engine):
    """Each id with its own token, by position: the exported one extends its lease now, the
    prefilling one is held with its token and answered once exported."""
    _exported(engine, "r2", token="tok2")
    engine.prefill_started("r1", 0.0)
    step = engine.on_notification(D_AGENT, _hb(["r1", "r2"], 0.5, ["tok1", "tok2"]), 0.6)
    (_, ack), = step.acks
    assert ack.time_left == {"r2": LEASE}
    engine.exported("r1", 0.7, 4, (0,), "tok1")
    (_, ack), = engine.poll(0.8).acks
    assert ack.time_left == {"r1": LEASE} and engine.state.record(P0, "r1").deadline == 0.8 + LEASE


def test_a_repeated_heartbeat_held_back_is_let_go_a_lease_after_its_first_copy(engine):
    engine.prefill_started("r1", 0.0)
    engine.on_notification(D_AGENT, _hb(["r1"], sent_at=0.1), 0.2)
    engine.on_notification(D_AGENT, _hb(["r1"], sent_at=LEASE - 1), LEASE - 0.5)
    (_, ack), = engine.poll(0.2 + LEASE).acks  # the first copy's bound, not the last's
    assert ack.sent_at == LEASE - 1 and ack.time_left == {"r1": -1.0}


def test_releases_held_back_are_kept_apart_by_what_they_say(engine):
    """Repeats of one release are held once; a release with another token (a guess) is a
    different message and cannot displace the real one."""
    engine.prefill_started("r1", 0.0)
    for t in (0.1, 0.2, 0.3):
        engine.on_notification(D_AGENT, Release("r1", "decode-0", 0, "tok"), t)
    engine.on_notification(D_AGENT, Release("r1", "decode-0", 0, "guess"), 0.35)
    engine.on_notification(D_AGENT, Release("r1", "decode-0", 0, "tok"), 0.4)
    assert len(engine._deferred) == 2
    engine.exported("r1", 0.5, 4, (0,), "tok")
    assert engine.poll(0.6).freed == ["r1"] and engine.counts["leases_released"] == 1
    assert replay(engine.log).violations == []


def test_a_release_for_a_prefill_that_never_ends_is_let_go_after_a_lease(engine):
    engine.prefill_started("r1", 0.0)
    engine.on_notification(D_AGENT, Release("r1", "decode-0", 0, "tok"), 0.2)
    engine.poll(0.2 + LEASE)  # held for a lease, then heard (the fold ignores it: no export)
    assert not engine._deferred and _state(engine, "r1") is PState.PREFILLING
    engine.aborted("r1", 0.2 + LEASE + 1, "client")
    assert _state(engine, "r1") is PState.FREED and engine.poll(0.2 + LEASE + 2).freed == []


def test_a_heartbeat_for_a_prefill_that_never_ends_is_answered_gone_after_a_lease(engine):
    engine.prefill_started("r1", 0.0)
    engine.on_notification(D_AGENT, _hb(["r1"]), 0.2)
    assert engine.poll(0.2 + LEASE - 0.01).acks == []
    (_, ack), = engine.poll(0.2 + LEASE).acks
    assert ack.time_left == {"r1": -1.0}


def test_an_abort_before_export_is_freed_by_the_host_engine_not_reported(engine):
    engine.prefill_started("r1", 0.0)
    engine.aborted("r1", 1.0, "client")
    assert _state(engine, "r1") is PState.FREED
    assert engine.poll(2.0).freed == []  # vLLM freed those blocks itself


def test_an_event_the_fold_refuses_is_counted_never_raised(engine):
    _exported(engine)
    assert not engine.exported("r1", 1.0, 4, (0,), "tok")  # a second export
    assert engine.counts["refused_events"] == 1 and _state(engine, "r1") is PState.EXPORTED


def test_an_expired_request_is_forgotten_two_leases_later_and_the_log_says_so(engine):
    _exported(engine)
    assert engine.poll(LEASE).expired == ["r1"]
    engine.forget(LEASE + 2 * LEASE)
    assert _state(engine, "r1") is PState.FREED  # still answers precisely
    (_, ack), = engine.on_notification(D_AGENT, _hb(["r1"]), LEASE + 1.0).acks
    assert ack.time_left == {"r1": -1.0} and engine.counts["heartbeats_late"] == 1
    engine.forget(LEASE + 2 * LEASE + 0.01)
    assert _state(engine, "r1") is None
    assert [e.kind for e in engine.log][-1] == "forgotten"
    assert state_hash(fold(engine.log)) == state_hash(engine.state)
    assert replay(engine.log).violations == []


def test_a_released_request_is_forgotten_as_it_is_freed_and_a_crossing_heartbeat_hears_gone(
        engine):
    _exported(engine)
    engine.on_notification(D_AGENT, Release("r1", "decode-0", 0, "tok"), 1.0)
    assert engine.poll(1.0).freed == ["r1"]
    assert _state(engine, "r1") is None
    assert [e.kind for e in engine.log][-2:] == ["freed", "forgotten"]
    (_, ack), = engine.on_notification(D_AGENT, _hb(["r1"], sent_at=0.9), 1.1).acks
    assert ack.time_left == {"r1": -1.0}  # "gone": D treats it as "released" (P let go)
    engine.on_notification(D_AGENT, Release("r1", "decode-0", 0, "tok"), 1.2)  # repeated
    assert engine.poll(1.3).freed == [] and engine.counts["frees"] == 1
    assert engine.counts["refused_events"] == 0
    assert state_hash(fold(engine.log)) == state_hash(engine.state)
    assert replay(engine.log).violations == []


def test_deadlines_for_the_driver_s_timer(engine):
    assert engine.next_deadline() == float("inf") and not engine.live()
    _exported(engine, "a", t=0.0)
    _exported(engine, "b", t=2.0)
    assert engine.next_deadline() == LEASE and engine.live()


def test_poll_frees_exactly_what_the_fold_says_whatever_the_order_of_inputs():
    """The engine's hints (when to scan, what a release just ended) never hide a free."""
    from kvhandoff.core import policy

    e = ProducerEngine(P0, LEASE)
    for i in range(30):
        _exported(e, f"r{i}", t=i * 0.5, ranks=(0, 1))
    t = 0.0
    for i in range(30):
        t = i * 0.7
        if i % 3 == 0:  # both ranks release
            for rank in (0, 1):
                e.on_notification(D_AGENT, Release(f"r{i}", "decode-0", rank, "tok"), t)
        elif i % 3 == 1:  # one rank's release, then silence: the lease runs out
            e.on_notification(D_AGENT, Release(f"r{i}", "decode-0", 0, "tok"), t)
        freed = e.poll(t).freed
        assert policy.to_free(e.state, P0) == [] and policy.expired_leases(e.state, P0, t) == []
        assert len(freed) == len(set(freed))
    e.poll(t + 2 * LEASE)
    assert e.counts["frees"] == 30 and policy.to_free(e.state, P0) == []


def test_an_idle_poll_does_not_scan_the_fold_until_a_lease_may_have_run_out(monkeypatch):
    from kvhandoff.core import producer

    scans: list[float] = []
    real = producer.expired_leases
    monkeypatch.setattr(producer, "expired_leases",
                        lambda state, stream, t: scans.append(t) or real(state, stream, t))
    e = ProducerEngine(P0, LEASE)
    _exported(e, "a", t=0.0)
    _exported(e, "b", t=1.0)
    assert e.due_at == LEASE
    for k in range(100):
        e.poll(k * 0.09)  # a hot P's engine steps, nothing due
    assert scans == []
    e.on_notification(D_AGENT, _hb(["a"]), 5.0)  # a's lease now runs to 15
    assert e.poll(LEASE).freed == [] and scans == [LEASE]  # looked once: nothing expired
    assert e.due_at == 1.0 + LEASE  # b's is next
    assert e.poll(1.0 + LEASE).freed == ["b"]


# --- the fence (docs/lifecycle.md, "The fence") ---------------------------------------


def test_an_export_writes_its_fence_value_and_the_free_clears_it_first(engine):
    engine.prefill_started("r1", 0.0)
    assert engine.exported("r1", 0.0, 4, (0,), "tok", fence_slot=5)
    assert engine.poll(0.1).fences == [(5, fence_value("r1", "tok"))]
    engine.on_notification(D_AGENT, Release("r1", "decode-0", 0, "tok"), 1.0)
    step = engine.poll(1.0)
    assert step.fences == [(5, CLEARED)] and step.freed == ["r1"]
    exported = [e for e in engine.log if e.kind == "exported"]
    assert exported[0].fence_slot == 5  # the log says which slot the export holds


def test_a_slot_handed_out_twice_is_left_to_the_later_export_when_the_first_is_freed(engine):
    """A driver bug (or a restarted scheduler) gives one slot to two live exports: the first
    free must not clear the second's value, and nothing vouches for the first after it."""
    for rid, token in (("r1", "a"), ("r2", "b")):
        engine.prefill_started(rid, 0.0)
        assert engine.exported(rid, 0.0, 4, (0,), token, fence_slot=0)
    (s1, v1), (s2, v2) = engine.poll(0.1).fences
    assert s1 == s2 == 0 and v1 != v2  # the slot holds r2's value now
    engine.on_notification(D_AGENT, Release("r1", "decode-0", 0, "a"), 1.0)
    step = engine.poll(1.0)
    assert step.freed == ["r1"] and step.fences == []  # r1's value is gone already
    step = engine.poll(LEASE + 1.0)  # r2's lease runs out
    assert step.freed == ["r2"] and step.fences == [(0, CLEARED)]


def test_without_a_slot_or_a_token_there_is_no_fence(engine):
    _exported(engine, "r1")
    engine.prefill_started("r2", 0.0)
    assert engine.exported("r2", 0.0, 4, (0,), "", fence_slot=3)
    assert engine.poll(0.1).fences == []


def test_fence_slots_are_handed_out_once_each_until_given_back():
    slots = FenceSlots(2)
    a, b = slots.take(), slots.take()
    assert {a, b} == {0, 1} and slots.take() is None and slots.free == 0
    slots.give_back(a)
    assert slots.take() == a


def test_an_export_refused_after_the_id_s_earlier_life_was_freed_is_freed_at_once(engine):
    """vLLM keeps a delay-freed request's blocks until P names it: an export the fold
    refuses (the id's expired life is still remembered) is named at once, not pinned for
    ever, and no heartbeat can vouch for it."""
    _exported(engine)
    assert engine.poll(LEASE).freed == ["r1"]  # expired, freed, remembered two leases
    assert not engine.exported("r1", LEASE + 1.0, 4, (0,), "tok-2", fence_slot=3)
    step = engine.poll(LEASE + 1.0)
    assert step.freed == ["r1"] and step.fences == []
    assert engine.poll(LEASE + 2.0).freed == []  # once
    (_, ack), = engine.on_notification(D_AGENT, _hb(["r1"]), LEASE + 2.0).acks
    assert ack.time_left == {"r1": -1.0}
    assert engine.counts["exports_refused_freed"] == 1


def test_an_export_refused_while_the_id_is_live_is_not_freed_twice(engine):
    _exported(engine)
    assert not engine.exported("r1", 1.0, 4, (0,), "tok")
    assert engine.poll(1.0).freed == []
    assert engine.poll(LEASE).freed == ["r1"]  # the live lease's own end, reported once


@pytest.mark.parametrize("prefilled", [True, False], ids=["prefilling", "unknown"])
def test_an_export_refused_before_any_lease_is_named_freed_once_and_its_record_ends(
        engine, prefilled):
    """An export the fold refuses (no consumer rank here) while the id has no lease, the
    request still prefilling or never seen: nothing else will name these blocks, so the
    engine names them at its next poll, once, ends the record, and vouches for nothing."""
    if prefilled:
        engine.prefill_started("r1", 0.0)
    assert not engine.exported("r1", 1.0, 4, (), "tok", fence_slot=3)
    step = engine.poll(1.0)
    assert step.freed == ["r1"] and step.fences == []
    assert engine.poll(2.0).freed == [] and engine.poll(LEASE * 5).freed == []  # once
    assert not engine.live()
    assert _state(engine, "r1") is (PState.FREED if prefilled else None)
    (_, ack), = engine.on_notification(D_AGENT, _hb(["r1"]), 2.0).acks
    assert ack.time_left == {"r1": -1.0}
    assert replay(engine.log).violations == []
