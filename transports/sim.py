"""The simulated transport: seeded, in-memory, fault-injecting, on a simulated clock.

Theory of operation
-------------------
A `SimNetwork` is one simulated fabric.  It owns the discrete-event clock
(`SimClock`), a seeded random stream, the fault plan and every agent on it.
`SimNetwork.agent(name)` returns a `SimTransport` that follows the
`Transport` protocol exactly as the NIXL transport does, so engine models and
the contract suite drive either one the same way.

* READs copy real bytes.  Registered regions are numpy buffers viewed as
  ``(num_blocks, block_bytes)`` rows, one every ``block_stride`` bytes (the
  bytes between rows are never read or written); a READ copies rows from the remote
  agent's region into the local one **when it completes**, i.e. it sees the
  source as it is at the end of the transfer.  That is the pessimistic choice:
  if P freed (and poisoned, or reused) a source block while the READ was in
  flight, D's bytes show it.
* A READ takes ``read_latency_s + bytes / bandwidth``, stretched by the fault
  plan (slow reads).  It completes ``ok=False`` when the plan fails it, when
  the source agent crashes before it completes, or when a partition outlasts
  ``read_timeout_s``; a partition shorter than that only stalls it.
* The READ's notification travels to the source agent only after the bytes
  landed, over the same faulty path as `send_notif`: it can be dropped,
  duplicated, delayed or overtaken; a partition in force at delivery time
  drops it.
* Time is the simulated clock's.  Nothing here reads the wall clock, and all
  randomness comes from ``random.Random`` seeded from the network seed, so a
  seed replays bit for bit.
* `SimBlockPool` is a block allocator over one or more agents' regions that
  writes a poison pattern into freed blocks and hands them out again last-in
  first-out, and asks the network whether a READ of them is still in flight:
  that is how ``freed_under_read`` is measured from the bytes' point of view,
  independently of any event log.

This module depends on nothing but numpy, orjson and the protocol, because
the simulated world (`kvhandoff.simulations`) is built on top of it and the
contract suite runs it standalone.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from kvhandoff.core.fence import FENCE_REGION
from kvhandoff.transports.base import (
    Completion,
    InvalidRead,
    KVRegion,
    Notification,
    PeerNotReady,
    ReadRequest,
    ReadSplit,
    RegionMismatch,
    TransportError,
    UnknownPeer,
)

__all__ = [
    "POISON", "AgentCrashed", "InvalidRead", "LinkModel", "NetworkStats", "NotifFaults",
    "ReadFaults", "SendRefused", "SimBlockPool", "SimClock", "SimNetwork", "SimTransport",
    "sub_seed",
]

POISON = 0xDB  # the byte a freed block is filled with ("dead block")


class AgentCrashed(TransportError):
    """A call on an agent that crashed or was closed."""


class SendRefused(TransportError):
    """``send_notif`` failed and sent nothing, as NIXL's raises on an endpoint error: the
    peer is not lost, a later send may go (`NotifFaults.refuse`)."""


def sub_seed(seed: int, name: str) -> int:
    """A component's seed derived from the run seed (stable across processes)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


# --- the clock ---------------------------------------------------------------


