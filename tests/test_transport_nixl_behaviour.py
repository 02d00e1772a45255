"""What the NIXL transport does beyond the shared contract.

Two kinds of test:

* Error mapping and handle hygiene run against `FakeAgent`, a stand-in for
  ``nixl_agent`` that fails on cue with exceptions named like NIXL's, so each
  failure path is exercised deterministically and every transfer handle can
  be counted.
* Everything else runs real NIXL over UCX between this process (D) and a
  spawned producer (P), with every byte checked.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from collections import Counter
from typing import Any

import numpy as np
import orjson
import pytest
from structlog.testing import capture_logs

pytest.importorskip("nixl")

from conftest import wait_for  # noqa: E402

from kvhandoff.core.planning import BlockRun, coalesce  # noqa: E402
from kvhandoff.transports.base import (  # noqa: E402
    KVRegion,
    MemoryKind,
    PeerNotReady,
    ReadRequest,
    RegionMismatch,
    Transport,
    TransportError,
    UnknownPeer,
)
from kvhandoff.transports.nixl import (  # noqa: E402
    PROBE,
    UCX_DEFAULTS,
    InvalidRead,
    NixlOptions,
    NixlTransport,
    PeerUnreachable,
    ReadSplit,
    TransportProcess,
    apply_ucx_defaults,
    runs_array,
    wire,  # noqa: E402
)
from kvhandoff.transports.nixl import transport as transport_module  # noqa: E402
from kvhandoff.transports.nixl.memory import locate, plan_registrations  # noqa: E402

# --- a scripted stand-in for nixl_agent --------------------------------------------


class nixlRemoteDisconnectError(Exception):  # noqa: N801 - named like NIXL's
    pass


class nixlBackendError(Exception):  # noqa: N801
    pass


class FakeAgent:
    """Enough of ``nixl_agent`` for the transport; transfers finish when told to."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.made = 0
        self.released: Counter[int] = Counter()
        self.state: dict[int, str | Exception] = {}
        self.fail_transfer: list[Exception | str] = []  # consumed one per transfer()
        self.sent: list[tuple[str, bytes]] = []
        self.send_error: Exception | None = None
        self.incoming: list[dict[str, list[bytes]] | Exception] = []
        self.dlists: Counter[str] = Counter()  # descriptor lists prepared and not released
        self.unloaded: list[str] = []  # remote agents removed

    # registration, metadata, descriptor lists
    def register_memory(self, rows, kind):
        return ("reg", tuple(rows), kind)

    def deregister_memory(self, descs):
        pass

    def prep_xfer_dlist(self, agent, rows, kind):
        self.dlists[agent] += 1
        return ("dlist", agent, kind, len(rows))

    def release_dlist_handle(self, handle):
        self.dlists[handle[1]] -= 1

    def get_agent_metadata(self):
        return b"nixl-md:" + self.name.encode()

    def add_remote_agent(self, blob):
        return blob.split(b":", 1)[1].decode()

    def remove_remote_agent(self, name):
        self.unloaded.append(name)

    def get_xfer_descs(self, rows, kind):
        return rows

    def check_remote_metadata(self, name, descs):
        return True

    # transfers
    def make_prepped_xfer(self, op, local, lidx, remote, ridx, notif):
        assert op == "READ" and len(lidx) == len(ridx)
        self.made += 1
        self.state[self.made] = "PROC"
        return self.made

    def transfer(self, xfer):
        if self.fail_transfer:
            outcome = self.fail_transfer.pop(0)
            self.state[xfer] = "ERR"  # a failed post leaves nothing in flight
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return "PROC"

    def check_xfer_state(self, xfer):
        s = self.state[xfer]
        if isinstance(s, Exception):
            raise s
        return s

    def release_xfer_handle(self, xfer):
        assert self.state[xfer] != "PROC", "released a transfer still in flight"
        self.released[xfer] += 1

    def send_notif(self, peer, message):
        if self.send_error is not None:
            raise self.send_error
        self.sent.append((peer, message))

    def get_new_notifs(self):  # ``incoming``: what each call returns (or raises), then {}
        if not self.incoming:
            return {}
        got = self.incoming.pop(0)
        if isinstance(got, Exception):
            raise got
        return got


LAYERS = ("layer0", "layer1")


@pytest.fixture
def fake(monkeypatch):
    """A D transport over a `FakeAgent`, already peered with a producer "P"."""
    agents: dict[str, FakeAgent] = {}

    def create(name: str, options: Any) -> FakeAgent:
        agents[name] = FakeAgent(name)
        return agents[name]

    monkeypatch.setattr(transport_module, "create_agent", create)
    p, d = NixlTransport("P"), NixlTransport("D")
    for t in (p, d):
        t.register([KVRegion(f"layer{i}", np.zeros((16, 64), np.uint8), 16, 64)
                    for i in range(2)] + [KVRegion("tail", np.zeros((4, 64), np.uint8), 4, 64)])
    assert d.add_peer(p.metadata()) == "P"
    agents["D"].p_metadata = p.metadata()  # P's handshake, for tests that forge one
    return d, agents["D"]


