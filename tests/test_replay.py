"""`kvhandoff replay` and `kvhandoff diagram`: what a user debugging a hand-off sees."""

from __future__ import annotations

import pathlib

import orjson
import pytest

from kvhandoff.adapters.cli import main
from kvhandoff.core.diagram import lifecycle_markdown
from kvhandoff.core.events import (
    Admitted,
    ClientCancelled,
    Exported,
    FinishedRecving,
    Forgotten,
    Freed,
    HeartbeatReceived,
    HeartbeatSent,
    LeaseAcknowledged,
    LeaseExpired,
    PrefillStarted,
    ReadsPosted,
    Rejected,
    ReleaseNotified,
    ReleaseSent,
    Side,
    SplitCompleted,
    SplitFailed,
    Stream,
    Validated,
)
from kvhandoff.core.ledger import Ledger
from kvhandoff.core.lifecycle import DState, LifecycleState, PState, fold
from kvhandoff.core.log import LogWriter, log_name, logs_in, read_logs
from kvhandoff.core.replay import state_hash
from kvhandoff.core.safelog import printable

ROOT = pathlib.Path(__file__).resolve().parents[1]
LEASE = 10.0


class Engines:
    """A P and a D engine each writing its own log, as in a real deployment."""

    def __init__(self, tmp_path):
        self.p_log = LogWriter(tmp_path / "p.jsonl")
        self.d_log = LogWriter(tmp_path / "d.jsonl")
        self.P = Ledger(Stream("prefill-0", Side.P, 0), LifecycleState(), self.p_log)
        self.D = Ledger(Stream("decode-0", Side.D, 0), LifecycleState(), self.d_log)
        self.paths = [str(tmp_path / "p.jsonl"), str(tmp_path / "d.jsonl")]

    def start_read(self, rid: str, t: float) -> None:
        self.P.record(PrefillStarted, rid, t)
        self.P.record(Exported, rid, t, lease_s=LEASE, consumer_ranks=(0,), num_blocks=2)
        self.D.record(Admitted, rid, t + 0.1, remote_engine="prefill-0", remote_ranks=(0,),
                      num_blocks=2, lease_s=LEASE, lease_margin_s=0.5, local_request_id=rid)
        self.D.record(Validated, rid, t + 0.1)
        self.D.record(HeartbeatSent, rid, t + 0.1)
        self.P.record(HeartbeatReceived, rid, t + 0.2, from_engine="decode-0")
        self.D.record(LeaseAcknowledged, rid, t + 0.3, p_rank=0, sent_at=t + 0.1, time_left=9.9)
        self.D.record(ReadsPosted, rid, t + 0.3, split_ranks=(0,))

    def finish_read(self, rid: str, t: float) -> None:
        self.D.record(SplitCompleted, rid, t, split=0)
        self.D.record(FinishedRecving, rid, t)
        notify_only = self.D.state.record(self.D.stream, rid).state is DState.FAILED
        self.D.record(ReleaseSent, rid, t, notify_only=notify_only)
        p_rec = self.P.state.record(self.P.stream, rid)
        if p_rec is not None and p_rec.state is PState.EXPORTED:
            self.P.record(ReleaseNotified, rid, t + 0.01, from_engine="decode-0", consumer_rank=0)
            self.P.record(Freed, rid, t + 0.02)

    def expire(self, rid: str, t: float) -> None:
        self.P.record(LeaseExpired, rid, t)
        self.P.record(Freed, rid, t)

    def close(self) -> list[str]:
        self.p_log.close()
        self.d_log.close()
        return self.paths


def _json(capsys, *argv):
    code = main(["replay", *argv, "--json"])
    return code, orjson.loads(capsys.readouterr().out)


def test_clean_hand_off_passes_check(tmp_path, capsys):
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)
    paths = e.close()
    code, out = _json(capsys, *paths, "--check")
    assert code == 0
    assert out["violations"] == [] and out["requests"] == 1
    assert out["states"] == {"D:DONE": 1, "P:FREED": 1}
    assert out["events"] == 13 and len(out["state_hash"]) == 32


