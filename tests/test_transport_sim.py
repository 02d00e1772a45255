"""The simulated transport: the shared contract, then what only the sim does.

The sim's own promises are the ones the simulations rely on: it is
deterministic per seed, it never reads the wall clock, its faults do what
they say (drop, duplicate, delay, reorder, fail, slow, partition, crash), and
its block pool makes a read of freed memory visible in the bytes.  A
Hypothesis state machine then mixes all of them at random and checks that
every READ completes exactly once with the right bytes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvhandoff.core.planning import BlockRun, coalesce
from kvhandoff.transports.base import ReadRequest, Transport
from kvhandoff.transports.sim import (
    POISON,
    AgentCrashed,
    LinkModel,
    NotifFaults,
    ReadFaults,
    SendRefused,
    SimBlockPool,
    SimNetwork,
)
from tests.transport_contract import (
    RegionShape,
    TransportContract,
    TransportPair,
    host_regions,
    host_shaped_regions,
)


def sim_pair(p_shapes: list[RegionShape], d_shapes: list[RegionShape],
             seed: int = 0) -> TransportPair:
    net = SimNetwork(seed=seed)
    p, d = net.agent("P0"), net.agent("D0")
    p_regions, p_rows = host_shaped_regions(p_shapes)
    d_regions, d_rows = host_shaped_regions(d_shapes)

    def write(rows):
        def put(i, data):
            rows[i][...] = data
        return put

    return TransportPair(
        p=p, d=d, p_regions=p_regions, d_regions=d_regions,
        write_p=write(p_rows), write_d=write(d_rows), read_d=lambda i: d_rows[i].copy(),
        pump=lambda: _pump(net),
        kill_p=lambda: net.crash("P0"),
    )


def _pump(net: SimNetwork) -> None:
    # Jump to the next thing that happens, but never more than 10 ms at once.
    clock = net.clock
    clock.run_until(max(min(clock.next_time(), clock.now + 0.01), clock.now + 1e-6))


class TestSimTransportContract(TransportContract):
    def make_shaped_pair(self, p_shapes, d_shapes):
        return sim_pair(p_shapes, d_shapes)


# --- fixtures for the sim-only tests -----------------------------------------


def connected(seed: int = 0, link: LinkModel | None = None, num_blocks: int = 16,
              block_bytes: int = 32):
    net = SimNetwork(seed=seed, link=link)
    p, d = net.agent("P0"), net.agent("D0")
    p_regions, p_rows = host_regions("p", num_blocks, block_bytes, 1)
    d_regions, d_rows = host_regions("d", num_blocks, block_bytes, 1)
    p.register(p_regions)
    d.register(d_regions)
    d.add_peer(p.metadata())
    p.add_peer(d.metadata())
    p_rows[0][...] = np.arange(num_blocks, dtype=np.uint8)[:, None]  # block b holds byte b
    return net, p, d, p_rows[0], d_rows[0]


def drain(net, seconds: float = 10.0) -> None:
    net.clock.run_until(net.clock.now + seconds)


def test_sim_transport_follows_the_protocol():
    net = SimNetwork()
    assert isinstance(net.agent("A"), Transport)


def test_the_sim_never_reads_the_wall_clock(monkeypatch):
    def no_wall_clock():
        raise AssertionError("the simulation read the wall clock")

    for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"):
        monkeypatch.setattr(time, name, no_wall_clock)
    net, p, d, _, _ = connected()
    d.post_read("P0", ReadRequest(runs=(BlockRun(0, 0, 4),)), b"done")
    drain(net)
    assert [c.ok for c in d.poll()] == [True]
    assert [n.message for n in p.recv_notifs()] == [b"done"]


def _trace(seed: int) -> list:
    net, p, d, _, _ = connected(seed=seed)
    net.set_notif_faults(NotifFaults(drop=0.2, duplicate=0.2, delay=0.2, delay_s=0.01, reorder=0.5))
    net.read_faults = ReadFaults(fail=0.2, slow=0.3, slow_s=(0.001, 0.01))
    out = []
    for i in range(40):
        d.post_read("P0", ReadRequest(runs=(BlockRun(i % 16, i % 16, 1),)), f"r{i}".encode())
        d.send_notif("P0", f"n{i}".encode())
        net.clock.run_until(net.clock.now + 0.0005)
        out.append((net.clock.now, [(c.handle, c.ok) for c in d.poll()],
                    [n.message for n in p.recv_notifs()]))
    drain(net)
    out.append((d.poll(), p.recv_notifs()))
    return out


def test_one_seed_replays_the_same_faults_and_timings():
    assert _trace(11) == _trace(11)
    assert _trace(11) != _trace(12)


# --- notification faults -------------------------------------------------------


def _send_many(net, d, p, n: int) -> list[bytes]:
    for i in range(n):
        d.send_notif("P0", f"m{i}".encode())
    drain(net)
    return [m.message for m in p.recv_notifs()]


def test_dropped_notifications_never_arrive():
    net, p, d, _, _ = connected()
    net.set_notif_faults(NotifFaults(drop=0.5))
    got = _send_many(net, d, p, 400)
    assert 120 < len(got) < 280
    assert net.stats.notifs_dropped == 400 - len(got)
    assert len(set(got)) == len(got)


def test_a_cap_on_consecutive_drops_is_honoured():
    net, p, d, _, _ = connected()
    net.set_notif_faults(NotifFaults(drop=0.9, max_consecutive_drops=2))
    got = {int(m[1:]) for m in _send_many(net, d, p, 300)}
    missing_run = 0
    for i in range(300):
        missing_run = 0 if i in got else missing_run + 1
        assert missing_run <= 2


def test_a_refused_send_raises_sends_nothing_and_a_read_s_own_notification_is_never_refused():
    """NIXL's send_notif can raise (an endpoint error): the sender knows nothing went,
    unlike a drop; the in-a-row cap holds for refusals too.  A READ's notification
    travels with the READ: no send_notif, nothing to refuse."""
    net, p, d, _, _ = connected()
    net.set_notif_faults(NotifFaults(refuse=0.9, max_consecutive_drops=2))
    refused, run = [], 0
    for i in range(300):
        try:
            d.send_notif("P0", f"m{i}".encode())
            run = 0
        except SendRefused:
            refused.append(i)
            run += 1
            assert run <= 2
    drain(net)
    got = {int(m.message[1:]) for m in p.recv_notifs()}
    assert got == set(range(300)) - set(refused) and len(refused) == net.stats.notifs_refused
    assert len(refused) > 150 and net.stats.notifs_dropped == 0
    assert net.stats.notifs_sent == 300 - len(refused)  # a refused send was never sent
    net.set_notif_faults(NotifFaults(refuse=1.0))
    d.post_read("P0", ReadRequest(runs=(BlockRun(0, 0, 1),)), b"done")
    drain(net)
    assert [m.message for m in p.recv_notifs()] == [b"done"]


def test_duplicated_notifications_arrive_twice():
    net, p, d, _, _ = connected()
    net.set_notif_faults(NotifFaults(duplicate=1.0))
    got = _send_many(net, d, p, 10)
    assert sorted(got) == sorted([f"m{i}".encode() for i in range(10)] * 2)


def test_delay_and_reorder_let_later_notifications_overtake():
    net, p, d, _, _ = connected()
    net.set_notif_faults(NotifFaults(reorder=1.0, reorder_s=0.01))
    for i in range(50):
        d.send_notif("P0", f"{i:03d}".encode())
        net.clock.run_until(net.clock.now + 0.0001)
    drain(net)
    got = [m.message for m in p.recv_notifs()]
    assert sorted(got) == [f"{i:03d}".encode() for i in range(50)]
    assert got != sorted(got)


def test_faults_can_target_one_kind_of_notification():
    net, p, d, _, _ = connected()
    net.kind_of = lambda m: m.split(b":")[0].decode()
    net.set_notif_faults(NotifFaults(drop=1.0), kind="hb")
    d.send_notif("P0", b"hb:1")
    d.send_notif("P0", b"rel:1")
    drain(net)
    assert [m.message for m in p.recv_notifs()] == [b"rel:1"]


# --- READ faults ----------------------------------------------------------------


def test_a_failed_read_copies_nothing_and_sends_no_notification():
    net, p, d, _, d_rows = connected()
    net.read_faults = ReadFaults(fail=1.0)
    d.post_read("P0", ReadRequest(runs=(BlockRun(3, 0, 2),)), b"release")
    drain(net)
    (c,) = d.poll()
    assert not c.ok and c.reason
    assert (d_rows == 0).all()
    assert p.recv_notifs() == []


def test_read_time_follows_latency_bandwidth_and_slow_faults():
    link = LinkModel(read_latency_s=0.001, bandwidth_Bps=32 * 1000.0, jitter_s=0.0)
    net, p, d, _, _ = connected(link=link)
    d.post_read("P0", ReadRequest(runs=(BlockRun(0, 0, 10),)))  # 320 bytes: 10 ms + 1 ms
    net.clock.run_until(0.0109)
    assert d.poll() == []
    net.clock.run_until(0.0111)
    assert [c.ok for c in d.poll()] == [True]
    net.read_faults = ReadFaults(slow=1.0, slow_s=(5.0, 5.0))
    d.post_read("P0", ReadRequest(runs=(BlockRun(0, 0, 1),)))
    net.clock.run_until(net.clock.now + 4.9)
    assert d.poll() == []
    net.clock.run_until(net.clock.now + 0.2)
    assert [c.ok for c in d.poll()] == [True]


def test_a_partition_stalls_a_read_until_it_heals_and_drops_notifications():
    net, p, d, p_rows, d_rows = connected()
    net.partition("P0", "D0", 0.0, 2.0)
    d.post_read("P0", ReadRequest(runs=(BlockRun(4, 4, 1),)), b"release")
    d.send_notif("P0", b"heartbeat")
    net.clock.run_until(1.9)
    assert d.poll() == [] and p.recv_notifs() == []
    p_rows[4] = 99  # P's bytes change while the READ is stalled: D sees the new ones
    net.clock.run_until(2.1)
    assert [c.ok for c in d.poll()] == [True]
    assert (d_rows[4] == 99).all()
    assert [n.message for n in p.recv_notifs()] == [b"release"]


def test_a_partition_longer_than_the_read_timeout_fails_the_read():
    net, p, d, _, _ = connected(link=LinkModel(read_timeout_s=1.0))
    net.partition("P0", "D0", 0.0, 5.0)
    d.post_read("P0", ReadRequest(runs=(BlockRun(0, 0, 1),)))
    net.clock.run_until(0.99)
    assert d.poll() == []
    net.clock.run_until(1.01)
    (c,) = d.poll()
    assert not c.ok and c.reason == "timeout"


def test_heal_all_ends_every_partition_now():
    net, p, d, _, _ = connected()
    net.partition("P0", "D0", 0.0, 100.0)
    net.clock.run_until(1.0)
    net.heal_all()
    d.send_notif("P0", b"x")
    drain(net, 1.0)
    assert [n.message for n in p.recv_notifs()] == [b"x"]


# --- crashes ---------------------------------------------------------------------


def test_a_crashed_reader_gets_nothing_and_releases_the_source_blocks():
    net, p, d, _, _ = connected()
    d.post_read("P0", ReadRequest(runs=(BlockRun(0, 0, 4),)), b"release")
    assert net.reads_in_flight("P0", range(4)) == 4
    net.crash("D0")
    assert net.reads_in_flight("P0", range(4)) == 0
    drain(net)
    assert p.recv_notifs() == []
    with pytest.raises(AgentCrashed):
        d.poll()
    assert p.lost_peers() == ["D0"]


def test_a_read_posted_to_a_dead_peer_fails_once():
    net, p, d, _, _ = connected()
    net.crash("P0")
    drain(net, 1.0)
    assert d.lost_peers() == ["P0"]
    h = d.post_read("P0", ReadRequest(runs=(BlockRun(0, 0, 1),)))
    drain(net, 1.0)
    assert [(c.handle, c.ok) for c in d.poll()] == [(h, False)]


# --- the poisoning block pool ----------------------------------------------------


def test_freed_blocks_are_poisoned_and_reused_first():
    net, p, d, p_rows, _ = connected()
    pool = SimBlockPool([p], 16)
    a = pool.allocate(4)
    b = pool.allocate(2)
    assert a == [0, 1, 2, 3] and b == [4, 5]
    pool.free(a)
    assert (p_rows[a] == POISON).all()
    assert (p_rows[b] != POISON).all()
    assert sorted(pool.allocate(4)) == sorted(a)  # last freed, first reused
    assert pool.allocate(100) is None


def test_freeing_blocks_under_a_read_is_counted_and_shows_in_the_bytes():
    net, p, d, p_rows, d_rows = connected(link=LinkModel(read_latency_s=1.0))
    pool = SimBlockPool([p], 16)
    ids = pool.allocate(4)
    d.post_read("P0", ReadRequest(runs=coalesce(ids, [8, 9, 10, 11])))
    pool.free(ids)
    assert net.stats.freed_under_read == 1  # one free, four blocks under the READ
    drain(net)
    assert [c.ok for c in d.poll()] == [True]
    assert (d_rows[8:12] == POISON).all()  # D really received freed memory


def test_a_double_free_is_counted_and_changes_nothing():
    net, p, d, _, _ = connected()
    pool = SimBlockPool([p], 16)
    ids = pool.allocate(3)
    assert pool.free(ids) == 0
    assert pool.free(ids) == 3
    assert net.stats.double_frees == 3
    assert pool.free_blocks == 16


def test_ranks_free_their_own_copy_and_ids_return_when_all_did():
    net = SimNetwork()
    ranks = [net.agent(f"P{r}") for r in range(2)]
    rows = []
    for r, agent in enumerate(ranks):
        regions, rr = host_regions(f"p{r}", 8, 16, 1)
        agent.register(regions)
        rows.append(rr[0])
    pool = SimBlockPool(ranks, 8)
    ids = pool.allocate(2)
    pool.free(ids, rank=0)
    assert (rows[0][ids] == POISON).all() and (rows[1][ids] == 0).all()
    assert pool.free_blocks == 6
    pool.free(ids, rank=1)
    assert pool.free_blocks == 8
    assert pool.free(ids, rank=1) == 2


def test_freeing_destination_pages_under_a_read_is_counted_separately():
    net, p, d, _, _ = connected(link=LinkModel(read_latency_s=1.0))
    dst_pool = SimBlockPool([d], 16, source=False)
    ids = dst_pool.allocate(2)
    d.post_read("P0", ReadRequest(runs=coalesce([0, 1], ids)))
    dst_pool.free(ids)
    assert net.stats.overwritten_under_read == 1
    assert net.stats.freed_under_read == 0


# --- a stateful model: whatever the faults, the sim keeps its promises -------------

N_BLOCKS = 16


class SimTransportMachine(RuleBasedStateMachine):
    """Drives a P/D pair with random READs, notifications, faults, partitions and a
    crash, next to a small reference model of what must hold."""

    @initialize(seed=st.integers(0, 2**16))
    def start(self, seed):
        self.net, self.p, self.d, self.p_rows, self.d_rows = connected(seed=seed,
                                                                     num_blocks=N_BLOCKS)
        self.posted: dict[int, tuple[list[int], list[int]]] = {}
        self.completed: dict[int, bool] = {}
        self.busy_local: set[int] = set()
        self.sent: dict[bytes, int] = {}
        self.received: dict[bytes, int] = {}
        self.read_notifs: set[bytes] = set()
        self.p_dead = False

    @rule(data=st.data())
    def post_read(self, data):
        free_local = [b for b in range(N_BLOCKS) if b not in self.busy_local]
        if not free_local:
            return
        n = data.draw(st.integers(1, min(4, len(free_local))))
        local = data.draw(st.permutations(free_local))[:n]
        remote = data.draw(st.permutations(range(N_BLOCKS)))[:n]
        notif = f"rel:{len(self.posted)}".encode()
        h = self.d.post_read("P0", ReadRequest(runs=coalesce(remote, local)), notif)
        assert h not in self.posted
        self.posted[h] = (remote, local)
        self.busy_local.update(local)
        self.read_notifs.add(notif)

    @rule(i=st.integers(0, 999))
    def send(self, i):
        msg = f"hb:{i}".encode()
        self.d.send_notif("P0", msg)
        self.sent[msg] = self.sent.get(msg, 0) + 1

    @rule(drop=st.floats(0, 0.5), dup=st.floats(0, 0.5), reorder=st.floats(0, 1))
    def notification_faults(self, drop, dup, reorder):
        self.net.set_notif_faults(NotifFaults(drop=drop, duplicate=dup, reorder=reorder))

    @rule(fail=st.floats(0, 0.5), slow=st.floats(0, 1))
    def read_faults(self, fail, slow):
        self.net.read_faults = ReadFaults(fail=fail, slow=slow, slow_s=(0.0, 0.5))

    @rule(length=st.floats(0.01, 2.0))
    def partition(self, length):
        now = self.net.clock.now
        self.net.partition("P0", "D0", now, now + length)

    @precondition(lambda self: not self.p_dead)
    @rule()
    def crash_p(self):
        self.net.crash("P0")
        self.p_dead = True

    @rule(dt=st.floats(1e-6, 1.0))
    def advance(self, dt):
        self.net.clock.run_until(self.net.clock.now + dt)
        self._collect()

    def _collect(self):
        for c in self.d.poll():
            assert c.handle in self.posted, "a completion for a READ nobody posted"
            assert c.handle not in self.completed, f"handle {c.handle} completed twice"
            self.completed[c.handle] = c.ok
            remote, local = self.posted[c.handle]
            if c.ok:
                assert np.array_equal(self.d_rows[local], self.p_rows[remote])
            else:
                assert c.reason
            self.busy_local.difference_update(local)
        if not self.p_dead:
            for n in self.p.recv_notifs():
                assert n.peer == "D0"
                self.received[n.message] = self.received.get(n.message, 0) + 1

    @invariant()
    def nothing_is_invented(self):
        if not hasattr(self, "received"):
            return
        for msg, count in self.received.items():
            limit = 2 * self.sent.get(msg, 0) or (2 if msg in self.read_notifs else 0)
            assert count <= limit, f"{msg!r} arrived {count} times"

    def teardown(self):
        if not hasattr(self, "net"):
            return
        self.net.heal_all()
        self.net.clock.run_until(self.net.clock.now + 200.0)
        self._collect()
        # Liveness: every READ completed exactly once, whatever happened.
        assert sorted(self.completed) == sorted(self.posted)
        if self.p_dead:
            assert self.d.lost_peers() == ["P0"]


TestSimTransportStateful = SimTransportMachine.TestCase


# --- the clock ---------------------------------------------------------------------


def test_the_clock_runs_callbacks_in_time_order_and_ties_in_scheduling_order():
    from kvhandoff.transports.sim import SimClock

    clock, seen = SimClock(), []
    clock.call_at(2.0, seen.append, "c")
    clock.call_at(1.0, seen.append, "a")
    clock.call_at(1.0, seen.append, "b")
    clock.call_later(0.5, seen.append, "first")
    clock.run_until(1.5)
    assert seen == ["first", "a", "b"] and clock.now == 1.5
    clock.call_at(0.0, seen.append, "late")  # the past is the present
    assert clock.step() and seen[-1] == "late" and clock.now == 1.5
    clock.run_until(10.0)
    assert seen[-1] == "c" and clock.pending() == 0 and not clock.step()
