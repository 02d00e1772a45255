"""The bytes a NIXL transport hands its peers: NIXL's agent blob plus our region table.

A peer needs two things to READ from us: NIXL's agent metadata (connection
info and registrations, opaque) and where each named region's blocks are
(address, block size, count, memory kind, device, stride).  Both travel in one blob
so they can never disagree::

    b"KVHNIXL1" | u32 header length | header (JSON) | NIXL agent metadata

The header carries the agent name, the CUDA IPC handles of its VRAM
allocations when it exports them (``ipc``, see `cuda_ipc`), an ``instance`` id (new each time an
agent starts, so a restarted peer is recognised) and a ``generation``
(bumped by every `register`, so metadata taken before a registration is
recognised as older than metadata taken after it).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from kvhandoff.core.safelog import bounded_repr
from kvhandoff.transports.base import MemoryKind, TransportError

from .memory import Placement

MAGIC = b"KVHNIXL1"
_LEN = struct.Struct("<I")


class MetadataUnreadable(TransportError):
    """Peer metadata that is not a kvhandoff NIXL blob (or is truncated)."""


@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """A peer's region as its metadata describes it."""

    name: str
    kind: MemoryKind
    device: int
    addr: int
    block_bytes: int
    num_blocks: int
    stride: int = 0  # bytes from block b to b + 1 (0: block_bytes, adjacent)


@dataclass(frozen=True, slots=True)
class PeerMetadata:
    agent: str
    instance: str
    generation: int
    regions: tuple[RemoteRegion, ...]
    nixl: bytes
    ipc: dict | None = None  # {"node": boot id, "allocations": [[dev, base, size, hex]]}


MAX_AGENT_NAME = 512  # an engine id of up to 256 characters, its side, rank and instance


def encode(agent: str, instance: str, generation: int, placements: Sequence[Placement],
           nixl_metadata: bytes, ipc: dict | None = None) -> bytes:
    header = orjson.dumps({
        "agent": agent,
        "instance": instance,
        "generation": generation,
        "ipc": ipc,
        # a 7th column, the stride, only where a region has one (older readers take 6)
        "regions": [[p.name, p.kind.value, p.device, p.addr, p.block_bytes, p.num_blocks]
                    + ([p.stride] if p.stride else []) for p in placements],
    })
    return MAGIC + _LEN.pack(len(header)) + header + nixl_metadata


_NIXL_NAME = b"nixlSerDes|Agent"  # how NIXL 1.5's own metadata begins: the agent's name


def nixl_agent_name(nixl: bytes) -> bytes | None:
    """The agent name NIXL's own metadata carries (NIXL 1.5 lays it out as ``nixlSerDes|Agent``,
    an 8-byte little-endian length, the name), or None when it is not laid out so (another
    NIXL version: the name is then checked once NIXL loaded it)."""
    at = len(_NIXL_NAME) + 8
    if not nixl.startswith(_NIXL_NAME) or len(nixl) < at:
        return None
    (n,) = struct.unpack_from("<Q", nixl, len(_NIXL_NAME))
    return nixl[at:at + n] if len(nixl) >= at + n else None


def decode(blob: bytes) -> PeerMetadata:
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise MetadataUnreadable(f"expected bytes, found {type(blob).__name__}")
    blob = bytes(blob)
    if not blob.startswith(MAGIC):
        raise MetadataUnreadable(f"expected the prefix {MAGIC!r}, found {blob[:8]!r}")
    start = len(MAGIC) + _LEN.size
    if len(blob) < start:
        raise MetadataUnreadable(f"expected at least {start} bytes, found {len(blob)}")
    (n,) = _LEN.unpack_from(blob, len(MAGIC))
    if len(blob) < start + n:
        raise MetadataUnreadable(f"header of {n} bytes truncated at {len(blob) - start}")
    try:
        h = orjson.loads(blob[start:start + n])
        regions = tuple(_region(*row) for row in h["regions"])
        ipc = h.get("ipc")
        if ipc is not None and not isinstance(ipc, dict):
            raise TypeError(f"ipc: expected an object, found {type(ipc).__name__}")
        agent = h["agent"]
        # Logged and keyed on: a peer names its own agent, so its name is checked here.
        if type(agent) is not str or not 0 < len(agent) <= MAX_AGENT_NAME or not agent.isprintable():
            raise ValueError(f"agent: expected 1..{MAX_AGENT_NAME} printable characters, found "
                             f"{bounded_repr(agent)}")
        return PeerMetadata(agent, str(h["instance"]), int(h["generation"]),
                            regions, blob[start + n:], ipc)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise MetadataUnreadable(f"unreadable header: {exc}") from None


def _region(name, kind, dev, addr, bb, nb, stride=0) -> RemoteRegion:
    bb, nb, stride = int(bb), int(nb), int(stride)
    if bb <= 0 or nb <= 0 or (stride and stride < bb):
        raise ValueError(f"region {bounded_repr(name)}: {nb} x {bb}, stride {stride}")
    return RemoteRegion(str(name), MemoryKind(kind), int(dev), int(addr), bb, nb,
                        0 if stride == bb else stride)