@pytest.mark.parametrize("p_forgets", [False, True], ids=["remembered", "forgotten_at_free"])
def test_a_free_on_ds_own_release_before_its_read_completed_is_served_freed(
        tmp_path, capsys, p_forgets):
    """D releases only after its reads drained, so an own release that beats the read is stale.

    (Until issue #9 replay exempted a D's own releases: a stale or early release
    freed P under the read, P later answered "released", D confirmed and served
    the bytes, and --check said nothing.)  P's engine forgets a released
    request as it frees it; the free time still counts against D's read.
    """
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.P.record(ReleaseNotified, "req-1", 1.5, from_engine="decode-0", consumer_rank=0)
    e.P.record(Freed, "req-1", 1.5)
    if p_forgets:
        e.P.record(Forgotten, "req-1", 1.5)
    e.finish_read("req-1", 1.6)  # the ack at t=1.3 proves the lease until t=10.5
    code, out = _json(capsys, *e.close(), "--check")
    assert code == 1 and out["freed_under_read"] == 1
    assert [v["invariant"] for v in out["violations"]] == ["served_freed"]


def test_bytes_served_beyond_what_the_acknowledgements_prove_are_a_violation(
        tmp_path, capsys, monkeypatch):
    """replay derives the proof from the log's events, not from the fold's verdict."""
    from kvhandoff.core import lifecycle

    # A core whose verdict ignores the lease bound, in the engine and in replay alike.
    monkeypatch.setattr(lifecycle, "read_verdict_of", lambda rec: lifecycle.Verdict.CONFIRMED)
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)  # acknowledged: the lease is proven until t=10.5
    e.finish_read("req-1", 12.0)
    code, out = _json(capsys, *e.close(), "--check")
    assert code == 1
    unproven = [v for v in out["violations"] if v["invariant"] == "served_unproven"]
    assert unproven and "until t=10.5" in unproven[0]["detail"]


def test_a_d_log_alone_is_reported_and_fails_check_unless_partial(tmp_path, capsys):
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)
    p_path, d_path = e.close()
    code, out = _json(capsys, d_path, "--check")
    assert code == 1 and out["missing_producers"] == ["prefill-0"]
    assert main(["replay", d_path, "--check"]) == 1
    captured = capsys.readouterr()
    assert "WARNING" in captured.out and "prefill-0" in captured.out
    assert "--partial" in captured.err
    code, out = _json(capsys, d_path, "--check", "--partial")
    assert code == 0 and out["missing_producers"] == ["prefill-0"] and out["partial"]
    code, out = _json(capsys, p_path, d_path, "--check")
    assert code == 0 and out["missing_producers"] == []


def test_release_by_another_engine_counts_as_freed_under_read(tmp_path, capsys):
    """Without a release token, a stray engine's release can beat the consumer's heartbeat."""
    e = Engines(tmp_path)
    e.P.record(Exported, "req-1", 1.0, lease_s=LEASE, consumer_ranks=(0,), num_blocks=2)
    e.D.record(Admitted, "req-1", 1.1, remote_engine="prefill-0", remote_ranks=(0,),
               num_blocks=2, lease_s=LEASE, lease_margin_s=0.5, local_request_id="req-1")
    e.D.record(Validated, "req-1", 1.1)
    e.D.record(ReadsPosted, "req-1", 1.1, split_ranks=(0,))
    e.P.record(ReleaseNotified, "req-1", 1.2, from_engine="decode-9", consumer_rank=0)
    e.P.record(Freed, "req-1", 1.2)
    code, out = _json(capsys, *e.close())
    assert out["freed_under_read"] == 1


