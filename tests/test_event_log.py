"""The event log: round trip, torn last line tolerated, anything else corrupt is named."""

from __future__ import annotations

import re

import orjson
import pytest
from lifecycle_paths import D_PATHS, P_PATHS, RID, ledger_in
from structlog.testing import capture_logs

from kvhandoff.core.errors import LogCorrupt
from kvhandoff.core.events import HeartbeatReceived
from kvhandoff.core.lifecycle import DState, PState, fold
from kvhandoff.core.log import LogWriter, encode_event, iter_log, read_log, read_logs, write_log
from kvhandoff.core.replay import state_hash


def _log_of(tmp_path, state, name="x.jsonl"):
    ledger = ledger_in(state)
    path = tmp_path / name
    captured = []
    from kvhandoff.core.ledger import Ledger
    from kvhandoff.core.lifecycle import LifecycleState
    replayed = Ledger(ledger.stream, LifecycleState(), captured.append)
    t = 0.0
    for cls, fields in (P_PATHS if isinstance(state, PState) else D_PATHS)[state]:
        fields = dict(fields)
        t = fields.pop("t", t + 0.001)  # the times `ledger_in` uses
        replayed.record(cls, RID, t, **fields)
    write_log(path, captured)
    return path, captured, replayed.state


def test_round_trip_gives_equal_events_and_state(tmp_path):
    path, written, live = _log_of(tmp_path, DState.DONE)
    read = read_log(path)
    assert read == written
    assert state_hash(fold(read)) == state_hash(live)


def test_writer_is_buffered_until_flush(tmp_path):
    path = tmp_path / "b.jsonl"
    ledger = ledger_in(PState.EXPORTED)
    with LogWriter(path) as writer:
        writer(HeartbeatReceived(RID, ledger.stream, 0, 1.0, from_engine="d"))
        assert path.read_bytes() == b""
        writer.flush()
        assert path.read_bytes().count(b"\n") == 1


class _FullDisk:
    """A file with room for ``budget`` more bytes (None: no limit); a write past it fails
    with ENOSPC after writing what fits.  Writes at most ``chunk`` bytes each (partial
    writes, as a kernel may do); ``failed`` holds the size of each write that failed."""

    def __init__(self, path, budget=0, chunk=100):
        self.real, self.budget, self.chunk = open(path, "ab", buffering=0), budget, chunk
        self.failed: list[int] = []
        self.closed = False

    def write(self, data):
        n = min(len(data), self.chunk)
        if self.budget is not None:
            if self.budget == 0:
                self.failed.append(len(data))
                raise OSError(28, "No space left on device")
            n = min(n, self.budget)
            self.budget -= n
        return self.real.write(bytes(data[:n]))

    def close(self):
        self.closed = True
        self.real.close()


def _heartbeats(n):
    stream = ledger_in(PState.EXPORTED).stream
    return [HeartbeatReceived(RID, stream, seq, float(seq), from_engine="d") for seq in range(n)]


def test_recording_never_raises_and_a_failed_write_loses_nothing(tmp_path):
    path = tmp_path / "f.jsonl"
    events = _heartbeats(50)
    writer = LogWriter(path, buffer_bytes=300)
    writer._file = disk = _FullDisk(path, budget=250)  # room for two lines and a bit
    for e in events[:30]:
        writer(e)  # the disk fills mid-line: recording still returns
    assert len(disk.failed) == 1  # one attempt when the buffer filled; then it waits for flush
    for _ in range(3):
        with pytest.raises(OSError):
            writer.flush()  # the caller hears the failure (it counts it and serves on)
    # While failing, a flush tries the first waiting piece alone (a line, or the rest of
    # the chunk a write cut short), never a copy of the backlog.
    assert all(size <= writer.buffer_bytes for size in disk.failed[1:])
    assert writer._pending_bytes > 25 * (len(encode_event(events[0])) + 1)
    disk.budget = None  # the disk has room again
    for e in events[30:]:
        writer(e)
    writer.close()
    assert read_log(path) == events  # every event once, in order, across partial writes
    assert writer.dropped == 0


def test_an_interrupted_flush_keeps_every_line_for_the_next_one(tmp_path):
    path = tmp_path / "i.jsonl"
    events = _heartbeats(20)
    writer = LogWriter(path, buffer_bytes=1 << 20)
    writer._file = disk = _FullDisk(path, budget=None, chunk=70)
    calls = 0
    real = disk.write

    def interrupted(data):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt  # Ctrl-C lands in the middle of a flush
        return real(data)
    disk.write = interrupted
    for e in events:
        writer(e)
    with pytest.raises(KeyboardInterrupt):
        writer.flush()
    writer.close()
    assert read_log(path) == events


