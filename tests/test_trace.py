"""`kvhandoff replay --trace` / `--svg`: a request timeline you can open.

The trace's structure is checked against the Trace Event Format
(`trace_format.check_trace`) on simulator logs; test_vllm_worker checks it
on a real engine pair's logs.  The picture in docs/lifecycle.md is drawn
from the simulator and must be what the code draws now.
"""

from __future__ import annotations

import pathlib
import xml.etree.ElementTree as ET

import orjson
import pytest
from trace_format import check_trace

from kvhandoff.adapters.cli import main
from kvhandoff.core.events import (
    Admitted,
    ClientCancelled,
    Exported,
    FinishedRecving,
    Freed,
    HeartbeatReceived,
    HeartbeatSent,
    LeaseAcknowledged,
    ReadsPosted,
    Rejected,
    ReleaseNotified,
    ReleaseSent,
    Side,
    SplitCompleted,
    Stream,
    Validated,
)
from kvhandoff.core.ledger import Ledger
from kvhandoff.core.lifecycle import LifecycleState
from kvhandoff.core.log import LogWriter, read_logs
from kvhandoff.core.trace import timeline, trace_events

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _times(paths) -> dict:
    return {(str(e.stream), e.seq): e.t for e in read_logs(paths)}


def _simulate(tmp_path, scenario: str, policy: str, seed: int = 0) -> list[str]:
    out = tmp_path / policy
    assert main(["simulate", "--scenario", scenario, "--seeds", str(seed), "--policy", policy,
                 "--log-dir", str(out), "--json"]) in (0, 1)
    stem = out / f"{scenario}.{policy}.s{seed}"
    return [f"{stem}.P.jsonl", f"{stem}.D.jsonl"]


def _trace(tmp_path, capsys, paths, *extra) -> dict:
    path = tmp_path / "trace.json"
    main(["replay", *paths, "--trace", str(path), "--json", *extra])
    out = orjson.loads(capsys.readouterr().out)
    assert out["trace"] == str(path)
    return orjson.loads(path.read_bytes())


def _by_request(doc: dict, rid: str) -> list[dict]:
    threads = {(e["pid"], e["tid"]) for e in doc["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"] == rid}
    return [e for e in doc["traceEvents"] if e["ph"] != "M" and (e["pid"], e["tid"]) in threads]


@pytest.mark.parametrize("policy", ["vllm-0.32", "kvhandoff"])
def test_a_simulated_cancel_during_read_is_a_well_formed_trace(tmp_path, capsys, policy):
    paths = _simulate(tmp_path, "cancel_during_read", policy)
    capsys.readouterr()
    doc = _trace(tmp_path, capsys, paths)
    got = check_trace(doc, _times(paths))
    assert sorted(got["processes"].values()) == [
        "decode-0/D0", "decode-0/D1", "prefill-0/P0", "prefill-0/P1"]
    assert set(got["phases"]) == set("MBEbeisf")
    assert got["flows"]["heartbeat"] > 0
    # The race, as the trace shows it for req-0 (cancelled during READs that outlast the lease).
    evs = _by_request(doc, "req-0")
    leases_end = [e for e in evs if e["ph"] == "E" and e["name"] == "lease"]
    splits_end = [e for e in evs if e["ph"] == "e"]
    assert len(leases_end) == 2 and len(splits_end) == 2
    assert all(e["args"]["ended_by"] == "freed" for e in leases_end)
    assert {e["args"]["result"] for e in splits_end} == {"completed"}
    begins = [e for e in evs if e["ph"] == "b"]
    assert {(b["args"]["p_engine"], b["args"]["p_rank"], b["args"]["group"]) for b in begins} == {
        ("prefill-0", 0, 0), ("prefill-0", 1, 0)}
    names = {e["name"] for e in evs if e["ph"] == "i"}
    assert {"client_cancelled", "heartbeat_sent", "heartbeat_received"} <= names
    freed_under_read = max(e["ts"] for e in leases_end) < max(e["ts"] for e in splits_end)
    assert freed_under_read is (policy == "vllm-0.32")
    assert ("lease_expired" in names) is (policy == "vllm-0.32")
    if policy == "kvhandoff":  # heartbeats go on after the cancel, until the READs drained
        cancel = next(e["ts"] for e in evs if e["name"] == "client_cancelled")
        last_hb = max(e["ts"] for e in evs if e["name"] == "heartbeat_sent")
        assert last_hb > cancel and "ack" in got["flows"]