def test_timeline_shows_both_engines_in_time_order(tmp_path, capsys):
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.start_read("req-2", 1.5)
    e.finish_read("req-1", 2.0)
    assert main(["replay", *e.close(), "--request", "req-1"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  t=")]
    assert "request req-1" in out and "req-2" not in out.split("\n\n")[0]
    assert [line.split()[2] for line in lines][:3] == ["prefill_started", "exported", "admitted"]
    assert "prefill-0/P0" in out and "decode-0/D0" in out and "-> DONE" in out


def test_cancelled_request_that_stopped_heartbeating_is_named(tmp_path, capsys):
    """The vLLM 0.32 gap, as it shows in the logs: heartbeats stop at the client cancel."""
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.D.record(ClientCancelled, "req-1", 1.5)
    e.expire("req-1", 11.2)  # no heartbeat since t=1.1: P's lease runs out under the read
    e.D.record(SplitCompleted, "req-1", 12.0, split=0)
    code, out = _json(capsys, *e.close(), "--check")
    assert code == 1
    assert out["freed_under_read"] == 1
    assert [v["invariant"] for v in out["violations"]] == ["heartbeat_gap"]
    assert out["violations"][0]["event"] == "decode-0/D0#6 split_completed req-1"


def test_checking_leaves_the_state_exactly_the_fold_of_the_logs(tmp_path, capsys):
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.D.record(ClientCancelled, "req-1", 1.5)
    e.D.record(SplitCompleted, "req-1", 12.0, split=0)  # a heartbeat gap is reported here
    paths = e.close()
    code, out = _json(capsys, *paths)
    assert [v["invariant"] for v in out["violations"]] == ["heartbeat_gap"]
    assert out["state_hash"] == state_hash(fold(read_logs(paths)))


def test_bytes_served_after_p_freed_them_are_a_violation(tmp_path, capsys):
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.D.record(HeartbeatSent, "req-1", 5.0)
    e.D.record(LeaseAcknowledged, "req-1", 5.0, p_rank=0, sent_at=5.0, time_left=9.9)  # a lie
    e.expire("req-1", 11.3)  # P never got the later heartbeats (a partition)
    e.D.record(HeartbeatSent, "req-1", 12.0)
    e.finish_read("req-1", 12.5)
    code, out = _json(capsys, *e.close(), "--check")
    assert code == 1
    assert [v["invariant"] for v in out["violations"]] == ["served_freed"]
    assert "after P freed the source at t=11.3" in out["violations"][0]["detail"]


def test_an_id_used_again_after_both_engines_forgot_it_is_a_new_request(tmp_path, capsys):
    """The second life is checked on its own: not against the first life's free."""
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)  # P freed it at t=2.02
    e.P.record(Forgotten, "req-1", 2.02)  # as P's engine does with a released request
    e.D.record(Forgotten, "req-1", 5.0)  # within two leases of P's free
    e.start_read("req-1", 6.0)
    e.finish_read("req-1", 7.0)
    code, out = _json(capsys, *e.close(), "--check")
    assert code == 0 and out["violations"] == [] and out["freed_under_read"] == 0
    assert out["states"] == {"D:DONE": 1, "P:FREED": 1}


def test_a_second_free_of_a_request_p_forgot_as_it_freed_it_is_a_double_free(tmp_path, capsys):
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)  # released, freed at t=2.02 and forgotten
    e.P.record(Forgotten, "req-1", 2.02)
    paths = e.close()
    with open(paths[0], "ab") as f:  # a buggy engine frees it again
        f.write(orjson.dumps({"v": 1, "type": "freed", "rid": "req-1", "engine": "prefill-0",
                              "side": "P", "rank": 0, "seq": 6, "t": 2.5}) + b"\n")
    code, out = _json(capsys, *paths, "--check")
    assert code == 1 and [v["invariant"] for v in out["violations"]] == ["double_free"]


def test_double_free_is_named_and_check_fails_with_the_first_violation(tmp_path, capsys):
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)
    paths = e.close()
    with open(paths[0], "ab") as f:  # a buggy engine frees again
        f.write(orjson.dumps({"v": 1, "type": "freed", "rid": "req-1", "engine": "prefill-0",
                              "side": "P", "rank": 0, "seq": 5, "t": 3.0}) + b"\n")
    code = main(["replay", *paths, "--check"])
    captured = capsys.readouterr()
    assert code == 1
    assert "VIOLATION double_free: prefill-0/P0#5 freed req-1" in captured.out
    assert "first: double_free at prefill-0/P0#5 freed req-1" in captured.err


def test_until_folds_each_stream_up_to_a_sequence_number(tmp_path, capsys):
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)
    code, out = _json(capsys, *e.close(), "--until", "1")
    assert code == 0 and out["states"] == {"D:VALIDATED": 1, "P:EXPORTED": 1}