def test_a_flush_inside_a_flush_is_refused_and_the_outer_one_writes_everything_once(tmp_path):
    """A signal handler that flushes lands inside a flush on the same thread: it must not
    write again what the interrupted flush already wrote (a repeated line corrupts the log)."""
    path = tmp_path / "r.jsonl"
    events = _heartbeats(20)
    writer = LogWriter(path, buffer_bytes=300)
    writer._file = disk = _FullDisk(path, budget=None, chunk=1 << 20)
    real, refused = disk.write, []

    def handler_lands(data):
        n = real(data)
        if not refused:
            with pytest.raises(RuntimeError, match="re-entered"):
                writer.flush()
            refused.append(1)
        return n
    disk.write = handler_lands
    for e in events:
        writer(e)
    writer.close()
    assert refused and read_log(path) == events


def test_a_disk_that_stays_full_bounds_the_memory_and_counts_what_it_dropped(tmp_path):
    path = tmp_path / "g.jsonl"
    writer = LogWriter(path, buffer_bytes=100, max_pending_bytes=1000)
    writer._file = disk = _FullDisk(path)
    for e in _heartbeats(100):
        writer(e)
    assert 0 < writer._pending_bytes < 1000 + 200 and writer.dropped > 80
    disk.budget = None
    writer.close()
    kept = path.read_bytes().count(b"\n")
    assert kept + writer.dropped == 100 and kept > 0


def test_torn_last_line_is_dropped_with_a_warning_and_keeps_the_rest(tmp_path):
    path, written, _ = _log_of(tmp_path, PState.FREED)
    data = path.read_bytes()
    path.write_bytes(data[:-25])  # crash mid-write of the last event
    with capture_logs() as logs:
        read = read_log(path)
    assert read == written[:-1]
    assert logs[0]["event"] == "eventlog.torn_last_line" and logs[0]["log_level"] == "warning"
    assert logs[0]["line"] == len(written)


def test_a_live_log_read_while_its_last_line_is_written_ends_at_the_torn_line(tmp_path):
    """The writer adds the rest of the torn line while the reader is still
    going: the reader stops where the file ended when it read it, never taking the rest
    of that line for a line of its own (a `LogCorrupt` of a healthy live log, seen in
    CI while a serve-route test polled P's log)."""
    path, written, _ = _log_of(tmp_path, PState.FREED)
    data = path.read_bytes()
    path.write_bytes(data[:-25])  # the last event half written
    with capture_logs() as logs:
        events = iter_log(path)
        first = next(events)  # the file read up to its torn end
        with open(path, "ab") as f:
            f.write(data[-25:])  # the writer finishes the line
        read = [first, *events]
    assert read == written[:-1]
    assert [entry["event"] for entry in logs] == ["eventlog.torn_last_line"]
    assert read_log(path) == written  # read again: the whole line is there