def all_released_once(agent: FakeAgent) -> bool:
    return sorted(agent.released) == list(range(1, agent.made + 1)) and \
        set(agent.released.values()) == {1}


class _Kernel:
    """A CUDA IPC gather's event, without a GPU: running until ``synchronize``."""

    def __init__(self) -> None:
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def test_close_waits_for_a_gather_kernel_before_unmapping_what_it_copies(fake, monkeypatch):
    """A kernel cannot be cancelled: past ``close_timeout_s`` close waits on its event (it
    handed the GatherRead to NIXL's release, which is no NIXL handle, and unmapped the
    peer's memory under the running kernel)."""
    from kvhandoff.transports.nixl.cuda_ipc import GatherRead

    d, agent = fake
    kernel = _Kernel()
    monkeypatch.setattr(d, "_gather_pairs", lambda peer, group: (0, ["pair"]))
    monkeypatch.setattr(d._gatherer, "gather", lambda *a: GatherRead(kernel))
    d.post_read("P", ReadRequest((BlockRun(0, 0, 4),), LAYERS))
    assert d.poll() == []  # the kernel runs
    d.close_timeout_s = 0.0
    with capture_logs() as logs:
        d.close()
    assert kernel.waited and agent.made == 0 and not agent.released
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "nixl.close_abandons_read"]


def test_a_peer_that_fails_to_go_still_hands_out_the_completion_it_waited_for(fake, monkeypatch):
    """Removing a peer with a READ in flight drops it when the READ ends; a NIXL error on
    the way (releasing its descriptor list) must not lose that READ's completion."""
    d, agent = fake
    h = d.post_read("P", ReadRequest(coalesce([1, 2], [3, 4]), LAYERS))
    d.remove_peer("P")

    def refuse(handle):
        raise RuntimeError("NIXL_ERR_BACKEND")
    monkeypatch.setattr(agent, "release_dlist_handle", refuse)
    agent.state[1] = "DONE"
    with capture_logs():
        (c,) = d.poll()
    assert (c.handle, c.ok) == (h, True) and "P" not in d._peers and all_released_once(agent)


def test_it_is_a_transport(fake):
    d, _ = fake
    assert isinstance(d, Transport)


def test_a_failed_post_completes_once_with_its_reason_and_leaks_no_handle(fake):
    d, agent = fake
    agent.fail_transfer = [nixlBackendError("NIXL_ERR_BACKEND")]
    h = d.post_read("P", ReadRequest(coalesce([1, 2, 3], [4, 5, 6]), LAYERS), b"rel")
    (c,) = d.poll()
    assert (c.handle, c.ok) == (h, False)
    assert "failed post" in c.reason and "nixlBackendError" in c.reason
    assert d.poll() == []
    assert all_released_once(agent)
    assert d.lost_peers() == []  # a backend error is not a lost peer


def test_a_remote_disconnect_fails_the_read_and_marks_the_peer_lost(fake):
    d, agent = fake
    h = d.post_read("P", ReadRequest((BlockRun(0, 0, 4),), LAYERS))
    assert d.poll() == []
    agent.state[1] = nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
    with capture_logs() as logs:
        (c,) = d.poll()
    assert (c.handle, c.ok) == (h, False) and "remote disconnect" in c.reason
    assert d.lost_peers() == ["P"]
    assert any(e["event"] == "nixl.peer_lost" and e["peer"] == "P" for e in logs)
    assert all_released_once(agent)
    # A READ posted to a lost peer fails at once, without touching NIXL.
    h2 = d.post_read("P", ReadRequest((BlockRun(0, 0, 1),), LAYERS))
    assert [(c.handle, c.ok, c.reason) for c in d.poll()] == [(h2, False, "failed post: peer lost")]
    assert agent.made == 1


def _reheader(metadata: bytes, **changes) -> bytes:
    """``metadata`` with its kvhandoff header changed, NIXL's own part as it was."""
    start = len(wire.MAGIC) + 4
    (n,) = struct.unpack_from("<I", metadata, len(wire.MAGIC))
    header = orjson.loads(metadata[start:start + n]) | changes
    body = orjson.dumps(header)
    return wire.MAGIC + struct.pack("<I", len(body)) + body + metadata[start + n:]


def test_metadata_naming_another_agent_than_its_nixl_part_is_refused_and_reads_go_on(fake):
    """A header saying "Q" over P's NIXL metadata would have replaced P's entry (and the READs
    it tracks) without the re-announce guard: refused, P kept as it was, its READ completes."""
    d, agent = fake
    h = d.post_read("P", ReadRequest((BlockRun(0, 0, 2),), LAYERS))
    forged = _reheader(agent.p_metadata, agent="Q")
    with pytest.raises(TransportError, match="metadata of agent 'Q' carries NIXL metadata of "
                                             "agent 'P'"):
        d.add_peer(forged)
    assert agent.unloaded == []  # P, held, is not unloaded under its READ
    agent.state[h] = "DONE"
    (done,) = d.poll()
    assert done.handle == h and done.ok