def test_a_log_dir_stands_for_each_engine_rank_s_current_log_in_it(tmp_path, capsys):
    """``kvhandoff replay P_DIR D_DIR``: the connector's ``log_dir`` holds each rank's
    ``<engine_id>.<P|D><rank>.jsonl``; a restarted engine's predecessor (moved aside as
    ``<engine_id>.D0.<unix time>.jsonl``, a stream of the same name) and other files are
    left out, so the directories replay exactly as the current files do."""
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)
    p_path, d_path = e.close()
    p_dir, d_dir = tmp_path / "P", tmp_path / "D"
    p_dir.mkdir()
    d_dir.mkdir()
    (p_dir / log_name(e.P.stream)).write_bytes(open(p_path, "rb").read())
    (d_dir / log_name(e.D.stream)).write_bytes(open(d_path, "rb").read())
    (d_dir / "decode-0.D0.1764800000.jsonl").write_bytes(b"not a log of this incarnation\n")
    (d_dir / "notes.txt").write_text("not a log")
    assert sorted(logs_in(d_dir)) == [str(d_dir / "decode-0.D0.jsonl")]
    code, files = _json(capsys, p_path, d_path, "--check")
    assert code == 0
    code, dirs = _json(capsys, str(p_dir), str(d_dir), "--check")
    assert code == 0 and dirs == files and dirs["requests"] == 1


def test_a_directory_without_an_engine_log_is_named(tmp_path, capsys):
    (tmp_path / "decode-0.D0.1764800000.jsonl").write_bytes(b"")
    assert main(["replay", str(tmp_path), "--check"]) == 2
    assert f"{tmp_path}: no engine log in this directory" in capsys.readouterr().err


def test_check_of_logs_without_an_event_fails_rather_than_passes(tmp_path, capsys):
    """An empty log (or ``--until`` before every event) checked nothing: it was exit 0."""
    (empty := tmp_path / "empty.jsonl").write_bytes(b"")
    assert main(["replay", str(empty), "--check"]) == 2
    assert "--check: no event was folded: nothing was checked" in capsys.readouterr().err
    assert main(["replay", str(empty)]) == 0  # showing nothing is no error
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)
    paths = e.close()
    assert main(["replay", *paths, "--until", "-1", "--check"]) == 2
    assert "nothing was checked" in capsys.readouterr().err
    assert main(["replay", *paths, "--until", "0", "--check"]) == 0


def test_a_request_the_logs_do_not_hold_is_named(tmp_path, capsys):
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)
    assert main(["replay", *e.close(), "--request", "req-2"]) == 2
    assert "--request req-2: no event of this request in the logs" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--trace", "--svg"])
def test_a_picture_is_never_written_over_a_log_it_reads(tmp_path, capsys, option):
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)
    paths = e.close()
    before = pathlib.Path(paths[0]).read_bytes()
    assert main(["replay", *paths, option, paths[0]]) == 2
    assert f"{option} {paths[0]} is one of the logs replayed" in capsys.readouterr().err
    assert pathlib.Path(paths[0]).read_bytes() == before
    assert main(["replay", *paths, option, str(tmp_path / "no" / "such" / "dir.out")]) == 2
    assert capsys.readouterr().err.startswith(f"kvhandoff replay: {option} {tmp_path}/no/such")


@pytest.mark.parametrize("bad", ["--trace", "--svg"])
def test_an_output_that_cannot_be_written_leaves_the_other_unwritten(tmp_path, capsys, bad):
    """Both outputs are checked before either is written: a bad ``--svg`` after a good
    ``--trace`` left the trace written, with exit 2."""
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)
    paths = e.close()
    good = "--svg" if bad == "--trace" else "--trace"
    out = tmp_path / "good.out"
    for target, why in ((tmp_path, "is a directory"),
                        (tmp_path / "no" / "such.out", "no such directory")):
        files = {good: out, bad: target}
        for first, second in ((good, bad), (bad, good)):
            assert main(["replay", *paths, first, str(files[first]),
                         second, str(files[second])]) == 2
            assert capsys.readouterr().err == f"kvhandoff replay: {bad} {target}: {why}\n"
            assert not out.exists()


def test_an_svg_that_fails_as_it_is_written_takes_the_new_trace_with_it(tmp_path, capsys):
    """A failure the check before writing cannot see (a name too long for the file system):
    the trace this run had just made is removed, so nothing is left half done."""
    e = Engines(tmp_path)
    e.start_read("req-1", 1.0)
    e.finish_read("req-1", 2.0)
    paths = e.close()
    trace = tmp_path / "t.json"
    assert main(["replay", *paths, "--trace", str(trace), "--svg",
                 str(tmp_path / ("x" * 300))]) == 2
    assert capsys.readouterr().err.startswith(f"kvhandoff replay: --svg {tmp_path}/xxx")
    assert not trace.exists()


def test_corrupt_log_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"v":1,"type":"exported"}\n')
    assert main(["replay", str(path)]) == 2
    assert f"{path}:1: field 'rid' must be str" in capsys.readouterr().err


