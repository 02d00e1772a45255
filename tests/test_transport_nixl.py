"""The NIXL transport between two processes over UCX, host memory: the shared contract.

P (the source) runs in a spawned child (`TransportProcess`) whose regions
live in shared memory, so the test writes P's bytes directly; D runs here.
Every READ's bytes are compared with the source.  NIXL-only behaviour is in
``test_transport_nixl_behaviour.py``; VRAM runs in ``test_transport_nixl_gpu.py``.
"""

from __future__ import annotations

import struct
import time

import numpy as np
import orjson
import pytest

pytest.importorskip("nixl")

from conftest import poll_pause  # noqa: E402

from kvhandoff.core.planning import coalesce  # noqa: E402
from kvhandoff.transports.base import Completion, KVRegion, ReadRequest, TransportError  # noqa: E402
from kvhandoff.transports.nixl import NixlOptions, NixlTransport, TransportProcess, wire  # noqa: E402
from tests.transport_contract import (  # noqa: E402
    RegionShape,
    TransportContract,
    TransportPair,
    host_shaped_regions,
)

_counter = iter(range(1_000_000))


def nixl_host_pair(p_shapes: list[RegionShape], d_shapes: list[RegionShape],
                   options: NixlOptions | None = None) -> TransportPair:
    tag = f"{time.monotonic_ns() % 10**9}-{next(_counter)}"
    p = TransportProcess(f"P-{tag}", options)
    try:
        d = NixlTransport(f"D-{tag}", options)
    except BaseException:
        p.close()
        raise
    p_rows = [p.shared_array((s.num_blocks, s.block_stride)) for s in p_shapes]
    p_regions = [KVRegion(s.name, r, s.num_blocks, s.block_bytes, stride=s.stride)
                 for s, r in zip(p_shapes, p_rows, strict=True)]
    d_regions, d_rows = host_shaped_regions(d_shapes)

    def put(rows):
        def write(i, data):
            rows[i][...] = data
        return write

    def close() -> None:
        try:
            d.close()
        finally:
            p.close()

    return TransportPair(
        p=p, d=d, p_regions=p_regions, d_regions=d_regions,
        write_p=put(p_rows), write_d=put(d_rows), read_d=lambda i: d_rows[i].copy(),
        pump=lambda: _pump(d), kill_p=p.kill, close=close,
    )


def _pump(d: NixlTransport) -> None:
    d.progress()  # READs in flight move (and send their notifications) only when checked
    poll_pause(0.0005)


class TestNixlHostContract(TransportContract):
    def make_shaped_pair(self, p_shapes, d_shapes):
        return nixl_host_pair(p_shapes, d_shapes)

    def test_metadata_naming_another_agent_than_its_nixl_part_is_refused(self, pair):
        """Real NIXL loads a held agent's metadata again without complaint, so the header's
        name is what must be checked: refused naming both, and the held peer reads on."""
        p_name, _ = self.connect(pair)
        source = self.fill(pair)
        metadata = pair.p.metadata()
        (n,) = struct.unpack_from("<I", metadata, len(wire.MAGIC))
        start = len(wire.MAGIC) + 4
        header = orjson.dumps(orjson.loads(metadata[start:start + n]) | {"agent": "Q"})
        forged = wire.MAGIC + struct.pack("<I", len(header)) + header + metadata[start + n:]
        with pytest.raises(TransportError, match=f"metadata of agent 'Q' carries NIXL "
                                                 f"metadata of agent {p_name!r}"):
            pair.d.add_peer(forged)
        handle = pair.d.post_read(p_name, ReadRequest(runs=coalesce(range(64), range(64))))
        (done,) = self.settled_completions(pair, "the READ from the held peer")
        assert done.handle == handle and done.ok
        for i in range(len(pair.d_regions)):
            assert np.array_equal(pair.read_d(i), source[i])

    def test_nixl_metadata_of_an_agent_whose_name_is_not_utf8_is_refused_before_loading(
            self, pair):
        """NIXL's binding returns the name of the agent it loaded as text: for a name that
        is not UTF-8 it raised after the load ("stale metadata of a peer that is gone?") and
        the agent stayed loaded, once per hello.  Refused before NIXL loads anything."""
        from kvhandoff.transports.nixl.agent import create_agent

        p_name, _ = self.connect(pair)
        stranger = create_agent(b"bad\xff", NixlOptions())
        metadata = pair.p.metadata()
        (n,) = struct.unpack_from("<I", metadata, len(wire.MAGIC))
        start = len(wire.MAGIC) + 4
        header = orjson.dumps(orjson.loads(metadata[start:start + n]) | {"agent": "Q"})
        forged = (wire.MAGIC + struct.pack("<I", len(header)) + header
                  + stranger.get_agent_metadata())
        agent = pair.d._agent
        loaded = []
        load = agent.add_remote_agent
        agent.add_remote_agent = lambda md: (loaded.append(md), load(md))[1]
        try:
            with pytest.raises(TransportError, match=r"metadata of agent 'Q' carries NIXL "
                                                     r"metadata of agent 'bad\\\\xff'"):
                pair.d.add_peer(forged)
        finally:
            del agent.add_remote_agent
        assert loaded == []  # NIXL never loaded it
        assert wire.nixl_agent_name(metadata[start + n:]) == p_name.encode()

    def test_a_peer_that_dies_mid_read_fails_the_read_and_is_reported_lost(self, pair):
        # Over UCX's cma path a READ of host memory is copied while it is posted, so
        # a READ posted just before the producer dies has usually landed already:
        # NIXL then rightly reports it done.  What must hold either way: one
        # completion; ok=True only with every byte in place; the dead peer reported
        # lost.  A READ truly cut short is in test_transport_nixl_behaviour.py.
        p_name, _ = self.connect(pair)
        source = self.fill(pair)
        handle = pair.d.post_read(p_name, ReadRequest(runs=coalesce(range(64), range(64))),
                                  b"release:req-2")
        pair.kill_p()
        completions: list[Completion] = []
        self.wait(pair, lambda: bool(completions.extend(pair.d.poll()) or completions),
                  "the READ's completion")
        assert [c.handle for c in completions] == [handle]
        if completions[0].ok:
            for i in range(len(pair.d_regions)):
                assert np.array_equal(pair.read_d(i), source[i])
        else:
            assert completions[0].reason
        self.wait(pair, lambda: p_name in pair.d.lost_peers(), "the dead peer in lost_peers()")
        for _ in range(20):
            pair.pump()
            assert pair.d.poll() == []