class SimClock:
    """A discrete-event loop: callbacks ordered by (time, insertion order).

    Two callbacks at the same instant run in the order they were scheduled,
    which keeps a run deterministic without any tie-breaking randomness.
    """

    __slots__ = ("now", "_queue", "_seq", "steps")

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._queue: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0
        self.steps = 0

    def call_at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        if t < self.now:
            t = self.now  # the past is the present: never run time backwards
        self._seq += 1
        heapq.heappush(self._queue, (t, self._seq, fn, args))

    def call_later(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.call_at(self.now + dt, fn, *args)

    def next_time(self) -> float:
        return self._queue[0][0] if self._queue else math.inf

    def step(self) -> bool:
        """Run the next callback; False when nothing is scheduled."""
        if not self._queue:
            return False
        t, _, fn, args = heapq.heappop(self._queue)
        self.now = t
        self.steps += 1
        fn(*args)
        return True

    def run_through(self, horizon: float, max_steps: int) -> int:
        """Run callbacks due at or before ``horizon``, at most ``max_steps`` of them (the
        loop of `step`, inlined); returns how many ran."""
        queue, pop = self._queue, heapq.heappop
        steps = 0
        while queue and queue[0][0] <= horizon and steps < max_steps:
            t, _, fn, args = pop(queue)
            self.now = t
            self.steps += 1
            fn(*args)
            steps += 1
        return steps

    def run_until(self, t: float) -> None:
        """Run every callback due at or before ``t``, then set the time to ``t``."""
        queue = self._queue
        while queue and queue[0][0] <= t:
            self.step()
        if t > self.now:
            self.now = t

    def pending(self) -> int:
        return len(self._queue)


# --- the fault plan ----------------------------------------------------------


@dataclass(slots=True)
class LinkModel:
    """Latency and bandwidth of the simulated fabric."""

    read_latency_s: float = 20e-6
    bandwidth_Bps: float = 25e9
    notif_latency_s: float = 30e-6
    jitter_s: float = 10e-6  # uniform extra latency on every message and READ
    read_timeout_s: float = 60.0  # a READ stalled longer than this fails ("timeout")
    detect_s: float = 0.5  # how long until survivors see a crashed peer as lost


@dataclass(slots=True)
class NotifFaults:
    """What can happen to a notification on its way.  Rates are probabilities."""

    drop: float = 0.0
    refuse: float = 0.0  # the sender's send_notif raises `SendRefused`: it knows, unlike a drop
    duplicate: float = 0.0
    delay: float = 0.0  # probability of an extra delay of up to ``delay_s``
    delay_s: float = 0.0
    reorder: float = 0.0  # probability of an extra jitter of up to ``reorder_s`` (overtaking)
    reorder_s: float = 0.005
    max_consecutive_drops: int | None = None  # per (src, dst) link, refusals too; None: unbounded

    def any(self) -> bool:
        return bool(self.drop or self.refuse or self.duplicate or self.delay or self.reorder)


@dataclass(slots=True)
class ReadFaults:
    """What can happen to a READ.  Rates are probabilities."""

    fail: float = 0.0
    slow: float = 0.0  # probability that a READ is stretched by ``slow_s`` (uniform in range)
    slow_s: tuple[float, float] = (0.0, 0.0)


@dataclass(slots=True)
class NetworkStats:
    reads_posted: int = 0
    reads_completed: int = 0
    reads_failed: int = 0
    bytes_read: int = 0
    notifs_sent: int = 0  # put on the fabric (a refused send is not: notifs_refused)
    notifs_delivered: int = 0
    notifs_dropped: int = 0
    notifs_refused: int = 0
    notifs_duplicated: int = 0
    notifs_delayed: int = 0
    freed_under_read: int = 0  # frees of source blocks that a READ in flight was reading
    overwritten_under_read: int = 0  # frees of destination pages a READ in flight was writing
    double_frees: int = 0


# --- the network -------------------------------------------------------------


@dataclass(slots=True)
class _Read:
    """One READ in flight."""

    key: int
    dst: str  # the agent that posted it
    src: str  # the agent whose blocks it copies
    handle: int
    parts: tuple[tuple[tuple, tuple[tuple[str, str], ...]], ...]  # (runs, (remote, local) pairs)
    notif: bytes | None
    posted_at: float
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    fail: bool = False
    done: bool = False


class SimNetwork:
    """One simulated fabric: clock, agents, faults, partitions, crashes."""

    def __init__(self, clock: SimClock | None = None, seed: int = 0,
                 link: LinkModel | None = None,
                 kind_of: Callable[[bytes], str] | None = None) -> None:
        self.clock = clock if clock is not None else SimClock()
        self.rng = random.Random(sub_seed(seed, "network"))
        self.link = link if link is not None else LinkModel()
        self.kind_of = kind_of  # classifies notifications for per-kind faults
        self.stats = NetworkStats()
        self.agents: dict[str, SimTransport] = {}
        self.notif_faults: dict[str | None, NotifFaults] = {}
        self.read_faults = ReadFaults()
        self._partitions: list[tuple[frozenset[str], float, float]] = []  # (pair, start, end)
        self._dead: dict[str, float] = {}  # agent -> time it died
        self._reads: dict[int, _Read] = {}
        self._read_key = 0
        self._src_refs: dict[str, dict[int, int]] = {}  # agent -> block -> READs in flight
        self._dst_refs: dict[str, dict[int, int]] = {}
        self._drop_streak: dict[tuple[str, str, str | None], int] = {}
        self.on_deliver: Callable[[str], None] | None = None  # wakes the owner of an agent

    # -- topology and faults ---------------------------------------------

    def agent(self, name: str) -> SimTransport:
        if name in self.agents and name not in self._dead:
            raise ValueError(f"agent {name!r} already exists")
        agent = SimTransport(self, name)
        self.agents[name] = agent
        self._dead.pop(name, None)
        self._src_refs[name] = {}
        self._dst_refs[name] = {}
        return agent

    def set_notif_faults(self, faults: NotifFaults, kind: str | None = None) -> None:
        """Faults for every notification (``kind=None``) or one kind (see ``kind_of``)."""
        self.notif_faults[kind] = faults

    def partition(self, a: str, b: str, start: float, end: float) -> None:
        """Cut the link between agents ``a`` and ``b`` from ``start`` to ``end``."""
        self._partitions.append((frozenset((a, b)), start, end))

    def partitioned(self, a: str, b: str, t: float) -> float:
        """The time the a–b link heals if it is cut at ``t``, else 0."""
        if not self._partitions:
            return 0.0
        pair = frozenset((a, b))
        heal = 0.0
        for p, start, end in self._partitions:
            if p == pair and start <= t < end:
                heal = max(heal, end)
        return heal

    def heal_all(self) -> None:
        """End every partition now (the liveness phase of a simulation)."""
        now = self.clock.now
        self._partitions = [(p, s, min(e, now)) for p, s, e in self._partitions]

    def crash(self, name: str) -> None:
        """Kill an agent now: its memory is gone, its READs die, peers notice after ``detect_s``."""
        if name in self._dead:
            return
        now = self.clock.now
        self._dead[name] = now
        self.agents[name]._crashed = True
        for read in list(self._reads.values()):
            if read.done:
                continue
            if read.dst == name:  # the reader died: nobody will hear of this READ
                self._finish(read)
            elif read.src == name:
                self._finish(read)
                read.fail = True
                self.clock.call_at(now + self.link.detect_s, self._complete_failed, read,
                                   "remote disconnect")

    @property
    def has_dead(self) -> bool:
        """Whether any agent has crashed (a cheap test before asking who)."""
        return bool(self._dead)

    def is_dead(self, name: str) -> bool:
        return name in self._dead

    def lost_since(self, name: str, t: float) -> bool:
        died = self._dead.get(name)
        return died is not None and t >= died + self.link.detect_s

    # -- block accounting for the "freed under read" measurement -----------

    def reads_in_flight(self, agent: str, blocks: Sequence[int], *, source: bool = True) -> int:
        """How many of ``blocks`` of ``agent`` a READ in flight reads (source) or writes."""
        refs = (self._src_refs if source else self._dst_refs).get(agent, {})
        return sum(1 for b in blocks if refs.get(b))

    @staticmethod
    def _ref(refs: dict[int, int], blocks: tuple[int, ...], delta: int) -> None:
        for b in blocks:
            n = refs.get(b, 0) + delta
            if n:
                refs[b] = n
            else:
                del refs[b]

    def _finish(self, read: _Read) -> None:
        if read.done:
            return
        read.done = True
        del self._reads[read.key]
        self._ref(self._src_refs[read.src], read.src_blocks, -1)
        self._ref(self._dst_refs[read.dst], read.dst_blocks, -1)

    # -- READs ------------------------------------------------------------

    def _post(self, dst: SimTransport, peer: str, splits: Sequence[ReadSplit],
              notif: bytes | None, handle: int) -> None:
        now = self.clock.now
        local_regions = dst._regions
        remote_regions = self.agents[peer]._remote_regions_of(dst)  # dst's view of peer's
        src_blocks: list[int] = []
        dst_blocks: list[int] = []
        parts = []
        nbytes = 0
        for split in splits:
            runs, pairs = split.runs, split.regions
            if not runs or not pairs:
                raise InvalidRead("a READ split needs block runs and regions")
            parts.append((tuple(runs), pairs))
            fence = False
            for remote_name, local_name in pairs:
                local = local_regions.get(local_name)
                remote = remote_regions.get(remote_name)
                if local is None or remote is None:
                    raise RegionMismatch(f"region {remote_name!r} -> {local_name!r} is not "
                                         f"registered on both {peer} and {dst.name}")
                local_blocks, block_bytes = local.shape
                remote_blocks = remote[0]
                if block_bytes != remote[1]:
                    raise RegionMismatch(f"region {remote_name!r} -> {local_name!r}: block_bytes "
                                         f"{remote[1]} on {peer}, {block_bytes} here")
                for run in runs:
                    count, remote_start, local_start = run.count, run.remote_start, run.local_start
                    if (count <= 0 or remote_start < 0 or local_start < 0
                            or remote_start + count > remote_blocks
                            or local_start + count > local_blocks):
                        raise InvalidRead(f"run {run} outside region {remote_name!r} -> "
                                          f"{local_name!r} ({remote_blocks} remote, "
                                          f"{local_blocks} local blocks)")
                    nbytes += count * block_bytes
                fence = fence or remote_name == FENCE_REGION or local_name == FENCE_REGION
            if fence:
                continue  # fence slots are no KV blocks: "freed under read" counts blocks
            for run in runs:
                src_blocks.extend(range(run.remote_start, run.remote_start + run.count))
                dst_blocks.extend(range(run.local_start, run.local_start + run.count))
        self._read_key += 1
        rec = _Read(self._read_key, dst.name, peer, handle, tuple(parts), notif, now,
                    tuple(src_blocks), tuple(dst_blocks))
        self.stats.reads_posted += 1
        if peer in self._dead:  # a post to a dead peer fails at once ("failed post")
            rec.done = True
            self.clock.call_at(now, self._complete_failed, rec, "failed post: peer lost")
            return
        self._reads[rec.key] = rec
        self._ref(self._src_refs[peer], rec.src_blocks, +1)
        self._ref(self._dst_refs[dst.name], rec.dst_blocks, +1)
        link, rng, faults = self.link, self.rng, self.read_faults
        duration = link.read_latency_s + nbytes / link.bandwidth_Bps + rng.random() * link.jitter_s
        if faults.slow and rng.random() < faults.slow:
            lo, hi = faults.slow_s
            duration += lo + rng.random() * (hi - lo)
        if faults.fail and rng.random() < faults.fail:
            rec.fail = True
        self.clock.call_at(now + duration, self._complete, rec)

    def _complete(self, read: _Read) -> None:
        if read.done:
            return  # a crash already settled it
        now = self.clock.now
        heal = self.partitioned(read.dst, read.src, now)
        if heal:  # stalled: finish when the link heals, or time out
            give_up = read.posted_at + self.link.read_timeout_s
            if heal <= give_up:
                self.clock.call_at(heal, self._complete, read)
            else:
                self._finish(read)
                self.clock.call_at(give_up, self._complete_failed, read, "timeout")
            return
        self._finish(read)
        dst = self.agents[read.dst]
        if read.fail:
            self.stats.reads_failed += 1
            dst._completions.append(Completion(read.handle, False, "injected read failure"))
            self._wake(read.dst)
            return
        src = self.agents[read.src]
        nbytes = 0
        for runs, pairs in read.parts:
            for remote_name, local_name in pairs:
                s, d = src._regions[remote_name], dst._regions[local_name]
                for run in runs:
                    d[run.local_start:run.local_start + run.count] = \
                        s[run.remote_start:run.remote_start + run.count]
                    nbytes += run.count * d.shape[1]
        self.stats.reads_completed += 1
        self.stats.bytes_read += nbytes
        dst._completions.append(Completion(read.handle, True))
        self._wake(read.dst)
        if read.notif is not None:
            self._send(read.dst, read.src, read.notif, refusable=False)

    def _complete_failed(self, read: _Read, reason: str) -> None:
        if read.dst in self._dead:
            return
        self.stats.reads_failed += 1
        self.agents[read.dst]._completions.append(Completion(read.handle, False, reason))
        self._wake(read.dst)

    # -- notifications ----------------------------------------------------

    def _send(self, src: str, dst: str, message: bytes, refusable: bool = True) -> None:
        """Put ``message`` on the fabric with its kind's faults.  ``refusable``: a
        ``send_notif`` (a READ's own notification travels with the READ: never refused).
        A refused send raises `SendRefused`, counted in ``notifs_refused`` only: nothing
        was sent."""
        link, rng = self.link, self.rng
        kind = self.kind_of(message) if self.kind_of is not None and self.notif_faults else None
        faults = self.notif_faults.get(kind) or self.notif_faults.get(None)
        delay = link.notif_latency_s + rng.random() * link.jitter_s
        copies = 1
        if faults is not None and faults.any():
            refused = refusable and faults.refuse and rng.random() < faults.refuse
            if refused or (faults.drop and rng.random() < faults.drop):
                key = (src, dst, kind)
                streak = self._drop_streak.get(key, 0)
                cap = faults.max_consecutive_drops
                if cap is None or streak < cap:
                    self._drop_streak[key] = streak + 1
                    if refused:
                        self.stats.notifs_refused += 1
                        raise SendRefused(f"{src} -> {dst}: send refused")
                    self.stats.notifs_sent += 1
                    self.stats.notifs_dropped += 1
                    return
            self._drop_streak.pop((src, dst, kind), None)
            if faults.delay and rng.random() < faults.delay:
                delay += rng.random() * faults.delay_s
                self.stats.notifs_delayed += 1
            if faults.reorder and rng.random() < faults.reorder:
                delay += rng.random() * faults.reorder_s
            if faults.duplicate and rng.random() < faults.duplicate:
                copies = 2
                self.stats.notifs_duplicated += 1
        self.stats.notifs_sent += 1
        now = self.clock.now
        for i in range(copies):
            extra = i * rng.random() * max(link.jitter_s, 1e-6) * 4
            self.clock.call_at(now + delay + extra, self._deliver, src, dst, message)

    def _deliver(self, src: str, dst: str, message: bytes) -> None:
        agent = self.agents.get(dst)
        if agent is None or dst in self._dead or self.partitioned(src, dst, self.clock.now):
            self.stats.notifs_dropped += 1
            return
        self.stats.notifs_delivered += 1
        agent._notifs.append(Notification(src, message))
        self._wake(dst)

    def _wake(self, name: str) -> None:
        if self.on_deliver is not None:
            self.on_deliver(name)


# --- one agent ---------------------------------------------------------------


def _rows(region: KVRegion) -> np.ndarray:
    """A region's buffer as (num_blocks, block_bytes) uint8 rows, sharing memory.

    Row ``b`` starts ``b * block_stride`` bytes in: a strided region's view
    skips the bytes between its blocks, so a READ never touches them.
    """
    buf = region.buffer
    if not isinstance(buf, np.ndarray):
        if hasattr(buf, "numpy") and getattr(buf, "device", None) is not None \
                and str(buf.device) == "cpu":
            buf = buf.numpy()  # a CPU torch tensor shares its memory with numpy
        else:
            raise RegionMismatch(f"region {region.name!r}: the sim transport needs host memory")
    if not buf.flags.c_contiguous:
        raise RegionMismatch(f"region {region.name!r}: buffer is not contiguous")
    if region.num_blocks <= 0 or region.block_bytes <= 0:
        raise RegionMismatch(f"region {region.name!r}: expected positive num_blocks and "
                             f"block_bytes, found {region.num_blocks} x {region.block_bytes}")
    stride = region.block_stride
    if stride < region.block_bytes:
        raise RegionMismatch(f"region {region.name!r}: stride {stride} < block_bytes "
                             f"{region.block_bytes} (blocks would overlap)")
    flat = buf.reshape(-1).view(np.uint8)
    need = (region.num_blocks - 1) * stride + region.block_bytes
    if flat.size < need:
        raise RegionMismatch(f"region {region.name!r}: {flat.size} bytes < {need} needed")
    if stride == region.block_bytes:
        return flat[:need].reshape(region.num_blocks, region.block_bytes)
    return np.lib.stride_tricks.as_strided(flat[:need], (region.num_blocks, region.block_bytes),
                                           (stride, 1))


class SimTransport:
    """One agent on a `SimNetwork`; follows the `Transport` protocol."""

    def __init__(self, network: SimNetwork, name: str) -> None:
        self.network = network
        self.name = name
        self._regions: dict[str, np.ndarray] = {}
        self._peers: dict[str, dict[str, tuple[int, int]]] = {}  # peer -> region -> (blocks, bytes)
        self._completions: list[Completion] = []
        self._notifs: list[Notification] = []
        self._next_handle = 0
        self._crashed = False
        self._lost_reported: list[str] = []

    def _alive(self) -> None:
        if self._crashed:
            raise AgentCrashed(f"agent {self.name!r} has crashed or was closed")

    # -- protocol ---------------------------------------------------------

    def register(self, regions: Sequence[KVRegion]) -> None:
        self._alive()
        for region in regions:
            if region.name in self._regions:
                raise RegionMismatch(f"region {region.name!r} registered twice on {self.name}")
            self._regions[region.name] = _rows(region)

    def metadata(self) -> bytes:
        self._alive()
        return orjson.dumps({
            "agent": self.name,
            "regions": [[n, r.shape[0], r.shape[1]] for n, r in self._regions.items()],
        })

    def add_peer(self, metadata: bytes) -> str:
        self._alive()
        try:
            meta = orjson.loads(metadata)
            name = meta["agent"]
            regions = {n: (int(b), int(s)) for n, b, s in meta["regions"]}
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"unreadable peer metadata: {exc}") from None
        if not regions:
            raise PeerNotReady(f"peer {name!r} has not registered any memory yet: re-fetch")
        if name not in self.network.agents:
            raise UnknownPeer(f"no agent {name!r} on this network")
        self._peers[name] = regions
        return name

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def post_read(self, peer: str, read: ReadRequest, notif: bytes | None = None) -> int:
        if not read.runs:
            raise InvalidRead("a READ needs at least one block run")
        names = read.regions if read.regions is not None else tuple(
            n for n in self._regions if n != FENCE_REGION)  # every KV region
        return self.post_split_read(peer, [ReadSplit(read.runs, tuple((n, n) for n in names))],
                                    notif)

    def post_split_read(self, peer: str, splits: Sequence[ReadSplit],
                        notif: bytes | None = None) -> int:
        self._alive()
        if peer not in self._peers:
            raise UnknownPeer(f"{self.name}: peer {peer!r} was never added")
        if not splits:
            raise InvalidRead("a READ needs at least one split")
        self._next_handle += 1
        self.network._post(self, peer, splits, notif, self._next_handle)
        return self._next_handle

    def progress(self) -> None:
        """Nothing to do: the simulated fabric moves with the clock."""

    def poll(self) -> list[Completion]:
        self._alive()
        out, self._completions = self._completions, []
        return out

    def send_notif(self, peer: str, message: bytes) -> None:
        self._alive()
        if peer not in self._peers:
            raise UnknownPeer(f"{self.name}: peer {peer!r} was never added")
        self.network._send(self.name, peer, message)

    def recv_notifs(self) -> list[Notification]:
        self._alive()
        out, self._notifs = self._notifs, []
        return out

    def lost_peers(self) -> list[str]:
        self._alive()
        now = self.network.clock.now
        return [p for p in self._peers if self.network.lost_since(p, now)]

    def close(self) -> None:
        if not self._crashed:
            self.network.crash(self.name)

    # -- simulation extras ----------------------------------------------------

    def _remote_regions_of(self, reader: SimTransport) -> dict[str, tuple[int, int]]:
        # The reader's view of this agent's regions (what the metadata said).
        return reader._peers.get(self.name, {})

    def blocks(self, region: str) -> np.ndarray:
        """The (num_blocks, block_bytes) rows of a registered region (shared memory)."""
        return self._regions[region]

    @property
    def region_names(self) -> tuple[str, ...]:
        return tuple(self._regions)

    @property
    def notifs_waiting(self) -> bool:
        """`recv_notifs` would return something (or raise: crashed).  Most simulated engine
        steps find nothing on most ranks, and the drivers skip the call then."""
        return bool(self._notifs) or self._crashed

    @property
    def completions_waiting(self) -> bool:
        """`poll` would return something (or raise: crashed)."""
        return bool(self._completions) or self._crashed


