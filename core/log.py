"""The event log: JSON Lines, one event per line, schema version on every line.

    {"v":1,"type":"exported","rid":"req-7","engine":"prefill-0","side":"P","rank":0,
     "seq":12,"t":103.25,"lease_s":30.0,"consumer_ranks":[0,1],"num_blocks":4}

Writing is buffered in memory (`LogWriter`); ``flush`` at the points where
losing the tail would hurt.  Recording never raises: a failed write keeps its
lines for the next flush.  Reading (`read_log`, `read_logs`) checks every line: bad
JSON, an unknown event type, a field of the wrong type, a sequence gap or
repeat within a stream raise `LogCorrupt` naming the file and line; a blank line
(an editor's) is skipped.  A torn
last line (a crash mid-write: no final newline and not parseable) is dropped
with a warning and the events before it are kept; a live log is read up to where
it ended then (what its writer adds meanwhile is for the next read).

Decoding is typed (msgspec): each line is decoded in C straight into a wire
struct of its event type, which checks every field's JSON type on the way,
and the event is built from that struct with no dict in between.  A line the
typed decoder refuses, or one of a stream not seen yet, goes to the careful
path (orjson, field by field), which decides as before what is wrong and
names it, or decodes the line.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Literal, Union

import msgspec
import orjson

from kvhandoff.core.errors import LogCorrupt
from kvhandoff.core.events import EVENT_TYPES, EXTRA_FIELDS, Event, Side, Stream
from kvhandoff.core.lifecycle import gc_paused
from kvhandoff.core.safelog import get_logger
from kvhandoff.core.slots import slot_builder

SCHEMA_VERSION = 1
log = get_logger(__name__)


_OWN_FIELDS = {kind: tuple(name for name, _ in extra) for kind, extra in EXTRA_FIELDS.items()}


def _encoder(kind: str):
    """``encode(event) -> bytes`` of one event type: its line, keys in the order above.

    Generated once per type (as `_builder` below): the same dict, built in one
    expression instead of a loop of ``getattr``, so the bytes are the same.

    The line is returned as a copy (``b"%b" % line``): orjson hands back a
    bytes object allocated at 4 KiB by the system allocator and shrunk in
    place, so every line a caller keeps (the simulator keeps a run's log in
    memory) pins a fragment of the C heap; the copy is a small object of
    Python's own allocator.  Keeping orjson's line costs several times the copy.
    """
    own = "".join(f", {name!r}: e.{name}" for name in _OWN_FIELDS[kind])
    source = (f"def encode(e):\n"
              f"    s = e.stream\n"
              f"    return b'%b' % dumps({{'v': {SCHEMA_VERSION}, 'type': {kind!r}, "
              f"'rid': e.request_id, 'engine': s[0], 'side': s[1], 'rank': s[2], "
              f"'seq': e.seq, 't': e.t{own}}})")
    namespace: dict = {"dumps": orjson.dumps}
    exec(source, namespace)
    return namespace["encode"]


_ENCODERS = {EVENT_TYPES[kind]: _encoder(kind) for kind in EXTRA_FIELDS}


def encode_event(event: Event) -> bytes:
    encode = _ENCODERS.get(type(event))
    if encode is None:  # a subclass of an event type: its kind's encoder
        encode = _ENCODERS[EVENT_TYPES[event.kind]]
    return encode(event)


class LogWriter:
    """Append events to a JSONL file through an in-memory buffer.

    Recording an event never raises: the engines record an event after their
    fold has taken it, so a recording that raised would lose a decision
    already made (a free, a report) on a full disk.  Lines wait in memory and
    are written when ``buffer_bytes`` wait, or by `flush`, in chunks of at most
    ``buffer_bytes``.  A write that fails (``ENOSPC``, ``EIO``) keeps every
    line not written, in order, for the next attempt, whatever interrupts it;
    `flush` raises that error for the caller to count, and recording stops
    trying until the next `flush`.  While writes fail, a `flush` first tries
    one waiting line alone, so a disk that stays full costs a failed ``write``
    per flush, not a copy of the backlog.  Past ``max_pending_bytes`` unwritten
    new lines are dropped and counted in ``dropped``, so memory stays bounded;
    the file then has a sequence gap, at which a replay stops, naming it.
    """

    def __init__(self, path: str | os.PathLike, buffer_bytes: int = 1 << 16,
                 max_pending_bytes: int = 1 << 26) -> None:
        self.path = os.fspath(path)
        self.buffer_bytes, self.max_pending_bytes = buffer_bytes, max_pending_bytes
        self.dropped = 0  # lines dropped while max_pending_bytes waited unwritten
        # Never through a link planted at the path, and a new log readable by its owner
        # alone, whatever the umask or the directory: the log holds release tokens.
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise OSError(errno.ELOOP, "event log: the path is a symbolic link, not followed "
                          "(the log holds release tokens)", self.path) from None
        self._file = os.fdopen(fd, "ab", buffering=0)
        self._pending: list[bytes] = []  # in order; the first may be a line's unwritten rest
        self._pending_bytes = 0
        self._failing = False  # the last write failed: recording leaves it to flush
        self._flushing = False  # a flush runs (a signal handler may land inside one)

    def __call__(self, event: Event) -> None:
        line = encode_event(event) + b"\n"
        if self._pending_bytes >= self.max_pending_bytes:
            self.dropped += 1
            return
        self._pending.append(line)
        self._pending_bytes += len(line)
        if self._pending_bytes >= self.buffer_bytes and not (self._failing or self._flushing):
            try:
                self.flush()
            except OSError:
                pass  # kept; the caller's flush raises it again

    write = __call__

    def flush(self) -> None:
        """Write every waiting line; on an error keep what was not written and raise it.

        `RuntimeError` when called inside a flush (a signal handler's, on the thread
        it interrupted): the interrupted flush writes everything when it resumes."""
        if self._flushing:
            raise RuntimeError(f"{self.path}: flush re-entered (a signal handler interrupted one)")
        self._flushing = True
        pending, at = self._pending, 0  # pending[:at] is written
        try:
            while at < len(pending):
                take, size = 1, len(pending[at])
                if not self._failing:  # coalesce up to a chunk (while failing: a one-line probe)
                    while at + take < len(pending) and size < self.buffer_bytes:
                        size += len(pending[at + take])
                        take += 1
                data = pending[at] if take == 1 else b"".join(pending[at:at + take])
                view, written = memoryview(data), 0
                try:
                    while written < size:
                        n = self._file.write(view[written:])
                        if not n:
                            raise OSError(errno.ENOSPC, f"{self.path}: write wrote nothing")
                        written += n
                except BaseException:
                    self._failing = True
                    if written:  # the chunk's rest, in front of what follows it
                        pending[at:at + take] = [data[written:]]
                        self._pending_bytes -= written
                    raise
                at += take
                self._pending_bytes -= size
                self._failing = False
        finally:
            del pending[:at]
            self._flushing = False

    def close(self) -> None:
        if not self._file.closed:
            try:
                self.flush()
            finally:
                self._file.close()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _field_spec(annotation: object) -> tuple[tuple[type, ...], str, object]:
    """(accepted JSON types, name for errors, converter or None) of one event field."""
    if annotation is bool:
        return (bool,), "bool", None
    if annotation is int:
        return (int,), "int", None
    if annotation is float:
        return (float, int), "number", float
    if annotation is str:
        return (str,), "str", None
    return (list,), "list of int", _int_tuple  # tuple[int, ...]


def _int_tuple(value: list) -> tuple[int, ...]:
    for x in value:
        if type(x) is not int:
            raise TypeError
    return tuple(value)


_DECODERS = {
    kind: (EVENT_TYPES[kind], tuple((name, *_field_spec(ann)) for name, ann in extra))
    for kind, extra in EXTRA_FIELDS.items()
}
# Fields added after logs of schema 1 were written: a line without one reads as its default.
_ADDED_LATER = {("reads_posted", "split_groups"): ()}
_HEADER = (("rid", (str,), "str"), ("engine", (str,), "str"), ("side", (str,), "str"),
           ("rank", (int,), "int"), ("seq", (int,), "int"), ("t", (float, int), "number"))
_SIDES = {s.value: s for s in Side}
_JSON_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
               type(None): "null"}


def _found(value: object) -> str:
    """What a line holds where something else was expected, in JSON's words (numbers by
    value: an integer beyond 64 bits reads as a float, and "found float" misled)."""
    if type(value) in (int, float):
        return f"the number {value!r}"
    if type(value) is list and value:
        bad = next((x for x in value if type(x) is not int), None)
        if bad is not None:
            return f"an array holding {_found(bad)}"
    return _JSON_NAMES.get(type(value), type(value).__name__)

# --- typed decoding -------------------------------------------------------------
# One msgspec struct per event type mirrors its line: the header, then the
# event's own fields, each typed as the careful path accepts it (int and bool
# apart, any number for a float, a list of int for a tuple).  Integers
# outside int64 are refused and handed over: the careful path accepts them
# up to 2**64 - 1 and names larger ones (orjson reads them as floats) a wrong
# type.  Keys an event does not have are ignored, as the careful path does.
_Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


def _wire_type(annotation: object) -> object:
    if annotation is int:
        return _Int
    if annotation in (bool, float, str):
        return annotation
    return tuple[_Int, ...]  # tuple[int, ...]


def _wire_struct(kind: str, extra: tuple) -> type:
    header = [("v", Literal[SCHEMA_VERSION]), ("rid", str), ("engine", str), ("side", str),
              ("rank", _Int), ("seq", _Int), ("t", float)]
    own = [(name, _wire_type(ann), _ADDED_LATER[kind, name]) if (kind, name) in _ADDED_LATER
           else (name, _wire_type(ann)) for name, ann in extra]
    return msgspec.defstruct(f"Wire_{kind}", header + own, tag_field="type", tag=kind,
                             kw_only=True, gc=False)


def _builder(kind: str):
    """``build(wire, stream) -> event`` of one event type (`core.slots`), from its own
    field names."""
    names = ("request_id", "stream", "seq", "t", *(name for name, _ in EXTRA_FIELDS[kind]))
    source = {"request_id": "w.rid", "stream": "stream"}
    return slot_builder(EVENT_TYPES[kind], "w, stream",
                        {name: source.get(name, f"w.{name}") for name in names})


_WIRE = {kind: _wire_struct(kind, extra) for kind, extra in EXTRA_FIELDS.items()}
_BUILD = {wire: _builder(kind) for kind, wire in _WIRE.items()}
_TYPED = msgspec.json.Decoder(Union[tuple(_WIRE.values())])  # noqa: UP007 - a runtime union


class _Reader:
    """Decodes lines of one or more files, keeping per-stream sequence checks across them.

    ``decode`` takes a fast path for well-formed lines; anything unexpected
    goes to ``_diagnose``, which finds the first thing wrong and names it.
    """

    def __init__(self) -> None:
        self.streams: dict[tuple, Stream] = {}
        self.last_seq: dict[Stream, int] = {}

    def decode(self, raw: bytes, path: str, lineno: int) -> Event:
        """One line's event (`_decode_chunk` is the same, inlined for a chunk of lines)."""
        try:
            wire = _TYPED.decode(raw)
        except Exception:  # refused: the careful path says what is wrong, as before
            return self._diagnose(raw, path, lineno)
        stream = self.streams.get((wire.engine, wire.side, wire.rank))
        if stream is None:  # a stream not seen yet: the careful path checks and names it
            return self._diagnose(raw, path, lineno)
        seq = wire.seq
        if seq != self.last_seq.get(stream, -1) + 1:
            self._check_seq(stream, seq, path, lineno)
        self.last_seq[stream] = seq
        return _BUILD[type(wire)](wire, stream)

    def _check_seq(self, stream: Stream, seq: int, path: str, lineno: int) -> None:
        expected = self.last_seq.get(stream, -1) + 1
        if seq != expected:
            what = "repeat" if seq < expected else "gap"
            raise LogCorrupt(path, lineno, f"sequence {what} in stream {stream}: "
                                           f"expected {expected}, found {seq}")
        self.last_seq[stream] = seq

    def _diagnose(self, raw: bytes, path: str, lineno: int) -> Event:
        """The slow, careful path: raise LogCorrupt naming what is wrong, or decode."""
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise LogCorrupt(path, lineno, f"bad JSON ({e.msg} at character {e.pos + 1} of "
                                           f"the line)") from None
        if type(obj) is not dict:
            raise LogCorrupt(path, lineno, f"expected an object, found {_found(obj)}")
        version = obj.get("v")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise LogCorrupt(path, lineno, f"schema version {orjson.dumps(version).decode()[:40]}"
                                           f", expected {SCHEMA_VERSION}")
        kind = obj.get("type")
        decoder = _DECODERS.get(kind) if type(kind) is str else None
        if decoder is None:
            raise LogCorrupt(path, lineno, f"unknown event type {kind!r}")
        cls, extras = decoder
        for name, types, type_name in _HEADER:
            v = obj.get(name)
            if type(v) not in types:
                raise LogCorrupt(path, lineno, f"field {name!r} must be {type_name}, "
                                               f"found {_found(v)}")
        side = _SIDES.get(obj["side"])
        if side is None:
            raise LogCorrupt(path, lineno, f"field 'side' must be P or D, found {obj['side']!r}")
        values = []
        for name, types, type_name, convert in extras:
            if name not in obj and (kind, name) in _ADDED_LATER:
                values.append(_ADDED_LATER[kind, name])
                continue
            if name not in obj:
                raise LogCorrupt(path, lineno, f"{kind}: missing field {name!r}")
            v = obj[name]
            try:
                if type(v) not in types:
                    raise TypeError
                values.append(v if convert is None else convert(v))
            except TypeError:
                raise LogCorrupt(path, lineno, f"{kind}: field {name!r} must be {type_name}, "
                                               f"found {_found(v)}") from None
        skey = (obj["engine"], obj["side"], obj["rank"])
        stream = self.streams.get(skey)
        if stream is None:
            stream = self.streams[skey] = Stream(obj["engine"], side, obj["rank"])
        self._check_seq(stream, obj["seq"], path, lineno)
        return cls(obj["rid"], stream, obj["seq"], float(obj["t"]), *values)

    def iter_file(self, path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> Iterator[Event]:
        """Decode a file chunk by chunk (bounded memory); see the module docstring."""
        path = os.fspath(path)
        lineno = 0
        with open(path, "rb") as f:
            while lines := f.readlines(chunk_bytes):
                torn = b""
                if not lines[-1].endswith(b"\n"):  # only the file's last line can lack it
                    torn = lines.pop()
                yield from self._decode_chunk(lines, path, lineno)
                lineno += len(lines)
                if torn.strip():
                    try:
                        yield self.decode(torn, path, lineno + 1)
                    except LogCorrupt as e:
                        if _parses(torn):  # a whole line, wrong: not a write cut short
                            raise
                        log.warning("eventlog.torn_last_line", path=path, line=lineno + 1,
                                    reason=e.reason, kept_events=lineno)
                    # The file ended there when it was read: a live log's writer may add
                    # the rest of that line since, which is not a line of its own.
                    return

    def _decode_chunk(self, lines: list[bytes], path: str, lineno: int) -> list[Event]:
        # Events are acyclic; pausing the cyclic GC while a million of them
        # are allocated keeps it from rescanning the growing heap (~1.7x faster).
        typed, build, streams, last_seq = _TYPED.decode, _BUILD, self.streams, self.last_seq
        diagnose = self._diagnose
        events: list[Event] = []
        append = events.append
        with gc_paused():
            for i, raw in enumerate(lines, lineno + 1):
                try:
                    wire = typed(raw)
                except Exception:  # refused: the careful path says what is wrong, as before
                    if raw.strip():  # (a blank line, an editor's, is no event: skipped)
                        append(diagnose(raw, path, i))
                    continue
                stream = streams.get((wire.engine, wire.side, wire.rank))
                if stream is None:
                    append(diagnose(raw, path, i))
                    continue
                seq = wire.seq
                if seq != last_seq.get(stream, -1) + 1:
                    self._check_seq(stream, seq, path, i)
                last_seq[stream] = seq
                append(build[type(wire)](wire, stream))
        return events


def _parses(raw: bytes) -> bool:
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return True


def iter_log(path: str | os.PathLike) -> Iterator[Event]:
    """Stream one event log's events (for folding logs larger than memory)."""
    return _Reader().iter_file(path)


def read_log(path: str | os.PathLike) -> list[Event]:
    """Read one event log (see the module docstring for what is checked)."""
    return list(iter_log(path))


def read_logs(paths: Sequence[str | os.PathLike]) -> list[Event]:
    """Read several logs (e.g. P's and D's); a stream may continue across files in order."""
    reader = _Reader()
    events: list[Event] = []
    with gc_paused():  # one pause for the whole read: each chunk's would rescan it after
        for path in paths:
            events.extend(reader.iter_file(path))
    return events


def log_name(stream: Stream) -> str:
    """The file an engine rank writes its events to, in its ``log_dir``: ``<engine_id>.P0.jsonl``."""
    return f"{stream.engine}.{stream.side.value}{stream.rank}.jsonl"


_CURRENT_LOG = re.compile(r".\.[PD][0-9]+\.jsonl\Z")  # `log_name`'s; not a predecessor's


def logs_in(directory: str | os.PathLike) -> list[str]:
    """The engine logs in ``directory`` (named by `log_name`), sorted.

    A restarted engine's predecessor, moved aside as ``<engine_id>.P0.<unix
    time>.jsonl``, is left out: its stream has the same name, so it is
    replayed on its own (name it as a file)."""
    with os.scandir(directory) as entries:
        return sorted(e.path for e in entries if _CURRENT_LOG.search(e.name) and e.is_file())


def write_log(path: str | os.PathLike, events: Iterable[Event]) -> None:
    with LogWriter(path) as writer:
        for event in events:
            writer(event)
