"""The event log's typed decoder (msgspec): exact round trips, and bad lines named as before.

`core.log` decodes each line into a wire struct of its event type and builds
the event from it; a line that decoder refuses (or one of a new stream) goes
to the careful path, ``_Reader._diagnose``, which was the reference before
the typed decoder existed.  These tests check that every event a `LogWriter`
writes reads back equal, field types included, and that for any line, well
formed or not, the typed path gives what the careful path alone gives: the
same event, or the same `LogCorrupt` (file, line, message).
"""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.core.errors import LogCorrupt
from kvhandoff.core.events import EVENT_TYPES, EXTRA_FIELDS, Side, Stream
from kvhandoff.core.log import _BUILD, _TYPED, LogWriter, _Reader, encode_event, read_log

STREAMS = [Stream("prefill-0", Side.P, 0), Stream("prefill-0", Side.P, 1),
           Stream("decode-0", Side.D, 0), Stream("d\u00e9code \"1\"\n", Side.D, 3)]
# What LogWriter (orjson) can write: no lone surrogates, integers within 64 bits.
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
INT = st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(-3, 3))
FLOAT = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                  st.sampled_from([0.0, -0.0, 1.0, 30.0, 1e-300, 5e-324]))
FIELD = {bool: st.booleans(), int: INT, float: FLOAT, str: TEXT}


def _field(annotation):
    return FIELD[annotation] if annotation in FIELD else st.lists(INT, max_size=4).map(tuple)


@st.composite
def events(draw, max_size=30):
    """Events of every kind, on several streams, each stream's seq counting from 0."""
    seq = dict.fromkeys(STREAMS, 0)
    out = []
    for kind in draw(st.lists(st.sampled_from(sorted(EVENT_TYPES)), max_size=max_size)):
        stream = draw(st.sampled_from(STREAMS))
        extras = {name: draw(_field(ann)) for name, ann in EXTRA_FIELDS[kind]}
        out.append(EVENT_TYPES[kind](draw(TEXT), stream, seq[stream], draw(FLOAT), **extras))
        seq[stream] += 1
    return out


def _fields(event) -> list:
    """Every field with its type and repr (tells 1 from 1.0 and 0.0 from -0.0)."""
    names = ("request_id", "stream", "seq", "t", *(n for n, _ in EXTRA_FIELDS[event.kind]))
    return [(type(event), n, type(getattr(event, n)), repr(getattr(event, n))) for n in names]


def _write(path, evs) -> None:
    with LogWriter(path) as writer:
        for e in evs:
            writer(e)


@given(evs=events())
def test_a_log_written_by_logwriter_reads_back_exactly(tmp_path_factory, evs):
    path = tmp_path_factory.mktemp("log") / "x.jsonl"
    _write(path, evs)
    read = read_log(path)
    assert read == evs
    assert [_fields(e) for e in read] == [_fields(e) for e in evs]


def test_every_event_kind_takes_the_typed_path_and_builds_the_same_event(tmp_path):
    stream = Stream("engine-0", Side.D, 2)
    evs = []
    for seq, (kind, cls) in enumerate(sorted(EVENT_TYPES.items())):
        extras = {name: {bool: True, int: 7, float: 2.5, str: "s"}.get(ann, (1, 2))
                  for name, ann in EXTRA_FIELDS[kind]}
        evs.append(cls(f"req-{seq}", stream, seq, 1.0 + seq, **extras))
    for e in evs:
        wire = _TYPED.decode(encode_event(e))  # raises if the typed decoder refused it
        built = _BUILD[type(wire)](wire, stream)
        assert built == e and _fields(built) == _fields(e)
    _write(tmp_path / "k.jsonl", evs)
    assert read_log(tmp_path / "k.jsonl") == evs
    assert {e.kind for e in evs} == set(EVENT_TYPES)


def _outcome(decode, raw: bytes):
    try:
        event = decode(raw, "f.jsonl", 9)
    except LogCorrupt as e:
        return ("corrupt", e.path, e.line, e.reason)
    return ("event", _fields(event))


def _reader() -> _Reader:
    """A reader that has seen stream prefill-0/P0 up to seq 4 (the next is 5)."""
    reader = _Reader()
    reader.streams[("prefill-0", "P", 0)] = stream = Stream("prefill-0", Side.P, 0)
    reader.last_seq[stream] = 4
    return reader


def _same_as_the_careful_path(raw: bytes) -> None:
    assert _outcome(_reader().decode, raw) == _outcome(_reader()._diagnose, raw)


JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), INT, st.integers(-(2**80), 2**80), FLOAT, TEXT),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6)


