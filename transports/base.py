"""The `Transport` protocol: what the lifecycle needs from a data path.

A transport moves KV blocks from a remote agent's registered regions into
local ones with one-sided READs, and carries small notifications (release,
heartbeat, heartbeat acknowledgement) between agents.  Two implementations
follow it: `transports.sim` (deterministic, in-memory, fault-injecting) and
`transports.nixl` (real NIXL/UCX READs of host and GPU memory).  Both pass
the same contract suite (`tests/transport_contract.py`).

Theory of operation
-------------------
* Each side registers its KV regions once (`register`).  A region is one
  contiguous buffer viewed as ``num_blocks`` blocks of ``block_bytes`` bytes;
  a model's KV cache is several regions (layers, K/V, cache groups) that share
  block ids.
* Agents exchange `metadata()` bytes out of band (a side channel) and call
  `add_peer`.  Metadata fetched before the peer registered is refused with
  `PeerNotReady`; the caller re-fetches.
* `post_read` reads remote blocks into local blocks over every region at once
  and returns a handle.  `notif`, when given, is delivered to the remote agent
  once the READ has completed (this is how a consumer's completion doubles as
  its release notification).  A posted READ cannot be cancelled.
* `post_split_read` is the general form: several splits, each pairing remote
  regions with (possibly differently named) local ones, one completion.
* `poll` returns each handle's completion exactly once: `ok=True`, or
  `ok=False` with the reason (failed post, remote disconnect, timeout);
  `progress` advances transfers between polls.
* `send_notif` / `recv_notifs` carry small byte messages; a send that fails
  raises `TransportError` (the caller may send again), and one to a peer
  already lost goes nowhere.  `lost_peers` reports peers the transport knows
  to be gone (a remote disconnect): never a live peer after an error that
  may pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvhandoff.core.fence import FENCE_BYTES, FENCE_REGION
from kvhandoff.core.planning import BlockRun, GroupRead  # reads are planned by the core


class MemoryKind(StrEnum):
    DRAM = "DRAM"
    VRAM = "VRAM"


class TransportError(Exception):
    """Base class of the typed errors a transport raises."""


class PeerNotReady(TransportError):
    """The peer's metadata does not (yet) show its registrations: re-fetch."""


class UnknownPeer(TransportError):
    """A call named a peer that was never added (or was removed)."""


class PeerUnreachable(TransportError):
    """Metadata names a peer that cannot be connected to (gone, or a stale address)."""


class RegionMismatch(TransportError):
    """Local and remote registrations cannot be paired (count, block size)."""


class InvalidRead(TransportError):
    """A READ that names blocks outside the registered regions, or no blocks at all."""


@dataclass(frozen=True, slots=True)
class KVRegion:
    """One registered buffer: ``num_blocks`` blocks of ``block_bytes`` each.

    ``buffer`` is a numpy array or a torch tensor (host or CUDA) whose bytes
    are laid out block after block, every ``block_stride`` bytes; ``name`` identifies the cache group /
    layer so peers can pair regions; ``device`` is the CUDA ordinal for VRAM.
    """

    name: str
    buffer: Any
    num_blocks: int
    block_bytes: int
    kind: MemoryKind = MemoryKind.DRAM
    device: int = 0
    # Bytes from block b to block b + 1 in ``buffer`` (0: ``block_bytes``, adjacent).  A
    # larger stride leaves bytes between blocks that the region does not own (a HiSparse
    # D's indexer pages sit in rows shared with groups never read).
    stride: int = 0

    @property
    def block_stride(self) -> int:
        return self.stride or self.block_bytes


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """What one READ split copies: block runs over the named regions."""

    runs: tuple[BlockRun, ...]
    regions: tuple[str, ...] | None = None  # None: every registered region


@dataclass(frozen=True, slots=True)
class ReadSplit:
    """One part of a READ: ``runs`` applied to each ``(remote region, local region)`` pair.

    Remote and local names differ when the destination is split by memory
    kind (``"layer0" -> "layer0@gpu"`` for a GPU-resident tail, ``->
    "layer0@host"`` for a host pool); a plain READ pairs each region with its
    namesake (``ReadRequest``).  ``runs`` is a tuple of `BlockRun` or, in the
    NIXL transport, an ``(n, 3)`` integer array of the same rows.
    """

    runs: Any
    regions: tuple[tuple[str, str], ...]


