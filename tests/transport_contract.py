"""The contract every `Transport` must pass (sim, NIXL host memory, NIXL VRAM).

How to run it against a transport
---------------------------------
Subclass `TransportContract` in a ``tests/test_transport_*.py`` module and
implement one hook::

    from tests.transport_contract import RegionShape, TransportContract, TransportPair

    class TestMyTransport(TransportContract):
        def make_shaped_pair(self, p_shapes: list[RegionShape],
                             d_shapes: list[RegionShape]) -> TransportPair:
            ...

pytest collects the subclass only: the base class's name does not start with
``Test``.  Each test calls ``make_shaped_pair`` once (most through
``make_pair``: ``n_regions`` alike) and ``pair.close()`` at the end.

What ``make_shaped_pair`` returns (`TransportPair`)
---------------------------------------------------
* ``p``, ``d``: two transports, **not yet registered and not yet peered**.
  ``p`` owns the source blocks (the prefill side); ``d`` posts the READs.
  ``p`` may be a proxy for an agent in another process, as long as it
  follows the protocol.
* ``p_regions``, ``d_regions``: one `KVRegion` per shape, in order, for the
  test to register, in the pair's memory (GPU memory for a VRAM pair);
  a shape with ``host=True`` is host memory whatever the pair's kind (a
  hierarchical sparse cache's pool, next to its GPU tail; on a host-memory
  pair the two are simply two host pools).
* ``write_p(i, rows)``, ``write_d(i, rows)``: overwrite region ``i`` on that
  side with ``rows`` (a ``(num_blocks, block_stride)`` uint8 array: each
  block's bytes, then for a strided shape the bytes up to the next block);
  ``read_d(i)``: a copy of D's region ``i`` as such an array.  A shape with a
  ``stride`` is a region of ``num_blocks`` rows of ``stride`` bytes whose
  `KVRegion` has that stride: only each row's first ``block_bytes`` are the
  region's, and a READ must never write the rest.  For host
  memory these are plain numpy copies; for VRAM, copies through the host.
* ``pump()``: make some progress and return; the tests call it in loops
  (at most ``MAX_PUMPS`` times) until what they wait for happens.  The sim
  advances its clock; a real transport polls or sleeps briefly.
* ``kill_p()``: the producer dies now, without any goodbye (SIGKILL for a
  process, a crash for the sim).  A READ that was posted but not yet pumped
  must then complete with ``ok=False``, and ``d.lost_peers()`` must name the
  producer within ``MAX_PUMPS`` pumps.
* ``close()``: free everything (called even when a test fails).

The tests are transport-neutral: they use only the protocol, these hooks and
the typed errors of `kvhandoff.transports.base`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvhandoff.core.planning import BlockRun, coalesce, plan_group_reads, route_tail
from kvhandoff.transports.base import (
    Completion,
    KVRegion,
    PeerNotReady,
    ReadRequest,
    ReadSplit,
    Transport,
    TransportError,
    UnknownPeer,
    group_splits,
)
from tests.hybrid_layouts import D_IDS, EXPECTED, MAIN_KV, NUM_BLOCKS, NUM_TOKENS, P_IDS, qsa_layout

SENTINEL = 0x5A  # what D's blocks hold before a READ; must survive where nothing was read


@dataclass
class TransportPair:
    p: Transport
    d: Transport
    p_regions: list[KVRegion]
    d_regions: list[KVRegion]
    write_p: Callable[[int, np.ndarray], None]
    write_d: Callable[[int, np.ndarray], None]
    read_d: Callable[[int], np.ndarray]
    pump: Callable[[], None]
    kill_p: Callable[[], None]
    close: Callable[[], None] = field(default=lambda: None)


@dataclass(frozen=True, slots=True)
class RegionShape:
    """One region a test wants: ``num_blocks`` x ``block_bytes``; ``host``: never GPU memory;
    ``stride``: bytes from block to block (0: ``block_bytes``)."""

    name: str
    num_blocks: int
    block_bytes: int
    host: bool = False
    stride: int = 0

    @property
    def block_stride(self) -> int:
        return self.stride or self.block_bytes


def uniform_shapes(num_blocks: int, block_bytes: int, n_regions: int) -> list[RegionShape]:
    return [RegionShape(f"layer{i}.kv", num_blocks, block_bytes) for i in range(n_regions)]


def host_shaped_regions(shapes: list[RegionShape]) -> tuple[list[KVRegion], list[np.ndarray]]:
    """Numpy-backed regions for ``shapes`` and their ``(num_blocks, block_stride)`` rows."""
    rows = [np.zeros((s.num_blocks, s.block_stride), dtype=np.uint8) for s in shapes]
    return [KVRegion(s.name, r, s.num_blocks, s.block_bytes, stride=s.stride)
            for s, r in zip(shapes, rows, strict=True)], rows


def host_regions(prefix: str, num_blocks: int, block_bytes: int, n_regions: int,
                 names: list[str] | None = None) -> tuple[list[KVRegion], list[np.ndarray]]:
    """``n_regions`` numpy-backed regions and their ``(num_blocks, block_bytes)`` rows."""
    names = names or [f"layer{i}.kv" for i in range(n_regions)]
    rows = [np.zeros((num_blocks, block_bytes), dtype=np.uint8) for _ in names]
    return [KVRegion(n, r, num_blocks, block_bytes) for n, r in zip(names, rows, strict=True)], rows


class TransportContract:
    """The contract suite.  Subclasses implement `make_pair`."""

    MAX_PUMPS = 20_000
    NUM_BLOCKS = 64
    BLOCK_BYTES = 256

    def make_shaped_pair(self, p_shapes: list[RegionShape],
                         d_shapes: list[RegionShape]) -> TransportPair:
        raise NotImplementedError

    def make_pair(self, num_blocks: int, block_bytes: int, n_regions: int) -> TransportPair:
        shapes = uniform_shapes(num_blocks, block_bytes, n_regions)
        return self.make_shaped_pair(shapes, shapes)

    # -- helpers ----------------------------------------------------------

    @pytest.fixture
    def pair(self):
        pair = self.make_pair(self.NUM_BLOCKS, self.BLOCK_BYTES, 3)
        try:
            yield pair
        finally:
            pair.close()

    def connect(self, pair: TransportPair) -> tuple[str, str]:
        """Register both sides and exchange metadata; return (P's name, D's name)."""
        pair.p.register(pair.p_regions)
        pair.d.register(pair.d_regions)
        p_name = pair.d.add_peer(pair.p.metadata())
        d_name = pair.p.add_peer(pair.d.metadata())
        return p_name, d_name

    def fill(self, pair: TransportPair, seed: int = 1) -> list[np.ndarray]:
        """Random source bytes on P (the bytes between strided blocks too), the sentinel
        on D; returns P's ``(num_blocks, block_stride)`` rows."""
        rng = np.random.default_rng(seed)
        source = []
        for i, region in enumerate(pair.p_regions):
            rows = rng.integers(0, 256, (region.num_blocks, region.block_stride), dtype=np.uint8)
            rows[rows == SENTINEL] = SENTINEL + 1  # so "untouched" is unambiguous
            pair.write_p(i, rows)
            source.append(rows)
        for i, region in enumerate(pair.d_regions):
            pair.write_d(i, np.full((region.num_blocks, region.block_stride), SENTINEL, np.uint8))
        return source

    def wait(self, pair: TransportPair, done: Callable[[], bool], what: str) -> None:
        for _ in range(self.MAX_PUMPS):
            if done():
                return
            pair.pump()
        raise AssertionError(f"gave up waiting for {what} after {self.MAX_PUMPS} pumps")

    def settled_completions(self, pair: TransportPair, what: str) -> list[Completion]:
        """D's completions once the first came and 50 more pumps brought nothing else
        (a split READ must complete once, not once per part)."""
        done: list[Completion] = []
        self.wait(pair, lambda: bool(done.extend(pair.d.poll()) or done), what)
        for _ in range(50):
            pair.pump()
            done.extend(pair.d.poll())
        return done

    def read_all(self, pair: TransportPair, peer: str, reads: list[ReadRequest],
                 notif: bytes | None = None) -> dict[int, Completion]:
        """Post ``reads``, pump until each completed, and return completions by handle."""
        handles = [pair.d.post_read(peer, r, notif) for r in reads]
        done: dict[int, Completion] = {}

        def collect() -> bool:
            for c in pair.d.poll():
                assert c.handle not in done, f"handle {c.handle} completed twice"
                done[c.handle] = c
            return len(done) == len(handles)

        self.wait(pair, collect, f"{len(handles)} READ completions")
        assert sorted(done) == sorted(handles)
        return done

    # -- registration and peers ---------------------------------------------

    def test_register_metadata_and_add_peer_name_each_other(self, pair):
        p_name, d_name = self.connect(pair)
        assert p_name == pair.p.name
        assert d_name == pair.d.name
        assert p_name != d_name

    def test_metadata_from_before_registration_is_refused_until_refetched(self, pair):
        stale = pair.p.metadata()
        with pytest.raises(PeerNotReady):
            pair.d.add_peer(stale)
        pair.p.register(pair.p_regions)
        pair.d.register(pair.d_regions)
        assert pair.d.add_peer(pair.p.metadata()) == pair.p.name

    def test_calls_naming_an_unknown_peer_raise_unknown_peer(self, pair):
        self.connect(pair)
        read = ReadRequest(runs=(BlockRun(0, 0, 1),))
        with pytest.raises(UnknownPeer):
            pair.d.post_read("no-such-agent", read)
        with pytest.raises(UnknownPeer):
            pair.d.send_notif("no-such-agent", b"hello")

    def test_a_read_outside_the_registered_blocks_is_refused(self, pair):
        p_name, _ = self.connect(pair)
        with pytest.raises(TransportError):
            pair.d.post_read(p_name, ReadRequest(runs=(BlockRun(self.NUM_BLOCKS - 1, 0, 2),)))

    # -- READs ----------------------------------------------------------------

    @pytest.mark.parametrize("pattern", ["one_block", "contiguous", "shuffled", "mixed"])
    def test_read_copies_exactly_the_requested_blocks(self, pair, pattern):
        p_name, _ = self.connect(pair)
        source = self.fill(pair)
        rng = np.random.default_rng(7)
        n = self.NUM_BLOCKS
        if pattern == "one_block":
            remote, local = [5], [9]
        elif pattern == "contiguous":
            remote, local = list(range(8, 24)), list(range(30, 46))
        elif pattern == "shuffled":
            remote = [int(b) for b in rng.permutation(n)[: n // 2]]
            local = [int(b) for b in rng.permutation(n)[: n // 2]]
        else:  # runs of various lengths, in no particular order
            remote = [3, 4, 5, 40, 41, 17, 60, 61, 62, 63, 0]
            local = [10, 11, 12, 2, 3, 50, 20, 21, 22, 23, 33]
        runs = coalesce(remote, local)
        if pattern == "contiguous":
            assert len(runs) == 1
        (c,) = self.read_all(pair, p_name, [ReadRequest(runs=runs)]).values()
        assert c.ok, c.reason
        for i in range(len(pair.d_regions)):
            got = pair.read_d(i)
            for r, loc in zip(remote, local, strict=True):
                assert np.array_equal(got[loc], source[i][r]), f"region {i}: block {r}->{loc}"
            untouched = np.setdiff1d(np.arange(n), local)
            assert (got[untouched] == SENTINEL).all(), f"region {i}: a block nobody asked for changed"

    def test_a_read_of_some_regions_leaves_the_others_untouched(self, pair):
        p_name, _ = self.connect(pair)
        source = self.fill(pair)
        chosen = pair.d_regions[1].name
        read = ReadRequest(runs=coalesce([1, 2, 3], [4, 5, 6]), regions=(chosen,))
        (c,) = self.read_all(pair, p_name, [read]).values()
        assert c.ok, c.reason
        assert np.array_equal(pair.read_d(1)[4:7], source[1][1:4])
        for i in (0, 2):
            assert (pair.read_d(i) == SENTINEL).all()

    def test_a_split_read_lands_each_part_where_it_is_paired_with_one_completion(self, pair):
        """Splits by destination (say a GPU tail and a host pool): one handle, one completion."""
        p_name, _ = self.connect(pair)
        source = self.fill(pair)
        names = [r.name for r in pair.d_regions]
        tail = ReadSplit(coalesce([10, 11], [0, 1]), ((names[0], names[1]),))  # crossed names
        pool = ReadSplit(coalesce([3, 7, 8], [20, 21, 22]), ((names[2], names[2]),))
        handle = pair.d.post_split_read(p_name, [tail, pool])
        done = self.settled_completions(pair, "the split READ")
        assert [(c.handle, c.ok) for c in done] == [(handle, True)], done
        assert np.array_equal(pair.read_d(1)[0:2], source[0][10:12])
        assert np.array_equal(pair.read_d(2)[20:23], source[2][[3, 7, 8]])
        assert (pair.read_d(0) == SENTINEL).all()
        assert (np.delete(pair.read_d(1), [0, 1], axis=0) == SENTINEL).all()

    def test_each_completion_is_reported_exactly_once(self, pair):
        p_name, _ = self.connect(pair)
        self.fill(pair)
        reads = [ReadRequest(runs=(BlockRun(i, i, 1),)) for i in range(0, 32, 2)]
        done = self.read_all(pair, p_name, reads)
        assert all(c.ok for c in done.values())
        for _ in range(50):  # nothing more ever comes
            pair.pump()
            assert pair.d.poll() == []

    def test_the_read_notification_reaches_the_source_only_after_the_bytes_landed(self, pair):
        p_name, d_name = self.connect(pair)
        source = self.fill(pair)
        remote, local = list(range(10, 30)), list(range(20, 40))
        pair.d.post_read(p_name, ReadRequest(runs=coalesce(remote, local)), b"release:req-1")
        seen: list = []

        def delivered() -> bool:
            got = pair.p.recv_notifs()
            if got:
                # Whenever P hears of the READ, D already holds every byte.
                for i in range(len(pair.d_regions)):
                    assert np.array_equal(pair.read_d(i)[20:40], source[i][10:30])
                seen.extend(got)
            return bool(seen)

        self.wait(pair, delivered, "the READ's notification at P")
        assert [(n.peer, n.message) for n in seen] == [(d_name, b"release:req-1")]
        completions: list[Completion] = []
        self.wait(pair, lambda: bool(completions.extend(pair.d.poll()) or completions),
                  "the READ's completion at D")
        assert [c.ok for c in completions] == [True]

    @pytest.mark.parametrize("strided", ["p", "d", "both"])
    def test_a_strided_read_lands_each_block_and_never_writes_between_blocks(self, strided):
        """Regions whose blocks sit ``stride`` bytes apart (a HiSparse D's indexer pages in
        rows shared with groups never read): every block lands; no byte between blocks moves."""
        n, bb = self.NUM_BLOCKS, self.BLOCK_BYTES

        def shapes(side: str, strides: tuple[int, int]) -> list[RegionShape]:
            on = strided in (side, "both")
            return [RegionShape(f"layer{i}.kv", n, bb, stride=s if on else 0)
                    for i, s in enumerate(strides)]

        # different strides on P and D, and per region; 3 * bb: whole rows skipped
        pair = self.make_shaped_pair(shapes("p", (bb + 64, 3 * bb)),
                                     shapes("d", (2 * bb, bb + 128)))
        try:
            p_name, _ = self.connect(pair)
            source = self.fill(pair)
            rng = np.random.default_rng(5)
            remote = [*range(0, 12), *(int(b) for b in rng.permutation(np.arange(12, n))[:20])]
            local = [*range(40, 52), *(int(b) for b in rng.permutation(np.arange(0, 40))[:20])]
            remote += [n - 1]
            local += [n - 1]  # the last block: its span ends with the region
            runs = coalesce(remote, local)
            (c,) = self.read_all(pair, p_name, [ReadRequest(runs=runs)], b"release:strided")\
                .values()
            assert c.ok, c.reason
            for i, region in enumerate(pair.d_regions):
                got = pair.read_d(i)
                assert got.shape == (n, region.block_stride)
                for r, loc in zip(remote, local, strict=True):
                    assert np.array_equal(got[loc, :bb], source[i][r, :bb]), \
                        f"region {i}: block {r}->{loc}"
                assert (got[:, bb:] == SENTINEL).all(), f"region {i}: a byte between blocks changed"
                untouched = np.setdiff1d(np.arange(n), local)
                assert (got[untouched] == SENTINEL).all(), f"region {i}: an unread block changed"
        finally:
            pair.close()

    # -- notifications --------------------------------------------------------

    def test_notifications_travel_both_ways_with_their_sender(self, pair):
        p_name, d_name = self.connect(pair)
        sent = [f"hb:{i}".encode() for i in range(5)]
        for m in sent:
            pair.d.send_notif(p_name, m)
        pair.p.send_notif(d_name, b"ack:1")
        at_p: list = []
        at_d: list = []

        def all_in() -> bool:
            at_p.extend(pair.p.recv_notifs())
            at_d.extend(pair.d.recv_notifs())
            return len(at_p) >= len(sent) and len(at_d) >= 1

        self.wait(pair, all_in, "notifications in both directions")
        assert sorted(n.message for n in at_p) == sorted(sent)
        assert {n.peer for n in at_p} == {d_name}
        assert [(n.peer, n.message) for n in at_d] == [(p_name, b"ack:1")]

    # -- failures -------------------------------------------------------------

    def test_a_peer_that_dies_mid_read_fails_the_read_and_is_reported_lost(self, pair):
        p_name, _ = self.connect(pair)
        self.fill(pair)
        handle = pair.d.post_read(p_name, ReadRequest(runs=coalesce(range(64), range(64))),
                                  b"release:req-2")
        pair.kill_p()
        completions: list[Completion] = []
        self.wait(pair, lambda: bool(completions.extend(pair.d.poll()) or completions),
                  "the failed completion")
        assert [(c.handle, c.ok) for c in completions] == [(handle, False)]
        assert completions[0].reason
        self.wait(pair, lambda: p_name in pair.d.lost_peers(), "the dead peer in lost_peers()")
        for _ in range(20):
            pair.pump()
            assert pair.d.poll() == []  # the failure is reported once

    # -- hybrid models: several cache owners, one request -----------------------

    def _hybrid_pair(self, d_shapes: list[RegionShape] | None = None) -> TransportPair:
        layout = qsa_layout()
        p_shapes = [RegionShape(r.name, NUM_BLOCKS, r.block_bytes) for r in layout.regions()]
        return self.make_shaped_pair(p_shapes, d_shapes or p_shapes)

    def _post_and_check(self, pair: TransportPair, splits: list[ReadSplit],
                        expect: dict[str, dict[int, tuple[str, int]]], nbytes: int) -> None:
        """One split READ with a notification: one completion, every byte where expected.

        ``expect[d region][local block] = (p region, remote block)``; every other
        block of every D region must still hold the sentinel, and the bytes that
        changed must add up to ``nbytes``, what the plan said it would read.
        """
        p_name, d_name = self.connect(pair)
        source = self.fill(pair)
        p_index = {r.name: i for i, r in enumerate(pair.p_regions)}

        def check_d() -> None:
            changed = 0
            for i, region in enumerate(pair.d_regions):
                got, want = pair.read_d(i), expect.get(region.name, {})
                for local, (remote_region, remote) in want.items():
                    assert np.array_equal(got[local], source[p_index[remote_region]][remote]), \
                        f"{region.name}[{local}] is not {remote_region}[{remote}]"
                others = np.setdiff1d(np.arange(region.num_blocks), list(want))
                assert (got[others] == SENTINEL).all(), f"{region.name}: a block nobody read changed"
                changed += len(want) * region.block_bytes
            assert changed == nbytes

        handle = pair.d.post_split_read(p_name, splits, b"release:hybrid")
        heard: list = []

        def delivered() -> bool:
            got = pair.p.recv_notifs()
            if got:
                check_d()  # P hears of the READ only once every group's bytes landed
                heard.extend(got)
            return bool(heard)

        self.wait(pair, delivered, "the hybrid READ's notification at P")
        assert [(n.peer, n.message) for n in heard] == [(d_name, b"release:hybrid")]
        done = self.settled_completions(pair, "the completion")
        assert [(c.handle, c.ok) for c in done] == [(handle, True)], done
        check_d()

    def test_a_multi_owner_request_is_one_completion_of_every_groups_split(self):
        """Main KV + indexer + GDN state + PLE + a sliding window sharing the main KV's regions."""
        layout = qsa_layout()
        plan = plan_group_reads(layout, layout, P_IDS, D_IDS, NUM_TOKENS)
        assert plan.keys == tuple((0, g) for g in range(5))
        expect: dict[str, dict[int, tuple[str, int]]] = {}
        for g, (remote, local) in EXPECTED.items():  # written out in hybrid_layouts, not planned
            for region in layout.groups[g].regions:
                for r, loc in zip(remote, local, strict=True):
                    expect.setdefault(region.name, {})[loc] = (region.name, r)
        splits = group_splits(plan.reads)
        pair = self._hybrid_pair()
        try:
            self._post_and_check(pair, splits, expect, plan.nbytes)
        finally:
            pair.close()

    def test_a_hisparse_import_lands_history_in_a_host_pool_and_the_tail_beside_it(self):
        """History into a host pool, the writable tail (and the indexer) into the pair's
        memory, GPU memory on a VRAM pair: one completion."""
        layout = qsa_layout()
        d_shapes = ([RegionShape(f"{r.name}@pool", NUM_BLOCKS, r.block_bytes, host=True)
                     for r in MAIN_KV]
                    + [RegionShape(f"{r.name}@tail", 8, r.block_bytes) for r in MAIN_KV]
                    + [RegionShape("indexer.0", NUM_BLOCKS, 128)])
        # The tail has its own slots: 0 and 1 name tail slots *and* pool blocks, and the
        # pool blocks D planned for the tail's positions (61, 62) are not written.
        pool_slots, tail_slots = [33, 34, 0, 60, 1], [0, 1]
        d_ids = [[*pool_slots, 61, 62], D_IDS[1], [], [], []]
        plan = plan_group_reads(layout, layout, P_IDS, d_ids, NUM_TOKENS)
        assert plan.skipped == (2, 3, 4)
        main, indexer = plan.reads
        routed = route_tail(main, tail_slots)

        def landing(src: str, slots: list[int], blocks: list[int]) -> dict[int, tuple[str, int]]:
            return {s: (src, b) for s, b in zip(slots, blocks, strict=True)}

        expect = {"indexer.0": landing("indexer.0", D_IDS[1], P_IDS[1])}
        for r in MAIN_KV:
            expect[f"{r.name}@pool"] = landing(r.name, pool_slots, P_IDS[0][:5])
            expect[f"{r.name}@tail"] = landing(r.name, tail_slots, P_IDS[0][5:])
        splits = group_splits([routed, indexer])
        assert len(splits) == 3
        pair = self._hybrid_pair(d_shapes)
        try:
            self._post_and_check(pair, splits, expect, plan.nbytes)
        finally:
            pair.close()