@pytest.mark.parametrize("regions", [
    [["layer0", "DRAM", 0, 2**63, 64, 16]],  # an address past int64
    [["layer0", "DRAM", 0, 4096, 2**62, 4]],  # a span past int64
    [["layer0", "DRAM", 0, 4096, 64, 16], ["tail", "DRAM", 0, 2**63, 64, 4]],  # the second
], ids=["address", "span", "second-region"])
def test_metadata_describing_unreadable_memory_is_a_transport_error_that_keeps_nothing(
        fake, regions):
    d, agent = fake
    d.remove_peer("P")
    before = +agent.dlists
    with pytest.raises(TransportError, match="describes memory this agent cannot read"):
        d.add_peer(_reheader(agent.p_metadata, regions=regions))
    assert "P" not in d._peers and agent.unloaded[-1] == "P" and +agent.dlists == before


def test_a_cuda_ipc_offer_that_is_no_list_is_no_offer(fake):
    d, agent = fake
    d.remove_peer("P")
    d.options = dataclasses.replace(d.options, vram_ipc=True)
    # Pinned host memory here, as a HiSparse pool: where an offer from this node is mapped.
    d._placements = {k: dataclasses.replace(v, pinned=True) for k, v in d._placements.items()}
    forged = _reheader(agent.p_metadata, ipc={"node": transport_module.node_id(),
                                                     "allocations": 1})
    assert d.add_peer(forged) == "P" and d._peers["P"].ipc_offer is None


def test_a_split_read_completes_once_after_every_split_drained_even_when_one_failed(fake):
    d, agent = fake
    splits = [ReadSplit(coalesce([0, 1], [0, 1]), (("layer0", "layer0"),)),
              ReadSplit(coalesce([5], [2]), (("layer1", "tail"),))]
    h = d.post_split_read("P", splits, b"release:r1")
    assert agent.made == 2  # one NIXL transfer per split
    agent.state[1] = nixlBackendError("NIXL_ERR_BACKEND")
    assert d.poll() == []  # the failed split waits for the other to drain
    agent.state[2] = "DONE"
    (c,) = d.poll()
    assert (c.handle, c.ok) == (h, False)
    assert agent.sent == []  # a failed READ does not tell P its blocks were read
    assert all_released_once(agent)


def test_a_split_read_notifies_the_source_only_after_the_last_split_landed(fake):
    d, agent = fake
    splits = [ReadSplit(coalesce([0], [0]), (("layer0", "layer0"),)),
              ReadSplit(coalesce([1], [3]), (("layer1", "tail"),))]
    h = d.post_split_read("P", splits, b"release:r2")
    agent.state[2] = "DONE"
    assert d.poll() == [] and agent.sent == []
    agent.state[1] = "DONE"
    assert [(c.handle, c.ok) for c in d.poll()] == [(h, True)]
    assert agent.sent == [("P", b"release:r2")]


@pytest.mark.parametrize("error, lost", [(nixlRemoteDisconnectError("gone"), True),
                                          (nixlBackendError("NIXL_ERR_BACKEND"), False)])
def test_a_read_whose_notification_cannot_be_sent_fails_and_only_a_disconnect_loses_the_peer(
        fake, error, lost):
    """The READ's completion notification is not sent: the READ fails (its reader was to
    tell P with it), and the peer is lost on a remote disconnect only, as for any send."""
    d, agent = fake
    h = d.post_split_read("P", [ReadSplit(coalesce([0], [0]), (("layer0", "layer0"),)),
                                ReadSplit(coalesce([0], [0]), (("layer1", "layer1"),))], b"r")
    agent.state[1] = agent.state[2] = "DONE"
    agent.send_error = error
    (c,) = d.poll()
    assert (c.handle, c.ok) == (h, False) and "notification" in c.reason
    d.probe_interval_s = 0.0
    agent.send_error = error if lost else None
    assert d.lost_peers() == (["P"] if lost else [])


def test_a_send_that_fails_raises_and_only_a_disconnect_loses_the_peer(fake):
    """A failed send is the caller's to retry (D does not log a heartbeat it never sent);
    errors that may pass, any number of them, probes included, never give a live peer up:
    a P that dropped its D answered none of D's heartbeats, and a D that dropped its P
    stopped heartbeating it while its READ was in flight, so P freed under the READ."""
    d, agent = fake
    agent.send_error = nixlBackendError("NIXL_ERR_BACKEND")
    for _ in range(5):
        with pytest.raises(TransportError, match="notification to 'P' failed.*nixlBackendError"):
            d.send_notif("P", b"hb")
        d.probe_interval_s = 0.0
        assert d.lost_peers() == []
    agent.send_error = None
    d.send_notif("P", b"hb")
    assert agent.sent == [("P", b"hb")]
    agent.send_error = nixlRemoteDisconnectError("gone")
    with pytest.raises(TransportError, match="remote disconnect"):
        d.send_notif("P", b"hb")
    assert d.lost_peers() == ["P"]
    d.send_notif("P", b"hb")  # to a lost peer: nowhere, as into a dead one (no error)


