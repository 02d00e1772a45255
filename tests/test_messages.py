"""Wire notifications: round trip, and forged or garbled bytes get a typed error."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.core.errors import MalformedMessage
from kvhandoff.core.messages import (
    MAX_BYTES,
    MAX_IDS,
    Heartbeat,
    HeartbeatAck,
    Release,
    decode,
    encode,
)


@pytest.mark.parametrize("msg", [
    Release("req-1", "decode-0", 1),
    Release("req-1", "decode-0", 1, "tok"),
    Heartbeat("decode-0", 0, 12.5, ("a", "b")),
    Heartbeat("decode-0", 0, 12.5, ("a", "b"), ("ta", "tb")),
    HeartbeatAck("prefill-0", 2, 12.5, {"a": 3.25, "b": -1.0, "c": 0.0}),
])
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(("data", "message"), [
    (b"req-1:2", "not JSON"),
    (b"[1]", "must be an object"),
    (b'{"v":2,"k":"rel"}', "unsupported wire version 2"),
    (b'{"v":1,"k":"steal"}', "unknown notification kind 'steal'"),
    (b'{"v":1,"k":[]}', r"unknown notification kind \[\]"),
    (b'{"v":1,"k":{"a":1}}', "unknown notification kind"),
    (b'{"v":1,"k":"rel","engine":"d","rank":0}', "Release: missing field 'request_id'"),
    (b'{"v":1,"k":"rel","engine":"d","rank":-1,"request_id":"r"}', "'rank' must be >= 0"),
    (b'{"v":1,"k":"rel","engine":"d","rank":true,"request_id":"r"}', "'rank' must be int"),
    (b'{"v":1,"k":"hb","engine":"d","rank":0,"sent_at":"x","request_ids":[]}',
     "'sent_at' must be int or float"),
    (b'{"v":1,"k":"hb","engine":"d","rank":0,"sent_at":1,"request_ids":[1]}', "hold strings"),
    (b'{"v":1,"k":"hb","engine":"d","rank":0,"sent_at":1,"request_ids":["a"],"tokens":["x","y"]}',
     "2 tokens for 1 request ids"),
    (b'{"v":1,"k":"rel","engine":"d","rank":0,"request_id":"r","token":5}', "'token' must be str"),
    (b'{"v":1,"k":"ack","engine":"p","rank":0,"sent_at":1,"time_left":{"r":"x"}}',
     "map request ids to numbers"),
])
def test_malformed_notifications_are_refused_with_the_reason(data, message):
    with pytest.raises(MalformedMessage, match=message):
        decode(data)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
_fields = st.fixed_dictionaries(
    {"v": st.just(1) | _json, "k": st.sampled_from(["rel", "hb", "ack"]) | _json},
    optional={name: _json for name in ("engine", "rank", "request_id", "token", "sent_at",
                                       "request_ids", "tokens", "time_left")})


@given(_fields)
def test_whatever_a_peer_sends_decodes_or_is_refused_as_malformed(obj):
    """A peer's bytes never raise anything but `MalformedMessage` (the worker contains that)."""
    try:
        msg = decode(orjson.dumps(obj))
    except MalformedMessage:
        return
    assert decode(encode(msg)) == msg


def test_a_message_naming_more_requests_than_max_ids_is_refused():
    """One notification costs its receiver a bounded time: at most MAX_IDS requests each."""
    ids = tuple(f"r{i}" for i in range(MAX_IDS))
    assert decode(encode(Heartbeat("d", 0, 1.0, ids, ("t",) * MAX_IDS))).request_ids == ids
    with pytest.raises(MalformedMessage, match=f"{MAX_IDS + 1} request ids, expected at most"):
        decode(encode(Heartbeat("d", 0, 1.0, (*ids, "one-more"))))
    with pytest.raises(MalformedMessage, match=f"{MAX_IDS + 1} request ids, expected at most"):
        decode(encode(HeartbeatAck("p", 0, 1.0, dict.fromkeys((*ids, "one-more"), 1.0))))


def test_the_largest_legal_heartbeat_fits_and_a_longer_notification_is_refused_unparsed():
    """MAX_IDS ids of 256 characters and tokens of 128, each character 4 bytes in UTF-8."""
    ids = tuple(f"{i:08d}" + "\U0001F600" * 248 for i in range(MAX_IDS))
    largest = encode(Heartbeat("d" * 256, 0, 1.0, ids, ("\U0001F600" * 128,) * MAX_IDS))
    assert len(largest) <= MAX_BYTES and decode(largest).request_ids == ids
    with pytest.raises(MalformedMessage, match=f"of {MAX_BYTES + 1} bytes, expected at most"):
        decode(b" " * (MAX_BYTES + 1))
