"""Wire notifications between D and P: release, heartbeat, heartbeat acknowledgement.

Small JSON objects (orjson), never pickle.  `decode` checks every field and
raises `MalformedMessage` naming the field, so a forged or garbled message
is refused before it reaches the lifecycle.  Whether a well-formed message
is *stale* (unknown or already released request, wrong peer) is decided by
the fold, which ignores and counts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from kvhandoff.core.errors import MalformedMessage
from kvhandoff.core.safelog import bounded_repr
from kvhandoff.core.slots import slot_builder

WIRE_VERSION = 1
# Bounds on one notification, so one message costs its receiver a bounded time under the
# worker's lock: a heartbeat names at most MAX_IDS requests (D sends more as several
# heartbeats; an acknowledgement answers one heartbeat), and no notification is longer than
# MAX_BYTES (MAX_IDS ids of 256 characters and their tokens of 128, in UTF-8, fit).
MAX_IDS = 2048
MAX_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Release:
    """D rank ``rank`` of engine ``engine`` is done with P's request ``request_id``.

    ``token`` is the release capability from the transfer parameters.
    """

    request_id: str
    engine: str
    rank: int
    token: str = ""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Keep these requests' blocks alive; ``sent_at`` is D's clock, echoed in the ack.

    ``tokens``, when given, holds each request's release token, in order.
    """

    engine: str
    rank: int
    sent_at: float
    request_ids: tuple[str, ...]
    tokens: tuple[str, ...] = ()

    def token_of(self, index: int) -> str:
        return self.tokens[index] if self.tokens else ""


@dataclass(frozen=True, slots=True)
class HeartbeatAck:
    """P rank ``rank`` of ``engine`` answers a heartbeat: time left per request (see policy)."""

    engine: str
    rank: int
    sent_at: float
    time_left: dict[str, float]


Message = Release | Heartbeat | HeartbeatAck
_KINDS = {"rel": Release, "hb": Heartbeat, "ack": HeartbeatAck}
_TAGS = {cls: tag for tag, cls in _KINDS.items()}


def _encoder(cls: type):
    """``encode(msg) -> bytes`` of one message type: the same dict as a loop over its slots
    builds, in one expression, so the same bytes.  Returned as a copy of orjson's result
    (``b"%b" % ...``), which is a system-allocated 4 KiB block shrunk in place (see
    `core.log`): the copy is a small object of Python's own allocator."""
    body = "".join(f", {name!r}: m.{name}" for name in cls.__slots__)
    namespace: dict = {"dumps": orjson.dumps}
    exec(f"def encode(m):\n    return b'%b' % dumps({{'v': {WIRE_VERSION}, "
         f"'k': {_TAGS[cls]!r}{body}}})", namespace)
    return namespace["encode"]


def _builder(cls: type):
    """``build(*fields)``: ``cls(*fields)`` (`core.slots`); every field is passed (`decode`
    has checked them all)."""
    return slot_builder(cls, ", ".join(cls.__slots__), {name: name for name in cls.__slots__})


_ENCODERS = {cls: _encoder(cls) for cls in _TAGS}
_BUILD_RELEASE, _BUILD_HEARTBEAT, _BUILD_ACK = (_builder(cls) for cls in _KINDS.values())


def encode(msg: Message) -> bytes:
    return _ENCODERS[type(msg)](msg)


def _field(obj: dict, name: str, kind: type | tuple[type, ...], what: str):
    if name not in obj:
        raise MalformedMessage(f"{what}: missing field {name!r}")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise MalformedMessage(f"{what}: field {name!r} must be {_type_name(kind)}, "
                               f"found {type(value).__name__}")
    return value


def _type_name(kind) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def _strings(obj: dict, name: str, what: str) -> tuple[str, ...]:
    values = _field(obj, name, list, what)
    for v in values:  # (orjson makes exact str: `type` says what isinstance would)
        if type(v) is not str:
            raise MalformedMessage(f"{what}: field {name!r} must hold strings")
    return tuple(values)


def decode(data: bytes) -> Message:
    """Parse one notification; raise `MalformedMessage` saying what was wrong."""
    if len(data) > MAX_BYTES:
        raise MalformedMessage(f"notification of {len(data)} bytes, expected at most {MAX_BYTES}")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise MalformedMessage(f"notification is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise MalformedMessage(f"notification must be an object, found {type(obj).__name__}")
    if obj.get("v") != WIRE_VERSION:
        raise MalformedMessage(f"unsupported wire version {bounded_repr(obj.get('v'))}, expected {WIRE_VERSION}")
    kind = obj.get("k")
    cls = _KINDS.get(kind) if type(kind) is str else None
    if cls is None:
        raise MalformedMessage(f"unknown notification kind {bounded_repr(obj.get('k'))}")
    what = cls.__name__
    # Fast paths: orjson makes exact str/int/float (bool is not int here), so a value of
    # the exact type passes `_field`; anything else goes to it, which checks and names it.
    engine = obj.get("engine")
    if type(engine) is not str:
        engine = _field(obj, "engine", str, what)
    rank = obj.get("rank")
    if type(rank) is not int:
        rank = _field(obj, "rank", int, what)
    if rank < 0:
        raise MalformedMessage(f"{what}: field 'rank' must be >= 0, found {rank}")
    if cls is Release:
        token = _field(obj, "token", str, what) if "token" in obj else ""
        return _BUILD_RELEASE(_field(obj, "request_id", str, what), engine, rank, token)
    sent_at = obj.get("sent_at")
    sent_at = float(sent_at if type(sent_at) is float or type(sent_at) is int
                    else _field(obj, "sent_at", (int, float), what))
    if cls is Heartbeat:
        ids = _strings(obj, "request_ids", what)
        if len(ids) > MAX_IDS:
            raise MalformedMessage(f"{what}: {len(ids)} request ids, expected at most {MAX_IDS}")
        tokens = _strings(obj, "tokens", what) if "tokens" in obj else ()
        if tokens and len(tokens) != len(ids):
            raise MalformedMessage(f"{what}: {len(tokens)} tokens for {len(ids)} request ids")
        return _BUILD_HEARTBEAT(engine, rank, sent_at, ids, tokens)
    left = _field(obj, "time_left", dict, what)
    if len(left) > MAX_IDS:
        raise MalformedMessage(f"{what}: {len(left)} request ids, expected at most {MAX_IDS}")
    for v in left.values():  # orjson makes exact int, float and bool
        if type(v) is not float and type(v) is not int:
            raise MalformedMessage(f"{what}: field 'time_left' must map request ids to numbers")
    return _BUILD_ACK(engine, rank, sent_at, {k: float(v) for k, v in left.items()})