def test_a_probe_that_meets_a_disconnect_loses_the_peer(fake):
    d, agent = fake
    agent.send_error = nixlRemoteDisconnectError("gone")
    d.probe_interval_s = 0.0
    assert d.lost_peers() == ["P"]


def test_notifications_progress_collected_survive_a_collection_that_raises(fake):
    """Without NIXL's progress thread, `progress` collects into an inbox; a later
    `recv_notifs` whose own collection raised lost what was waiting there."""
    d, agent = fake
    d.options = dataclasses.replace(d.options, progress_thread=False)
    agent.incoming = [{"P": [b"ack-1"]}, RuntimeError("NIXL_ERR_BACKEND (transient)")]
    d.progress()
    with pytest.raises(RuntimeError):
        d.recv_notifs()
    assert [(n.peer, n.message) for n in d.recv_notifs()] == [("P", b"ack-1")]


def test_impossible_reads_are_refused_before_anything_is_posted(fake):
    d, agent = fake
    with pytest.raises(InvalidRead):
        d.post_read("P", ReadRequest((BlockRun(15, 0, 2),), LAYERS))  # past the remote end
    with pytest.raises(InvalidRead):
        d.post_split_read("P", [ReadSplit(coalesce([0, 1], [3, 4]), (("layer0", "tail"),))])
    with pytest.raises(InvalidRead):
        d.post_read("P", ReadRequest((), LAYERS))
    with pytest.raises(RegionMismatch):
        d.post_read("P", ReadRequest((BlockRun(0, 0, 1),), regions=("nope",)))
    with pytest.raises(UnknownPeer):
        d.post_read("Q", ReadRequest((BlockRun(0, 0, 1),), LAYERS))
    assert agent.made == 0 and d.poll() == []


def test_probes_are_never_handed_to_the_caller(fake, monkeypatch):
    d, agent = fake
    monkeypatch.setattr(agent, "get_new_notifs", lambda: {"P": [PROBE, b"hb", PROBE]})
    assert [(n.peer, n.message) for n in d.recv_notifs()] == [("P", b"hb")]


# --- pure parts ------------------------------------------------------------------


def test_runs_array_matches_the_cores_coalesce():
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        remote = list(rng.permutation(64)[:n])
        local = sorted(rng.permutation(64)[:n]) if rng.random() < 0.5 else list(range(n))
        want = [(r.remote_start, r.local_start, r.count) for r in coalesce(remote, local)]
        assert [tuple(row) for row in runs_array(remote, local).tolist()] == want


def test_regions_sharing_one_allocation_are_registered_once():
    cache = np.zeros((8, 4, 1024), np.uint8)  # 8 blocks x 4 layers, one allocation
    per_layer = [KVRegion(f"layer{i}", cache[:, i].copy() if False else cache, 8, 4096)
                 for i in range(2)]  # two logical groups viewing the same tensor
    halves = [KVRegion("first", cache[:4], 4, 4096), KVRegion("second", cache[4:], 4, 4096)]
    other = KVRegion("other", np.zeros((8, 4096), np.uint8), 8, 4096)
    plan = plan_registrations([locate(r) for r in per_layer + halves + [other]])
    assert len(plan) == 2
    assert sorted(r.nbytes for r in plan) == [8 * 4096, 8 * 4096]
    assert sorted(sorted(r.regions) for r in plan) == [
        ["first", "layer0", "layer1", "second"], ["other"]]


def test_cuda_ipc_handles_survive_the_trip_through_metadata_bytes():
    from kvhandoff.transports.nixl.cuda_ipc import handle_from_hex, handle_to_hex

    raw = bytes([0, 7, 0, 0, 255] + [0] * 50 + list(range(9)))  # NULs anywhere
    assert len(raw) == 64
    assert handle_to_hex(handle_from_hex(raw.hex())) == raw.hex()


@pytest.mark.parametrize(("gap", "strides"), [(0, (0, 0)), (64, (0, 0)), (3, (0, 0)),
                                               (0, (96, 0)), (0, (0, 128)), (5, (96, 192))])
