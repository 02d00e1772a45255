"""P answers a heartbeat promptly while another Python thread holds the GIL,
with and without NIXL's progress thread (``KVHANDOFF_NIXL_PROGRESS_THREAD``).

While P holds a delayed free, vLLM's engine loop steps without pause in
Python; P's notification thread, woken by its timer, then waited CPython's
switch interval (5 ms by default) for the GIL before it could answer D
(docs/benchmarks.md, bench vllm co-located).  The notification thread lowers
the switch interval to ``notif_poll_s`` while it runs (`producer._FastGilSwitch`).
Here the main thread stands in for that engine loop: it pumps D and never
steps P, so only P's notification thread can answer.
"""

from __future__ import annotations

import statistics
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

from hybrid_layouts import one_group_layout  # noqa: E402

from kvhandoff.adapters.vllm.cluster import free_port  # noqa: E402
from kvhandoff.adapters.vllm.config import HandoffConfig  # noqa: E402
from kvhandoff.adapters.vllm.metadata import Admit, Export, StepPlan  # noqa: E402
from kvhandoff.adapters.vllm.params import RemotePrefill  # noqa: E402
from kvhandoff.adapters.vllm.producer import _FastGilSwitch  # noqa: E402
from kvhandoff.adapters.vllm.worker import HandoffWorker  # noqa: E402
from kvhandoff.core.events import Side  # noqa: E402
from kvhandoff.core.log import read_log  # noqa: E402
from kvhandoff.transports.nixl.agent import PROGRESS_THREAD_ENV, NixlOptions  # noqa: E402

BLOCK, LAYERS, HEADS, HEAD, NUM_BLOCKS = 16, 2, 2, 64, 16
COMPAT = {"model": "test", "dtype": "torch.float16", "block_size": BLOCK, "num_kv_heads": HEADS,
          "head_size": HEAD, "num_layers": LAYERS, "tp_size": 1}
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LAYOUT = one_group_layout(NAMES, NUM_BLOCKS, BLOCK, HEADS * BLOCK * 2 * HEAD * 2)
LEASE = 30.0


def _caches() -> dict[str, object]:
    buf = torch.zeros((LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)).half()
    return {name: buf[i] for i, name in enumerate(NAMES)}


def _first(path: str, rid: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in read_log(path):
        if e.request_id == rid:
            out.setdefault(e.kind, e.t)
    return out


def test_the_switch_interval_is_lowered_while_p_runs_and_restored_after_the_last():
    before = sys.getswitchinterval()
    _FastGilSwitch.enter(0.0005)
    _FastGilSwitch.enter(0.001)  # a second P worker in the process: the lower value stays
    assert sys.getswitchinterval() == pytest.approx(min(before, 0.0005))
    _FastGilSwitch.exit()
    assert sys.getswitchinterval() == pytest.approx(min(before, 0.0005))
    _FastGilSwitch.exit()
    assert sys.getswitchinterval() == pytest.approx(before)


def test_the_progress_thread_default_follows_the_environment(monkeypatch):
    monkeypatch.delenv(PROGRESS_THREAD_ENV, raising=False)
    assert NixlOptions().progress_thread
    monkeypatch.setenv(PROGRESS_THREAD_ENV, "0")
    assert not NixlOptions().progress_thread
    assert NixlOptions(progress_thread=True).progress_thread  # an explicit option wins
    monkeypatch.setenv(PROGRESS_THREAD_ENV, "no")
    with pytest.raises(ValueError, match=PROGRESS_THREAD_ENV):
        NixlOptions()


@pytest.mark.parametrize("env, p_thread, d_thread", [(None, True, False), ("1", True, True),
                                                     ("0", False, False)])
def test_the_connector_starts_the_progress_thread_on_p_only_unless_told(tmp_path, monkeypatch,
                                                                       env, p_thread, d_thread):
    """P must answer UCX (a GET over tcp, connection set-up) while its engine is busy
    elsewhere; D progresses its own READs and answers from its engine step."""
    if env is None:
        monkeypatch.delenv(PROGRESS_THREAD_ENV, raising=False)
    else:
        monkeypatch.setenv(PROGRESS_THREAD_ENV, env)
    extra = {"lease_s": LEASE, "log_dir": str(tmp_path), "side_channel_port": free_port()}
    workers = [HandoffWorker(HandoffConfig.from_extra(extra, env={}), f"{side.value}-pt", side, 0, 1,
                             COMPAT) for side in (Side.P, Side.D)]
    try:
        for w in workers:
            w.register_kv_caches(_caches(), LAYOUT)  # nothing here holds the tensors but w
        assert [w.transport.options.progress_thread for w in workers] == [p_thread, d_thread]
        # D without NIXL's thread moves its READs between engine steps itself; no one else.
        p, d = workers
        assert p._read_progress is None
        assert (d._read_progress is not None) is (not d_thread)
        assert d._read_progress is None or d._read_progress.is_alive()
    finally:
        for w in workers:
            w.close()


def test_the_worker_keeps_the_memory_it_registered_alive(tmp_path):
    """NIXL reads into and serves registered memory: the worker holds the caches it
    registered, so a caller that lets go of them cannot leave READs landing in freed
    memory (it crashed this module's tests with malloc errors)."""
    import gc
    import weakref

    extra = {"lease_s": LEASE, "log_dir": str(tmp_path)}
    for side in (Side.P, Side.D):
        extra["side_channel_port"] = free_port()
        worker = HandoffWorker(HandoffConfig.from_extra(extra, env={}), f"{side.value}-keep",
                               side, 0, 1, COMPAT)
        caches = _caches()
        try:
            worker.register_kv_caches(caches, LAYOUT)
            registered = [weakref.ref(t) for t in caches.values()]
            del caches
            gc.collect()
            assert all(ref() is not None for ref in registered), side
        finally:
            worker.close()


def test_an_agent_without_the_progress_thread_starts_no_thread():
    import os

    from kvhandoff.transports.nixl import NixlTransport

    def threads_started(progress_thread: bool) -> int:
        before = set(os.listdir("/proc/self/task"))
        t = NixlTransport(f"thr-{progress_thread}", NixlOptions(progress_thread=progress_thread))
        started = len(set(os.listdir("/proc/self/task")) - before)
        t.close()
        return started

    assert threads_started(False) < threads_started(True)


@pytest.mark.parametrize("progress_thread", ["1", "0"])
def test_p_answers_within_a_poll_period_or_so_while_the_gil_is_busy(tmp_path, monkeypatch,
                                                                     progress_thread):
    monkeypatch.setenv(PROGRESS_THREAD_ENV, progress_thread)
    port = free_port()
    extra = {"lease_s": LEASE, "log_dir": str(tmp_path), "side_channel_port": port}
    before = sys.getswitchinterval()
    p = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "P-wk", Side.P, 0, 1, COMPAT)
    d = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-wk", Side.D, 0, 1, COMPAT)
    try:
        p.register_kv_caches(_caches(), LAYOUT)
        d.register_kv_caches(_caches(), LAYOUT)
        assert sys.getswitchinterval() <= p.cfg.notif_poll_s
        waits = []
        for i in range(12):
            rid, token = f"r{i}", f"tok-{i}"
            p.start_step(StepPlan(prefill_started=[rid]))
            p.finish_step()
            p.start_step(StepPlan(exports=[Export(rid, 1, token)]))
            p.finish_step()
            params = RemotePrefill("P-wk", rid, "127.0.0.1", port, 1, ((i,),), BLOCK, LEASE,
                                   token=token).to_wire()
            d.start_step(StepPlan(admits=[Admit(f"L{i}", params, "", BLOCK)]))
            # The engine loop stand-in: Python without pause; P is never stepped.
            deadline = time.monotonic() + 10  # the first admission waits for the handshake
            while "lease_acknowledged" not in _first(d.flush(), rid):
                d.finish_step()
                assert time.monotonic() < deadline, "no acknowledgement from P"
            events = _first(d.log_path, rid)
            if i:
                waits.append(events["lease_acknowledged"] - events["heartbeat_sent"])
        # CPython's default interval alone (5 ms) was the wait before; a loaded
        # machine adds its own scheduling delays to whichever interval applies.
        assert statistics.median(waits) < 0.005, waits
    finally:
        d.close()
        p.close()
    assert sys.getswitchinterval() == pytest.approx(before)