def test_the_writer_never_follows_a_link_planted_at_the_log_s_path(tmp_path):
    """A log directory others can write to (an operator's ``log_dir``): a symbolic link
    at the log's path is refused, naming it, and its target is left as it was."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched\n")
    link = tmp_path / "prefill-0.P0.jsonl"
    link.symlink_to(victim)
    with pytest.raises(OSError, match="symbolic link, not followed") as caught:
        LogWriter(link)
    assert str(link) in str(caught.value)
    assert victim.read_bytes() == b"untouched\n"
    with LogWriter(tmp_path / "real.jsonl") as writer:  # a plain path: created, appended
        writer.flush()
    assert (tmp_path / "real.jsonl").exists()


def test_a_new_log_is_readable_by_its_owner_alone_whatever_the_umask(tmp_path):
    """An operator's ``log_dir`` may be readable by others, and the umask permissive:
    the log holds release tokens, so a new one is made 0600 (an existing one keeps its
    mode: the operator chose it)."""
    import os
    import stat

    old = os.umask(0)
    try:
        with LogWriter(tmp_path / "prefill-0.P0.jsonl") as writer:
            writer.flush()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "prefill-0.P0.jsonl").stat().st_mode) == 0o600
    kept = tmp_path / "decode-0.D0.jsonl"
    kept.touch(mode=0o640)
    kept.chmod(0o640)
    with LogWriter(kept) as writer:
        writer.flush()
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640


def _corrupt(tmp_path, mutate):
    path, written, _ = _log_of(tmp_path, PState.FREED)
    lines = path.read_bytes().split(b"\n")[:-1]
    mutate(lines)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _set(index, **changes):
    def mutate(lines):
        obj = orjson.loads(lines[index])
        for k, v in changes.items():
            if v is KeyError:
                del obj[k]
            else:
                obj[k] = v
        lines[index] = orjson.dumps(obj)
    return mutate


@pytest.mark.parametrize(("mutate", "line", "message"), [
    (lambda lines: lines.__setitem__(1, b'{"v":1,"type":'), 2, "bad JSON"),
    (lambda lines: lines.__setitem__(1, b"[1,2]"), 2, "expected an object"),
    (_set(2, type="teleported"), 3, "unknown event type 'teleported'"),
    (_set(2, v=7), 3, "schema version 7"),
    (_set(1, lease_s="30"), 2, "field 'lease_s' must be number, found a string"),
    (_set(1, consumer_ranks=[0, "1"]), 2,
     "field 'consumer_ranks' must be list of int, found an array holding a string"),
    (_set(1, consumer_ranks=[0, 1.5]), 2,
     "field 'consumer_ranks' must be list of int, found an array holding the number 1.5"),
    # an integer beyond 64 bits reads as a float: named by its value, not "found float"
    (lambda lines: lines.__setitem__(1, re.sub(rb'"num_blocks":\d+', b'"num_blocks":' + b"9" * 23,
                                              lines[1])),
     2, "field 'num_blocks' must be int, found the number 1e+23"),
    (_set(2, v=True), 3, "schema version true, expected 1"),  # JSON's true is no 1
    (lambda lines: lines.__setitem__(1, b"null"), 2, "expected an object, found null"),
    (_set(3, consumer_rank=KeyError), 4, "missing field 'consumer_rank'"),
    (_set(2, seq=5), 3, "sequence gap in stream prefill-0/P0: expected 2, found 5"),
    (_set(2, seq=1), 3, "sequence repeat"),
    (_set(0, side="X"), 1, "field 'side' must be P or D"),
    (_set(0, rank="0"), 1, "field 'rank' must be int"),
    (lambda lines: lines.__setitem__(2, b'{"v":1}x'), 3,
     "bad JSON (unexpected content after document at character 8 of the line)"),
])
def test_corrupt_lines_name_file_and_line(tmp_path, mutate, line, message):
    path = _corrupt(tmp_path, mutate)
    with pytest.raises(LogCorrupt) as info:
        read_log(path)
    assert info.value.path == str(path) and info.value.line == line
    assert message in str(info.value)
    assert str(info.value).startswith(f"{path}:{line}:")


def test_a_blank_line_is_no_event_and_skipped(tmp_path):
    """An editor's blank line (one at the end, or between events) made the log unreadable;
    it holds no event, and the sequence numbers still catch one that went missing."""
    path, written, _ = _log_of(tmp_path, PState.FREED)
    lines = path.read_bytes().split(b"\n")[:-1]
    path.write_bytes(b"\n".join(lines[:2] + [b"", b"  "] + lines[2:]) + b"\n\n")
    assert read_log(path) == written
    path.write_bytes(b"\n".join(lines[:2] + [b""] + lines[3:]) + b"\n")  # one lost there
    with pytest.raises(LogCorrupt, match=f"{path}:4: sequence gap"):
        read_log(path)


def test_a_whole_last_line_that_is_wrong_is_corrupt_not_torn(tmp_path):
    """Only a write cut short (no final newline, no JSON) is a torn line, dropped with a
    warning; a last line that parses but is wrong (a field of the wrong type, a sequence
    gap) was written whole, and is named as any other corrupt line."""
    path, written, _ = _log_of(tmp_path, PState.FREED)
    lines = path.read_bytes().split(b"\n")[:-1]
    path.write_bytes(b"\n".join(lines[:-1] + [lines[-1].replace(b'"t":', b'"t":"late","x":')]))
    with pytest.raises(LogCorrupt, match="field 't' must be number, found a string"):
        read_log(path)


def test_several_logs_read_together(tmp_path):
    p_path, p_events, _ = _log_of(tmp_path, PState.FREED, "p.jsonl")
    d_path, d_events, _ = _log_of(tmp_path, DState.DONE, "d.jsonl")
    assert read_logs([p_path, d_path]) == p_events + d_events


def test_reads_posted_of_a_log_before_hybrid_models_reads_as_group_0(tmp_path):
    """Logs written before splits named their cache group still replay: every split is group 0."""
    path, written, live = _log_of(tmp_path, DState.DONE)
    lines = path.read_bytes().split(b"\n")[:-1]
    posted = next(i for i, raw in enumerate(lines) if orjson.loads(raw)["type"] == "reads_posted")
    obj = orjson.loads(lines[posted])
    assert obj.pop("split_groups") == []
    lines[posted] = orjson.dumps(obj)
    path.write_bytes(b"\n".join(lines) + b"\n")
    read = read_log(path)
    assert read == written and read[posted].split_groups == ()
    rec = next(iter(fold(read).streams.values())).requests[RID]
    assert rec.split_groups == (0,) * len(rec.split_ranks)
    assert state_hash(fold(read)) == state_hash(live)


def test_split_groups_round_trip_and_a_wrong_type_is_named(tmp_path):
    from kvhandoff.core.events import ReadsPosted, Side, Stream

    stream = Stream("decode-0", Side.D, 0)
    ev = ReadsPosted("r", stream, 0, 1.0, split_ranks=(0, 0), split_groups=(0, 1))
    write_log(tmp_path / "g.jsonl", [ev])
    assert read_log(tmp_path / "g.jsonl") == [ev]
    obj = orjson.loads(orjson.dumps({**orjson.loads((tmp_path / "g.jsonl").read_bytes()),
                                     "split_groups": [0, "1"]}))
    (tmp_path / "g.jsonl").write_bytes(orjson.dumps(obj) + b"\n")
    with pytest.raises(LogCorrupt, match="field 'split_groups' must be list of int"):
        read_log(tmp_path / "g.jsonl")