def test_cuda_ipc_gather_jobs_copy_exactly_what_the_pairs_say(gap, strides):
    """gap: bytes between regions (3: off the row grid); strides: (source, destination)
    bytes from block to block, 0 adjacent; the bytes between strided blocks never move."""
    from numpy.lib.stride_tricks import as_strided

    from kvhandoff.transports.nixl.cuda_ipc import GatherPair, plan_jobs

    rng = np.random.default_rng(gap)
    nb, bb, regions = 8, 64, 5
    sp, dp = (s or bb for s in strides)
    size = nb * max(sp, dp) + gap
    src_mem = rng.integers(1, 256, regions * size + 8 * bb, dtype=np.uint8)
    dst_mem = np.zeros_like(src_mem)
    # memory "addresses" are offsets into src_mem / dst_mem
    pairs = [GatherPair(r * size, 7 * bb + r * size, nb, nb, bb, *strides)
             for r in range(regions - 1)]
    remote, local = np.array([5, 0, 3, 7]), np.array([1, 2, 6, 7])
    jobs = plan_jobs(pairs, remote, local)
    assert len(jobs) == (1 if size % sp == 0 and size % dp == 0 else len(pairs))

    def rows(mem, ptr, n, pitch):
        return as_strided(mem[ptr:ptr + (n - 1) * pitch + bb], (n, bb), (pitch, 1))

    for job in jobs:  # what the kernel does, in numpy
        dst = rows(dst_mem, job.dst, job.dst_rows, job.dst_pitch)
        dst[job.local] = rows(src_mem, job.src, job.src_rows, job.src_pitch)[job.remote]
    want = np.zeros_like(dst_mem)
    for p in pairs:
        for r, lo in zip(remote, local, strict=True):
            want[p.dst + lo * dp:p.dst + lo * dp + bb] = src_mem[p.src + r * sp:p.src + r * sp + bb]
    assert np.array_equal(dst_mem, want)


@pytest.mark.parametrize("local", ["shuffled", "in_order_strided", "in_order"])
@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
def test_a_gather_stages_at_most_its_chunk_and_copies_exactly_the_rows(local, chunk_rows):
    """`copy_rows`, the gather kernel's body, on CPU tensors: ``dst[local] = src[remote]``
    and nothing else, staging no more than ``chunk_rows`` rows at a time (it staged the
    whole READ: a 2 GiB READ took 2 GiB more of D's GPU, measured on an H200)."""
    import torch

    from kvhandoff.transports.nixl.cuda_ipc import copy_rows

    staged: list[int] = []

    class Recorded(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.index_select, torch.index_select) and "out" not in (
                    kwargs or {}):
                staged.append(len(args[2]))
            return super().__torch_function__(func, types, args, kwargs or {})

    rng = np.random.default_rng(chunk_rows)
    src = torch.from_numpy(rng.integers(1, 1 << 30, (40, 8))).as_subclass(Recorded)
    remote = rng.permutation(40)[:10]
    base = torch.zeros((30, 16), dtype=src.dtype)
    dst = base[:, :8] if local == "in_order_strided" else base[:, :8].contiguous()
    lo = np.arange(12, 22) if local != "shuffled" else rng.permutation(30)[:10]
    copy_rows(torch, src, dst, remote, lo, torch.device("cpu"), chunk_rows)
    want = np.zeros((30, 8), dtype=np.int64)
    want[lo] = src.numpy()[remote]
    assert np.array_equal(dst.numpy(), want)
    if local == "in_order_strided":
        assert not base[:, 8:].any()  # the bytes between strided rows never move
    assert max(staged, default=0) <= chunk_rows  # in order and contiguous: staged nothing
    assert (not staged) == (local == "in_order")


def test_strides_travel_in_the_metadata_and_old_six_column_rows_still_read():
    from kvhandoff.transports.nixl import wire
    from kvhandoff.transports.nixl.memory import Placement, descriptor_rows, span_rows

    DRAM = MemoryKind.DRAM
    placed = [Placement("idx", DRAM, 0, 4096, 128, 10, ("DRAM", 0, 4096), 640),
              Placement("kv", DRAM, 0, 1 << 20, 256, 4, ("DRAM", 0, 1 << 20))]
    meta = wire.decode(wire.encode("P", "i", 1, placed, b"nixl"))
    assert [(r.name, r.block_bytes, r.num_blocks, r.stride) for r in meta.regions] == \
        [("idx", 128, 10, 640), ("kv", 256, 4, 0)]
    assert placed[0].nbytes == 9 * 640 + 128 and placed[1].nbytes == 1024
    assert descriptor_rows(placed)[:, 3].tolist() == [640, 256]
    assert span_rows(placed)[:, 1].tolist() == [9 * 640 + 128, 1024]
    import orjson

    header = orjson.dumps({"agent": "P", "instance": "i", "generation": 1,
                           "regions": [["kv", "DRAM", 0, 64, 256, 4]]})
    old = wire.decode(wire.MAGIC + wire._LEN.pack(len(header)) + header)
    assert old.regions[0].stride == 0


@pytest.mark.parametrize("agent", ["", "x\x1b[1A\x1b[2K_forged_line", "x\u2028y", "A" * 513, 7, None])
def test_metadata_naming_an_agent_that_could_not_be_logged_safely_is_refused(agent):
    """A peer names its own NIXL agent, and P logged that name raw (consumer_connected,
    malformed_notification ...): an ESC sequence in it could draw a line of its own."""
    import orjson

    from kvhandoff.transports.nixl import wire

    header = orjson.dumps({"agent": agent, "instance": "i", "generation": 1,
                           "regions": [["kv", "DRAM", 0, 64, 256, 4]]})
    with pytest.raises(wire.MetadataUnreadable, match="agent: expected 1..512 printable") as e:
        wire.decode(wire.MAGIC + wire._LEN.pack(len(header)) + header)
    assert str(e.value).isprintable() and len(str(e.value)) < 300


