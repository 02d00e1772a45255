"""`NixlTransport`: the `Transport` protocol over NIXL (UCX), host memory and GPU.

Theory of operation
-------------------
* **Agent.**  One NIXL agent per transport, started by `agent.create_agent`
  (UCX defaults, a progress thread that sleeps when idle, or none:
  ``NixlOptions(progress_thread=False)``, and then `poll`, `recv_notifs` and
  the other calls are what progresses UCX).  A transport is
  not thread-safe: drive it from one thread, as an engine's worker loop does.
* **Registration.**  `register` locates each region's buffer, registers the
  few ranges that cover them (`memory.plan_registrations`: one range per
  allocation, shared ranges once) and prepares, per memory kind, one local
  descriptor list with a strided row per region (`memory.descriptor_rows`):
  descriptor ``base(region) + block`` is that block.  It is prepared once and
  reused by every READ.
* **Peers.**  `metadata` is NIXL's agent blob plus our region table
  (`wire`).  `add_peer` loads it, checks with ``check_remote_metadata`` that
  NIXL sees the peer's registrations (else `PeerNotReady`: re-fetch), and
  prepares the peer's descriptor lists, per memory kind, once.
* **READs.**  A READ is one or more `ReadSplit`\\ s (block runs over pairs of
  remote and local regions).  Runs become descriptor indices (numpy, no
  per-block Python); NIXL merges consecutive indices of one region into one
  descriptor, so a coalesced run of N blocks is one descriptor on the wire.
  Each split's pairs are grouped by (local kind, remote kind): each group is
  one NIXL transfer (a descriptor list has one memory kind), all of them
  together one handle with one aggregate completion.  A READ into a GPU tail and a
  host pool is thus one `post_split_read`.
* **Strided regions.**  A region's block ``b`` is at ``addr + b * stride``
  (`KVRegion.stride`; 0: adjacent).  The stride travels in the metadata,
  is the stride column of the region's descriptor row (NIXL then never
  merges its blocks, so the bytes between them are never written) and the
  row pitch of the CUDA IPC gather's views on either side.
* **Same-node VRAM.**  UCX posts one GPU copy per descriptor (~8-10 µs of CPU
  each on an H200), which makes shuffled READs of small blocks CPU-bound,
  and stages VRAM READs into host memory through TCP (~0.4 GB/s on one
  H200).  When both agents are on one node, a group from the peer's VRAM
  into our VRAM *or into CUDA-pinned host memory* (a HiSparse host pool) is
  instead copied by gather kernels over CUDA IPC (`cuda_ipc`, usually one
  per READ; a host destination is written through its device pointer); its
  completion is a CUDA event polled like a NIXL transfer.  Everything else
  (unpinned host memory, host sources, other nodes,
  ``NixlOptions(vram_ipc=False)``) is NIXL.
* **Completion notification.**  With a single NIXL transfer the notification
  rides on it (NIXL sends it once the bytes landed).  With several (or a
  CUDA IPC gather), it is sent by `poll` after the last one landed: attached to any one of them, it
  could tell the source to free blocks another transfer is still reading.
* **Failures.**  A failed post or a transfer that ends in error completes its
  handle with ``ok=False`` and a reason, after every other transfer of that
  handle drained (pages are not reusable before).  A remote disconnect marks
  the peer lost.  Every NIXL transfer handle is released exactly once,
  whatever happened.  `lost_peers` also probes idle peers with an internal
  notification (filtered out at the receiver), because UCX reports a dead
  peer only when something is sent to it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.core.fence import FENCE_REGION
from kvhandoff.core.safelog import bounded_repr, get_logger
from kvhandoff.transports.base import (
    Completion,
    KVRegion,
    MemoryKind,
    Notification,
    PeerNotReady,
    PeerUnreachable,
    ReadRequest,
    RegionMismatch,
    TransportError,
    UnknownPeer,
)

from . import wire
from .agent import NixlOptions, create_agent
from .cuda_ipc import (
    CudaIpcError,
    Gatherer,
    GatherPair,
    GatherRead,
    PeerMemory,
    export,
    host_device_pointer,
    node_id,
)
from .memory import (
    Placement,
    Registration,
    descriptor_rows,
    locate,
    plan_registrations,
    span_rows,
)
from .reads import (
    Pairing,
    ReadGroup,
    ReadSplit,
    RegionAt,
    plan_reads,
)

log = get_logger(__name__)

PROBE = b"\x00kvh.probe"  # internal liveness probe; never handed to the receiver's caller


@dataclass(slots=True)
class _Side:
    """Regions of one agent, as indices into one descriptor list per memory kind."""

    regions: dict[str, RegionAt]
    dlists: dict[MemoryKind, Any]  # kind -> prepped NIXL descriptor-list handle


@dataclass(slots=True)
class _Peer:
    name: str
    instance: str
    generation: int
    side: _Side
    inflight: set[int] = field(default_factory=set)
    lost: bool = False
    removing: bool = False
    probed_at: float = 0.0
    probe_failures: int = 0  # liveness probes failed in a row (the first of a run is logged)
    ipc_offer: list | None = None  # its exported VRAM allocations (same node, vram_ipc on)
    ipc: PeerMemory | None = None  # ...mapped here, on the first VRAM READ that needs them
    ipc_tried: bool = False
    # `plan_reads`'s checked region pairs for READs from this peer into `local`, the local
    # side they were checked against (a `register` replaces it, and they are dropped)
    pairings: dict[Any, Pairing] = field(default_factory=dict)
    pairings_local: _Side | None = None


@dataclass(slots=True)
class _Pending:
    handle: int
    peer: str
    xfers: list[Any]
    notif_after: bytes | None  # sent by poll once every transfer landed
    failure: str = ""


class NixlTransport:
    """A `Transport` over one NIXL agent.  See the module docstring."""

    def __init__(self, name: str, options: NixlOptions | None = None, *,
                 probe_interval_s: float = 0.2, close_timeout_s: float = 10.0) -> None:
        self.name = name
        self.options = options or NixlOptions()
        self.probe_interval_s = probe_interval_s
        self.close_timeout_s = close_timeout_s
        self._agent = create_agent(name, self.options)
        self._instance = uuid.uuid4().hex
        self._generation = 0
        self._placements: dict[str, Placement] = {}
        self._registered: list[tuple[Any, Registration]] = []  # (NIXL reg list, range)
        self._local = _Side({}, {})
        self._peers: dict[str, _Peer] = {}
        self._pending: dict[int, _Pending] = {}
        self._settled: list[Completion] = []  # completions decided at post time
        self._inbox: list[Notification] = []  # collected by `progress`, returned by `recv_notifs`
        self._next_handle = 0
        self._closed = False
        self.descriptors_posted = 0  # one per block run and region pair
        self.descriptors_on_wire = 0  # NIXL's own count after merging (telemetry only)
        self.ipc_descriptors = 0  # posted as CUDA IPC gathers instead (see cuda_ipc)
        self._gatherer = Gatherer()
        self._ipc_export: list[list] = []
        self._host_ptrs: dict[tuple[int, int], int | None] = {}  # pinned host -> device address

    # -- registration and metadata ------------------------------------------

    @property
    def registrations(self) -> tuple[Registration, ...]:
        """The NIXL registrations made so far (few: one per allocation in use)."""
        return tuple(reg for _, reg in self._registered)

    def register(self, regions: Sequence[KVRegion]) -> None:
        """Register ``regions`` (in addition to earlier ones) and prepare local descriptors."""
        self._open()
        if self._pending:
            raise TransportError(f"{self.name}: cannot register while {len(self._pending)} "
                                 "READs are in flight")
        new = [locate(r) for r in regions]
        names = [p.name for p in new]
        dupes = sorted({n for n in names if names.count(n) > 1 or n in self._placements})
        if dupes:
            raise RegionMismatch(f"{self.name}: regions registered twice: {dupes}")
        t0 = time.perf_counter()
        plan = plan_registrations(new)
        for reg in plan:
            rows = [(reg.addr, reg.nbytes, reg.device, "")]
            descs = self._agent.register_memory(rows, reg.kind.value)
            self._registered.append((descs, reg))
        self._placements.update({p.name: p for p in new})
        self._local = self._prepare_side("", list(self._placements.values()), self._local)
        vram = [(p.device, p.addr) for p in self._placements.values()
                if p.kind is MemoryKind.VRAM]
        if self.options.vram_ipc and vram:
            self._ipc_export = export(vram)
        self._generation += 1
        log.info("nixl.registered", agent=self.name, regions=len(new),
                 registrations=len(plan), bytes=sum(r.nbytes for r in plan),
                 ms=round((time.perf_counter() - t0) * 1e3, 3))

    def metadata(self) -> bytes:
        self._open()
        ipc = {"node": node_id(), "allocations": self._ipc_export} if self._ipc_export else None
        return wire.encode(self.name, self._instance, self._generation,
                           list(self._placements.values()), self._agent.get_agent_metadata(),
                           ipc)

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; `PeerNotReady` until its registrations are visible."""
        self._open()
        meta = wire.decode(metadata)
        if meta.agent == self.name:
            raise TransportError(f"{self.name}: metadata names this agent itself")
        named = wire.nixl_agent_name(meta.nixl)
        if named is not None and named != meta.agent.encode():
            # Refused before NIXL loads it, and before a held peer of that name is dropped:
            # NIXL's binding returns the loaded name as text, so a name that is not UTF-8
            # raised after the load and the agent stayed loaded.
            raise TransportError(f"{self.name}: metadata of agent {meta.agent!r} carries NIXL "
                                 f"metadata of agent "
                                 f"{bounded_repr(named.decode(errors='backslashreplace'))}")
        if not meta.regions:
            raise PeerNotReady(f"peer {meta.agent!r} has not registered any memory yet "
                               f"(generation {meta.generation}): re-fetch its metadata")
        old = self._peers.get(meta.agent)
        if old is not None and not old.lost and old.instance == meta.instance \
                and old.generation >= meta.generation:
            return old.name  # already current
        if old is not None:
            if old.inflight:
                raise TransportError(f"{self.name}: peer {meta.agent!r} re-announced while "
                                     f"{len(old.inflight)} READs from it are in flight")
            self._drop_peer(old)
        try:
            name = self._agent.add_remote_agent(meta.nixl)
        except Exception as exc:  # NIXL connects while loading: a dead peer fails here
            raise PeerUnreachable(f"{self.name}: expected to connect to peer {meta.agent!r} "
                                  f"(instance {meta.instance[:8]}), found "
                                  f"{type(exc).__name__}: stale metadata of a peer that is "
                                  "gone?") from None
        if isinstance(name, bytes):
            name = name.decode()
        if name != meta.agent:  # keyed by one name, loaded as another: refused, nothing kept
            if name not in self._peers:  # (a peer held under that name stays as it is)
                self._unload(name, ())
            raise TransportError(f"{self.name}: metadata of agent {meta.agent!r} carries NIXL "
                                 f"metadata of agent {name!r}")
        side = None
        try:
            placements = [Placement(r.name, r.kind, r.device, r.addr, r.block_bytes,
                                    r.num_blocks, (r.kind.value, r.device, r.addr), r.stride)
                          for r in meta.regions]
            for kind in {p.kind for p in placements}:
                spans = span_rows([p for p in placements if p.kind is kind])
                descs = self._agent.get_xfer_descs(spans, kind.value)
                if not self._agent.check_remote_metadata(name, descs):
                    raise PeerNotReady(f"peer {name!r}: NIXL does not see its {kind.value} "
                                       "registrations in this metadata: re-fetch")
            side = self._prepare_side(name, placements, None)
            ipc_offer = self._ipc_offer(meta)
        except Exception as exc:  # nothing of this peer is kept: NIXL's remote agent goes too
            self._unload(name, side.dlists.values() if side is not None else ())
            if isinstance(exc, TransportError):
                raise
            raise TransportError(f"{self.name}: metadata of peer {name!r} describes memory "
                                 f"this agent cannot read: {type(exc).__name__}: {exc}") from None
        self._peers[name] = _Peer(name, meta.instance, meta.generation, side,
                                  probed_at=time.monotonic(), ipc_offer=ipc_offer)
        log.info("nixl.peer_added", agent=self.name, peer=name, regions=len(placements),
                 generation=meta.generation)
        return name

    def _ipc_offer(self, meta: wire.PeerMetadata) -> list | None:
        """The peer's VRAM allocations we may map, if CUDA IPC can apply at all."""
        ipc = meta.ipc or {}
        if (self.options.vram_ipc and type(ipc.get("allocations")) is list and ipc.get("node")
                and ipc.get("node") == node_id()
                and any(p.kind is MemoryKind.VRAM or p.pinned
                        for p in self._placements.values())):
            return list(ipc["allocations"])
        return None

    def _peer_vram(self, peer: _Peer) -> PeerMemory | None:
        # Mapped on first use, so an agent that never READs VRAM from this peer
        # (P, reading nothing from D) never maps the peer's memory.
        if peer.ipc is None and peer.ipc_offer and not peer.ipc_tried:
            peer.ipc_tried = True
            try:
                peer.ipc = PeerMemory(peer.ipc_offer)
            except Exception as exc:  # not exportable, driver refusal: NIXL carries it
                log.info("nixl.cuda_ipc_unavailable", agent=self.name, peer=peer.name,
                         error=str(exc))
                return None
            log.info("nixl.cuda_ipc_mapped", agent=self.name, peer=peer.name,
                     allocations=len(peer.ipc_offer))
        return peer.ipc

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer``; READs from it in flight drain first (they cannot be cancelled)."""
        p = self._peers.get(peer)
        if p is None:
            return
        if p.inflight:
            p.removing = True
        else:
            self._drop_peer(p)

    # -- READs --------------------------------------------------------------

    def post_read(self, peer: str, read: ReadRequest, notif: bytes | None = None) -> int:
        names = read.regions if read.regions is not None else tuple(
            n for n in self._local.regions if n != FENCE_REGION)  # every KV region
        return self.post_split_read(peer, [ReadSplit(read.runs, tuple((n, n) for n in names))],
                                    notif)

    def post_split_read(self, peer: str, splits: Sequence[ReadSplit],
                        notif: bytes | None = None) -> int:
        """Post one READ made of ``splits``; one handle, one aggregate completion."""
        self._open()
        p = self._peer(peer)
        if p.removing:
            raise UnknownPeer(f"{self.name}: peer {peer!r} is being removed")
        if p.pairings_local is not self._local:
            p.pairings, p.pairings_local = {}, self._local
        groups = plan_reads(splits, p.side.regions, self._local.regions, p.name,
                            self.name, p.pairings)
        self._next_handle += 1
        handle = self._next_handle
        if p.lost:
            self._settled.append(Completion(handle, False, "failed post: peer lost"))
            return handle
        gathers = [self._gather_pairs(p, g) for g in groups]
        single_nixl = len(groups) == 1 and gathers[0] is None
        attach = notif if (notif and single_nixl) else None
        pending = _Pending(handle, peer, [], None if attach else notif)
        for group, gather in zip(groups, gathers, strict=True):
            if gather is not None:
                try:
                    device, pairs = gather
                    pending.xfers.append(self._gatherer.gather(
                        device, pairs, group.remote_blocks, group.local_blocks))
                    self.descriptors_posted += group.descriptors
                    self.ipc_descriptors += group.descriptors
                    continue
                except CudaIpcError as exc:  # memory torch cannot view, no room to stage: NIXL
                    log.info("nixl.cuda_ipc_gather_refused", agent=self.name, peer=p.name,
                             error=str(exc))
                except Exception as exc:
                    pending.failure = pending.failure or self._failure(p, "failed post", exc)
                    break
            xfer = None
            lidx, ridx = group.indices()
            try:
                xfer = self._agent.make_prepped_xfer(
                    "READ", self._local.dlists[group.lkind], lidx,
                    p.side.dlists[group.rkind], ridx, attach or b"")
                state = self._agent.transfer(xfer)
            except Exception as exc:  # NIXL raises typed errors from its bindings
                pending.failure = pending.failure or self._failure(p, "failed post", exc)
                if xfer is not None:
                    self._release(xfer)
                break  # what was posted still drains; nothing more is posted
            if state == "ERR":
                pending.failure = pending.failure or "failed post: NIXL returned ERR"
                self._release(xfer)
                break
            pending.xfers.append(xfer)
            self.descriptors_posted += group.descriptors
        if pending.xfers:
            self._pending[handle] = pending
            p.inflight.add(handle)
        else:
            self._settled.append(Completion(handle, False, pending.failure))
        return handle

    def poll(self) -> list[Completion]:
        """Completions of READs that finished since the last call, each exactly once."""
        self._open()
        self._advance_reads()
        out, self._settled = self._settled, []
        return out

    @property
    def reads_in_flight(self) -> int:
        """READs posted whose completion NIXL has not reported yet."""
        return len(self._pending)

    def progress(self) -> None:
        """Advance READs in flight without collecting their completions (`poll` returns them).

        NIXL sends a READ's completion notification from the reader's side
        when the reader next checks that READ, so the source hears of it only
        as promptly as the reader polls.  A loop that waits for something
        else (a notification, a peer) calls this to keep READs moving.
        """
        self._open()
        self._advance_reads()
        if not self.options.progress_thread:
            # Without NIXL's thread only our calls move UCX: collecting notifications
            # does (NIXL's getNotifs progresses the worker), so a message this agent
            # sent, a connection set-up or a peer's message is handled now, not at the
            # next `recv_notifs`.  What arrived waits in the inbox for it.  A failure
            # here is left to `recv_notifs`, which collects again and raises it to its
            # own caller.
            try:
                self._inbox.extend(self._collect())
            except Exception:
                pass

    def _advance_reads(self) -> None:
        for pending in list(self._pending.values()):
            if self._advance(pending):
                self._settled.append(self._finish(pending))

    # -- notifications -------------------------------------------------------

    def send_notif(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer``: to a lost peer it goes nowhere, as into a dead one.

        A send that fails raises `TransportError` (the caller may try again) and makes the
        peer lost only if NIXL says the peer disconnected: one error that may pass is not a
        dead peer, and a live peer given up stays cut off (a P that dropped its D answered
        none of D's heartbeats; a D that dropped its P stopped heartbeating it, and P freed
        under the READ).
        """
        self._open()
        p = self._peer(peer)
        if p.lost:
            return
        try:
            self._agent.send_notif(peer, message)
        except Exception as exc:
            reason = self._failure(p, "notification", exc)
            raise TransportError(f"{self.name}: notification to {peer!r} failed: {reason}") \
                from exc

    def recv_notifs(self) -> list[Notification]:
        self._open()
        new = self._collect()  # raising, it leaves what `progress` collected in the inbox
        out, self._inbox = self._inbox, []
        out.extend(new)
        return out

    def _collect(self) -> list[Notification]:
        out: list[Notification] = []
        for peer, messages in self._agent.get_new_notifs().items():
            name = peer.decode() if isinstance(peer, bytes) else peer
            out.extend(Notification(name, bytes(m)) for m in messages if m != PROBE)
        return out

    def lost_peers(self) -> list[str]:
        """Peers known to be gone; idle peers are probed at most every ``probe_interval_s``."""
        self._open()
        now = time.monotonic()
        for p in self._peers.values():
            if not p.lost and now - p.probed_at >= self.probe_interval_s:
                p.probed_at = now
                try:
                    self._agent.send_notif(p.name, PROBE)
                except Exception as exc:  # lost on a disconnect only, as for any notification
                    reason = self._failure(p, "liveness probe", exc)
                    p.probe_failures += 1
                    if not p.lost and p.probe_failures == 1:
                        log.warning("nixl.probe_failed", agent=self.name, peer=p.name,
                                    reason=reason)
                else:
                    p.probe_failures = 0
        return sorted(p.name for p in self._peers.values() if p.lost)

    # -- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        """Drain READs in flight (up to ``close_timeout_s``), then free everything."""
        if self._closed:
            return
        deadline = time.monotonic() + self.close_timeout_s
        while self._pending and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.0005)
        for pending in self._pending.values():
            log.warning("nixl.close_abandons_read", agent=self.name, handle=pending.handle,
                        peer=pending.peer)
            for xfer in pending.xfers:
                if isinstance(xfer, GatherRead):  # a kernel cannot be cancelled: let it end
                    try:  # before the memory it copies between is unmapped
                        xfer.event.synchronize()
                    except Exception as exc:
                        log.warning("nixl.close_gather_failed", agent=self.name, error=repr(exc))
                else:
                    self._release(xfer)
        self._pending.clear()
        for p in list(self._peers.values()):
            self._drop_peer(p)
        for dlist in self._local.dlists.values():
            self._agent.release_dlist_handle(dlist)
        for descs, _ in self._registered:
            try:
                self._agent.deregister_memory(descs)
            except Exception as exc:
                log.warning("nixl.deregister_failed", agent=self.name, error=repr(exc))
        self._registered.clear()
        self._closed = True
        self._agent = None
        log.info("nixl.closed", agent=self.name)

    # -- internals -------------------------------------------------------------

    def _open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            raise UnknownPeer(f"{self.name}: peer {peer!r} was never added (or was removed)")
        return p

    def _prepare_side(self, agent_name: str, placements: list[Placement],
                      old: _Side | None) -> _Side:
        if old is not None:
            for dlist in old.dlists.values():
                self._agent.release_dlist_handle(dlist)
        regions: dict[str, RegionAt] = {}
        dlists: dict[MemoryKind, Any] = {}
        try:
            for kind in MemoryKind:
                of_kind = [p for p in placements if p.kind is kind]
                if not of_kind:
                    continue
                base = 0
                for p in of_kind:
                    regions[p.name] = RegionAt(kind, base, p.num_blocks, p.block_bytes, p.addr,
                                                p.device, p.stride, p.pinned)
                    base += p.num_blocks
                if base >= 2**31:
                    raise RegionMismatch(f"{agent_name or self.name}: {base} {kind.value} "
                                         "blocks exceed NIXL's 32-bit descriptor indices")
                dlists[kind] = self._agent.prep_xfer_dlist(agent_name, descriptor_rows(of_kind),
                                                           kind.value)
        except BaseException:  # the lists prepared so far are released, not leaked
            self._release_dlists(agent_name, dlists.values())
            raise
        return _Side(regions, dlists)

    def _gather_pairs(self, peer: _Peer,
                      group: ReadGroup) -> tuple[int, list[GatherPair]] | None:
        """The group as CUDA IPC gathers ``(device, pairs)``, or None when NIXL must carry it.

        The source is the peer's VRAM, mapped here; the destination is our VRAM
        (the kernel runs on its device) or CUDA-pinned host memory, written by
        the kernel through its device pointer (the kernel runs on the source's
        device).  Block ``b`` is at ``addr + b * stride`` on each side.
        """
        if group.rkind is not MemoryKind.VRAM:
            return None
        host = group.lkind is MemoryKind.DRAM
        if host and not all(local.pinned for _, local in group.pairs):
            return None
        if not host and group.lkind is not MemoryKind.VRAM:
            return None
        mapped = self._peer_vram(peer)
        if mapped is None:
            return None
        device = group.pairs[0][0].device if host else group.pairs[0][1].device
        pairs = []
        for remote, local in group.pairs:
            src = mapped.translate(remote.addr, remote.nbytes)
            if src is None:
                return None
            if host:
                dst = self._host_pointer(local.addr, device) if remote.device == device else None
            else:
                dst = local.addr if local.device == device else None
            if dst is None:
                return None
            pairs.append(GatherPair(src, dst, remote.num_blocks, local.num_blocks,
                                    local.block_bytes, remote.stride, local.stride))
        return device, pairs

    def _host_pointer(self, addr: int, device: int) -> int | None:
        """The device address of pinned host memory at ``addr`` (None: not mapped)."""
        key = (addr, device)
        if key not in self._host_ptrs:
            try:
                self._host_ptrs[key] = host_device_pointer(addr, device)
            except Exception as exc:  # not pinned after all, or a driver refusal
                log.info("nixl.cuda_host_pointer_unavailable", agent=self.name,
                         addr=hex(addr), device=device, error=str(exc))
                self._host_ptrs[key] = None
        return self._host_ptrs[key]

    def _advance(self, pending: _Pending) -> bool:
        """Check each transfer of ``pending``; True once all of them have finished."""
        p = self._peers[pending.peer]
        still = []
        for xfer in pending.xfers:
            if isinstance(xfer, GatherRead):
                try:
                    if not xfer.done():
                        still.append(xfer)
                except Exception as exc:  # a CUDA error surfaces on the event
                    pending.failure = pending.failure or self._failure(p, "READ", exc)
                continue
            try:
                state = self._agent.check_xfer_state(xfer)
            except Exception as exc:
                pending.failure = pending.failure or self._failure(p, "READ", exc)
                state = "FAILED"
            if state == "PROC":
                still.append(xfer)
                continue
            if state == "ERR":
                pending.failure = pending.failure or "READ failed: NIXL returned ERR"
            elif state == "DONE" and self.options.telemetry:
                self.descriptors_on_wire += self._agent.get_xfer_telemetry(xfer).descCount
            self._release(xfer)
        pending.xfers = still
        return not still

    def _finish(self, pending: _Pending) -> Completion:
        del self._pending[pending.handle]
        p = self._peers[pending.peer]
        p.inflight.discard(pending.handle)
        if not pending.failure and pending.notif_after is not None:
            try:
                self._agent.send_notif(p.name, pending.notif_after)
            except Exception as exc:
                pending.failure = self._failure(p, "completion notification", exc)
        if p.removing and not p.inflight:
            self._drop_peer(p)
        if pending.failure:
            log.warning("nixl.read_failed", agent=self.name, peer=p.name,
                        handle=pending.handle, reason=pending.failure)
        return Completion(pending.handle, not pending.failure, pending.failure)

    def _failure(self, peer: _Peer, what: str, exc: BaseException) -> str:
        """The reason to hand out for ``exc``; the peer is lost on a remote disconnect only
        (an error that may pass never gives a live peer up)."""
        kind = type(exc).__name__
        lost = kind == "nixlRemoteDisconnectError"
        reason = f"{what}: {'remote disconnect' if kind == 'nixlRemoteDisconnectError' else kind}"
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if lost and not peer.lost:
            peer.lost = True
            log.warning("nixl.peer_lost", agent=self.name, peer=peer.name, cause=reason,
                        detail=detail)
        return f"{reason} ({detail})" if detail else reason

    def _release(self, xfer: Any) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception as exc:  # nixl keeps the handle on its own leak list
            log.warning("nixl.release_failed", agent=self.name, error=repr(exc))

    def _drop_peer(self, p: _Peer) -> None:
        """Forget ``p`` whatever fails on the way (each failure logged): a READ's completion
        that made the peer go must still be handed out."""
        self._peers.pop(p.name, None)
        if p.ipc is not None:
            self._gatherer.forget()  # cached views of the memory about to be unmapped
            try:
                p.ipc.close()
            except Exception as exc:
                log.warning("nixl.ipc_close_failed", agent=self.name, peer=p.name, error=repr(exc))
            p.ipc = None
        self._unload(p.name, p.side.dlists.values())

    def _unload(self, name: str, dlists: Iterable[Any]) -> None:
        """Release a peer's prepared descriptor lists and unload its NIXL metadata, whatever
        fails on the way (each failure logged)."""
        self._release_dlists(name, dlists)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            log.info("nixl.remove_remote_failed", agent=self.name, peer=name, error=repr(exc))

    def _release_dlists(self, name: str, dlists: Iterable[Any]) -> None:
        """Release prepared descriptor lists of ``name``, each failure logged, none raised."""
        for dlist in dlists:
            try:
                self._agent.release_dlist_handle(dlist)
            except Exception as exc:
                log.warning("nixl.release_failed", agent=self.name, peer=name, error=repr(exc))