FORGED = '{"v":1}'
# What a client (remote_request_id, through P's params) or a peer can put in an event field.
HOSTILE_NAMES = {
    "rids": (f"x\n{FORGED}", "a\x1b[2J\x1b[31mb", "c\rVIOLATION none", "e\u2028f\u2029g\x85h"),
    "reason": f"bad\n{FORGED}: request z\x1b]0;title\x07",
    "p_engine": "prefill\x1b[0m-0",
    "d_engine": "decode\r-0",
    "absent_engine": f"gone\n{FORGED}\u2028",
}
PLAIN_NAMES = {"rids": ("req-1", "req-2", "req-3", "req-4"), "reason": "bad params",
               "p_engine": "prefill-0", "d_engine": "decode-0", "absent_engine": "prefill-9"}


def _logs_naming(tmp_path, names) -> list[str]:
    """P and D logs whose every kind of string field carries ``names``: a clean hand-off,
    a heartbeat gap, a double free, a rejection and a failed split whose reasons are
    ``names["reason"]``, and a request read from a P whose log is absent."""
    r0, r1, r2, r3 = names["rids"]
    p_engine, d_engine = names["p_engine"], names["d_engine"]
    tmp_path.mkdir(exist_ok=True)
    paths = [str(tmp_path / "p.jsonl"), str(tmp_path / "d.jsonl")]
    with LogWriter(paths[0]) as p_log, LogWriter(paths[1]) as d_log:
        P = Ledger(Stream(p_engine, Side.P, 0), LifecycleState(), p_log)
        D = Ledger(Stream(d_engine, Side.D, 0), LifecycleState(), d_log)
        for i, rid in enumerate((r0, r1, r3)):
            t = 1.0 + i
            P.record(PrefillStarted, rid, t)
            P.record(Exported, rid, t, lease_s=LEASE, consumer_ranks=(0,), num_blocks=2)
            D.record(Admitted, rid, t + 0.1, remote_engine=p_engine, remote_ranks=(0,),
                     num_blocks=2, lease_s=LEASE, lease_margin_s=0.5, local_request_id=rid)
            D.record(Validated, rid, t + 0.1)
            D.record(HeartbeatSent, rid, t + 0.1)
            P.record(HeartbeatReceived, rid, t + 0.2, from_engine=d_engine)
            D.record(LeaseAcknowledged, rid, t + 0.3, p_rank=0, sent_at=t + 0.1, time_left=9.9)
            D.record(ReadsPosted, rid, t + 0.3, split_ranks=(0,))
        D.record(SplitCompleted, r0, 5.0, split=0)
        D.record(FinishedRecving, r0, 5.0)
        D.record(ReleaseSent, r0, 5.0)
        P.record(ReleaseNotified, r0, 5.01, from_engine=d_engine, consumer_rank=0)
        P.record(Freed, r0, 5.02)
        D.record(ClientCancelled, r1, 5.0)
        D.record(SplitCompleted, r1, 14.0, split=0)  # no heartbeat since t=2.1: a gap
        D.record(SplitFailed, r3, 5.0, split=0, reason=names["reason"])
        D.record(Admitted, r2, 6.0, remote_engine=names["absent_engine"], remote_ranks=(0,),
                 num_blocks=2, lease_s=LEASE, lease_margin_s=0.5, local_request_id=r2)
        D.record(Rejected, r2, 6.0, reason=names["reason"])
        seq = P.state.stream(P.stream).last_seq + 1
    with open(paths[0], "ab") as f:  # a buggy P frees r0 again
        f.write(orjson.dumps({"v": 1, "type": "freed", "rid": r0, "engine": p_engine,
                              "side": "P", "rank": 0, "seq": seq, "t": 6.0}) + b"\n")
    return paths