def test_locate_refuses_overlapping_strides_and_buffers_short_of_the_last_block():
    buf = np.zeros(9 * 640 + 128, np.uint8)
    assert locate(KVRegion("idx", buf, 10, 128, stride=640)).nbytes == buf.size
    with pytest.raises(RegionMismatch, match="stride 640"):
        locate(KVRegion("idx", buf[:-1], 10, 128, stride=640))
    with pytest.raises(RegionMismatch, match="overlap"):
        locate(KVRegion("idx", buf, 10, 128, stride=64))


def test_ucx_defaults_are_set_unless_the_user_set_them():
    env = {"UCX_CUDA_IPC_ENABLE_SAME_PROCESS": "n"}
    with capture_logs() as logs:
        applied = apply_ucx_defaults(env, cuda=True)
    assert applied == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    assert env == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_CUDA_IPC_ENABLE_SAME_PROCESS": "n"}
    sources = {e["variable"]: e["source"] for e in logs if e["event"] == "nixl.ucx_default"}
    assert sources == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "kvhandoff",
                       "UCX_CUDA_IPC_ENABLE_SAME_PROCESS": "environment"}
    assert set(sources) == set(UCX_DEFAULTS)


def test_without_a_cuda_driver_no_cuda_variable_is_set():
    env: dict[str, str] = {}
    with capture_logs() as logs:
        assert apply_ucx_defaults(env, cuda=False) == {}
    assert env == {}
    assert {e["source"] for e in logs if e["event"] == "nixl.ucx_default"} == {"skipped"}


# --- real NIXL, two processes -------------------------------------------------------


def _names(tag: str) -> tuple[str, str]:
    n = time.monotonic_ns() % 10**9
    return f"P-{tag}-{n}", f"D-{tag}-{n}"


def _wait(cond, what: str, timeout_s: float = 20.0):
    return wait_for(cond, timeout_s, what, interval=0.001)


def _completions(d: NixlTransport, n: int) -> list:
    out: list = []
    _wait(lambda: len(out) >= n if not out.extend(d.poll()) else len(out) >= n,
          f"{n} completion(s)")
    return out


@pytest.fixture
def producer():
    procs: list[TransportProcess] = []

    def start(name: str, options: NixlOptions | None = None) -> TransportProcess:
        procs.append(TransportProcess(name, options))
        return procs[-1]

    yield start
    for p in procs:
        p.close()


def test_a_split_read_into_two_destinations_lands_every_byte_and_completes_once(producer):
    p_name, d_name = _names("split")
    p = producer(p_name)
    nb, bb = 32, 512
    src = [p.shared_array((nb, bb)) for _ in range(2)]
    for i, rows in enumerate(src):
        rows[...] = np.random.default_rng(i).integers(1, 256, rows.shape, dtype=np.uint8)
    p.register([KVRegion(f"layer{i}", rows, nb, bb) for i, rows in enumerate(src)])
    d = NixlTransport(d_name, NixlOptions(telemetry=True))
    try:
        # D keeps a small resident tail and a big pool per layer (a HiSparse layout).
        tail = {i: np.zeros((4, bb), np.uint8) for i in range(2)}
        pool = {i: np.zeros((nb, bb), np.uint8) for i in range(2)}
        d.register([KVRegion(f"layer{i}@tail", tail[i], 4, bb) for i in range(2)]
                   + [KVRegion(f"layer{i}@pool", pool[i], nb, bb) for i in range(2)])
        peer = d.add_peer(p.metadata())
        p.add_peer(d.metadata())
        history, recent = [7, 8, 9, 10, 2, 3, 20], [28, 29, 30]
        splits = [
            ReadSplit(runs_array(history, [0, 1, 2, 3, 10, 11, 5]),
                      tuple((f"layer{i}", f"layer{i}@pool") for i in range(2))),
            ReadSplit(coalesce(recent, [1, 2, 3]),
                      tuple((f"layer{i}", f"layer{i}@tail") for i in range(2))),
        ]
        h = d.post_split_read(peer, splits, b"release:hisparse")
        (c,) = _completions(d, 1)
        assert (c.handle, c.ok) == (h, True), c.reason
        for i in range(2):
            assert np.array_equal(pool[i][[0, 1, 2, 3, 10, 11, 5]], src[i][history])
            assert np.array_equal(tail[i][1:4], src[i][recent])
            assert not tail[i][0].any() and not np.delete(pool[i], [0, 1, 2, 3, 10, 11, 5], 0).any()
        got = p.call("recv_notifs_until", 1, 10.0)
        assert [(n.peer, n.message) for n in got] == [(d_name, b"release:hisparse")]
        # Adjacent blocks travelled as one descriptor: 3 runs + 1 run, per layer.
        assert d.descriptors_posted == d.descriptors_on_wire == (3 + 1) * 2
        assert d.poll() == []
    finally:
        d.close()