class _FakeTransport:
    """What `ReadProgress` uses of a transport: READs in flight and `progress`."""

    def __init__(self) -> None:
        import threading

        self.reads_in_flight = 0
        self.calls = 0
        self.called = threading.Event()
        self.counted = threading.Condition()

    def progress(self) -> None:
        with self.counted:
            self.calls += 1
            self.counted.notify_all()
        self.called.set()


def test_read_progress_advances_reads_in_flight_when_woken_and_stops_on_close():
    import threading

    from kvhandoff.transports.nixl.progress import ReadProgress

    t, lock = _FakeTransport(), threading.RLock()
    pump = ReadProgress(t, lock, busy_s=0.0005, idle_s=3600.0).start()  # idle: never by timer
    try:
        assert t.called.wait(5)  # its first pass
        t.called.clear()
        pump.wake()  # nothing in flight: a wake-up is not wanted
        assert not t.called.wait(0.05)
        with lock:
            t.reads_in_flight = 1
        pump.wake()  # the owner posted a READ
        assert t.called.wait(5)
        before = t.calls
        with t.counted:  # every busy_s while a READ is in flight
            assert t.counted.wait_for(lambda: t.calls >= before + 10, timeout=5), t.calls
        with lock:  # the owner's lock is the transport's: held, no call goes through
            t.called.clear()
            assert not t.called.wait(0.02)
    finally:
        pump.close()
    assert not pump.is_alive()


def test_without_the_progress_thread_progress_keeps_notifications_for_recv_notifs():
    import numpy as np

    from kvhandoff.transports.base import KVRegion, MemoryKind
    from kvhandoff.transports.nixl import NixlTransport

    a = NixlTransport("inbox-a", NixlOptions(progress_thread=False))
    b = NixlTransport("inbox-b", NixlOptions(progress_thread=False))
    buffers = [np.zeros(4096, np.uint8) for _ in range(2)]  # registered: peers need memory
    try:
        for t, buf in zip((a, b), buffers, strict=True):
            t.register([KVRegion("r0", buf, 1, 4096, MemoryKind.DRAM, 0, 0)])
        peer_b = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        for i in range(3):
            a.send_notif(peer_b, f"m{i}".encode())
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(b._inbox) + len(got) < 3:  # progress() alone: collected, not handed out
            assert time.monotonic() < deadline, "no notification arrived"
            a.progress()
            b.progress()
        got = [n.message for n in b.recv_notifs()]
        assert got == [b"m0", b"m1", b"m2"]
        b.progress()
        assert b.recv_notifs() == []  # exactly once
    finally:
        a.close()
        b.close()