def test_the_text_output_names_the_files_and_keeps_the_summary_and_check(tmp_path, capsys):
    paths = _simulate(tmp_path, "cancel_during_read", "vllm-0.32")
    capsys.readouterr()
    trace, svg = tmp_path / "t.json", tmp_path / "t.svg"
    assert main(["replay", *paths, "--check", "--trace", str(trace), "--svg", str(svg)]) == 1
    out = capsys.readouterr()
    assert f"trace written to {trace}" in out.out and f"svg written to {svg}" in out.out
    assert "request req-0" not in out.out  # the files instead of the timelines
    assert " events, 15 requests, states " in out.out and "VIOLATION heartbeat_gap" in out.out
    assert "first: heartbeat_gap" in out.err
    assert trace.stat().st_size and svg.stat().st_size


def test_rejections_carry_their_reason_and_narrowing_applies(tmp_path, capsys):
    paths = _simulate(tmp_path, "reject_invalid_geometry", "kvhandoff")
    capsys.readouterr()
    doc = _trace(tmp_path, capsys, paths)
    check_trace(doc, _times(paths))
    rejected = [e for e in doc["traceEvents"] if e.get("name") == "rejected"]
    assert rejected and all(e["args"]["reason"] for e in rejected)
    rid = next(e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"
               and e["name"] == "thread_name" and _by_request(doc, e["args"]["name"])
               and any(x.get("name") == "rejected" for x in _by_request(doc, e["args"]["name"])))
    one = _trace(tmp_path, capsys, paths, "--request", rid)
    check_trace(one)
    assert {e["args"]["name"] for e in one["traceEvents"] if e["name"] == "thread_name"} == {rid}
    early = _trace(tmp_path, capsys, paths, "--until", "3")
    check_trace(early)
    assert all(e["args"]["seq"] <= 3 for e in early["traceEvents"] if e["ph"] == "i")


def _hostile_logs(tmp_path, rid: str, reason: str) -> list[str]:
    paths = [str(tmp_path / "p.jsonl"), str(tmp_path / "d.jsonl")]
    with LogWriter(paths[0]) as p_log, LogWriter(paths[1]) as d_log:
        P = Ledger(Stream("prefill\n-0", Side.P, 0), LifecycleState(), p_log)
        D = Ledger(Stream("decode-0", Side.D, 0), LifecycleState(), d_log)
        P.record(Exported, rid, 1.0, lease_s=10.0, consumer_ranks=(0,), num_blocks=2,
                 token="secret-token")
        D.record(Admitted, rid, 1.1, remote_engine="prefill\n-0", remote_ranks=(0,),
                 num_blocks=2, lease_s=10.0, lease_margin_s=0.5, local_request_id=rid)
        D.record(Validated, rid, 1.1)
        D.record(HeartbeatSent, rid, 1.1)
        P.record(HeartbeatReceived, rid, 1.2, from_engine="decode-0", token="secret-token")
        D.record(LeaseAcknowledged, rid, 1.3, p_rank=0, sent_at=1.1, time_left=9.9)
        D.record(ReadsPosted, rid, 1.3, split_ranks=(0,))
        D.record(ClientCancelled, rid, 1.4)
        D.record(SplitCompleted, rid, 2.0, split=0)
        D.record(FinishedRecving, rid, 2.0)
        D.record(ReleaseSent, rid, 2.0)
        P.record(ReleaseNotified, rid, 2.1, from_engine="decode-0", consumer_rank=0,
                 token="secret-token")
        P.record(Freed, rid, 2.1)
        D.record(Admitted, "other", 3.0, remote_engine="prefill\n-0", remote_ranks=(0,),
                 num_blocks=2, lease_s=10.0, lease_margin_s=0.5, local_request_id="other")
        D.record(Rejected, "other", 3.0, reason=reason)
    return paths