def test_a_shuffled_read_posts_one_descriptor_per_block_and_region(producer):
    p_name, d_name = _names("shuffle")
    p = producer(p_name)
    nb, bb = 256, 128
    src = p.shared_array((nb, bb))
    src[...] = np.random.default_rng(5).integers(1, 256, src.shape, dtype=np.uint8)
    p.register([KVRegion("kv", src, nb, bb)])
    d = NixlTransport(d_name, NixlOptions(telemetry=True))
    try:
        dst = np.zeros((nb, bb), np.uint8)
        d.register([KVRegion("kv", dst, nb, bb)])
        peer = d.add_peer(p.metadata())
        perm = np.random.default_rng(6).permutation(nb)
        d.post_read(peer, ReadRequest(coalesce(perm.tolist(), list(range(nb)))))
        (c,) = _completions(d, 1)
        assert c.ok, c.reason
        assert np.array_equal(dst, src[perm])
        runs = len(coalesce(perm.tolist(), list(range(nb))))
        assert d.descriptors_posted == d.descriptors_on_wire == runs
    finally:
        d.close()


def test_logical_groups_on_one_tensor_make_one_registration(producer):
    _, d_name = _names("dedup")
    d = NixlTransport(d_name)
    try:
        cache = np.zeros((16, 2, 4096), np.uint8)  # blocks x (attention, indexer) x bytes
        d.register([KVRegion("attention", cache, 16, 8192),
                    KVRegion("indexer", cache, 16, 8192),   # same physical tensor
                    KVRegion("ssm", np.zeros((16, 1024), np.uint8), 16, 1024)])
        assert len(d.registrations) == 2
        assert sorted(r.regions for r in d.registrations) == [("attention", "indexer"), ("ssm",)]
    finally:
        d.close()


def test_a_producer_killed_during_a_long_read_fails_it_once_and_is_reported_lost(producer):
    p_name, d_name = _names("kill")
    p = producer(p_name)
    nb, bb = 65536, 4096  # 256 MiB in 4 KiB blocks, shuffled: ~0.1-0.3 s over cma here
    src = p.shared_array((nb, bb))
    src[:, :8] = 1
    p.register([KVRegion("kv", src, nb, bb)])
    d = NixlTransport(d_name)
    try:
        dst = np.zeros((nb, bb), np.uint8)
        d.register([KVRegion("kv", dst, nb, bb)])
        peer = d.add_peer(p.metadata())
        runs = runs_array(np.random.default_rng(1).permutation(nb), np.arange(nb))
        p.call("die_after", 0.02)
        h = d.post_split_read(peer, [ReadSplit(runs, (("kv", "kv"),))], b"release:k")
        (c,) = _completions(d, 1)
        assert (c.handle, c.ok) == (h, False) and c.reason
        _wait(lambda: d.lost_peers() == [peer], "the producer in lost_peers()")
        for _ in range(10):
            assert d.poll() == []
        # Anything that did land is the producer's bytes, never garbage.
        landed = dst[:, 0] != 0
        assert (dst[landed, :8] == 1).all()
        # A new READ to the dead producer fails at once.
        h2 = d.post_read(peer, ReadRequest((BlockRun(0, 0, 1),)))
        assert [(x.handle, x.ok) for x in d.poll()] == [(h2, False)]
    finally:
        d.close()


def test_stale_metadata_of_a_dead_producer_is_refused_and_a_restart_replaces_it(producer):
    p_name, d_name = _names("stale")
    nb, bb = 16, 256
    first = producer(p_name)
    rows1 = first.shared_array((nb, bb))
    rows1[...] = 1
    first.register([KVRegion("kv", rows1, nb, bb)])
    stale = first.metadata()
    d = NixlTransport(d_name)
    try:
        dst = np.zeros((nb, bb), np.uint8)
        d.register([KVRegion("kv", dst, nb, bb)])
        assert d.add_peer(stale) == p_name
        first.kill()
        d.post_read(p_name, ReadRequest((BlockRun(0, 0, 4),)))
        (c,) = _completions(d, 1)
        assert not c.ok
        _wait(lambda: p_name in d.lost_peers(), "the dead producer in lost_peers()")
        with pytest.raises(PeerUnreachable):  # loading it again connects, and fails
            d.add_peer(stale)
        # The producer restarts under the same name: its new metadata replaces the old.
        second = producer(p_name)
        with pytest.raises(PeerNotReady):
            d.add_peer(second.metadata())  # fetched before it registered
        rows2 = second.shared_array((nb, bb))
        rows2[...] = 2
        second.register([KVRegion("kv", rows2, nb, bb)])
        assert d.add_peer(second.metadata()) == p_name
        assert d.lost_peers() == []
        d.post_read(p_name, ReadRequest((BlockRun(0, 0, nb),)))
        (c,) = _completions(d, 1)
        assert c.ok, c.reason
        assert (dst == 2).all()
    finally:
        d.close()