@given(evs=events(max_size=3), data=st.data())
def test_any_changed_line_decodes_or_is_named_as_the_careful_path_does(evs, data):
    for e in evs:
        obj = orjson.loads(encode_event(e))
        obj.update(engine="prefill-0", side="P", rank=0, seq=5)
        key = data.draw(st.sampled_from(sorted(obj) + ["extra"]))
        change = data.draw(st.sampled_from(["set", "delete", "seq"]))
        if change == "delete":
            obj.pop(key, None)
        elif change == "seq":
            obj["seq"] = data.draw(st.integers(3, 7))
        else:
            obj[key] = data.draw(JSON)
        _same_as_the_careful_path(json.dumps(obj, ensure_ascii=False).encode())  # big ints


@pytest.mark.parametrize("raw", [
    b"", b" ", b"\r", b"[1,2]", b"null", b'"x"', b"{", b'{"v":1,"type":', b"{}",
    b'{"v":1,"type":"freed","rid":"r","engine":"prefill-0","side":"P","rank":0,"seq":5,"t":1}',
    b'{"v":1,"type":"freed","rid":"r","engine":"prefill-0","side":"P","rank":0,"seq":5,"t":1.0}'
    b'{"v":1}',
    b'{"v":1,"type":"freed","rid":"r","engine":"prefill-0","side":"P","rank":0,"seq":5,'
    b'"t":1.0} ',
    b'{"v":true,"type":"freed","rid":"r","engine":"prefill-0","side":"P","rank":0,"seq":5,'
    b'"t":1.0}',
    b'{"v":1.0,"type":"freed","rid":"r","engine":"prefill-0","side":"P","rank":0,"seq":5,'
    b'"t":1.0}',
    b'{"v":1,"type":"freed","type":"aborted","rid":"r","engine":"prefill-0","side":"P",'
    b'"rank":0,"seq":5,"t":1.0,"reason":"x"}',
    b'{"v":1,"type":"freed","rid":"r","engine":"prefill-0","side":"P","rank":0,'
    b'"seq":9223372036854775808,"t":1.0}',
    b'{"v":1,"type":"freed","rid":"r","engine":"prefill-0","side":"P","rank":0,'
    b'"seq":18446744073709551616,"t":1.0}',
    b'{"v":1,"type":"freed","rid":"r","engine":"prefill-0","side":"P","rank":0,"seq":5,'
    b'"t":1e400}',
    b'{"v":1,"type":"freed","rid":"r","engine":"prefill-0","side":"P","rank":0,"seq":5,'
    b'"t":-0}',
    b'{"v":1,"type":"freed","rid":"\\ud800","engine":"prefill-0","side":"P","rank":0,"seq":5,'
    b'"t":1.0}',
    b'{"v":1,"type":"freed","rid":"\xff","engine":"prefill-0","side":"P","rank":0,"seq":5,'
    b'"t":1.0}',
    b'{"v":1,"type":"freed","rid":"r","engine":"prefill-0","side":"P","rank":0,"seq":5,'
    b'"t":1.0,"deep":' + b"[" * 2000 + b"]" * 2000 + b"}",
    b'{"v":1,"type":"reads_posted","rid":"r","engine":"prefill-0","side":"P","rank":0,'
    b'"seq":5,"t":1.0,"split_ranks":[0,true]}',
    b'{"v":1,"type":"reads_posted","rid":"r","engine":"prefill-0","side":"P","rank":0,'
    b'"seq":5,"t":1.0,"split_ranks":[0,1.0]}',
    b'{"v":1,"type":"reads_posted","rid":"r","engine":"prefill-0","side":"P","rank":0,'
    b'"seq":5,"t":1.0,"split_ranks":[0,1]}',
    b'{"v":1,"type":"release_sent","rid":"r","engine":"prefill-0","side":"P","rank":0,'
    b'"seq":5,"t":1.0,"notify_only":1}',
    b'{"v":1,"type":"freed","rid":"r","engine":"prefill-0","side":"Q","rank":0,"seq":5,"t":1.0}',
    b'{"v":1,"type":"freed","rid":"r","engine":"prefill-1","side":"P","rank":0,"seq":0,"t":1.0}',
])
def test_odd_lines_decode_or_are_named_as_the_careful_path_does(raw):
    _same_as_the_careful_path(raw)


def test_a_bad_line_past_the_first_chunk_is_named_with_its_line(tmp_path):
    stream = Stream("prefill-0", Side.P, 0)
    evs = [EVENT_TYPES["heartbeat_received"](f"r{i}", stream, i, float(i), from_engine="d")
           for i in range(200)]
    _write(tmp_path / "c.jsonl", evs)
    lines = (tmp_path / "c.jsonl").read_bytes().split(b"\n")
    lines[150] = lines[150].replace(b'"seq":150', b'"seq":152')
    (tmp_path / "c.jsonl").write_bytes(b"\n".join(lines))
    with pytest.raises(LogCorrupt) as info:
        list(_Reader().iter_file(tmp_path / "c.jsonl", chunk_bytes=1000))
    assert info.value.line == 151
    assert info.value.reason == f"sequence gap in stream {stream}: expected 150, found 152"