def group_splits(reads: Sequence[GroupRead]) -> list[ReadSplit]:
    """The `ReadSplit`\\ s that post planned group reads (`core.planning.GroupRead`), in order."""
    return [ReadSplit(part.runs, part.regions) for read in reads for part in read.parts]


def fence_region(slots: int) -> tuple[KVRegion, np.ndarray]:
    """A fence region of ``slots`` words in host memory (`core.fence`): P's slots, or D's
    landing slots for the fence READs it posts; registered with the KV regions.  Returns
    the region and its words (``uint64``, zeroed: every slot cleared)."""
    words = np.zeros(slots, np.uint64)
    return KVRegion(FENCE_REGION, words, slots, FENCE_BYTES), words


def fence_split(slot: int, local_slot: int) -> ReadSplit:
    """The one READ split that copies P's fence ``slot`` into D's landing ``local_slot``."""
    return ReadSplit((BlockRun(slot, local_slot, 1),), ((FENCE_REGION, FENCE_REGION),))


class FenceReader:
    """D's side of the fence READs over one transport (`core.fence`): its landing slots (a
    region to register with the KV regions) and the READs in flight into them.

    Each driver of a `core.consumer.ConsumerEngine` posts the fence READs the engine plans
    with `post` and hands `landed`'s answer back to the engine (``fence_read``).
    """

    __slots__ = ("region", "words", "_free", "_reads")

    def __init__(self, slots: int) -> None:
        self.region, self.words = fence_region(slots)
        self._free = list(range(slots - 1, -1, -1))
        self._reads: dict[int, tuple[str, int, int, float]] = {}  # handle -> (rid, landing, slot, planned)

    def post(self, transport: Transport, peer: str, rid: str, slot: int,
             planned: float) -> bool:
        """Post one READ of P's ``slot``; False when no landing slot is free (it proves
        nothing: the engine asks P).  What ``post_split_read`` raises, the caller handles."""
        if not self._free:
            return False
        local = self._free.pop()
        try:
            handle = transport.post_split_read(peer, [fence_split(slot, local)])
        except BaseException:
            self._free.append(local)
            raise
        self._reads[handle] = (rid, local, slot, planned)
        return True

    def landed(self, c: Completion) -> tuple[str, int, int | None, float] | None:
        """(request, P's slot, the word it found or None when the READ failed, when the engine
        planned it) for a completion of one of these READs; None for any other."""
        read = self._reads.pop(c.handle, None)
        if read is None:
            return None
        rid, local, slot, planned = read
        value = int(self.words[local]) if c.ok else None  # read before the slot is reused
        self._free.append(local)
        return rid, slot, value, planned

    @property
    def in_flight(self) -> int:
        return len(self._reads)


@dataclass(frozen=True, slots=True)
class Completion:
    handle: int
    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Notification:
    peer: str
    message: bytes


@runtime_checkable
class Transport(Protocol):
    name: str

    def register(self, regions: Sequence[KVRegion]) -> None: ...

    def metadata(self) -> bytes: ...

    def add_peer(self, metadata: bytes) -> str:
        """Add the agent described by ``metadata``; return its name."""
        ...

    def remove_peer(self, peer: str) -> None: ...

    def post_read(self, peer: str, read: ReadRequest, notif: bytes | None = None) -> int:
        """Post a READ from ``peer``'s blocks into same-named local regions; return a handle."""
        ...

    def post_split_read(self, peer: str, splits: Sequence[ReadSplit],
                        notif: bytes | None = None) -> int:
        """Post one READ made of several splits (e.g. a GPU tail and a host pool).

        One handle, one completion once every part landed (failed if any part
        failed); ``notif`` reaches the peer only after the last part.
        """
        ...

    def poll(self) -> list[Completion]: ...

    def progress(self) -> None:
        """Advance posted READs without collecting completions (a pump loop's step)."""
        ...

    def send_notif(self, peer: str, message: bytes) -> None: ...

    def recv_notifs(self) -> list[Notification]: ...

    def lost_peers(self) -> list[str]: ...

    def close(self) -> None: ...