def test_text_output_escapes_what_clients_wrote_and_json_keeps_it_exact(tmp_path, capsys):
    """A remote_request_id of 'x\\n{"v":1}' must not forge a line (issue #13): every string
    from an event field is escaped in the text output, one event stays one line, and no
    control character reaches the terminal raw; --json carries the strings exactly."""
    outputs = {}
    for label, names in (("plain", PLAIN_NAMES), ("hostile", HOSTILE_NAMES)):
        paths = _logs_naming(tmp_path / label, names)  # the hostile ones stay in ``paths``
        assert main(["replay", *paths, "--check", "--partial"]) == 1
        outputs[label] = capsys.readouterr()
    plain, hostile = outputs["plain"], outputs["hostile"]
    assert "VIOLATION double_free" in plain.out and "heartbeat_gap" in plain.out
    assert "WARNING" in plain.out and "first: double_free" in plain.err
    for stream in ("out", "err"):
        seen, expected = getattr(hostile, stream), getattr(plain, stream)
        # splitlines also splits at \r, \x85, U+2028/2029 and other separators
        assert len(seen.splitlines()) == len(expected.splitlines()) > 0
        assert seen.count("\n") == expected.count("\n")
        assert all(c.isprintable() for c in seen.replace("\n", ""))
        for raw in ("\x1b", "\r", "\x07", "\x85", "\u2028", "\u2029"):
            assert raw not in seen, (stream, raw)
        for line in seen.splitlines():
            assert not line.lstrip().startswith(FORGED), line
            assert not line.startswith("VIOLATION none")
    # Each string is still shown, escaped, in every place it appears.
    assert "request x\\n" + FORGED in hostile.out
    assert "x\\n" + FORGED in hostile.err  # --check names the first violation
    assert "reason=bad\\n" + FORGED + ": request z\\x1b]0;title\\x07" in hostile.out
    assert "prefill\\x1b[0m-0/P0" in hostile.out and "decode\\r-0/D0" in hostile.out
    assert "gone\\n" + FORGED + "\\u2028" in hostile.out
    assert "e\\u2028f\\u2029g\\x85h" in hostile.out

    code, out = _json(capsys, *paths, "--check")
    assert code == 1
    assert out["missing_producers"] == [HOSTILE_NAMES["absent_engine"]]
    events = {v["invariant"]: v["event"] for v in out["violations"]}
    r0, r1 = HOSTILE_NAMES["rids"][:2]
    assert events["double_free"].startswith(HOSTILE_NAMES["p_engine"] + "/P0#")
    assert events["double_free"].endswith(f" freed {r0}")
    assert events["heartbeat_gap"].startswith(HOSTILE_NAMES["d_engine"] + "/D0#")
    assert events["heartbeat_gap"].endswith(f" split_completed {r1}")


def test_ordinary_ids_print_unchanged():
    for s in ("req-1", "cmpl-8f3a_0", "prefill-0/P0", "état 日本", "", "a b"):
        assert printable(s) == s
    assert printable("a\\b") == "a\\\\b"  # a backslash is escaped: the text names one string
    assert printable("x\ny\u2028\x9b\x7f\u202e") == "x\\ny\\u2028\\x9b\\x7f\\u202e"


@pytest.mark.parametrize("side", ["P", "D"])
def test_diagram_is_generated_from_the_machine(side, capsys):
    assert main(["diagram", "--side", side]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stateDiagram-v2")
    states = PState if side == "P" else DState
    for state in states:
        if state.value != "NEW":
            assert state.value in out


def test_docs_embed_the_current_diagram():
    doc = (ROOT / "docs" / "lifecycle.md").read_text()
    assert lifecycle_markdown() in doc, "regenerate with: kvhandoff diagram >> docs/lifecycle.md"


def test_events_merge_by_time_ties_to_the_earlier_stream_and_each_stream_keeps_its_order():
    """`merge_by_time` is heapq.merge's order (ties: the stream seen first, then the event
    written first), whether or not each stream's clock moved forward: a stream written out
    of time order keeps its own order."""
    import heapq

    from kvhandoff.core.replay import merge_by_time

    def stream_events(engine: str, side: Side, times: list[float]) -> list:
        s = Stream(engine, side, 0)
        return [PrefillStarted(f"r{i}", s, i, t) for i, t in enumerate(times)]

    in_order = [stream_events("p", Side.P, [0.0, 1.0, 1.0, 2.0]),
                stream_events("d", Side.D, [1.0, 1.0, 3.0]),
                stream_events("q", Side.P, [0.5, 1.0])]
    backwards = [*in_order, stream_events("late", Side.D, [2.5, 0.2, 1.0])]
    for runs in (in_order, backwards):
        interleaved = [e for i in range(4) for run in runs if i < len(run) for e in [run[i]]]
        merged = merge_by_time(interleaved)
        assert [(e.stream, e.seq) for e in merged] == [
            (e.stream, e.seq) for e in heapq.merge(*runs, key=lambda e: e.t)]
