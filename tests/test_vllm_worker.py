"""The connector's worker halves without vLLM: a P and a D worker over the real NIXL transport.

Both workers live in this process and are driven the way vLLM drives them
(``start_step`` with the scheduler's plan, then ``finish_step``), with
KV-cache-shaped tensors: host memory here, CUDA memory when
``KVH_WORKER_DEVICE=cuda`` (run on a GPU machine).  Seconds, not minutes:
this is where the hand-off's bytes and event logs are checked in detail.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
from conftest import wait_for
from structlog.testing import capture_logs

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

from hybrid_layouts import gemma_layout, one_group_layout  # noqa: E402

from kvhandoff.adapters.vllm.cluster import free_port  # noqa: E402
from kvhandoff.adapters.vllm.config import HandoffConfig  # noqa: E402
from kvhandoff.adapters.vllm.demo import analyse_logs  # noqa: E402
from kvhandoff.adapters.vllm.metadata import Admit, Export, Failure, Read, StepPlan  # noqa: E402
from kvhandoff.adapters.vllm.params import RemotePrefill  # noqa: E402
from kvhandoff.adapters.vllm.worker import HandoffWorker  # noqa: E402
from kvhandoff.core import messages  # noqa: E402
from kvhandoff.core.events import Admitted, Side  # noqa: E402
from kvhandoff.core.lifecycle import DState  # noqa: E402
from kvhandoff.core.log import read_log  # noqa: E402

DEVICE = os.environ.get("KVH_WORKER_DEVICE", "cpu")
BLOCK = 16
LAYERS, HEADS, HEAD = 4, 8, 128
NUM_BLOCKS = 64
COMPAT = {"model": "test", "dtype": "torch.float16", "block_size": BLOCK, "num_kv_heads": HEADS,
          "head_size": HEAD, "num_layers": LAYERS, "tp_size": 1}
LEASE = 3.0


NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LAYOUT = one_group_layout(NAMES, NUM_BLOCKS, BLOCK, HEADS * BLOCK * 2 * HEAD * 2)


def _caches(fill: bool) -> dict[str, object]:
    """Per-layer views of one allocation, block-major (vLLM's LBHNC), as vLLM allocates them."""
    gen = torch.Generator().manual_seed(1)
    shape = (LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    buf = (torch.randn(shape, generator=gen).half() if fill else torch.zeros(shape).half())
    buf = buf.to(DEVICE)
    return {name: buf[i] for i, name in enumerate(NAMES)}


class SkipClock:
    """``time.monotonic()`` plus what a test skipped: the workers' threads keep their real
    pace (heartbeats, READs, polls), and a lease that would take seconds runs out when the
    test skips time, not after a wall-clock wait.  Only the test's thread skips."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skipped

    def skip(self, seconds: float) -> None:
        self.skipped += seconds


@pytest.fixture
def workers(tmp_path):
    """P and D on one `SkipClock` (``p.clock is d.clock``)."""
    port = free_port()
    extra = {"lease_s": LEASE, "heartbeat_interval_s": 0.3, "lease_margin_s": 0.2,
             "log_dir": str(tmp_path), "side_channel_port": port, "read_timeout_s": 10.0,
             "debug_read_delay_param": True}
    clock = SkipClock()
    p = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "P-w", Side.P, 0, 1, COMPAT, clock)
    d = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-w", Side.D, 0, 1, COMPAT, clock)
    pc, dc = _caches(True), _caches(False)
    p.register_kv_caches(pc, LAYOUT)
    d.register_kv_caches(dc, LAYOUT)
    yield p, d, pc, dc, port
    d.close()
    p.close()


_SLOTS = itertools.count()
_SLOT_OF: dict[str, int] = {}  # the fence slot of each request's last export


def _export(p: HandoffWorker, rid: str, n: int, token: str) -> None:
    """What P's scheduler plans for a finished prefill: the export, with a fence slot."""
    _SLOT_OF[rid] = next(_SLOTS) % 1024
    p.start_step(StepPlan(prefill_started=[rid]))
    p.finish_step()
    p.start_step(StepPlan(exports=[Export(rid, n, token, _SLOT_OF[rid])]))
    p.finish_step()


def _params(rid: str, port: int, blocks: tuple[int, ...], token: str, **kw) -> dict:
    """The transfer parameters P's scheduler hands out for ``rid`` (its fence slot too)."""
    kw.setdefault("fence_slot", _SLOT_OF.get(rid))
    r = RemotePrefill("P-w", rid, "127.0.0.1", port, 1, (blocks,), len(blocks) * BLOCK, LEASE,
                      token=token, **kw)
    return r.to_wire()


def _pump(p, d, until, timeout=10.0, skip=0.0):
    """Step both workers until ``until(sent, recved, failed)`` holds; return what they reported.

    ``skip``: seconds of the workers' `SkipClock` skipped each round (a round takes a few
    milliseconds), so leases and held READs run their course at that pace while every
    heartbeat still goes out and is answered on time.  ``timeout`` is wall-clock."""
    sent, recved, failed = set(), set(), set()
    deadline = time.monotonic() + timeout
    while not until(sent, recved, failed):
        assert time.monotonic() < deadline, (sent, recved, failed)
        if skip:
            p.clock.skip(skip)
        s, _, _ = p.finish_step()
        _, r, f = d.finish_step()
        assert not (s & sent) and not (r & recved), "reported twice"
        sent |= s
        recved |= r
        failed |= f
        _PACE.wait(0.002)  # the workers poll; pace the loop (never a stand-in for an event)
    return sent, recved, failed


_PACE = threading.Event()


def _d_state(d: HandoffWorker, rid: str) -> DState | None:
    rec = d.state.record(d.stream, rid)
    return rec.state if rec is not None else None


def _same(pc, dc, remote, local) -> bool:
    return all(torch.equal(pc[k][list(remote)].cpu(), dc[k][list(local)].cpu()) for k in pc)


def test_bytes_arrive_and_p_frees_once_on_the_release(workers):
    p, d, pc, dc, port = workers
    _export(p, "r1", 3, "tok-1")
    d.start_step(StepPlan(admits=[Admit("L1", _params("r1", port, (5, 9, 10), "tok-1"), "", 3 * BLOCK)]))
    d.start_step(StepPlan(reads=[Read("L1", [[1, 2, 3]])]))
    sent, recved, failed = _pump(p, d, lambda s, r, f: "r1" in s and "L1" in r)
    assert failed == set()
    assert _same(pc, dc, (5, 9, 10), (1, 2, 3))
    assert not any(dc[k][4:].abs().sum().item() for k in dc)  # nothing else written
    a = analyse_logs([p.flush(), d.flush()])
    assert a["replay_violations"] == 0 and a["p_frees"] == 1 and a["double_frees"] == 0
    d_kinds = [e.kind for e in read_log(d.log_path)]
    proofs = [i for i, k in enumerate(d_kinds) if k in ("lease_acknowledged", "fence_held")]
    assert proofs and proofs[0] < d_kinds.index("finished_recving")  # proven, then reported


def test_the_read_goes_to_the_agent_the_request_was_admitted_with(workers):
    """The READ goes to the P agent D admitted the request with, whatever link its address
    has by the time the READ is posted (vLLM posts it when D's blocks are allocated, a
    step or more later; a P restarted at the address meanwhile is another agent, which
    does not hold the export: its memory must never be read for it)."""
    import dataclasses

    p, d, pc, dc, port = workers
    _export(p, "r1a", 2, "tok-1a")
    d.start_step(StepPlan(admits=[Admit("L1a", _params("r1a", port, (6, 7), "tok-1a"), "", 2 * BLOCK)]))
    _pump(p, d, lambda *_: _d_state(d, "r1a") is DState.VALIDATED)  # handshake done
    ((key, link),) = d._peers.items()
    d._peers[key] = dataclasses.replace(link, agent="another-P-at-that-address")
    d.start_step(StepPlan(reads=[Read("L1a", [[1, 2]])]))
    sent, recved, failed = _pump(p, d, lambda s, r, f: "r1a" in s and "L1a" in r)
    assert failed == set() and _same(pc, dc, (6, 7), (1, 2))


def test_a_read_whose_p_was_dropped_since_admission_fails_as_a_read_not_an_internal_error(workers):
    """P's link was dropped (P lost) between the admission and the READ: the READ goes to the
    agent it was admitted with, its post fails, and the request fails as a failed READ
    (no error escapes into the worker's containment as an internal error)."""
    p, d, pc, dc, port = workers
    _export(p, "r1b", 2, "tok-1b")
    d.start_step(StepPlan(admits=[Admit("L1b", _params("r1b", port, (6, 7), "tok-1b"), "", 2 * BLOCK)]))
    _pump(p, d, lambda *_: _d_state(d, "r1b") is DState.VALIDATED)
    ((_, link),) = d._peers.items()
    d._peers.clear()  # as when D drops a P it found lost
    d.transport.remove_peer(link.agent)
    d.start_step(StepPlan(reads=[Read("L1b", [[1, 2]])]))
    sent, recved, failed = _pump(p, d, lambda s, r, f: "L1b" in f)
    assert d.total["rejected_internal_error"] == 0
    assert "split_failed" in _kinds(d, "r1b") and not _same(pc, dc, (6, 7), (1, 2))


def test_cancel_mid_read_keeps_heartbeating_until_the_read_drains(workers):
    p, d, pc, dc, port = workers
    _export(p, "r2", 2, "tok-2")
    params = _params("r2", port, (7, 8), "tok-2", debug_read_delay_s=LEASE * 1.5)
    d.start_step(StepPlan(admits=[Admit("L2", params, "", 2 * BLOCK)], reads=[Read("L2", [[20, 21]])]))
    _pump(p, d, lambda s, r, f: _d_state(d, "r2") is DState.READING)  # the READ is in flight
    d.start_step(StepPlan(cancels=["L2"]))  # the client went away while the READ is in flight
    sent, recved, _ = _pump(p, d, lambda s, r, f: "r2" in s and "L2" in r, skip=0.05)
    p_events = [e for e in read_log(p.flush()) if e.request_id == "r2"]
    kinds = [e.kind for e in p_events]
    assert "lease_expired" not in kinds and kinds.count("freed") == 1
    assert kinds.count("heartbeat_received") >= 5
    assert _same(pc, dc, (7, 8), (20, 21))


def test_d_stamps_an_acknowledgement_no_earlier_than_it_collected_it(workers, monkeypatch):
    """Found by a trace of real engines' logs (CI): D stamped an acknowledgement with the
    step's clock read from before it collected the notification, 42 µs before P had
    even received the heartbeat it answers."""
    p, d, pc, dc, port = workers
    collected: dict[tuple[str, float], float] = {}  # (request, heartbeat sent_at) -> when
    recv = d.transport.recv_notifs

    def recv_notifs():
        notes = recv()
        at = d.clock()  # the workers' clock: what D's events are stamped with
        for note in notes:
            msg = messages.decode(note.message)
            if isinstance(msg, messages.HeartbeatAck):
                for rid in msg.time_left:
                    collected.setdefault((rid, msg.sent_at), at)
        return notes
    monkeypatch.setattr(d.transport, "recv_notifs", recv_notifs)
    for i in range(3):  # no fence slot: D proves the lease by asking P
        _export(p, f"ra{i}", 2, f"tok-a{i}")
        params = _params(f"ra{i}", port, (5 + i, 9), f"tok-a{i}", fence_slot=None)
        d.start_step(StepPlan(admits=[Admit(f"La{i}", params, "", 2 * BLOCK)],
                              reads=[Read(f"La{i}", [[1, 2]])]))
        _pump(p, d, lambda s, r, f, i=i: f"ra{i}" in s and f"La{i}" in r)
    acks = [e for e in read_log(d.flush()) if e.kind == "lease_acknowledged"]
    assert acks and all((e.request_id, e.sent_at) in collected for e in acks)
    assert all(e.t >= collected[e.request_id, e.sent_at] for e in acks), [
        (e.request_id, e.t - collected[e.request_id, e.sent_at]) for e in acks]


def test_a_read_held_until_cancelled_is_in_flight_when_the_client_leaves(workers):
    """``kvhandoff_debug_hold_read_until_cancelled`` (the serve tests and the demos): the
    delay runs from the client's cancel, so however late an overloaded API server
    reports the client gone, the READ is still in flight then, and stays so that long."""
    p, d, pc, dc, port = workers
    _export(p, "r2h", 2, "tok-2h")
    params = _params("r2h", port, (7, 8), "tok-2h", debug_read_delay_s=0.3,
                     debug_hold_until_cancelled=True)
    d.start_step(StepPlan(admits=[Admit("L2h", params, "", 2 * BLOCK)],
                          reads=[Read("L2h", [[20, 21]])]))
    inc = d._incoming["L2h"]
    # The READ landed long ago (held), and three times the delay has passed since its post:
    _, recved, _ = _pump(p, d, lambda s, r, f: inc.held and d.clock() > inc.posted_at + 0.9)
    assert _d_state(d, "r2h") is DState.READING and "L2h" not in recved
    d.start_step(StepPlan(cancels=["L2h"]))
    _pump(p, d, lambda s, r, f: "r2h" in s and "L2h" in r)
    d_events = {e.kind: e.t for e in read_log(d.flush()) if e.request_id == "r2h"}
    assert d_events["split_completed"] - d_events["client_cancelled"] >= 0.3
    p_kinds = [e.kind for e in read_log(p.flush()) if e.request_id == "r2h"]
    assert p_kinds.count("freed") == 1 and "lease_expired" not in p_kinds
    assert _same(pc, dc, (7, 8), (20, 21))


def test_a_cancel_before_p_proved_its_lease_is_logged_as_abandoned_not_refused(workers,
                                                                               monkeypatch):
    """D hears nothing from P (no acknowledgement, no fence slot): the client's cancel
    ends the request unproven once its READ drains, which the connector logs as abandoned
    (info) and does not count as a refused READ (an error, and the counter operators
    alert on): the client left, nothing went wrong with the hand-off."""
    p, d, pc, dc, port = workers
    monkeypatch.setattr(d.transport, "recv_notifs", lambda: [])
    _export(p, "r2u", 2, "tok-2u")
    params = _params("r2u", port, (7, 8), "tok-2u", fence_slot=None, debug_read_delay_s=0.3,
                     debug_hold_until_cancelled=True)
    d.start_step(StepPlan(admits=[Admit("L2u", params, "", 2 * BLOCK)],
                          reads=[Read("L2u", [[20, 21]])]))
    _pump(p, d, lambda s, r, f: _d_state(d, "r2u") is DState.READING)
    with capture_logs() as logs:
        d.start_step(StepPlan(cancels=["L2u"]))
        _pump(p, d, lambda s, r, f: "L2u" in f)
    said = [(x["event"], x["log_level"], x.get("reason")) for x in logs
            if x["event"] in ("vllm.worker.read_abandoned", "vllm.worker.read_refused")]
    assert said == [("vllm.worker.read_abandoned", "info",
                     "the client cancelled before P proved it held the blocks")], said
    assert not {k: v for k, v in d.total.items() if k.startswith("reads_refused") and v}


@pytest.mark.parametrize("token", ["guess", ""])
def test_a_release_without_the_token_frees_nothing(workers, token):
    p, d, pc, dc, port = workers
    _export(p, "r3", 1, "tok-3")
    # A stray engine that knows the request id but not the token (a wrong one, or none).
    d.start_step(StepPlan(admits=[Admit("L3", _params("r3", port, (3,), "tok-3"), "", BLOCK)]))
    _pump(p, d, lambda s, r, f: bool(d._peers), timeout=5)
    peer = next(iter(d._peers.values())).agent
    with d.lock:
        d.transport.send_notif(peer, messages.encode(messages.Release("r3", "intruder", 0, token)))
    p_stream = p.state.streams[p.stream]
    wait_for(lambda: p_stream.ignored["bad_token"] >= 1, 5, "P to refuse the stray release")
    s, _, _ = p.finish_step()
    assert "r3" not in s
    rec = p.state.record(p.stream, "r3")
    assert rec.state.value == "EXPORTED"
    # The real consumer still reads and releases it.
    d.start_step(StepPlan(reads=[Read("L3", [[30]])]))
    _pump(p, d, lambda s, r, f: "r3" in s and "L3" in r)
    assert _same(pc, dc, (3,), (30,))


def test_a_release_that_overtakes_its_export_frees_when_p_folds_the_export(workers):
    """vLLM's P hands out the parameters a step before its worker folds the export; a D
    that lets go at once (here: the client cancels before any READ) can release first.
    P holds that release for the export and frees then, not a lease later."""
    p, d, pc, dc, port = workers
    _SLOT_OF["r40"] = slot = next(_SLOTS) % 1024
    p.start_step(StepPlan(prefill_started=["r40"]))  # the export is still to come
    p.finish_step()
    d.start_step(StepPlan(admits=[Admit("L40", _params("r40", port, (20,), "tok-40"), "",
                                        BLOCK)]))
    d.start_step(StepPlan(cancels=["L40"]))
    wait_for(lambda: d.finish_step() and "release_sent" in _kinds(d, "r40"), 5, "D's release")
    wait_for(lambda: p.producer._deferred, 5, "P to hold the release for the export")
    p.start_step(StepPlan(exports=[Export("r40", 1, "tok-40", slot)]))
    sent, _, _ = p.finish_step()
    assert "r40" in sent  # freed in the step that folded the export
    kinds = _kinds(p, "r40")
    assert kinds.index("exported") < kinds.index("release_notified") < kinds.index("freed")
    assert "lease_expired" not in kinds


def test_bad_geometry_is_rejected_with_a_notify_only_release(workers):
    p, d, pc, dc, port = workers
    _export(p, "r4", 2, "tok-4")
    params = _params("r4", port, (1, NUM_BLOCKS + 5), "tok-4")  # beyond P's pool
    d.start_step(StepPlan(admits=[Admit("L4", params, "", 2 * BLOCK)]))
    _pump(p, d, lambda s, r, f: bool(d._peers), timeout=5)
    d.start_step(StepPlan(reads=[Read("L4", [[40, 41]])]))
    sent, recved, failed = _pump(p, d, lambda s, r, f: "r4" in s and "L4" in r)
    assert failed == {"L4"}
    d_events = [e for e in read_log(d.flush()) if e.request_id == "r4"]
    assert [e.kind for e in d_events if e.kind in ("rejected", "release_sent", "reads_posted")] == [
        "rejected", "release_sent"]
    assert next(e for e in d_events if e.kind == "release_sent").notify_only
    assert "remote_block_ids" in next(e for e in d_events if e.kind == "rejected").reason
    assert not any(dc[k].abs().sum().item() for k in dc)


def test_parameters_read_again_after_the_release_are_refused_not_served(workers, tmp_path):
    """A router retry, or a D restarted with the same engine id, reads released blocks again.

    P freed (and may have reused) the blocks on the first reader's release; the
    second reader is another transport peer, so P answers its heartbeat "gone"
    and D fails the request instead of serving whatever the blocks hold now.
    """
    p, d, pc, dc, port = workers
    _export(p, "r5", 2, "tok-5")
    params = _params("r5", port, (11, 12), "tok-5")
    d.start_step(StepPlan(admits=[Admit("L5", params, "", 2 * BLOCK)], reads=[Read("L5", [[1, 2]])]))
    _pump(p, d, lambda s, r, f: "r5" in s and "L5" in r)
    extra = {"lease_s": LEASE, "heartbeat_interval_s": 0.3, "lease_margin_s": 0.2,
             "log_dir": str(tmp_path / "again"), "side_channel_port": port, "read_timeout_s": 10.0}
    d2 = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-w", Side.D, 0, 1, COMPAT)
    try:
        d2.register_kv_caches(_caches(False), LAYOUT)
        d2.start_step(StepPlan(admits=[Admit("L5b", params, "", 2 * BLOCK)],
                               reads=[Read("L5b", [[3, 4]])]))
        _, recved, failed = _pump(p, d2, lambda s, r, f: "L5b" in r, timeout=LEASE * 2)
        assert failed == {"L5b"}
        # P cleared the request's fence slot before it freed: a fence READ of the second
        # reader (if P's "gone" did not end the request first) proves nothing.
        assert not d2.consumer.counts["fences_held"]
    finally:
        d2.close()


def _done_handoff(p, d, port, rid, local, blocks, token, dest, skip=0.0) -> dict:
    _export(p, rid, len(blocks), token)
    params = _params(rid, port, blocks, token)
    d.start_step(StepPlan(admits=[Admit(local, params, "", len(blocks) * BLOCK)],
                          reads=[Read(local, [dest])]))
    _pump(p, d, lambda s, r, f: rid in s and local in r, skip=skip)
    assert _d_state(d, rid) is DState.DONE
    return params


def _kinds(worker: HandoffWorker, rid: str) -> list[str]:
    return [e.kind for e in read_log(worker.log_path) if e.request_id == rid]


def test_re_admission_of_a_released_request_fails_it_and_never_reads_again(workers):
    p, d, pc, dc, port = workers
    params = _done_handoff(p, d, port, "r6", "L6", (4, 5), "tok-6", [1, 2])
    with capture_logs() as logs:  # a client retry after D's release went out
        d.start_step(StepPlan(admits=[Admit("L6b", params, "", 2 * BLOCK)],
                              reads=[Read("L6b", [[3, 4]])]))
        _, recved, failed = _pump(p, d, lambda s, r, f: "L6b" in r)
    assert failed == {"L6b"}
    assert _kinds(d, "r6").count("admitted") == 1 and _kinds(d, "r6").count("reads_posted") == 1
    errors = [e for e in logs if e["log_level"] == "error"]
    assert [e["event"] for e in errors] == ["vllm.worker.request_rejected"]
    assert "single-use" in errors[0]["error"] and "DONE" in errors[0]["error"]
    assert not any(dc[k][3:5].abs().sum().item() for k in dc)


def test_an_event_the_fold_refuses_is_logged_once_not_raised(workers):
    p, d, pc, dc, port = workers
    _done_handoff(p, d, port, "r7", "L7", (6,), "tok-7", [5])
    refused = d.engine.counts["refused_events"]
    with capture_logs() as logs:
        assert d.engine._record(Admitted, "r7", d.clock(), remote_engine="P-w",
                                remote_ranks=(0,), num_blocks=1, lease_s=LEASE,
                                lease_margin_s=0.2, local_request_id="L7b") is False
    (entry,) = logs
    assert entry["event"] == "consumer.refused_event" and entry["event_kind"] == "admitted"
    assert "DONE" in entry["error"] and d.engine.counts["refused_events"] == refused + 1


@pytest.mark.parametrize("when", ["unknown", "done", "reading"])
def test_the_clean_up_request_releases_only_what_d_never_took(workers, when):
    """vLLM's API server re-sends a failed or disconnected request's params, pre-aborted."""
    p, d, pc, dc, port = workers
    if when == "done":
        params = _done_handoff(p, d, port, "rc", "Lc", (6, 7), "tok-c", [1, 2])
    else:
        _export(p, "rc", 2, "tok-c")
        params = _params("rc", port, (6, 7), "tok-c", debug_read_delay_s=0.3)
    if when == "reading":
        d.start_step(StepPlan(admits=[Admit("Lc", params, "", 2 * BLOCK)],
                              reads=[Read("Lc", [[1, 2]])]))
        _pump(p, d, lambda s, r, f: _d_state(d, "rc") is DState.READING)
    identity = ("P-w", "rc", "127.0.0.1", port, "tok-c")
    with capture_logs() as logs:
        d.start_step(StepPlan(admits=[Admit("cmpl-c", params, "", 1, identity, cleanup=True)],
                              cancels=["cmpl-c"]))
        if when == "reading":  # the request D took goes on as if nothing happened
            _, recved, failed = _pump(p, d, lambda s, r, f: "rc" in s and "Lc" in r)
            assert failed == set() and _same(pc, dc, (6, 7), (1, 2))
        elif when == "unknown":  # D never took it: P is told at once (notify-only)
            _pump(p, d, lambda s, r, f: "rc" in s)
        else:
            _pump(p, d, lambda s, r, f: "cmpl-c" not in d._incoming)
    assert not [e for e in logs if e["log_level"] == "error"], logs
    d_kinds, p_kinds = _kinds(d, "rc"), _kinds(p, "rc")
    assert "rejected" not in d_kinds and d_kinds.count("admitted") == 1
    (release,) = [e for e in read_log(d.log_path) if e.request_id == "rc" and e.kind == "release_sent"]
    assert release.notify_only is (when == "unknown")
    assert p_kinds.count("freed") == 1 and "lease_expired" not in p_kinds


@pytest.mark.parametrize("path", ["admission", "read", "completion", "report", "scheduler"])
def test_an_exception_in_any_per_request_path_fails_only_that_request(workers, monkeypatch, path):
    p, d, pc, dc, port = workers
    _export(p, "good", 2, "tok-g")
    _export(p, "bad", 2, "tok-b")
    fired: list[str] = []

    def explode_once(name, hits):
        real = getattr(d, name)

        def step(*args, **kwargs):
            if not fired and hits(*args):
                fired.append(name)
                raise RuntimeError(f"injected into {name}")
            return real(*args, **kwargs)
        monkeypatch.setattr(d, name, step)

    if path == "admission":
        explode_once("_geometry_problem", lambda remote, *a: remote.request_id == "bad")
    elif path == "read":
        explode_once("_post_read", lambda local_id, *a: local_id == "Lbad")
    elif path == "completion":
        explode_once("_drain", lambda inc, *a: inc.local_id == "Lbad" and bool(inc.held))
    elif path == "report":
        explode_once("_report", lambda rid, *a: rid == "bad")
    plan = StepPlan(admits=[Admit("Lgood", _params("good", port, (1, 2), "tok-g"), "", 2 * BLOCK),
                            Admit("Lbad", _params("bad", port, (3, 4), "tok-b"), "", 2 * BLOCK)],
                    reads=[Read("Lgood", [[10, 11]]), Read("Lbad", [[20, 21]])])
    if path == "scheduler":  # the scheduler half failed it after allocating its blocks
        plan.reads.pop()
        plan.failures.append(Failure("Lbad", "injected", awaiting=True))
        fired.append("scheduler")
    d.start_step(plan)
    sent, recved, failed = _pump(p, d, lambda s, r, f: {"good", "bad"} <= s
                                 and {"Lgood", "Lbad"} <= r, skip=0.05)
    assert fired and failed == {"Lbad"}
    assert _same(pc, dc, (1, 2), (10, 11))
    assert all(_kinds(p, rid).count("freed") == 1 for rid in ("good", "bad"))
    a = analyse_logs([p.flush(), d.flush()])
    assert a["replay_violations"] == 0 and a["double_frees"] == 0, a["violations"]


@pytest.mark.parametrize(("trusted", "port", "rank"), [
    (["10.1.2.3"], 5600, 0),
    (["127.0.0.1:5600"], 5600, 1),  # D rank 1 dials 5601: the entry names 5600 only
    (["127.0.0.1"], 65535, 1),  # 65535 + 1 is no port at all
])
def test_an_untrusted_producer_gets_not_a_single_packet(tmp_path, trusted, port, rank):
    extra = {"lease_s": LEASE, "log_dir": str(tmp_path), "trusted_producers": trusted}
    d = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-t", Side.D, rank, 2, COMPAT)
    try:
        d.register_kv_caches(_caches(False), LAYOUT)
        params = _params("r8", port, (1,), "tok-8")
        with capture_logs() as logs:
            d.start_step(StepPlan(admits=[Admit("L8", params, "", BLOCK)], reads=[Read("L8", [[1]])]))
            _, recved, failed = d.finish_step()
        assert recved == failed == {"L8"}
        assert d._handshakes == {} and d._peers == {}  # no handshake was even started
        (entry,) = [e for e in logs if e["log_level"] == "error"]
        assert "UntrustedProducer" in entry["error"] and f"{port + rank}" in entry["error"]
    finally:
        d.close()


def test_what_d_remembers_of_failed_handshakes_stays_bounded(tmp_path):
    """The addresses D dials come from requests: a failed one is refused for REFUSE_S,
    then tried again; past MAX_REFUSED remembered, the expired and then the oldest are
    forgotten (they are tried again)."""
    import threading

    from kvhandoff.adapters.vllm.consumer import MAX_REFUSED, REFUSE_S

    extra = {"lease_s": LEASE, "log_dir": str(tmp_path)}
    d = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-h", Side.D, 0, 2, COMPAT)

    def fail(keys, now):
        for key in keys:
            done = threading.Event()
            done.set()
            d._handshakes[key] = {"done": done, "error": ConnectionRefusedError("refused")}
        with capture_logs():
            d._finish_handshakes(now)
    try:
        fail([("127.0.0.1", port) for port in range(1000, 2100)], now=0.0)
        assert list(d._refused) == [("127.0.0.1", port)
                                    for port in range(2100 - MAX_REFUSED, 2100)]  # the newest
        fail([("127.0.0.2", port) for port in range(1000, 1100)], now=REFUSE_S + 1)
        assert set(d._refused) == {("127.0.0.2", port) for port in range(1000, 1100)}
    finally:
        d.close()


def test_events_reach_the_os_every_step_without_a_flush(workers):
    p, d, pc, dc, port = workers
    _export(p, "r9", 1, "tok-9")
    assert "exported" in _kinds(p, "r9")  # on disk, nobody called flush()
    d.start_step(StepPlan(admits=[Admit("L9", _params("r9", port, (9,), "tok-9"), "", BLOCK)],
                          reads=[Read("L9", [[9]])]))
    _pump(p, d, lambda s, r, f: "r9" in s)
    assert "release_sent" in _kinds(d, "r9") and _kinds(p, "r9")[-2:] == ["freed", "forgotten"]


@pytest.mark.parametrize("side", ["P", "D"])
def test_an_exception_answering_one_notification_costs_only_that_one(workers, monkeypatch, side):
    """P's answer to a heartbeat, or D's taking of P's acknowledgement, raises once: that
    notification is counted ignored and logged, the rest of its batch and the request go on."""
    p, d, pc, dc, port = workers
    engine = p.producer if side == "P" else d.consumer
    fired: list[int] = []
    real = engine.on_notification

    def answer(*args, **kwargs):
        if not fired:
            fired.append(1)
            raise RuntimeError(f"injected into {side}'s notification handling")
        return real(*args, **kwargs)
    monkeypatch.setattr(engine, "on_notification", answer)
    with capture_logs() as logs:
        _export(p, "r10", 1, "tok-10")
        params = _params("r10", port, (12,), "tok-10", fence_slot=None)  # D asks P: an ack comes
        d.start_step(StepPlan(admits=[Admit("L10", params, "", BLOCK)], reads=[Read("L10", [[12]])]))
        _pump(p, d, lambda s, r, f: "r10" in s and "L10" in r)
    assert fired and [e["event"] for e in logs if e["log_level"] == "error"] == [
        "vllm.worker.notification_error"]
    assert _same(pc, dc, (12,), (12,)) and _kinds(p, "r10").count("freed") == 1


def test_a_notification_the_decoder_chokes_on_costs_only_that_one(workers, monkeypatch):
    """The wire decoder raises something other than MalformedMessage once (a decoder bug):
    that note is counted ignored and logged, the rest of the batch still arrives."""
    from kvhandoff.core import messages
    p, d, pc, dc, port = workers
    fired: list[int] = []
    real = messages.decode

    def decode(data):
        if not fired:
            fired.append(1)
            raise TypeError("unhashable type: 'list'")
        return real(data)
    monkeypatch.setattr(messages, "decode", decode)
    with capture_logs() as logs:
        _export(p, "r10b", 1, "tok-10b")
        params = _params("r10b", port, (12,), "tok-10b", fence_slot=None)
        d.start_step(StepPlan(admits=[Admit("L10b", params, "", BLOCK)],
                              reads=[Read("L10b", [[12]])]))
        _pump(p, d, lambda s, r, f: "r10b" in s and "L10b" in r)
    assert fired and [e["event"] for e in logs if e["log_level"] == "error"] == [
        "vllm.worker.notification_error"]
    assert _same(pc, dc, (12,), (12,)) and _kinds(p, "r10b").count("freed") == 1


def _explode_always(monkeypatch, worker, name, hits, fired):
    real = getattr(worker, name)

    def step(*args, **kwargs):
        if hits(*args, **kwargs):
            fired.append(name)
            raise RuntimeError(f"injected into {name}, every time")
        return real(*args, **kwargs)
    monkeypatch.setattr(worker, name, step)


@pytest.mark.parametrize("path", ["completion", "in_flight"])
def test_a_request_that_fails_every_step_ends_once_and_p_frees_it_by_lease(workers, monkeypatch, path):
    """A per-request path that raises every time ends the request after the second error.

    (The report path runs once per request: the engine reports a request once,
    having released P already; its failure is covered above.)

    vLLM hears ``failed_recving`` once; D forgets it so its heartbeats stop
    and P frees by lease, but only after the READs drained: with a READ
    still in flight (``in_flight``) the lease outlives it.
    """
    p, d, pc, dc, port = workers
    _export(p, "good", 2, "tok-g")
    _export(p, "bad", 2, "tok-b")
    fired: list[str] = []
    delay = LEASE * 1.5 if path == "in_flight" else 0.0
    if path == "completion":
        _explode_always(monkeypatch, d, "_drain", lambda inc, *a: inc.local_id == "Lbad"
                        and bool(inc.held), fired)
    else:
        _explode_always(monkeypatch, d, "_drain", lambda inc, *a: inc.local_id == "Lbad"
                        and bool(inc.handles), fired)
    d.start_step(StepPlan(
        admits=[Admit("Lgood", _params("good", port, (1, 2), "tok-g"), "", 2 * BLOCK),
                Admit("Lbad", _params("bad", port, (3, 4), "tok-b", debug_read_delay_s=delay),
                      "", 2 * BLOCK)],
        reads=[Read("Lgood", [[10, 11]]), Read("Lbad", [[20, 21]])]))
    with capture_logs() as logs:
        sent, recved, failed = _pump(p, d, lambda s, r, f: {"good", "bad"} <= s
                                     and {"Lgood", "Lbad"} <= r, skip=0.05)
    assert len(fired) >= 2 and failed == {"Lbad"}
    assert "Lbad" not in d._incoming and "bad" not in d._by_remote
    (ended,) = [e for e in logs if e["event"] == "vllm.worker.request_ended"]
    assert ended["errors_after_give_up"] >= 1
    assert len([e for e in logs if e["event"] == "vllm.worker.request_failed_again"]) == 1
    p_bad = [e for e in read_log(p.flush()) if e.request_id == "bad"]
    assert [e.kind for e in p_bad].count("freed") == 1 and "lease_expired" in [e.kind for e in p_bad]
    assert _same(pc, dc, (1, 2), (10, 11)) and _kinds(p, "good").count("freed") == 1
    d_bad = [e for e in read_log(d.flush()) if e.request_id == "bad"]
    posted = next(e.t for e in d_bad if e.kind == "reads_posted")
    expired = next(e.t for e in p_bad if e.kind == "lease_expired")
    last_hb = max(e.t for e in d_bad if e.kind == "heartbeat_sent")
    assert expired - last_hb >= LEASE - 0.5  # it expired because D stopped heartbeating
    assert expired > posted + delay  # never while the READ was in flight


def test_p_reports_a_free_even_when_what_follows_it_raises_every_step(workers, monkeypatch):
    p, d, pc, dc, port = workers
    real = p._p_send

    def send(step):
        if step.freed:
            raise RuntimeError("injected after P's frees")
        return real(step)
    monkeypatch.setattr(p, "_p_send", send)
    _done_handoff(p, d, port, "r11", "L11", (13,), "tok-11", [13])  # vLLM hears r11 once
    assert _kinds(p, "r11").count("freed") == 1


def test_a_completion_the_engine_raised_on_still_ends_the_request_once(workers, monkeypatch):
    """D's engine raises taking one READ's completion (a bug, contained to that request):
    the completion stays held, so the request still ends (vLLM hears it failed, once, and
    D stops heartbeating, so P frees by its lease) instead of waiting for a completion
    that was taken away (it hung: reading for ever, heartbeating P for ever)."""
    p, d, pc, dc, port = workers
    _export(p, "r13", 2, "tok-13")
    real = d.consumer.split_done

    def split_done(rid, *args, **kwargs):
        if rid == "r13":
            raise RuntimeError("injected into split_done")
        return real(rid, *args, **kwargs)
    monkeypatch.setattr(d.consumer, "split_done", split_done)
    d.start_step(StepPlan(admits=[Admit("L13", _params("r13", port, (3, 4), "tok-13"), "",
                                        2 * BLOCK)], reads=[Read("L13", [[20, 21]])]))
    sent, recved, failed = _pump(p, d, lambda s, r, f: "L13" in r and "r13" in s, skip=0.05)
    assert failed == {"L13"}  # vLLM recomputes it, never serves these pages as read
    p_kinds = _kinds(p, "r13")
    assert p_kinds.count("freed") == 1 and "lease_expired" in p_kinds  # D let go of it


def test_p_keeps_a_bounded_number_of_consumers_connected(workers, monkeypatch, tmp_path):
    """Each hello connects a NIXL agent: past MAX_CONSUMERS, P refuses the hello of a D it
    does not know (D fails that request as handshake_failed, naming the bound) and keeps
    serving the Ds it has."""
    from kvhandoff.adapters.vllm import producer as producer_mod

    p, d, pc, dc, port = workers
    monkeypatch.setattr(producer_mod, "MAX_CONSUMERS", 1)
    _done_handoff(p, d, port, "r8", "L8", (6,), "tok-8", [5])  # D: the one P keeps
    extra = {"lease_s": LEASE, "log_dir": str(tmp_path / "d2"), "side_channel_port": port}
    d2 = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-w2", Side.D, 0, 1, COMPAT,
                       p.clock)
    try:
        d2.register_kv_caches(_caches(False), LAYOUT)
        _export(p, "r8b", 1, "tok-8b")
        with capture_logs() as logs:
            d2.start_step(StepPlan(admits=[Admit("L8b", _params("r8b", port, (7,), "tok-8b"),
                                                 "", BLOCK)], reads=[Read("L8b", [[7]])]))
            _pump(p, d2, lambda s, r, f: "L8b" in f)
        assert d2.total["rejected_handshake_failed"] == 1
        assert any("1 consumers connected (at most 1)" in str(x.get("error")) for x in logs), logs
        assert len(p._consumers) == 1
    finally:
        d2.close()
    _done_handoff(p, d, port, "r8c", "L8c", (8,), "tok-8c", [9])  # the first D still reads


def test_a_p_with_trusted_consumers_answers_no_d_outside_them(tmp_path):
    """``trusted_consumers`` on P: a D connecting from elsewhere gets no metadata and no
    NIXL peer on P; it fails the request as handshake_failed, naming why."""
    port = free_port()
    extra = {"lease_s": LEASE, "log_dir": str(tmp_path), "side_channel_port": port}
    clock = SkipClock()
    p = HandoffWorker(HandoffConfig.from_extra({**extra, "trusted_consumers": ["10.0.0.0/8"]},
                                               env={}), "P-w", Side.P, 0, 1, COMPAT, clock)
    d = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-w", Side.D, 0, 1, COMPAT, clock)
    try:
        p.register_kv_caches(_caches(True), LAYOUT)
        d.register_kv_caches(_caches(False), LAYOUT)
        _export(p, "r1", 1, "tok-1")
        with capture_logs() as logs:
            d.start_step(StepPlan(admits=[Admit("L1", _params("r1", port, (7,), "tok-1"), "",
                                                BLOCK)], reads=[Read("L1", [[7]])]))
            _pump(p, d, lambda s, r, f: "L1" in f)
        assert d.total["rejected_handshake_failed"] == 1
        assert any("UntrustedConsumer: 127.0.0.1 is not in this P's trusted_consumers"
                   in str(x.get("error")) for x in logs), logs
        assert not p._consumers
    finally:
        d.close()
        p.close()


def test_addresses_from_requests_cost_d_a_bounded_number_of_threads_and_entries(
        workers, monkeypatch):
    """Each request may name another P address (any port of loopback is trusted by
    default): D runs at most MAX_HANDSHAKES handshakes at once, refusing more requests
    than that with a typed error, and remembers at most MAX_REFUSED failed addresses."""
    from kvhandoff.adapters.vllm import consumer as consumer_mod

    p, d, pc, dc, port = workers
    release = threading.Event()

    def handshake(host, port, *args):  # an address that never answers, until released
        release.wait(30)
        raise ConnectionError(f"{host}:{port} did not answer")
    monkeypatch.setattr(consumer_mod, "handshake", handshake)
    monkeypatch.setattr(consumer_mod, "MAX_HANDSHAKES", 4)
    monkeypatch.setattr(consumer_mod, "MAX_REFUSED", 3)
    now = d.clock()

    def remote(i: int) -> RemotePrefill:
        return RemotePrefill("P-x", f"x{i}", f"127.0.0.{i + 2}", 40000, 1, ((1,),), BLOCK, LEASE)
    threads = threading.active_count()
    assert [d._peer_for(remote(i), now) for i in range(4)] == [None] * 4  # handshakes run
    with pytest.raises(consumer_mod.ProducerRefused, match="at most 4"):
        d._peer_for(remote(4), now)
    assert threading.active_count() - threads == 4
    release.set()
    wait_for(lambda: all(b["done"].is_set() for b in d._handshakes.values()), 10,
             "the handshakes to fail")
    d._finish_handshakes(now)
    assert len(d._refused) == 3 and remote(0).host not in {h for h, _ in d._refused}
    assert d._peer_for(remote(4), now) is None  # room again: its handshake runs


def test_a_report_is_never_lost_to_an_error_later_in_its_step(workers, monkeypatch):
    """The engine reports a request once: a step that also posts a fence READ which raises
    (here: for another request, injected into the very step of the report) still hands
    vLLM the report (it was lost, and vLLM waited for ever)."""
    p, d, pc, dc, port = workers
    real = d.consumer.poll

    def poll(now):
        step = real(now)
        if step.finished:
            step.fences.append(("ghost", "nobody", 0, 0, now))
        return step

    def post_fence(rid, *args):
        raise RuntimeError("injected into a fence post")
    monkeypatch.setattr(d.consumer, "poll", poll)
    monkeypatch.setattr(d, "_post_fence", post_fence)
    with capture_logs():
        _done_handoff(p, d, port, "r14", "L14", (15,), "tok-14", [15], skip=0.05)  # vLLM hears L14
    assert _same(pc, dc, (15,), (15,))


def test_an_earlier_stage_raising_every_step_does_not_stop_d_reporting(workers, monkeypatch):
    p, d, pc, dc, port = workers
    fired: list[str] = []
    _explode_always(monkeypatch, d, "_drop_lost_producers", lambda *a: True, fired)
    _done_handoff(p, d, port, "r12", "L12", (14,), "tok-12", [14])
    assert fired and _same(pc, dc, (14,), (14,))


def test_one_export_that_raises_costs_only_itself(workers, monkeypatch):
    p, d, pc, dc, port = workers
    real = p.producer._record

    def record(event_type, rid, *args, **kwargs):
        if rid == "x1" and event_type.kind == "exported":
            raise RuntimeError("injected into one export")
        return real(event_type, rid, *args, **kwargs)
    monkeypatch.setattr(p.producer, "_record", record)
    p.start_step(StepPlan(prefill_started=["x1", "x2"]))
    p.start_step(StepPlan(exports=[Export("x1", 1, "t1"), Export("x2", 1, "t2")]))
    sent, _, _ = p.finish_step()
    assert "exported" not in _kinds(p, "x1") and _kinds(p, "x2")[-1] == "exported"
    # No lease holds x1's blocks: vLLM, which keeps them until P names them, hears of it
    # once; x2 stays pinned under its lease.
    assert sent == {"x1"}
    assert "x1" not in p.finish_step()[0]
    assert p.state.record(p.stream, "x1").state.value == "FREED"  # ended: not live, answered


def test_an_export_the_fold_refuses_is_named_freed_once_by_the_engine(workers, monkeypatch):
    """A refused export (here a lease of 0 s) pins nothing: the engine, not the connector,
    names the blocks at its next poll, once, and ends the record."""
    p, d, pc, dc, port = workers
    p.start_step(StepPlan(prefill_started=["z1"]))
    monkeypatch.setattr(p.producer, "lease_s", 0.0)
    p.start_step(StepPlan(exports=[Export("z1", 1, "t1")]))
    assert p.finish_step()[0] == {"z1"}
    assert "z1" not in p.finish_step()[0]
    assert _kinds(p, "z1")[:3] == ["prefill_started", "aborted", "freed"]  # (forgotten: lease 0)
    assert p.producer.counts["refused_events"] == 1  # the export, and nothing after it


def test_an_export_that_finds_no_fence_slot_is_counted(workers):
    """P's scheduler hands no slot when every one is live: operators see it in the stats."""
    p, d, pc, dc, port = workers
    p.start_step(StepPlan(prefill_started=["u1", "u2"]))
    p.finish_step()
    p.take_stats()
    p.start_step(StepPlan(exports=[Export("u1", 1, "t1"), Export("u2", 1, "t2", 7)]))
    p.finish_step()
    stats = p.take_stats()
    assert stats["exports_unfenced"] == 1 and stats["leases_exported"] == 2


def test_a_failing_log_write_never_reaches_vllm(workers, monkeypatch):
    p, d, pc, dc, port = workers

    class FullDisk:  # every write fails, as on a full disk
        closed = False

        def write(self, data):
            raise OSError(28, "No space left on device")
    with capture_logs() as logs:  # before the disk fills: P's notification thread flushes too
        for w in (p, d):
            w.flush()
            monkeypatch.setattr(w.writer, "_file", FullDisk())
            monkeypatch.setattr(w.writer, "buffer_bytes", 1)  # every event tries to write
        _done_handoff(p, d, port, "r13", "L13", (15,), "tok-13", [15])  # P's answers included
    assert _same(pc, dc, (15,), (15,)) and p._notif_thread.is_alive()
    degraded = [e for e in logs if e["event"] == "vllm.worker.event_log_degraded"]
    assert len(degraded) == 2 and all(e["log_level"] == "critical" for e in degraded)
    assert p.log_degraded and d.log_degraded
    assert p.take_stats()["log_write_errors"] > 0 and d.take_stats()["log_write_errors"] > 0
    monkeypatch.undo()  # the disk has room again: what was buffered reaches the file
    p.flush(), d.flush()
    assert _kinds(p, "r13")[-2:] == ["freed", "forgotten"]
    assert "release_sent" in _kinds(d, "r13")


def test_d_remembers_a_request_for_two_of_the_requests_leases_when_longer(workers):
    p, d, pc, dc, port = workers
    long_lease = LEASE * 10  # P's lease, longer than D's cfg.lease_s
    _export(p, "r14", 1, "tok-14")
    params = RemotePrefill("P-w", "r14", "127.0.0.1", port, 1, ((16,),), BLOCK, long_lease,
                           token="tok-14").to_wire()
    d.start_step(StepPlan(admits=[Admit("L14", params, "", BLOCK)], reads=[Read("L14", [[16]])]))
    _pump(p, d, lambda s, r, f: "r14" in s and "L14" in r)
    ended = d.state.record(d.stream, "r14").t_end
    d._prune(ended + 2 * LEASE + 1)  # past two of D's leases, inside two of the request's
    assert _d_state(d, "r14") is DState.DONE  # still single-use: a retry is refused
    d._prune(ended + 2 * long_lease + 1)
    assert _d_state(d, "r14") is None


def test_another_producers_request_with_a_known_id_is_not_called_a_reuse(workers):
    p, d, pc, dc, port = workers
    _done_handoff(p, d, port, "r15", "L15", (17,), "tok-15", [17])
    other = RemotePrefill("P-other", "r15", "127.0.0.1", port, 1, ((17,),), BLOCK, LEASE,
                          token="x").to_wire()
    with capture_logs() as logs:
        d.start_step(StepPlan(admits=[Admit("L15b", other, "", BLOCK)], reads=[Read("L15b", [[18]])]))
        _, recved, failed = _pump(p, d, lambda s, r, f: "L15b" in r)
    assert failed == {"L15b"} and _kinds(d, "r15").count("reads_posted") == 1
    (entry,) = [e for e in logs if e["log_level"] == "error"]
    assert "collides" in entry["error"] and "P-other" in entry["error"] and "single-use" not in entry["error"]


def test_a_deferred_heartbeat_that_raises_costs_only_itself(workers, monkeypatch):
    p, d, pc, dc, port = workers
    answered: list[tuple[str, ...]] = []
    real = p.producer._heartbeat

    def answer(peer, msg, now, since, step):
        if "a" in msg.request_ids:
            raise RuntimeError("injected into one deferred heartbeat, every time")
        answered.append(msg.request_ids)
        return real(peer, msg, now, since, step)
    monkeypatch.setattr(p.producer, "_heartbeat", answer)
    with p.lock:  # two heartbeats that came before P folded the exports
        t = p.clock()
        for rid in ("a", "b"):
            p.producer._defer("no-peer", messages.Heartbeat("D-x", 0, t, (rid,), ()), t, (rid,))
    with capture_logs() as logs:
        p.finish_step()  # the engine step answers what waited
    assert answered == [("b",)]
    assert [e["event"] for e in logs if e["log_level"] == "error"] == [
        "producer.deferred_heartbeat_error"]


# ---- hybrid models: a Gemma-3-style layout, two groups overlaid on one allocation ------

WINDOW = 32  # tokens: two 16-token blocks
GEMMA = gemma_layout(NUM_BLOCKS, BLOCK, HEADS * BLOCK * 2 * HEAD * 2, WINDOW, LAYERS)
SLIDING, FULL = NAMES[0::2], NAMES[1::2]


def _gemma_caches(fill: bool) -> tuple[dict[str, object], object]:
    """vLLM 0.32's hybrid allocation: layer slot k holds sliding layer 2k and full layer 2k+1."""
    gen = torch.Generator().manual_seed(2)
    shape = (LAYERS // 2, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    buf = (torch.randn(shape, generator=gen).half() if fill else torch.zeros(shape).half())
    buf = buf.to(DEVICE)
    return {name: buf[i // 2] for i, name in enumerate(NAMES)}, buf


@pytest.fixture
def gemma_workers(tmp_path):
    port = free_port()
    extra = {"lease_s": LEASE, "heartbeat_interval_s": 0.3, "lease_margin_s": 0.2,
             "log_dir": str(tmp_path), "side_channel_port": port, "read_timeout_s": 10.0}
    p = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "P-g", Side.P, 0, 1, COMPAT)
    d = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-g", Side.D, 0, 1, COMPAT)
    (pc, pbuf), (dc, dbuf) = _gemma_caches(True), _gemma_caches(False)
    p.register_kv_caches(pc, GEMMA)
    d.register_kv_caches(dc, GEMMA)
    yield p, d, pbuf, dbuf, port
    d.close()
    p.close()


# P prefilled 99 of a 100-token prompt (D computes the last one): 7 blocks of 16 tokens.
# The window keeps tokens 68.. (the last token D computes attends to 68..99): positions 4-6.
P_SLIDING, P_FULL = (30, 31, 9), (10, 11, 12, 13, 14, 15, 16)
D_SLIDING, D_FULL = [0, 0, 0, 0, 40, 41, 42], [50, 51, 52, 53, 54, 55, 56]


def _gemma_params(rid, port, token, ids=(P_SLIDING, P_FULL)) -> dict:
    return RemotePrefill("P-g", rid, "127.0.0.1", port, 1, ids, 99, LEASE, token=token).to_wire()


def test_a_hybrid_hand_off_reads_each_group_s_blocks_and_the_window_s_only(gemma_workers):
    p, d, pbuf, dbuf, port = gemma_workers
    _export(p, "g1", len(P_SLIDING) + len(P_FULL), "tok-g1")
    d.start_step(StepPlan(admits=[Admit("G1", _gemma_params("g1", port, "tok-g1"), "", 100)],
                          reads=[Read("G1", [D_SLIDING, D_FULL])]))
    sent, recved, failed = _pump(p, d, lambda s, r, f: "g1" in s and "G1" in r)
    assert failed == set()
    # Each layer slot holds both groups' blocks; every block D got is P's, and nothing else
    # moved: not the sliding window's null positions, not one block more.
    src = list(P_SLIDING) + list(P_FULL)
    dst = D_SLIDING[4:] + D_FULL
    assert torch.equal(pbuf[:, src].cpu(), dbuf[:, dst].cpu())
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
    assert not dbuf[:, untouched].abs().sum().item()
    page = GEMMA.groups[0].block_bytes  # both layer slots' pages of one block
    d_events = [e for e in read_log(d.flush()) if e.request_id == "g1"]
    assert next(e for e in d_events if e.kind == "admitted").num_blocks == 10  # every group's
    posted = next(e for e in d_events if e.kind == "reads_posted")
    assert (posted.split_ranks, posted.split_groups) == ((0, 0), (0, 1))  # one split per group
    assert sorted(e.split for e in d_events if e.kind == "split_completed") == [0, 1]
    # The window's blocks, not the prompt's: 3 of 7 sliding blocks, 7 full ones.
    assert d.total["bytes_read"] == (3 + 7) * page
    assert sorted(d.total["read_bytes"]) == [3 * page, 7 * page]
    a = analyse_logs([p.flush(), d.flush()])
    assert a["replay_violations"] == 0 and a["p_frees"] == 1 and a["double_frees"] == 0


@pytest.mark.parametrize(("ids", "named"), [
    (((30, 31), P_FULL), "len(remote_block_ids[0]) (group 0, sliding_window): expected 3, found 2"),
    ((P_SLIDING,), "len(remote_block_ids) (KV cache groups): expected 2, found 1"),
    ((P_SLIDING, P_FULL[:-1] + (NUM_BLOCKS,)), "remote_block_ids[1][6]"),
])
def test_hybrid_params_that_do_not_fit_a_group_are_rejected_naming_it(gemma_workers, ids, named):
    p, d, pbuf, dbuf, port = gemma_workers
    _export(p, "g2", 10, "tok-g2")
    d.start_step(StepPlan(admits=[Admit("G2", _gemma_params("g2", port, "tok-g2", ids), "", 100)]))
    _pump(p, d, lambda s, r, f: bool(d._peers), timeout=5)
    d.start_step(StepPlan(reads=[Read("G2", [D_SLIDING, D_FULL])]))
    sent, recved, failed = _pump(p, d, lambda s, r, f: "g2" in s and "G2" in r)
    assert failed == {"G2"}
    reason = next(e for e in read_log(d.flush()) if e.request_id == "g2" and e.kind == "rejected").reason
    assert named in reason
    assert not dbuf.abs().sum().item()


def test_a_local_block_list_that_does_not_fit_fails_the_read_naming_the_group(gemma_workers):
    p, d, pbuf, dbuf, port = gemma_workers
    _export(p, "g3", 10, "tok-g3")
    # D's sliding list claims a null block where the window must be read.
    d.start_step(StepPlan(admits=[Admit("G3", _gemma_params("g3", port, "tok-g3"), "", 100)],
                          reads=[Read("G3", [[0, 0, 0, 0, 0, 41, 42], D_FULL])]))
    sent, recved, failed = _pump(p, d, lambda s, r, f: "g3" in s and "G3" in r)
    assert failed == {"G3"}
    events = [e for e in read_log(d.flush()) if e.request_id == "g3"]
    assert "cache group 0: local block ids[0] (the null block)" in next(
        e for e in events if e.kind == "split_failed").reason
    assert not dbuf.abs().sum().item()


def test_d_stamps_a_completion_no_earlier_than_it_received_it(workers):
    """A READ's completion time decides whether P provably held the source then: a clock
    read before the poll that brought the completion in would date it too early."""
    p, d, pc, dc, port = workers
    _export(p, "r20", 1, "tok-20")
    d.start_step(StepPlan(admits=[Admit("L20", _params("r20", port, (3,), "tok-20"), "", BLOCK)],
                          reads=[Read("L20", [[33]])]))
    received = []
    real_poll = d.transport.poll

    def poll():
        out = real_poll()
        if out:
            received.append(d.clock())  # the moment the completion is in D's hands
        return out

    d.transport.poll = poll
    _pump(p, d, lambda s, r, f: "r20" in s and "L20" in r)
    (done,) = [e for e in read_log(d.flush()) if e.request_id == "r20" and e.kind == "split_completed"]
    assert received and done.t >= received[0]


def test_heartbeats_follow_p_s_lease_when_it_is_shorter_than_d_s_setting(tmp_path):
    """P grants 1.5 s, D runs its defaults (30 s lease: a heartbeat every 5 s), a READ takes 3 s.

    D heartbeats that P rank every sixth of the shortest lease it covers, so
    P's lease never lapses under the READ, the hand-off is served and replay
    finds no heartbeat gap.  (At D's own period P expired the lease at 1.5 s
    and D refused the bytes.)
    """
    port = free_port()
    p_lease, read_s = 1.5, 3.0
    clock = SkipClock()
    p = HandoffWorker(HandoffConfig.from_extra(
        {"lease_s": p_lease, "log_dir": str(tmp_path), "side_channel_port": port}, env={}),
        "P-w", Side.P, 0, 1, COMPAT, clock)
    d = HandoffWorker(HandoffConfig.from_extra(
        {"log_dir": str(tmp_path), "debug_read_delay_param": True}, env={}),
        "D-w", Side.D, 0, 1, COMPAT, clock)
    try:
        pc, dc = _caches(True), _caches(False)
        p.register_kv_caches(pc, LAYOUT)
        d.register_kv_caches(dc, LAYOUT)
        assert d.cfg.heartbeat_interval_s == 5.0 and d.cfg.read_timeout_s > read_s
        _export(p, "r20", 2, "tok-20")
        params = RemotePrefill("P-w", "r20", "127.0.0.1", port, 1, ((3, 4),), 2 * BLOCK, p_lease,
                               token="tok-20", debug_read_delay_s=read_s).to_wire()
        d.start_step(StepPlan(admits=[Admit("L20", params, "", 2 * BLOCK)],
                              reads=[Read("L20", [[7, 8]])]))
        sent, recved, failed = _pump(p, d, lambda s, r, f: "r20" in s and "L20" in r,
                                     skip=0.02)  # P's 1.5 s lease: 75 rounds
        assert failed == set() and _same(pc, dc, (3, 4), (7, 8))
        a = analyse_logs([p.flush(), d.flush()])
        assert a["violations"] == [] and a["lease_expiries"] == 0 and a["p_frees"] == 1
        beats = [e.t for e in read_log(d.log_path) if e.kind == "heartbeat_sent"]
        assert max(b - a for a, b in zip(beats, beats[1:], strict=False)) <= p_lease / 6 + 0.2
    finally:
        d.close()
        p.close()


def test_params_re_sent_after_d_forgot_them_are_a_new_request_and_replay_stays_clean(workers):
    """Forgetting is in the log: a re-use after it is a fresh request (P answers "gone", so it
    fails and nothing is served) and ``replay --check`` folds both lives of the id."""
    p, d, pc, dc, port = workers
    params = _done_handoff(p, d, port, "r21", "L21", (9,), "tok-21", [2])
    ended = d.state.record(d.stream, "r21").t_end
    d._prune(ended + 2 * LEASE + 1)  # two leases after it ended: D forgets it
    d.flush()
    assert _d_state(d, "r21") is None and _kinds(d, "r21")[-1] == "forgotten"
    d.start_step(StepPlan(admits=[Admit("L21b", params, "", BLOCK)], reads=[Read("L21b", [[3]])]))
    _, recved, failed = _pump(p, d, lambda s, r, f: "L21b" in r)
    assert failed == {"L21b"}
    assert _kinds(d, "r21").count("admitted") == 2
    a = analyse_logs([p.flush(), d.flush()])
    assert a["violations"] == [] and a["p_frees"] == 1 and a["double_frees"] == 0


def test_replay_trace_of_a_real_worker_pair_s_logs_is_well_formed(workers, tmp_path):
    """``kvhandoff replay --trace`` on logs a real P/D worker pair wrote (issue #18): a clean
    hand-off and a cancel during a READ; the structure follows the Trace Event Format and the
    heartbeats D sent while the cancelled READ drained arrive at P as flows."""
    import orjson
    from trace_format import check_trace

    from kvhandoff.adapters.cli import main
    from kvhandoff.core.log import read_logs

    p, d, pc, dc, port = workers
    _done_handoff(p, d, port, "r30", "L30", (11, 12), "tok-30", [30, 31])
    _export(p, "r31", 2, "tok-31")
    params = _params("r31", port, (13, 14), "tok-31", debug_read_delay_s=1.0)
    d.start_step(StepPlan(admits=[Admit("L31", params, "", 2 * BLOCK)],
                          reads=[Read("L31", [[32, 33]])]))
    _pump(p, d, lambda s, r, f: _d_state(d, "r31") is DState.READING)
    d.start_step(StepPlan(cancels=["L31"]))
    _pump(p, d, lambda s, r, f: "r31" in s and "L31" in r, timeout=LEASE * 3)
    paths = [p.flush(), d.flush()]
    out = tmp_path / "real.trace.json"
    assert main(["replay", *paths, "--check", "--trace", str(out)]) == 0
    doc = orjson.loads(out.read_bytes())
    got = check_trace(doc, {(str(e.stream), e.seq): e.t for e in read_logs(paths)})
    assert sorted(got["processes"].values()) == ["D-w/D0", "P-w/P0"]
    assert {"r30", "r31"} <= set(got["threads"].values())
    assert got["flows"]["heartbeat"] >= 2 and got["flows"]["ack"] >= 1
    splits = [e for e in doc["traceEvents"] if e["ph"] == "e" and e["name"] == "r31 split 0"]
    lease_end = [e for e in doc["traceEvents"] if e["ph"] == "E" and e["name"] == "lease"
                 and got["threads"][e["pid"], e["tid"]] == "r31"]
    assert len(splits) == 1 and len(lease_end) == 1
    assert lease_end[0]["args"]["ended_by"] == "freed" and lease_end[0]["ts"] >= splits[0]["ts"]


# --- the fence (docs/lifecycle.md, "The fence") ----------------------------------------


def test_the_fence_proves_a_read_when_every_answer_from_p_is_lost(workers, monkeypatch):
    """P's answers never reach D: D proves each drained READ by reading P's fence slot over
    NIXL (one more one-sided READ), reports it received and serves P's exact bytes."""
    p, d, pc, dc, port = workers
    monkeypatch.setattr(p, "_p_send", lambda step: None)  # every acknowledgement lost
    for i, (blocks, dest) in enumerate((((5, 9), [1, 2]), ((11, 12, 13), [3, 4, 5]))):
        rid, local = f"f{i}", f"LF{i}"
        _export(p, rid, len(blocks), f"tok-f{i}")
        d.start_step(StepPlan(admits=[Admit(local, _params(rid, port, blocks, f"tok-f{i}"), "",
                                            len(blocks) * BLOCK)], reads=[Read(local, [dest])]))
        sent, recved, failed = _pump(p, d, lambda s, r, f, rid=rid, local=local:
                                     rid in s and local in r)
        assert failed == set() and _same(pc, dc, blocks, dest)
        kinds = _kinds(d, rid)
        assert "lease_acknowledged" not in kinds
        assert kinds.index("split_completed") < kinds.index("fence_held") \
            < kinds.index("finished_recving")
    assert d.consumer.counts["fences_held"] == 2 and d.consumer.counts["acks_received"] == 0
    assert analyse_logs([p.flush(), d.flush()])["replay_violations"] == 0


def test_one_acknowledgement_p_fails_to_send_does_not_cut_d_off(workers, monkeypatch):
    """A transient error sending one answer costs that answer: P keeps D as a peer, so D's
    next heartbeats are answered and a READ held past the lease is still proven and served
    (P used to drop D after one failed send and answer nothing until D handshook again)."""
    p, d, pc, dc, port = workers
    _done_handoff(p, d, port, "t1", "LT1", (4, 5), "tok-t1", [1, 2])
    send, failed_once = p.transport._agent.send_notif, []

    def flaky(peer, message):
        if not failed_once:
            failed_once.append(peer)
            raise RuntimeError("NIXL_ERR_BACKEND (transient)")
        return send(peer, message)

    monkeypatch.setattr(p.transport._agent, "send_notif", flaky)
    _export(p, "t2", 2, "tok-t2")
    params = _params("t2", port, (7, 8), "tok-t2", debug_read_delay_s=LEASE * 1.5)
    d.start_step(StepPlan(admits=[Admit("LT2", params, "", 2 * BLOCK)],
                          reads=[Read("LT2", [[20, 21]])]))
    sent, recved, failed = _pump(p, d, lambda s, r, f: "t2" in s and "LT2" in r, skip=0.05)
    assert failed_once and failed == set() and p.transport.lost_peers() == []
    assert _same(pc, dc, (7, 8), (20, 21))
    assert "lease_acknowledged" in _kinds(d, "t2")  # P's later answers reached D


def _failing_sends(monkeypatch, worker, fails, wanted=lambda message: True):
    """``worker``'s NIXL sends of ``wanted`` messages raise, ``fails`` of them (probes
    included when wanted), as a transient NIXL error does; ``fails`` fills with them."""
    send, failed = worker.transport._agent.send_notif, []

    def flaky(peer, message):
        if len(failed) < fails and wanted(message):
            failed.append(message)
            raise RuntimeError("NIXL_ERR_BACKEND (transient)")
        return send(peer, message)

    monkeypatch.setattr(worker.transport._agent, "send_notif", flaky)
    return failed


def _is_release(message: bytes) -> bool:
    try:
        return isinstance(messages.decode(message), messages.Release)
    except Exception:  # a liveness probe
        return False


def test_sends_d_fails_in_a_row_never_cut_p_off_a_read_in_flight(workers, monkeypatch):
    """Transient send errors on D, many in a row: D keeps P as a peer and heartbeats it
    again, so P holds the lease while the READ is in flight (D used to give P up after
    one failed send, stop heartbeating it, and P freed under the READ), and D logs no
    heartbeat it did not send."""
    p, d, pc, dc, port = workers
    _export(p, "t3", 2, "tok-t3")
    params = _params("t3", port, (7, 8), "tok-t3", debug_read_delay_s=LEASE * 1.5)
    d.start_step(StepPlan(admits=[Admit("LT3", params, "", 2 * BLOCK)],
                          reads=[Read("LT3", [[20, 21]])]))
    _pump(p, d, lambda s, r, f: _d_state(d, "t3") is DState.READING)
    failed_sends = _failing_sends(monkeypatch, d, 10)
    sent, recved, failed = _pump(p, d, lambda s, r, f: "t3" in s and "LT3" in r, skip=0.05)
    assert len(failed_sends) == 10 and failed == set() and d.transport.lost_peers() == []
    assert "lease_expired" not in _kinds(p, "t3") and _same(pc, dc, (7, 8), (20, 21))
    assert _kinds(d, "t3").count("heartbeat_sent") <= _kinds(p, "t3").count("heartbeat_received")


def test_a_release_d_fails_to_send_goes_in_a_later_step(workers, monkeypatch):
    """P frees on the release, not a lease later (the engine sends a release once)."""
    p, d, pc, dc, port = workers
    failed_sends = _failing_sends(monkeypatch, d, 1, _is_release)
    _done_handoff(p, d, port, "q1", "LQ1", (7, 8), "tok-q1", [20, 21], skip=0.05)
    assert len(failed_sends) == 1
    assert "lease_expired" not in _kinds(p, "q1") and _kinds(p, "q1").count("freed") == 1


def test_a_p_without_fence_slots_is_asked_at_admission_as_before(tmp_path):
    port = free_port()
    extra = {"lease_s": LEASE, "heartbeat_interval_s": 0.3, "lease_margin_s": 0.2,
             "log_dir": str(tmp_path), "side_channel_port": port, "read_timeout_s": 10.0}
    p = HandoffWorker(HandoffConfig.from_extra({**extra, "fence_slots": 0}, env={}), "P-w",
                      Side.P, 0, 1, COMPAT)
    d = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-w", Side.D, 0, 1, COMPAT)
    try:
        pc, dc = _caches(True), _caches(False)
        p.register_kv_caches(pc, LAYOUT)
        d.register_kv_caches(dc, LAYOUT)
        for i in range(2):  # the second is admitted between keep-alives: it is asked about
            _done_handoff(p, d, port, f"n{i}", f"LN{i}", (5 + i,), f"tok-n{i}", [1 + i])
            kinds = _kinds(d, f"n{i}")
            assert "fence_held" not in kinds
            assert kinds.index("heartbeat_sent") < kinds.index("finished_recving")
        assert _same(pc, dc, (5, 6), (1, 2))
        assert d.consumer.counts["fences_held"] == d.consumer.counts["fences_missed"] == 0
    finally:
        d.close()
        p.close()
