"""The fence: P's word that it still holds a request's blocks, read by D without asking P.

Theory of operation
-------------------
Each P rank registers one more region with its transport, `FENCE_REGION`:
``slots`` words of `FENCE_BYTES` bytes.  Whoever makes a request's transfer
parameters on P (vLLM's scheduler, the simulator's P) takes a free slot for
the export (`FenceSlots`) and puts it in the parameters; it gives the slot
back once every P rank freed the request.  When a P rank exports the request
its engine writes the request's value into the slot (`fence_value`: derived
from the request id and the release token P minted for this export, so D
computes it from the parameters); before it frees the request's blocks it
clears the slot (`core.producer.ProducerEngine` decides both writes; its
driver carries them out before it frees anything).

After a request's READs from one P rank drained, D READs that rank's slot
(one more one-sided READ, posted only after the data READs completed).  The
value it finds there proves, when it equals the request's, that P had not
freed the blocks when the slot was read, which is after every data READ
completed: the bytes are sound without a round trip to P
(`core.events.FenceHeld`).  Any other value proves nothing (P's worker has
not written it yet, P cleared it, the slot went to a later export): D reads
the slot again and asks P.  A second reader of the same parameters finds the
slot cleared, or another export's value, once P freed: the fence never
vouches for reused blocks.
"""

from __future__ import annotations

from hashlib import blake2b

__all__ = ["FENCE_BYTES", "FENCE_REGION", "FENCE_SLOTS", "FENCE_READS", "LANDING_SLOTS",
           "CLEARED", "FenceSlots", "fence_of", "fence_value"]

FENCE_REGION = "kvhandoff.fence"  # the registered region's name, on P and on D (landing slots)
FENCE_BYTES = 8  # one little-endian unsigned word per slot
FENCE_SLOTS = 1 << 17  # P's slots per rank by default (1 MiB): its live leases at most
CLEARED = 0  # what P writes before it frees (no request's value is 0)
LANDING_SLOTS = 1024  # D's slots per rank for its fence READs in flight (more: D asks P)
FENCE_READS = 3  # D reads a slot at most this often for one request (P may write it late)


def fence_value(request_id: str, token: str) -> int:
    """The word P writes into the slot of this export: never `CLEARED`, another for each
    export (the token is minted per export)."""
    digest = blake2b(f"{request_id}\0{token}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1


def fence_of(request_id: str, token: str, slot: int | None) -> tuple[int, int] | None:
    """(slot, value) of one export, or None when it has no fence: no slot was free for it
    (or P registered none), or P minted no token."""
    if slot is None or slot < 0 or not token:
        return None
    return slot, fence_value(request_id, token)


class FenceSlots:
    """P's free fence slots: one per live export, taken by whoever makes the parameters and
    given back once every P rank freed the request (its slot is cleared on each by then)."""

    __slots__ = ("size", "_next", "_free")

    def __init__(self, size: int) -> None:
        self.size = size
        self._next = 0  # slots from here on were never handed out
        self._free: list[int] = []  # slots given back

    def take(self) -> int | None:
        """A free slot, or None when every slot is live (that export has no fence)."""
        if self._free:
            return self._free.pop()
        if self._next < self.size:
            self._next += 1
            return self._next - 1
        return None

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def free(self) -> int:
        return self.size - self._next + len(self._free)
