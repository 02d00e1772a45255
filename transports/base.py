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
* `poll` returns each handle's completion exactly once: `ok=True`, or
  `ok=False` with the reason (failed post, remote disconnect, timeout).
* `send_notif` / `recv_notifs` carry small byte messages; `lost_peers`
  reports peers the transport knows to be gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from kvhandoff.core.planning import BlockRun  # runs are planned by the core


class MemoryKind(StrEnum):
    DRAM = "DRAM"
    VRAM = "VRAM"


class TransportError(Exception):
    """Base class of the typed errors a transport raises."""


class PeerNotReady(TransportError):
    """The peer's metadata does not (yet) show its registrations: re-fetch."""


class UnknownPeer(TransportError):
    """A call named a peer that was never added (or was removed)."""


class RegionMismatch(TransportError):
    """Local and remote registrations cannot be paired (count, block size)."""


@dataclass(frozen=True, slots=True)
class KVRegion:
    """One registered buffer: ``num_blocks`` blocks of ``block_bytes`` each.

    ``buffer`` is a numpy array or a torch tensor (host or CUDA) whose bytes
    are laid out block after block; ``name`` identifies the cache group /
    layer so peers can pair regions; ``device`` is the CUDA ordinal for VRAM.
    """

    name: str
    buffer: Any
    num_blocks: int
    block_bytes: int
    kind: MemoryKind = MemoryKind.DRAM
    device: int = 0


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """What one READ split copies: block runs over the named regions."""

    runs: tuple[BlockRun, ...]
    regions: tuple[str, ...] | None = None  # None: every registered region


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
        """Post a READ from ``peer``'s blocks into local blocks; return a handle."""
        ...

    def poll(self) -> list[Completion]: ...

    def send_notif(self, peer: str, message: bytes) -> None: ...

    def recv_notifs(self) -> list[Notification]: ...

    def lost_peers(self) -> list[str]: ...

    def close(self) -> None: ...