# --- a block pool that poisons what it frees ----------------------------------


class SimBlockPool:
    """Block ids shared by one or more agents' registered regions (one agent per rank).

    The ids are allocated once for every rank (as an engine's scheduler does);
    each rank frees its copy when its own lifecycle says so, and the id goes
    back to the free list when no rank holds it any more.  ``free`` writes the
    poison pattern into the rank's blocks, checks whether a READ of them (or,
    for a destination pool, into them) is still in flight, and puts the ids
    at the head of the free list, so the next allocation reuses them: a READ
    of freed memory then sees poison or another request's KV.  Freeing a block
    the rank does not hold is counted as a double free and otherwise ignored.
    """

    __slots__ = ("agents", "num_blocks", "source", "_free", "_held", "_holders")

    def __init__(self, agents: Sequence[SimTransport], num_blocks: int, *,
                 source: bool = True) -> None:
        self.agents = list(agents)
        self.num_blocks = num_blocks
        self.source = source  # P's pool (READs read it) or D's (READs write into it)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._held = [bytearray(num_blocks) for _ in self.agents]
        self._holders = bytearray(num_blocks)  # how many ranks still hold each id

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def held(self, rank: int) -> int:
        """How many blocks ``rank`` still holds."""
        return sum(self._held[rank])

    def allocate(self, n: int) -> list[int] | None:
        """``n`` block ids held by every rank, or None when the pool cannot hold them now."""
        free = self._free
        if n > len(free):
            return None
        ids = [free.pop() for _ in range(n)]
        ranks = len(self.agents)
        for held in self._held:
            for b in ids:
                held[b] = 1
        for b in ids:
            self._holders[b] = ranks
        return ids

    def free(self, ids: Sequence[int], rank: int = 0) -> int:
        """``rank`` gives ``ids`` back; returns how many it did not hold (double frees)."""
        agent = self.agents[rank]
        net = agent.network
        held = self._held[rank]
        live = [b for b in ids if held[b]]
        doubles = len(ids) - len(live)
        net.stats.double_frees += doubles
        if not live:
            return doubles
        if not agent._crashed:
            refs = (net._src_refs if self.source else net._dst_refs)[agent.name]
            # (``refs`` holds only blocks with a READ in flight: counts are never 0)
            if refs and not refs.keys().isdisjoint(live):
                # Counted once per free that hit a READ in flight, whatever its size.
                if self.source:
                    net.stats.freed_under_read += 1
                else:
                    net.stats.overwritten_under_read += 1
            index = np.array(live, dtype=np.intp)  # converted once, for every region
            for name, rows in agent._regions.items():
                if name != FENCE_REGION:  # fence slots are P's, written by its engine
                    rows[index] = POISON
        holders, free = self._holders, self._free
        for b in live:
            held[b] = 0
            holders[b] -= 1
            if not holders[b]:
                free.append(b)
        return doubles