def test_strings_from_the_log_stay_exact_in_json_and_escaped_in_the_svg(tmp_path, capsys):
    rid, reason = 'x"\n{"v":1}</text><script>\x1b[2J\u2028', "bad <geometry> & \"ids\"\r"
    paths = _hostile_logs(tmp_path, rid, reason)
    doc = _trace(tmp_path, capsys, paths)
    got = check_trace(doc, _times(paths))
    assert rid in got["threads"].values() and "prefill\n-0/P0" in got["processes"].values()
    assert [e["args"]["reason"] for e in doc["traceEvents"] if e.get("name") == "rejected"] == [
        reason]
    assert got["flows"] == {"heartbeat": 1, "ack": 1}
    assert b"secret-token" not in (tmp_path / "trace.json").read_bytes()
    svg_path = tmp_path / "t.svg"
    assert main(["replay", *paths, "--svg", str(svg_path)]) == 0
    assert "svg written to" in capsys.readouterr().out
    text = svg_path.read_text()
    root = ET.fromstring(text)  # well-formed XML: nothing from the log broke out
    assert root.tag.endswith("svg") and "<script" not in text and "\x1b" not in text
    shown = "".join(root.itertext())
    assert "x\"\\n{\"v\":1}</text><script>\\x1b[2J\\u2028" in shown
    assert 'rejected: bad <geometry> & "ids"\\r' in shown


def test_a_span_left_open_ends_at_its_streams_last_event(tmp_path):
    paths = _hostile_logs(tmp_path, "r", "why")
    events = [e for e in read_logs(paths) if e.kind not in ("freed", "release_sent")]
    tl = timeline(events)
    lease = next(s for s in tl.spans if s.name == "lease")
    request = next(s for s in tl.spans if s.name == "request" and s.request_id == "r")
    assert lease.end_args == {"open": True} and lease.end == 2.1  # P's last event
    assert request.end_args == {"open": True} and request.end == 3.0
    check_trace({"traceEvents": trace_events(tl)})


def _texts_and_bars(svg: str) -> tuple[list[list[str]], list[int]]:
    """Per panel, the text it shows; per panel, how many bars it draws."""
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    panels = [g for g in root.iter(f"{ns}g") if g.get("class") == "panel"]
    return ([["".join(t.itertext()) for t in g.iter(f"{ns}text")] for g in panels],
            [len(list(g.iter(f"{ns}rect"))) for g in panels])


def test_docs_show_the_current_cancel_during_read_picture():
    """The committed picture shows what the code draws now: the same labels and bars (the
    bars' lengths may differ by a simulator's rounding), and the story: under vllm-0.32 the
    splits run on after P freed, under kvhandoff they do not."""
    from kvhandoff.adapters.pictures import cancel_during_read_svg

    committed = (ROOT / "docs" / "img" / "cancel_during_read.svg").read_text()
    fresh = cancel_during_read_svg()
    redraw = "redraw with: python -m kvhandoff.adapters.pictures docs/img/cancel_during_read.svg"
    assert _texts_and_bars(committed) == _texts_and_bars(fresh), redraw
    (vllm, ours), _ = _texts_and_bars(fresh)
    assert vllm.count("read after P freed") == 2 and "lease expired" in vllm
    assert "read after P freed" not in ours and "lease expired" not in ours
    assert "cancel" in vllm and "cancel" in ours
    assert "img/cancel_during_read.svg" in (ROOT / "docs" / "lifecycle.md").read_text()
