"""Which `Transport` the connector's worker uses.

kvhandoff's data path is `kvhandoff.transports.nixl` (one data path for the
project).  Until that module is present in an installation, the connector
falls back to `LocalNixlTransport` below: the smallest faithful use of the
``nixl`` API that follows the same `Transport` protocol (per-block prepped
descriptor lists, READ with completion polling, notifications, progress
driven from polling so an idle agent does not spin a core).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import orjson
import structlog

from kvhandoff.transports.base import (
    Completion,
    KVRegion,
    Notification,
    PeerNotReady,
    ReadRequest,
    RegionMismatch,
    Transport,
    TransportError,
    UnknownPeer,
)

log = structlog.get_logger(__name__)


def make_transport(name: str) -> Transport:
    """The project's NIXL transport when installed, else the local fallback."""
    try:
        from kvhandoff.transports import nixl as project_nixl
    except ImportError:
        project_nixl = None
    cls = getattr(project_nixl, "NixlTransport", None) if project_nixl else None
    if cls is not None:
        log.info("vllm.transport", impl="kvhandoff.transports.nixl", agent=name)
        return cls(name)
    log.info("vllm.transport", impl="adapters.vllm.transport.LocalNixlTransport", agent=name)
    return LocalNixlTransport(name)


def _tensor_addr(buf: Any) -> tuple[int, int]:
    if hasattr(buf, "data_ptr"):
        return buf.data_ptr(), buf.numel() * buf.element_size()
    return buf.ctypes.data, buf.nbytes  # numpy


class LocalNixlTransport:
    """Host-memory (DRAM) READs over NIXL/UCX; one descriptor per block per region."""

    def __init__(self, name: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        # No progress thread: nixl's Python API would start it with a zero
        # delay and it would spin a whole core while idle.  check_xfer_state
        # and get_new_notifs drive progress instead.
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False,
                                                        backends=["UCX"]))
        self.regions: list[KVRegion] = []
        self._reg_descs: Any = None
        self._local: Any = None
        self._peers: dict[str, tuple[Any, list[dict]]] = {}
        self._inflight: dict[int, tuple[Any, str]] = {}
        self._next = 0
        self._lost: list[str] = []

    def register(self, regions: Sequence[KVRegion]) -> None:
        if self.regions:
            raise TransportError(f"{self.name}: regions already registered")
        spans = []
        xfer = []
        for r in regions:
            addr, nbytes = _tensor_addr(r.buffer)
            if nbytes < r.num_blocks * r.block_bytes:
                raise RegionMismatch(f"region {r.name}: {nbytes} bytes < {r.num_blocks} x {r.block_bytes}")
            spans.append((addr, nbytes, 0, r.name))
            xfer.extend((addr + b * r.block_bytes, r.block_bytes, 0) for b in range(r.num_blocks))
        self._reg_descs = self.agent.get_reg_descs(spans, "DRAM")
        self.agent.register_memory(self._reg_descs)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", xfer, "DRAM")
        self.regions = list(regions)

    def metadata(self) -> bytes:
        header = orjson.dumps({"name": self.name, "regions": [
            {"name": r.name, "addr": _tensor_addr(r.buffer)[0], "num_blocks": r.num_blocks,
             "block_bytes": r.block_bytes} for r in self.regions]})
        return struct.pack("<I", len(header)) + header + self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        (n,) = struct.unpack_from("<I", metadata)
        header = orjson.loads(metadata[4:4 + n])
        if not header["regions"]:
            raise PeerNotReady(f"peer {header['name']} has not registered its regions yet")
        if len(header["regions"]) != len(self.regions):
            raise RegionMismatch(f"peer {header['name']}: {len(header['regions'])} regions, "
                                 f"local {len(self.regions)}")
        for mine, theirs in zip(self.regions, header["regions"], strict=True):
            if mine.block_bytes != theirs["block_bytes"]:
                raise RegionMismatch(f"region {mine.name}: block_bytes {mine.block_bytes} "
                                     f"vs peer {theirs['block_bytes']}")
        peer = self.agent.add_remote_agent(metadata[4 + n:])
        if isinstance(peer, bytes):
            peer = peer.decode()
        xfer = [(r["addr"] + b * r["block_bytes"], r["block_bytes"], 0)
                for r in header["regions"] for b in range(r["num_blocks"])]
        remote = self.agent.prep_xfer_dlist(peer, xfer, "DRAM")
        self._peers[peer] = (remote, header["regions"])
        return peer

    def remove_peer(self, peer: str) -> None:
        entry = self._peers.pop(peer, None)
        if entry is not None:
            self.agent.release_dlist_handle(entry[0])
            self.agent.remove_remote_agent(peer)

    def post_read(self, peer: str, read: ReadRequest, notif: bytes | None = None) -> int:
        entry = self._peers.get(peer)
        if entry is None:
            raise UnknownPeer(peer)
        remote, remote_regions = entry
        names = [r.name for r in self.regions]
        chosen = range(len(names)) if read.regions is None else [names.index(n) for n in read.regions]
        local_idx: list[int] = []
        remote_idx: list[int] = []
        for i in chosen:
            lbase = sum(r.num_blocks for r in self.regions[:i])
            rbase = sum(r["num_blocks"] for r in remote_regions[:i])
            for run in read.runs:
                for k in range(run.count):
                    local_idx.append(lbase + run.local_start + k)
                    remote_idx.append(rbase + run.remote_start + k)
        handle = self._next
        self._next += 1
        try:
            xfer = self.agent.make_prepped_xfer("READ", self._local, local_idx, remote,
                                                remote_idx, notif or b"")
            state = self.agent.transfer(xfer)
        except Exception as exc:  # nixl raises its own typed errors; they fail this split
            self._inflight[handle] = (None, f"post failed: {type(exc).__name__}: {exc}")
            return handle
        if state == "ERR":
            self._inflight[handle] = (xfer, "post failed: ERR")
        else:
            self._inflight[handle] = (xfer, "")
        return handle

    def poll(self) -> list[Completion]:
        done: list[Completion] = []
        for handle, (xfer, err) in list(self._inflight.items()):
            if xfer is None or err:
                done.append(Completion(handle, False, err))
            else:
                try:
                    state = self.agent.check_xfer_state(xfer)
                except Exception as exc:
                    state, err = "ERR", f"{type(exc).__name__}: {exc}"
                if state == "PROC":
                    continue
                done.append(Completion(handle, state == "DONE", err or ("" if state == "DONE" else state)))
            del self._inflight[handle]
            if xfer is not None:
                try:
                    self.agent.release_xfer_handle(xfer)
                except Exception as exc:
                    log.warning("vllm.transport.release_failed", error=str(exc))
        return done

    def send_notif(self, peer: str, message: bytes) -> None:
        if peer not in self._peers:
            raise UnknownPeer(peer)
        self.agent.send_notif(peer, message)

    def recv_notifs(self) -> list[Notification]:
        out: list[Notification] = []
        for peer, msgs in self.agent.get_new_notifs().items():
            out.extend(Notification(peer, m) for m in msgs)
        return out

    def lost_peers(self) -> list[str]:
        lost, self._lost = self._lost, []
        return lost

    def close(self) -> None:
        for handle in list(self._inflight):
            xfer, _ = self._inflight.pop(handle)
            if xfer is not None:
                try:
                    self.agent.release_xfer_handle(xfer)
                except Exception:  # teardown: the agent is going away anyway
                    pass
        for peer in list(self._peers):
            self.remove_peer(peer)
