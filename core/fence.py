"""The fence: P's word that it still holds a request's blocks, read by D without asking P.

Theory of operation
-------------------
Each P rank registers one more region with its transport, `FENCE_REGION`:
``slots`` words of `FENCE_BYTES` bytes.  When P exports a request it writes
the request's fence value into the request's slot (`fence_of`: both derived
from the request id and the release token P minted for this export, so D
computes them from the transfer parameters alone); before it frees the
request's blocks it clears the slot, unless a later export has taken it
(`core.producer.ProducerEngine` decides both writes; its driver carries them
out before it frees anything).

After a request's READs from one P rank drained, D READs that rank's slot
(one more one-sided READ, posted only after the data READs completed).  The
value it finds there proves, when it equals the request's, that P had not
freed the blocks when the slot was read, which is after every data READ
completed: the bytes are sound without a round trip to P
(`core.events.FenceHeld`).  Any other value proves nothing (not written yet,
cleared, or another request's after a slot collision): D then asks P, as it
does without a fence.  A second reader of the same parameters finds the slot
cleared once P freed, so the fence never vouches for reused blocks.
"""

from __future__ import annotations

from hashlib import blake2b

__all__ = ["FENCE_BYTES", "FENCE_REGION", "FENCE_SLOTS", "LANDING_SLOTS", "CLEARED", "fence_of"]

FENCE_REGION = "kvhandoff.fence"  # the registered region's name, on P and on D (landing slots)
FENCE_BYTES = 8  # one little-endian unsigned word per slot
FENCE_SLOTS = 1 << 16  # P's slots by default (512 KiB); a collision only costs an ask
CLEARED = 0  # what P writes before it frees (no request's value is 0)
LANDING_SLOTS = 1024  # D's slots per rank for its fence READs in flight (more: D asks P)


def fence_of(request_id: str, token: str, slots: int) -> tuple[int, int] | None:
    """(slot, value) of one export, or None when there is no fence: P registered no slots
    (``slots`` 0) or minted no token (the value must differ for each export of an id)."""
    if slots <= 0 or not token:
        return None
    digest = blake2b(f"{request_id}\0{token}".encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little") % slots, int.from_bytes(digest[8:], "little") | 1