def test_removing_a_peer_with_reads_in_flight_lets_them_drain_first(producer):
    p_name, d_name = _names("remove")
    p = producer(p_name)
    nb, bb = 64, 4096
    src = p.shared_array((nb, bb))
    src[...] = 3
    p.register([KVRegion("kv", src, nb, bb)])
    d = NixlTransport(d_name)
    try:
        dst = np.zeros((nb, bb), np.uint8)
        d.register([KVRegion("kv", dst, nb, bb)])
        peer = d.add_peer(p.metadata())
        h = d.post_read(peer, ReadRequest((BlockRun(0, 0, nb),)))
        d.remove_peer(peer)
        with pytest.raises(UnknownPeer):
            d.post_read(peer, ReadRequest((BlockRun(0, 0, 1),)))
        (c,) = _completions(d, 1)
        assert (c.handle, c.ok) == (h, True) and (dst == 3).all()
        with pytest.raises(UnknownPeer):
            d.send_notif(peer, b"x")
    finally:
        d.close()


@pytest.mark.parametrize(("delay_us", "low", "high"), [(1000, 0.0, 10.0), (0, 50.0, 200.0)])
def test_an_idle_agent_sleeps_unless_the_busy_spin_is_asked_for(producer, delay_us, low, high):
    p_name, d_name = _names(f"idle{delay_us}")
    p = producer(p_name, NixlOptions(progress_delay_us=delay_us))
    d = NixlTransport(d_name)  # a connected peer, so the agent has live endpoints
    try:
        rows = p.shared_array((4, 4096))
        p.register([KVRegion("kv", rows, 4, 4096)])
        d.register([KVRegion("kv", np.zeros((4, 4096), np.uint8), 4, 4096)])
        d.add_peer(p.metadata())
        p.add_peer(d.metadata())
        used = p.call("idle_cpu_percent", 1.0)
        assert low <= used <= high, f"idle agent used {used:.1f} % of a core"
    finally:
        d.close()


# --- READ planning: the short path and the kept pairings equal the general one ------------

_KINDS = (MemoryKind.DRAM, MemoryKind.VRAM)


def _outcome(splits, remote, local, pairings=None):
    from kvhandoff.transports.nixl.reads import plan_reads

    try:
        groups = plan_reads(splits, remote, local, "P", "D", pairings)
    except Exception as exc:  # noqa: BLE001 - the refusal itself is compared
        return type(exc), str(exc)
    return [(g.lkind, g.rkind, g.pairs, g.descriptors, g.remote_blocks.tolist(),
             g.local_blocks.tolist(), *(i.tolist() for i in g.indices()), g.indices()[0].dtype)
            for g in groups]


def _general(splits):
    """The same splits with their runs as an array: `plan_reads`'s numpy path."""
    return [ReadSplit(np.array([[r.remote_start, r.local_start, r.count] for r in s.runs],
                               dtype=np.int64).reshape(-1, 3), s.regions) for s in splits]


@pytest.mark.parametrize("seed", range(4))
def test_planning_a_short_read_and_reusing_checked_pairs_gives_what_the_general_path_gives(seed):
    """`plan_reads` checks and expands a few `BlockRun`s with Python ints and keeps each
    region list's checked pairs for the next READ: the groups, blocks, descriptor indices
    and refusals must be the numpy path's, for a READ and for the next one naming the same
    regions (valid, one block past a region's end, wrong regions, mismatched block sizes)."""
    from hypothesis import given
    from hypothesis import strategies as st

    rng = np.random.default_rng(seed)

    def regions(num_blocks, block_bytes):
        return {f"x{i}": transport_module.RegionAt(
            _KINDS[int(rng.integers(2))], int(rng.integers(0, 500)), num_blocks[i],
            int(rng.choice(block_bytes)), 0, 0) for i in range(4)}
    remote = regions((50, 50, 100, 120), [64, 64, 32])
    local = regions((200, 200, 200, 50), [64])  # mostly the remote end bounds a READ
    start = st.sampled_from([0, 1, 44, 45, 46, 47, 48, 49, 50, 94, 95, 99, 100, 115, 119]) | \
        st.integers(-1, 125)
    runs = st.lists(st.builds(BlockRun, start, start, st.integers(0, 6)), max_size=8).map(tuple)
    pairs = st.lists(st.tuples(*(st.sampled_from(["x0", "x1", "x2", "x3", "x4"]),) * 2),
                     max_size=3).map(tuple)
    pairings: dict = {}

    @given(pairs, st.lists(runs, min_size=1, max_size=3))
    def check(names, reads):
        # ... and READs that end at the remote regions' end, or one block past it
        end = min((remote[r].num_blocks for r, _ in names if r in remote), default=1)
        reads = [*reads, (BlockRun(end - 1, 0, 1),), (BlockRun(end - 1, 0, 2),),
                 (BlockRun(end, 0, 1),)]
        for read in reads:  # one after another: the later ones may reuse the pairs kept
            splits = [ReadSplit(read, names)]
            expected = _outcome(_general(splits), remote, local)
            assert _outcome(splits, remote, local, pairings) == expected
            assert _outcome(splits, remote, local) == expected  # checked from scratch

    check()
