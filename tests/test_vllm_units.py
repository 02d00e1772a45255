"""The vLLM adapter's pieces without engines: params, config, side channel, scheduler half."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
from conftest import wait_for
from hybrid_layouts import gemma_layout, one_group_layout
from structlog.testing import capture_logs

from kvhandoff.adapters.vllm.cluster import free_port, open_private_log
from kvhandoff.adapters.vllm.config import (
    ConnectorConfigError,
    HandoffConfig,
    default_log_dir,
    make_log_dir,
)
from kvhandoff.adapters.vllm.params import (
    DEBUG_HOLD_KEY,
    MalformedTransferParams,
    RemotePrefill,
    parse_identity,
    parse_remote_prefill,
)
from kvhandoff.adapters.vllm.side_channel import (
    HandshakeFailed,
    PeerIncompatible,
    SideChannelServer,
    check_compatible,
    handshake,
)

GOOD = RemotePrefill("P-1", "req-1", "127.0.0.1", 5600, 1, ((3, 4, 5),), 300, 30.0, token="t0k")


def test_an_engine_s_output_log_is_its_owner_s_alone_whatever_the_umask(tmp_path):
    """`vllm serve`'s and the engines' output (prompts; with --enable-log-requests the
    transfer parameters, release tokens included) goes to a new file made 0600."""
    old = os.umask(0)
    try:
        with open_private_log(tmp_path / "D.serve.log") as f:
            f.write(b"one\n")
        with open_private_log(tmp_path / "D.serve.log") as f:  # appends
            f.write(b"two\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "D.serve.log").stat().st_mode) == 0o600
    assert (tmp_path / "D.serve.log").read_bytes() == b"one\ntwo\n"


def test_params_round_trip():
    assert parse_remote_prefill(GOOD.to_wire()) == GOOD
    hybrid = RemotePrefill("P-1", "req-1", "127.0.0.1", 5600, 1, ((30, 31), (), (7,)), 300, 30.0)
    assert parse_remote_prefill(hybrid.to_wire()) == hybrid
    assert hybrid.to_wire()["remote_block_ids"] == [[30, 31], [], [7]]  # NixlConnector's shape
    held = RemotePrefill("P-1", "req-1", "127.0.0.1", 5600, 1, ((3,),), 300, 30.0, 2.5,
                         debug_hold_until_cancelled=True)
    assert parse_remote_prefill(held.to_wire()) == held
    assert DEBUG_HOLD_KEY not in GOOD.to_wire()  # off: not on the wire at all


@pytest.mark.parametrize("mutate, field", [
    (lambda p: p.pop("remote_block_ids"), "remote_block_ids"),
    (lambda p: p.update(remote_port="x"), "remote_port"),
    (lambda p: p.update(remote_port=70000), "remote_port"),
    (lambda p: p.update(remote_block_ids=[[1, -2]]), "remote_block_ids"),
    (lambda p: p.update(remote_block_ids=[[1, "2"]]), "remote_block_ids"),
    (lambda p: p.update(remote_block_ids=[[1, 1]]), "duplicate"),
    (lambda p: p.update(remote_block_ids=[[1], 2]), r"remote_block_ids'\]\[1\]: expected a list"),
    (lambda p: p.update(remote_block_ids=[[1], [2, 2]]), r"\[1\]\[1\]: duplicate block id 2"),
    (lambda p: p.update(remote_block_ids=[[]]), "remote_block_ids"),
    (lambda p: p.update(remote_block_ids=[]), "expected 1..64 lists"),
    (lambda p: p.update(remote_block_ids=[[1]] * 65), "expected 1..64 lists"),
    (lambda p: p.update(tp_size=True), "tp_size"),
    (lambda p: p.update(remote_engine_id=""), "remote_engine_id"),
    (lambda p: p.update(remote_num_tokens=0), "remote_num_tokens"),
    (lambda p: p.update(lease_s=-1), "lease_s"),
    (lambda p: p.update(protocol="nixl/14"), "protocol"),
    (lambda p: p.update(release_token=7), "release_token"),
    (lambda p: p.update(cache_layout_version=2), r"cache_layout_version'\]: expected 1, found 2"),
    (lambda p: p.pop("cache_layout_version"), "missing field 'cache_layout_version'"),
    (lambda p: p.update(cache_layout_version=True), r"cache_layout_version'\]: expected int"),
    (lambda p: p.update(cache_layout_version="1"), r"cache_layout_version'\]: expected int"),
    (lambda p: p.update({DEBUG_HOLD_KEY: 1}), r"hold_read_until_cancelled'\]: expected true or false"),
    (lambda p: p.update({DEBUG_HOLD_KEY: "yes"}), "hold_read_until_cancelled"),
    # Logged as text by D: a control character would forge or rewrite a log line.
    (lambda p: p.update(remote_request_id="r\x1b[2K\rvllm.worker.ok"), r"remote_request_id'\]: expected printable"),
    (lambda p: p.update(remote_request_id="r\u2028x"), "remote_request_id"),
    (lambda p: p.update(remote_engine_id="P\x85x"), r"remote_engine_id'\]: expected printable"),
    (lambda p: p.update(remote_host="h\x0bx"), "remote_host"),
    # D's trust list compares names case-folded: KELVIN SIGN folds to "k", and D would dial
    # another name than the one the list allowed
    (lambda p: p.update(remote_host="\u212av-prefill.internal"), r"remote_host'\]: expected an ASCII"),
    (lambda p: p.update(release_token="t\nx"), "release_token"),
])
def test_malformed_params_name_the_field(mutate, field):
    p = GOOD.to_wire()
    mutate(p)
    with pytest.raises(MalformedTransferParams, match=field):
        parse_remote_prefill(p)


def test_identity_survives_bad_block_ids_but_not_a_bad_port():
    p = {**GOOD.to_wire(), "remote_block_ids": "nonsense"}
    assert parse_identity(p) == ("P-1", "req-1", "127.0.0.1", 5600, "t0k")
    assert parse_identity({**p, "remote_port": "x"}) is None
    assert parse_identity("not a dict") is None
    for field in ("remote_engine_id", "remote_request_id", "remote_host"):  # logged as text
        assert parse_identity({**p, field: "x\x1b[2K\rforged"}) is None, field
    assert parse_identity({**p, "remote_host": "\u212av-prefill.internal"}) is None


def test_config_defaults_follow_the_lease():
    c = HandoffConfig.from_extra({"lease_s": 12}, env={})
    assert (c.lease_s, c.heartbeat_interval_s, c.lease_margin_s) == (12.0, 2.0, 1.0)
    assert c.side_channel_port == 5600 and c.failure_policy == "fail"
    assert HandoffConfig.from_extra({}, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "6100"}).side_channel_port == 6100


def test_the_default_log_dir_is_one_per_engine_whichever_process_parses_it(tmp_path, monkeypatch):
    # vLLM builds the connector in the scheduler's process and in each worker's, each
    # parsing the same extra config: the scheduler prints the log dir, the workers
    # write there, so every parse must name the same directory, and parsing creates none.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scheduler = HandoffConfig.from_extra({}, env={}, engine_id="prefill-a")
    worker = HandoffConfig.from_extra({}, env={}, engine_id="prefill-a")
    other = HandoffConfig.from_extra({}, env={}, engine_id="decode-b")
    uid = os.geteuid()
    assert scheduler.log_dir == worker.log_dir == str(tmp_path / f"kvhandoff-events-{uid}-prefill-a")
    assert other.log_dir == str(tmp_path / f"kvhandoff-events-{uid}-decode-b")
    assert list(tmp_path.iterdir()) == []
    assert HandoffConfig.from_extra({"log_dir": "/var/log/kvh"}, env={},
                                    engine_id="prefill-a").log_dir == "/var/log/kvh"


def test_the_default_log_dir_is_private_and_one_made_by_someone_else_is_refused(
        tmp_path, monkeypatch):
    """The default sits in a shared temp dir under a predictable name, and the logs hold
    release tokens: made mode 0700 (as mkdtemp did), and refused when it is not a private
    directory of this user's (someone made it first, or a link), never written into."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = default_log_dir("P-priv")
    make_log_dir(path, "P-priv")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    make_log_dir(path, "P-priv")  # the engine's other processes: the same directory, fine
    shared = default_log_dir("P-shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)  # another user's trap: anyone may write (or plant links) there
    with pytest.raises(ConnectorConfigError, match="log_dir.*mode drwxrwxrwx"):
        make_log_dir(shared, "P-shared")
    linked = default_log_dir("P-link")
    os.symlink(path, linked)
    with pytest.raises(ConnectorConfigError, match="log_dir"):
        make_log_dir(linked, "P-link")
    chosen = tmp_path / "var" / "log" / "kvh"  # what the operator set: made as given
    make_log_dir(str(chosen), "P-priv")
    assert chosen.is_dir()


def test_a_restart_within_the_same_second_keeps_every_predecessor_s_log(tmp_path):
    from kvhandoff.adapters.vllm.worker import _rotate_previous_log

    log = tmp_path / "E.P0.jsonl"
    for life in ("first", "second", "third"):
        log.write_text(life)
        _rotate_previous_log(str(log))
    assert not log.exists()
    kept = sorted(p.read_text() for p in tmp_path.iterdir())
    assert kept == ["first", "second", "third"]


@pytest.mark.parametrize("extra, policy, key", [
    ({"lease": 3}, "fail", "lease"),
    ({"lease_s": "3"}, "fail", "lease_s"),
    ({"lease_s": 0}, "fail", "lease_s"),
    ({"lease_s": 0.5}, "fail", "lease_s"),  # below MIN_LEASE_S: D would refuse its params
    ({"lease_s": 3, "heartbeat_interval_s": 3}, "fail", "heartbeat_interval_s"),
    ({"lease_margin_s": 0}, "fail", "lease_margin_s"),  # P frees at its deadline
    ({"failure_policy": "recompute"}, "fail", "failure_policy"),
    ({"failure_policy": "retry"}, "retry", "failure_policy"),
    ({"debug_read_delay_param": 1}, "fail", "debug_read_delay_param"),
    # vLLM reads --kv-transfer-config with json.loads, which takes NaN and Infinity: a NaN
    # passed every range check, then every handshake failed or P's notification thread died;
    # so did a wait past what a thread's wait takes (1e10 s), and a lease past what D takes.
    *(({key: bad}, "fail", key) for bad in (math.nan, math.inf, -math.inf, 10**400, 1e10, -1)
      for key in ("lease_s", "heartbeat_interval_s", "lease_margin_s", "read_timeout_s",
                  "handshake_timeout_s", "notif_poll_s", "idle_poll_s", "debug_read_delay_s")),
    ({"lease_s": 86401}, "fail", "lease_s"),  # D refuses parameters with a longer lease
    ({"notif_poll_s": 1e-6}, "fail", "notif_poll_s"),  # P's notification thread would spin
    ({"idle_poll_s": 0}, "fail", "idle_poll_s"),
    ({"lease_margin_s": 1e-12}, "fail", "lease_margin_s"),  # no margin at a clock of 1e6 s
])
def test_config_refuses_bad_values_at_start(extra, policy, key):
    with pytest.raises(ConnectorConfigError, match=key):
        HandoffConfig.from_extra(extra, policy, env={})


def test_every_setting_is_in_the_operator_guide_s_table_and_the_module_s():
    """Each `HandoffConfig` field is a row of docs/operator-guide.md's settings table and of
    the config module's docstring, and neither table names a setting that does not exist."""
    import dataclasses

    from kvhandoff.adapters.vllm import config

    guide = (pathlib.Path(__file__).parents[1] / "docs" / "operator-guide.md").read_text()
    names = {f.name for f in dataclasses.fields(HandoffConfig)}
    assert set(re.findall(r"^\| `(\w+)` \|", guide.split("## Settings", 1)[1], re.M)) >= names
    assert set(re.findall(r"^\| (\w+)\s+\|", config.__doc__, re.M)) - {"key"} == names


def test_config_takes_nan_and_infinity_from_the_json_vllm_reads_as_bad_values():
    extra = json.loads('{"handshake_timeout_s": NaN, "idle_poll_s": Infinity}')
    with pytest.raises(ConnectorConfigError,
                       match=r"handshake_timeout_s.*seconds in \[0, 86400\], found nan"):
        HandoffConfig.from_extra(extra, "fail", env={})


LAYOUT = one_group_layout(["l.0", "l.1"], 64, 128, 131072)
COMPAT = {"model": "m", "dtype": "torch.float32", "cache_dtype": "torch.float32", "block_size": 128,
          "num_kv_heads": 2, "head_size": 64, "num_layers": 2, "tp_size": 1,
          "cache_layout": LAYOUT.to_wire()}


def test_compat_mismatch_names_field_and_both_values():
    with pytest.raises(PeerIncompatible) as e:
        check_compatible(COMPAT, {**COMPAT, "head_size": 128}, "P-x")
    assert e.value.expected == 64 and e.value.found == 128 and "head_size" in str(e.value)


def test_a_peer_with_other_cache_groups_is_refused_naming_the_group_and_field():
    gemma = gemma_layout(64, 128, 131072, window=64, layers=2)
    other_window = gemma_layout(64, 128, 131072, window=32, layers=2)
    with pytest.raises(PeerIncompatible) as e:
        check_compatible({**COMPAT, "cache_layout": gemma.to_wire()},
                         {**COMPAT, "cache_layout": other_window.to_wire()}, "P-x")
    assert "cache group 0: window" in str(e.value) and (e.value.expected, e.value.found) == (64, 32)
    with pytest.raises(PeerIncompatible, match="number of groups"):
        check_compatible(COMPAT, {**COMPAT, "cache_layout": gemma.to_wire()}, "P-x")
    with pytest.raises(PeerIncompatible, match="field 'version'"):
        check_compatible(COMPAT, {**COMPAT, "cache_layout": {**LAYOUT.to_wire(), "version": 9}},
                         "P-x")
    with pytest.raises(PeerIncompatible, match="cache layout"):
        check_compatible(COMPAT, {k: v for k, v in COMPAT.items() if k != "cache_layout"}, "P-x")
    # pool sizes are each engine's own: not compared
    check_compatible(COMPAT, {**COMPAT, "cache_layout": one_group_layout(
        ["l.0", "l.1"], 999, 128, 131072).to_wire()}, "P-x")


def test_side_channel_handshake_swaps_metadata_and_refuses_mismatches():
    port = free_port()
    seen = []
    server = SideChannelServer("127.0.0.1", port, "P-1", 0, COMPAT,
                               lambda hello, md: (seen.append((hello["engine_id"], md)), b"P-META")[1])
    try:
        hello, md = handshake("127.0.0.1", port, "D-1", 0, COMPAT, b"D-META", 5.0)
        assert md == b"P-META" and hello["engine_id"] == "P-1" and seen == [("D-1", b"D-META")]
        with pytest.raises(HandshakeFailed, match="block_size"):
            handshake("127.0.0.1", port, "D-2", 0, {**COMPAT, "block_size": 16}, b"x", 5.0)
        with pytest.raises(HandshakeFailed, match="engine_id must be 1..256 printable"):
            handshake("127.0.0.1", port, "D-\x1b[2K", 0, COMPAT, b"x", 5.0)
        assert len(seen) == 1  # a refused peer is never added
    finally:
        server.close()
    with pytest.raises(HandshakeFailed, match="no answer"):
        handshake("127.0.0.1", free_port(), "D-1", 0, COMPAT, b"x", 0.3)


def test_p_answers_hellos_only_from_its_trusted_consumers():
    """With ``trusted_consumers`` set, a hello from any other address gets nothing: no
    metadata, no compatibility fields (which would let a stranger pass the check on its
    second try), no NIXL peer on P, and P logs the address."""
    from kvhandoff.adapters.vllm.trust import TrustedConsumers

    seen = []
    for entries, trusted in ((("10.0.0.0/8", "192.168.1.7"), False), (("127.0.0.1",), True),
                             (("10.0.0.0/8", "127.0.0.0/8"), True)):
        port = free_port()
        server = SideChannelServer("127.0.0.1", port, "P-1", 0, COMPAT,
                                   lambda hello, md: (seen.append(hello["engine_id"]), b"P-META")[1],
                                   TrustedConsumers(entries).allows)
        try:
            if trusted:
                assert handshake("127.0.0.1", port, "D-1", 0, COMPAT, b"D-META", 5.0)[1] == b"P-META"
                continue
            with capture_logs() as logs, pytest.raises(
                    HandshakeFailed, match="UntrustedConsumer: 127.0.0.1 is not in this P's "
                                           "trusted_consumers"):
                handshake("127.0.0.1", port, "D-1", 0, COMPAT, b"D-META", 5.0)
            assert [e["address"] for e in logs if e["event"] ==
                    "vllm.side_channel.untrusted_consumer"] == ["127.0.0.1"]
        finally:
            server.close()
    assert seen == ["D-1", "D-1"]


@pytest.mark.parametrize("entries", [["p0.example"], ["10.0.0.1:5600"], ["::1"], [7], []])
def test_trusted_consumers_take_ipv4_addresses_and_cidrs_only(entries):
    with pytest.raises(ConnectorConfigError, match="trusted_consumers"):
        HandoffConfig.from_extra({"trusted_consumers": entries}, env={})


def test_a_frame_over_the_limit_is_never_taken_and_p_goes_on_answering(monkeypatch):
    """ZMQ buffers a whole frame before P sees it: one past `MAX_FRAME_BYTES` drops its
    sender's connection (it never reaches P's hello handler) and the next D is served.
    D takes no such frame from P either."""
    from kvhandoff.adapters.vllm import side_channel

    limit = 1 << 16
    monkeypatch.setattr(side_channel, "MAX_FRAME_BYTES", limit)  # read when a socket is made
    port, seen, reply = free_port(), [], [b"P-META"]
    server = SideChannelServer("127.0.0.1", port, "P-1", 0, COMPAT,
                               lambda hello, md: (seen.append(len(md)), reply[0])[1])
    try:
        with pytest.raises(HandshakeFailed, match="no answer"):
            handshake("127.0.0.1", port, "D-big", 0, COMPAT, b"x" * (limit + 1), 1.0)
        hello, md = handshake("127.0.0.1", port, "D-1", 0, COMPAT, b"D-META", 5.0)
        assert md == b"P-META" and seen == [6]
        reply[0] = b"y" * (limit + 1)
        with pytest.raises(HandshakeFailed, match="no answer"):
            handshake("127.0.0.1", port, "D-2", 0, COMPAT, b"D-META", 1.0)
        assert seen == [6, 6]
    finally:
        server.close()


# ---- the scheduler half, with stand-ins for vLLM's request objects ----------

pytest.importorskip("vllm")


def _request(rid, prompt_len=300, params=None, status=None):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params,
                           prompt_token_ids=list(range(prompt_len)),
                           num_computed_tokens=prompt_len, status=status)


def _blocks(*groups, hashed=0):
    """vLLM's KVCacheBlocks for one list of ids per group (0 is the null block)."""
    return SimpleNamespace(blocks=tuple(
        [SimpleNamespace(block_id=b, block_hash=("h", b) if i < hashed else None, is_null=b == 0)
         for i, b in enumerate(ids)] for ids in groups))


def _sched(producer, layout=LAYOUT):
    from kvhandoff.adapters.vllm.scheduler import HandoffScheduler

    return HandoffScheduler(HandoffConfig.from_extra({}, env={}), "E", producer, layout, 1)


def test_decode_side_keeps_blocks_only_while_reads_are_in_flight():
    s = _sched(producer=False)
    early, inflight, drained = (_request(r, params=GOOD.to_wire()) for r in ("a", "b", "c"))
    for r in (early, inflight, drained):
        s.on_new_request(r)
        assert s.get_num_new_matched_tokens(r, 0) == (300, True)
    s.update_state_after_alloc(inflight, _blocks([7, 8, 9]), 300)
    s.update_state_after_alloc(drained, _blocks([1, 2, 3]), 300)
    assert s.get_num_new_matched_tokens(inflight, 0) == (0, False)  # one load per request
    plan = s.build_plan()
    assert [a.local_id for a in plan.admits] == ["a", "b", "c"]
    assert [(r.local_id, r.local_block_ids) for r in plan.reads] == [
        ("b", [[7, 8, 9]]), ("c", [[1, 2, 3]])]
    s.update_connector_output({"c"})
    assert s.request_finished(early, ([],)) == (False, None)  # never read: notify-only
    assert s.request_finished(inflight, ([7, 8, 9],)) == (True, None)  # reads own the pages
    assert s.request_finished(drained, ([1, 2, 3],)) == (False, None)
    assert s.build_plan().cancels == ["a", "b"]


def test_a_local_prefix_hit_is_skipped_not_overwritten():
    s = _sched(producer=False)
    r = _request("h", params=GOOD.to_wire())
    s.on_new_request(r)
    s.update_state_after_alloc(r, _blocks([40, 41, 42], hashed=2), 44)
    (read,) = s.build_plan().reads
    assert (read.local_block_ids, read.awaiting) == ([[42]], True)


def test_malformed_params_still_load_so_the_worker_can_fail_them():
    s = _sched(producer=False)
    r = _request("x", params={"do_remote_prefill": True, "remote_port": "x"})
    s.on_new_request(r)
    (admit,) = s.build_plan().admits
    assert admit.params is None and "remote_" in admit.error and admit.identity is None
    assert s.get_num_new_matched_tokens(r, 0) == (300, True)


def test_prefill_side_exports_with_a_token_or_reports_an_abort():
    from vllm.v1.request import RequestStatus

    s = _sched(producer=True)
    done = _request("p1", params={"do_remote_decode": True}, status=RequestStatus.FINISHED_LENGTH_CAPPED)
    gone = _request("p2", params={"do_remote_decode": True}, status=RequestStatus.FINISHED_ABORTED)
    for r in (done, gone):
        s.on_new_request(r)
        s.update_state_after_alloc(r, _blocks([1, 2, 3]), 0)
    delay, params = s.request_finished(done, ([4, 5, 6],))
    assert delay is True
    parsed = parse_remote_prefill(params)
    assert parsed.block_ids == ((4, 5, 6),) and parsed.engine_id == "E" and len(parsed.token) == 32
    assert s.request_finished(gone, ([1],)) == (False, None)
    plan = s.build_plan()
    assert plan.prefill_started == ["p1", "p2"] and plan.aborted == ["p2"]
    assert [(e.request_id, e.num_blocks, e.token) for e in plan.exports] == [("p1", 3, parsed.token)]


@pytest.mark.parametrize("client_id", ["a" * 260, "caf\x85e", "\x1b[2Jforged"])
def test_p_exports_no_request_id_that_d_would_refuse(client_id):
    """vLLM makes the request id from the client's X-Request-Id (``cmpl-<it>-<random>``):
    one D refuses (too long, not printable) would pin P's blocks a whole lease for nothing.
    P hands off nothing for it (vLLM frees the blocks; D computes the prompt itself) and
    says why, the id escaped."""
    from vllm.v1.request import RequestStatus

    s = _sched(producer=True)
    rid = f"cmpl-{client_id}-1234abcd"
    r = _request(rid, params={"do_remote_decode": True},
                 status=RequestStatus.FINISHED_LENGTH_CAPPED)
    prompt = list(r.prompt_token_ids)
    with capture_logs() as logs:
        s.on_new_request(r)
        s.update_state_after_alloc(r, _blocks([1, 2, 3]), 0)
        assert s.request_finished(r, ([4, 5, 6],)) == (False, None)
    assert r.prompt_token_ids == prompt  # not cut for a hand-off that will not happen
    plan = s.build_plan()
    assert not (plan.prefill_started or plan.exports or plan.aborted)
    (error,) = [e for e in logs if e["log_level"] == "error"]
    assert error["event"] == "vllm.connector.request_id_not_exportable"
    assert error["request_id"].isprintable() and "\x1b" not in error["request_id"]


@pytest.mark.parametrize("field", ["remote_port", "lease_s", "release_token", "protocol",
                                   "kvhandoff_fence_slot", "remote_host", "do_remote_prefill"])
def test_d_logs_a_client_s_request_id_escaped_and_a_huge_field_bounded(field):
    """vLLM's request id carries the client's text (``cmpl-<it>-<random>``) and D logged it
    raw: under ``vllm serve`` structlog's console renderer writes an ESC sequence as it is,
    so a client could erase a line and draw its own.  And a 10 MB field came back whole in
    the error, logged and pickled to every worker each step."""
    s = _sched(producer=False)
    rid = "cmpl-\x1b[1A\x1b[2K\x1b[1Gforged\u2028line\x85-0-deadbeef"
    params = GOOD.to_wire()
    params[field] = "A" * 10_000_000
    with capture_logs() as logs:
        s.on_new_request(_request(rid, params=params))
    (line,) = logs
    assert line["event"] == "vllm.scheduler.malformed_transfer_params"
    for value in line.values():
        if isinstance(value, str):
            assert value.isprintable() and len(value) < 1000, value[:200]
    assert line["request_id"] == "cmpl-\\x1b[1A\\x1b[2K\\x1b[1Gforged\\u2028line\\x85-0-deadbeef"
    (admit,) = s.build_plan().admits
    assert field in admit.error and len(admit.error) < 1000


def test_an_export_that_raises_ends_ps_record_and_exports_nothing():
    """P's ``request_finished`` raises while exporting (here: block lists that do not
    match the layout): nothing is exported, vLLM frees the pages, and P's worker hears
    the abort, so the record it started does not stay live for ever."""
    from vllm.v1.request import RequestStatus

    s = _sched(producer=True)
    r = _request("p3", params={"do_remote_decode": True},
                 status=RequestStatus.FINISHED_LENGTH_CAPPED)
    s.on_new_request(r)
    s.update_state_after_alloc(r, _blocks([1, 2, 3]), 0)
    with capture_logs() as logs:
        assert s.request_finished(r, ([4, 5, 6], [7])) == (False, None)  # one group too many
    assert [e["event"] for e in logs if e["log_level"] == "error"] == [
        "vllm.scheduler.request_error"]
    plan = s.build_plan()
    assert plan.prefill_started == ["p3"] and plan.aborted == ["p3"] and not plan.exports
    assert s.request_finished(r, ([4, 5, 6],)) == (False, None)  # forgotten: asked again, nothing


def test_each_live_export_holds_one_fence_slot_given_back_when_p_freed_it():
    from vllm.v1.request import RequestStatus

    from kvhandoff.adapters.vllm.params import FENCE_SLOT_KEY

    s = _sched(producer=True)

    def export(rid):
        r = _request(rid, params={"do_remote_decode": True},
                     status=RequestStatus.FINISHED_LENGTH_CAPPED)
        s.on_new_request(r)
        return s.request_finished(r, ([4, 5, 6],))[1]

    first, second = export("f1"), export("f2")
    assert first[FENCE_SLOT_KEY] != second[FENCE_SLOT_KEY]
    # The same id again while its first life holds a slot (only without vLLM's id
    # randomization; P refuses that export): no second slot, which would never come back.
    again = export("f1")
    assert FENCE_SLOT_KEY not in again
    s.update_connector_output(None, {"f1", "f2"})  # every P rank freed both
    assert sorted(s.fence.take() for _ in range(2)) == sorted(
        [first[FENCE_SLOT_KEY], second[FENCE_SLOT_KEY]])  # both back, none lost


GEMMA = gemma_layout(64, 16, 4096, window=32)  # 16-token blocks, a 32-token window


def _prompt_request(rid, n, params, status=None):
    r = _request(rid, prompt_len=n, params=params, status=status)
    r.num_prompt_tokens, r._all_token_ids, r.max_tokens = n, list(range(n)), 50
    return r


def test_hybrid_prefill_leaves_the_last_token_to_d_and_exports_only_what_d_reads():
    from vllm.v1.request import RequestStatus

    p = _sched(producer=True, layout=GEMMA)
    r = _prompt_request("p1", 100, {"do_remote_decode": True},
                        status=RequestStatus.FINISHED_LENGTH_CAPPED)
    p.on_new_request(r)
    p.on_new_request(r)  # rescheduled after a preemption: truncated once only
    assert (len(r.prompt_token_ids), r.num_prompt_tokens, len(r._all_token_ids), r.max_tokens) == (
        99, 99, 99, 1)
    r.num_computed_tokens = 99  # 7 blocks; the window keeps tokens 68.. = positions 4, 5, 6
    delay, params = p.request_finished(r, ([0, 0, 0, 0, 30, 31, 9], [10, 11, 12, 13, 14, 15, 16]))
    assert delay is True and params["remote_num_tokens"] == 99
    assert params["remote_block_ids"] == [[30, 31, 9], [10, 11, 12, 13, 14, 15, 16]]
    assert p.build_plan().exports[0].num_blocks == 10  # one lease over both groups

    d = _sched(producer=False, layout=GEMMA)
    q = _prompt_request("d1", 100, {**parse_remote_prefill(params).to_wire()})
    d.on_new_request(q)
    assert d.get_num_new_matched_tokens(q, 0) == (99, True)  # D computes token 99 itself
    # vLLM's D blocks: the window's out-of-range positions are null at allocation; a block
    # allocated past the loaded tokens' last one is not a target.
    d.update_state_after_alloc(q, _blocks([0, 0, 0, 0, 40, 41, 42], [50, 51, 52, 53, 54, 55, 56, 57]),
                               99)
    (read,) = d.build_plan().reads
    assert read.local_block_ids == [[40, 41, 42], [50, 51, 52, 53, 54, 55, 56]]


def test_a_local_prefix_hit_that_reaches_into_the_window_reads_only_the_rest():
    """D holds the first 5 blocks from its own prefix cache; the window (positions 4-6) starts
    inside that hit: D reads positions 5 and 6 of both groups, into its new blocks."""
    from kvhandoff.core.planning import plan_group_reads

    d = _sched(producer=False, layout=GEMMA)
    remote = ((30, 31, 9), (10, 11, 12, 13, 14, 15, 16))
    params = RemotePrefill("P-1", "req-h", "127.0.0.1", 5600, 1, remote, 99, 30.0).to_wire()
    q = _prompt_request("d2", 100, params)
    d.on_new_request(q)
    d.update_state_after_alloc(q, _blocks([0, 0, 0, 0, 24, 41, 42], [20, 21, 22, 23, 25, 55, 56],
                                          hashed=5), 19)
    (read,) = d.build_plan().reads
    assert read.local_block_ids == [[41, 42], [55, 56]]
    plan = plan_group_reads(GEMMA, GEMMA, remote, read.local_block_ids, 99, null_block=0)
    assert [(r.group, r.remote_ids, r.local_ids) for r in plan.reads] == [
        (0, (31, 9), (41, 42)), (1, (15, 16), (55, 56))]


def test_a_plain_model_loads_the_whole_prompt_and_p_keeps_it_whole():
    p = _sched(producer=True)
    r = _prompt_request("p1", 300, {"do_remote_decode": True})
    p.on_new_request(r)
    assert len(r.prompt_token_ids) == 300 and r.max_tokens == 50  # no backoff: full attention
    d = _sched(producer=False)
    q = _request("d1", params=GOOD.to_wire())
    d.on_new_request(q)
    assert d.get_num_new_matched_tokens(q, 0) == (300, True)


def test_connector_stats_aggregate_and_export_to_prometheus():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvhandoff.adapters.vllm import stats as kstats

    a, b = kstats.empty(), kstats.empty()
    a.update(reads_completed=2, bytes_read=3 << 20, read_s=[0.001, 0.002], read_bytes=[1 << 20, 2 << 20])
    b.update(reads_completed=1, leases_expired=1, read_s=[0.004], read_bytes=[0])
    cls = kstats.stats_class()
    merged = cls(data=a).aggregate(cls(data=b))
    summary = merged.reduce()
    assert summary["reads_completed"] == 3 and summary["leases_expired"] == 1
    assert summary["read_ms_median"] == 2.0 and round(summary["read_GBps_median"], 2) == 1.05

    registry = CollectorRegistry()

    def bound(kind):
        return lambda **kw: kind(registry=registry, **kw)

    prom = kstats.prom_metrics_class()(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)},
        ["engine"], {0: ["0"]})
    prom.observe(merged.data, 0)
    assert registry.get_sample_value("vllm:kvhandoff_reads_completed_total", {"engine": "0"}) == 3
    assert registry.get_sample_value("vllm:kvhandoff_read_seconds_count", {"engine": "0"}) == 3


class _Exploding(dict):
    """kv_transfer_params whose reading raises: a stand-in for any bug a request can trigger."""

    def get(self, *a, **k):
        raise RuntimeError("boom")


def test_a_scheduler_hook_that_raises_fails_only_its_request():
    s = _sched(producer=False)
    bad, good = _request("bad", params=_Exploding(GOOD.to_wire())), _request("ok", params=GOOD.to_wire())
    with capture_logs() as logs:
        s.on_new_request(bad)  # must not raise into vLLM
        s.on_new_request(good)
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["vllm.scheduler.request_error"]
    assert s.get_num_new_matched_tokens(bad, 0) == (300, True)  # loads, so the worker fails it
    plan = s.build_plan()
    assert [f.local_id for f in plan.failures] == ["bad"] and "boom" in plan.failures[0].reason
    assert [a.local_id for a in plan.admits] == ["ok"]
    s.update_state_after_alloc(bad, None, 300)  # blocks=None: the hook raises, contained
    (f,) = s.build_plan().failures
    assert f.local_id == "bad" and f.awaiting
    assert s.request_finished(bad, ([1],)) == (True, None)  # vLLM waits for the failure report


def test_the_clean_up_request_is_marked_and_keeps_its_identity():
    s = _sched(producer=False)
    r = _request("cmpl-1", params=GOOD.to_wire(), prompt_len=1)
    r.abort_immediately = True  # vLLM's notify_kv_transfer_request_rejected
    s.on_new_request(r)
    (admit,) = s.build_plan().admits
    assert admit.cleanup and admit.identity[:2] == (GOOD.engine_id, GOOD.request_id)
    assert s.request_finished(r, ([],)) == (False, None)
    assert s.build_plan().cancels == ["cmpl-1"]


@pytest.mark.parametrize(("entries", "host", "port", "allowed"), [
    (None, "127.0.0.1", 5600, True), (None, "localhost", 1, True),
    (None, "10.0.0.11", 5600, False), (None, "evil.example", 5600, False),
    (["10.0.0.0/24:5600"], "10.0.0.11", 5600, True), (["10.0.0.0/24:5600"], "10.0.0.11", 5601, False),
    (["p0.example"], "P0.example", 7, True),
    # What D could never dial as written, or would dial somewhere else:
    (None, "::1", 9, False), (None, "::1%;192.0.2.1", 5600, False),
    (["127.0.0.0/8"], "127.0.0.1%eth0", 5600, False), (["127.0.0.1"], "127.0.0.1", 65536, False),
    (["127.0.0.1"], "127.0.0.1", 0, False), (["localhost"], "localhost:99", 5600, False),
    (["127.0.0.0/8"], "127.1", 5600, False),
])
def test_trusted_producers(entries, host, port, allowed):
    from kvhandoff.adapters.vllm.trust import TrustedProducers, UntrustedProducer

    extra = {} if entries is None else {"trusted_producers": entries}
    t = TrustedProducers(HandoffConfig.from_extra(extra, env={}).trusted_producers)
    assert t.allows(host, port) is allowed
    for _ in range(2):  # the same answer again (check remembers only what it passed)
        if not allowed:
            with pytest.raises(UntrustedProducer, match="trusted_producers"):
                t.check(host, port)
        else:
            t.check(host, port)


def test_a_passed_address_does_not_vouch_for_one_that_compares_equal():
    """`check` remembers what it passed: a port of True (== 1) is still refused."""
    from kvhandoff.adapters.vllm.trust import TrustedProducers, UntrustedProducer

    t = TrustedProducers(HandoffConfig.from_extra({"trusted_producers": ["127.0.0.1:1"]},
                                                  env={}).trusted_producers)
    t.check("127.0.0.1", 1)
    with pytest.raises(UntrustedProducer, match="out of range"):
        t.check("127.0.0.1", True)


@pytest.mark.parametrize("bad", [[], "127.0.0.1", [3], ["x:99999"], ["a/b"], ["[::1]x"], ["::1"],
                                 ["[::1]:7"], ["fe80::/10"], ["fe80::1%eth0"], ["p0;p1"],
                                 ["p0.example,p1.example"], ["p0..example"]])
def test_bad_trusted_producers_refused_at_start(bad):
    with pytest.raises(ConnectorConfigError, match="trusted_producers"):
        HandoffConfig.from_extra({"trusted_producers": bad}, env={})


def test_trusted_producers_from_the_environment_replace_the_default():
    from kvhandoff.adapters.vllm.trust import TrustedProducers

    env = {"KVHANDOFF_TRUSTED_PRODUCERS": "10.0.0.11:5600, p0.example:5601,10.0.1.0/24"}
    t = TrustedProducers(HandoffConfig.from_extra({}, env=env).trusted_producers)
    for host, port, allowed in [("10.0.0.11", 5600, True), ("10.0.0.11", 5601, False),
                                ("p0.example", 5601, True), ("p0.example", 5600, False),
                                ("10.0.1.7", 9, True), ("10.0.2.7", 5600, False),
                                ("127.0.0.1", 5600, False)]:  # not loopback any more
        assert t.allows(host, port) is allowed, (host, port)


def test_the_extra_config_wins_over_the_environment():
    from kvhandoff.adapters.vllm.trust import TrustedProducers

    for value in ("10.0.0.11:5600", "not a host"):  # the variable is not even read
        cfg = HandoffConfig.from_extra({"trusted_producers": ["10.0.0.12:5600"]},
                                       env={"KVHANDOFF_TRUSTED_PRODUCERS": value})
        t = TrustedProducers(cfg.trusted_producers)
        assert t.allows("10.0.0.12", 5600) and not t.allows("10.0.0.11", 5600)


@pytest.mark.parametrize("bad", ["", " ", "10.0.0.11:70000", "10.0.0.11,,10.0.0.12", "10.0.0.11,",
                                 "::1", "10.0.0.11,fe80::1%eth0", "10.0.0.0/24:x", "a b",
                                 "10.0.0.11;10.0.0.12"])
def test_bad_trusted_producers_in_the_environment_refused_at_start(bad):
    with pytest.raises(ConnectorConfigError,
                       match="environment variable KVHANDOFF_TRUSTED_PRODUCERS: expected "):
        HandoffConfig.from_extra({}, env={"KVHANDOFF_TRUSTED_PRODUCERS": bad})


class _RefusingList(list):
    def append(self, item):
        raise RuntimeError("injected: the plan refuses the cancel")


def test_request_finished_that_raises_never_frees_pages_a_read_may_own():
    s = _sched(producer=False)
    r = _request("reading", params=GOOD.to_wire())
    s.on_new_request(r)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, _blocks([4, 5]), 300)  # a READ into blocks 4, 5 goes out
    s.build_plan()
    s._plan.cancels = _RefusingList()
    with capture_logs() as logs:
        assert s.request_finished(r, ([4, 5],)) == (True, None)  # delay the free: the READ owns them
    assert [e["event"] for e in logs if e["log_level"] == "error"] == [
        "vllm.scheduler.request_error", "vllm.scheduler.cancel_not_planned"]
    s._plan.cancels = []
    idle = _request("idle", params=GOOD.to_wire())  # never allocated: nothing to protect
    s.on_new_request(idle)
    s._plan.cancels = _RefusingList()
    assert s.request_finished(idle, ([],)) == (False, None)


@pytest.mark.parametrize("lease", [float("inf"), float("nan"), 86400.5, 0.999, 1e-6])
def test_a_lease_d_could_not_remember_or_heartbeat_is_refused(lease):
    """Too long to remember (single-use), or so short that D would heartbeat its P rank
    (naming every request it holds there) at every poll."""
    with pytest.raises(MalformedTransferParams, match="lease_s"):
        parse_remote_prefill({**GOOD.to_wire(), "lease_s": lease})


def test_write_tokenizer_leaves_unchanged_files_alone(tmp_path):
    from kvhandoff.adapters.vllm.tiny_model import write_tokenizer

    write_tokenizer(tmp_path)
    stamps = {f.name: f.stat().st_mtime_ns for f in tmp_path.iterdir()}
    for f in tmp_path.iterdir():
        os.utime(f, ns=(1, 1))  # an engine reading them must not see them rewritten
    write_tokenizer(tmp_path)
    assert {f.name: f.stat().st_mtime_ns for f in tmp_path.iterdir()} == dict.fromkeys(stamps, 1)


_SIGNAL_CHILD = r"""
import signal, sys, threading
from pathlib import Path
from kvhandoff.adapters.vllm import connector
from kvhandoff.adapters.vllm.config import HandoffConfig
from kvhandoff.adapters.vllm.worker import HandoffWorker
from kvhandoff.core.events import PrefillStarted, Side

log_dir, previous = sys.argv[1], sys.argv[2]
if previous == "python":
    def handler(signum, frame):
        Path(log_dir, "previous-ran").write_text(str(signum))
        sys.exit(3)
    signal.signal(signal.SIGTERM, handler)
elif previous == "none":  # a handler not installed from Python reads as None
    real = signal.getsignal
    signal.getsignal = lambda sig: None if sig == signal.SIGTERM else real(sig)
w = HandoffWorker(HandoffConfig.from_extra({"log_dir": log_dir}, env={}), "E", Side.P, 0, 1, {})
connector._WORKERS.add(w)
off_main = threading.Thread(target=connector._flush_on_exit)  # cannot set signal handlers
off_main.start()
off_main.join()
if getattr(connector._flush_on_exit, "installed", False):
    sys.exit(10)  # claimed installed: the main thread's call below would do nothing
connector._flush_on_exit()
for i in range(50):  # recorded, never flushed: they sit in the writer's buffer
    w.ledger.record(PrefillStarted, f"r{i}", float(i))
Path(log_dir, "ready").write_text(str(Path(w.log_path).stat().st_size))
threading.Event().wait(60)
sys.exit(0)  # never reached: the signal ends the process
"""


def test_sigterm_flushes_the_log_then_does_what_the_previous_handler_would(tmp_path):
    """One child per previous handler (run side by side: each imports vLLM's connector base)."""
    pytest.importorskip("vllm")
    from kvhandoff.core.log import read_log

    expected = {"python": 3, "default": -signal.SIGTERM, "none": -signal.SIGTERM}
    children = {}
    try:
        for previous in expected:
            (tmp_path / previous).mkdir()
            children[previous] = subprocess.Popen(
                [sys.executable, "-c", _SIGNAL_CHILD, str(tmp_path / previous), previous],
                stdout=subprocess.DEVNULL)
        for previous, child in children.items():
            ready = wait_for(lambda d=tmp_path / previous: (d / "ready").exists()
                             and (d / "ready").read_text(), 300, f"the {previous!r} child")
            assert ready == "0", ready  # nothing on disk before the signal
            child.send_signal(signal.SIGTERM)
        for previous, child in children.items():
            assert child.wait(timeout=60) == expected[previous], previous
            evs = read_log(tmp_path / previous / "E.P0.jsonl")
            assert [e.request_id for e in evs] == [f"r{i}" for i in range(50)], previous
            assert (tmp_path / previous / "previous-ran").exists() is (previous == "python")
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()


# ---- failure classes: bounded labels; the monitoring docs name real metrics ----

HOSTILE_REASON = 'geometry"} 1\nvllm:kvhandoff_evil_total{reason="pwned'


def _d_worker(tmp_path):
    from kvhandoff.adapters.vllm.worker import HandoffWorker
    from kvhandoff.core.events import Side

    return HandoffWorker(HandoffConfig.from_extra({"log_dir": str(tmp_path)}, env={}), "D-m",
                         Side.D, 0, 1, COMPAT)


def _prom(registry, labelnames=("engine",)):
    from prometheus_client import Counter, Gauge, Histogram

    from kvhandoff.adapters.vllm import stats as kstats

    def bound(kind):
        return lambda **kw: kind(registry=registry, **kw)
    return kstats.prom_metrics_class()(
        SimpleNamespace(kv_transfer_config=None),
        {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)},
        list(labelnames), {0: ["0"] * len(labelnames)})


def test_rejections_are_counted_by_a_bounded_class_whatever_the_request_says(tmp_path, monkeypatch):
    import time

    from prometheus_client import CollectorRegistry

    from kvhandoff.adapters.vllm import consumer
    from kvhandoff.adapters.vllm import stats as kstats
    from kvhandoff.adapters.vllm.metadata import Admit, StepPlan
    from kvhandoff.core.errors import GeometryMismatch

    # The class comes from the error's type, never from its text.
    assert consumer.reject_class(MalformedTransferParams(HOSTILE_REASON)) == "malformed_params"
    assert consumer.reject_class(RuntimeError("untrusted_producer")) == "other"
    assert consumer.reject_class(GeometryMismatch("x", 1, 2)) == "geometry"
    assert consumer.reject_class(HandshakeFailed("no answer")) == "handshake_failed"
    with pytest.raises(PeerIncompatible) as version:
        check_compatible(COMPAT, {**COMPAT, "cache_layout": {**LAYOUT.to_wire(), "version": 9}}, "P")
    assert consumer.reject_class(version.value) == "layout_version"
    with pytest.raises(PeerIncompatible) as head:
        check_compatible(COMPAT, {**COMPAT, "head_size": 128}, "P")
    assert consumer.reject_class(head.value) == "incompatible_peer"
    assert kstats.failure_key("rejected", HOSTILE_REASON) == "rejected_other"
    assert kstats.failure_key("reads_refused", "CONFIRMED") == "reads_refused_failed"

    # Through D's worker, as the scheduler hands requests over.
    w = _d_worker(tmp_path)
    untrusted = {**GOOD.to_wire(), "remote_host": "10.9.9.9"}
    version_error = ("kv_transfer_params['cache_layout_version']: expected 1, found 2 (P and D "
                     "run different kvhandoff versions)")
    w._d_plan(StepPlan(admits=[
        Admit("a", None, HOSTILE_REASON, 300),  # the scheduler's text, with no identity
        Admit("b", None, "kv_transfer_params['remote_port']: expected int, found str "
                         f"{version_error!r}", 300),
        Admit("c", None, version_error, 300),
        Admit("d", untrusted, "", 300),
    ]), time.monotonic())
    # A P rank whose handshake fails: its waiting requests take the handshake's class.
    w.transport = SimpleNamespace(metadata=lambda: b"D-META", lost_peers=lambda: [],
                                  close=lambda: None)

    def refused(*args):
        check_compatible(COMPAT, {**COMPAT, "cache_layout": {**LAYOUT.to_wire(), "version": 9}}, "P")
    monkeypatch.setattr(consumer, "handshake", refused)
    w._d_plan(StepPlan(admits=[Admit("e", GOOD.to_wire(), "", 300)]), time.monotonic())
    wait_for(lambda: all(b["done"].is_set() for b in w._handshakes.values()), 10, "the handshake")
    w._finish_handshakes(time.monotonic())
    w._d_plan(StepPlan(admits=[Admit("f", {**GOOD.to_wire(), "remote_request_id": "req-2"}, "",
                                     300)]), time.monotonic())  # refused for 10 s, same class
    stats = w.take_stats()
    counted = {k: v for k, v in stats.items() if k.startswith("rejected_") and v}
    assert counted == {"rejected_malformed_params": 2, "rejected_layout_version": 3,
                       "rejected_untrusted_producer": 1}, counted
    assert stats["rejected"] == 6
    assert set(stats) <= {*kstats.COUNTERS, *kstats.FAILURE_KEYS, "read_s", "read_bytes"}
    w.close()

    # Exported: one counter per family, its label values the bounded set and nothing else.
    registry = CollectorRegistry()
    prom = _prom(registry)
    prom.observe({**stats, f"rejected_{HOSTILE_REASON}": 5, "reads_refused_unsafe": 1,
                  "reads_refused_PWNED": 7}, 0)
    reasons = {s.labels["reason"]: s.value for m in registry.collect()
               for s in m.samples if s.name == "vllm:kvhandoff_rejected_by_reason_total"}
    assert set(reasons) == set(kstats.REJECT_REASONS)
    assert reasons["layout_version"] == 3 and reasons["other"] == 0  # the hostile key: not read
    verdicts = {s.labels["verdict"]: s.value for m in registry.collect()
                for s in m.samples if s.name == "vllm:kvhandoff_reads_refused_total"}
    assert verdicts == {"unsafe": 1, "unproven": 0, "failed": 0}
    assert registry.get_sample_value("vllm:kvhandoff_rejected_total", {"engine": "0"}) == 6


def test_p_counts_a_heartbeat_that_came_after_the_lease_ran_out():
    from kvhandoff.core.events import Side, Stream
    from kvhandoff.core.messages import Heartbeat
    from kvhandoff.core.producer import ProducerEngine

    e = ProducerEngine(Stream("P", Side.P, 0), 10.0)

    def hb(rid, token="tok"):
        return Heartbeat("D", 0, 0.0, (rid,), (token,))
    for rid in ("r1", "r2", "r3"):
        e.prefill_started(rid, 0.0)
        e.exported(rid, 0.0, 4, (0,), "tok")
    e.on_notification("D-agent", hb("r1"), 9.0)  # in time
    assert e.counts["heartbeats_late"] == 0
    e.on_notification("D-agent", hb("r2"), 10.5)  # past the deadline, not reaped yet
    assert e.counts["heartbeats_late"] == 1  # (late, but P still held it: the lease goes on)
    assert e.poll(11.0).expired == ["r3"]
    e.on_notification("D-agent", hb("r3", token="guess"), 12.0)  # not its D: not counted
    e.on_notification("stranger", hb("r1"), 30.0)  # r1 bound to D-agent by its heartbeat
    assert e.counts["heartbeats_late"] == 1
    e.on_notification("D-agent", hb("r3"), 12.0)  # reaped, then its D's heartbeat
    assert e.counts["heartbeats_late"] == 2


def monitoring_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every query in docs/monitoring: the dashboard's and the alert rules'."""
    import json
    from pathlib import Path

    import yaml

    docs = Path(__file__).resolve().parent.parent / "docs" / "monitoring"
    out = []
    dash = json.loads((docs / "kvhandoff-dashboard.json").read_text())
    panels = list(dash["panels"])
    while panels:
        panel = panels.pop(0)
        panels += panel.get("panels", [])
        out += [(f"dashboard {panel['title']!r}", t["expr"]) for t in panel.get("targets", [])]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):  # label_values(SELECTOR, LABEL): the selector is PromQL
            selector = query["query"].removeprefix("label_values(").rsplit(",", 1)[0]
            out.append((f"dashboard variable {var['name']!r}", selector))
    rules = yaml.safe_load((docs / "kvhandoff-alerts.yml").read_text())
    out += [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    return out


_PROMQL_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                    "group_right", "bool", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (enough PromQL for docs/monitoring)."""
    import re

    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.:$])[A-Za-z_:][\w:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group().lower() in _PROMQL_KEYWORDS:
            continue  # a function or an aggregation, or a keyword
        names.add(m.group())
    return names


def test_promql_metric_names_finds_what_a_query_selects():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, instance) (rate(vllm:a_bucket{x=~"a|b"}[5m]))) '
        '/ on (instance) group_left sum without (reason) (vllm:b_total offset 5m) > 1e-9 '
        'unless count(c) > bool 0') == {"vllm:a_bucket", "vllm:b_total", "c"}


def test_the_monitoring_docs_name_only_metrics_the_connector_exports():
    """Offline half of the check (tests/test_vllm_serve.py asks real engines' /metrics)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    _prom(registry, ("model_name", "engine"))
    exported = {s.name for m in registry.collect() for s in m.samples}
    named = {n for _, expr in monitoring_expressions() for n in promql_metric_names(expr)}
    ours = {n for n in named if n.startswith("vllm:kvhandoff_")}
    assert ours and ours <= exported, sorted(ours - exported)
    assert named - ours <= {"vllm:request_success_total"}, named - ours  # vLLM's own
    # every failure family is watched by some alert
    alerts = " ".join(expr for where, expr in monitoring_expressions() if where.startswith("alert"))
    for name in ("rejected_by_reason", "reads_refused", "leases_expired", "heartbeats_late",
                 "heartbeats_sent_late", "log_write_errors", "refused_events"):
        assert f"vllm:kvhandoff_{name}_total" in alerts, name


def test_a_free_port_is_outside_the_kernels_ephemeral_range_and_so_are_the_next():
    """A port the kernel may hand an outgoing connection before the engine binds it is
    where NixlConnector's side channel failed with "Address already in use"."""
    from kvhandoff.adapters.vllm.cluster import ephemeral_ports

    for _ in range(20):
        port = free_port()
        assert port not in ephemeral_ports() and port + 1 not in ephemeral_ports()
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + 1))
    # on another loopback "host" (tests/two_hosts.py), one port per TP rank
    port = free_port("127.0.0.2", 3)
    assert not {port, port + 1, port + 2} & set(ephemeral_ports())
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        for s, k in ((a, 0), (b, 1), (c, 2)):
            s.bind(("127.0.0.2", port + k))


def test_what_a_serving_engine_keeps_for_its_timings_and_medians_is_bounded():
    """Under `vllm serve` nobody takes the scheduler's timings, and a worker's cumulative
    READ samples live as long as the engine: both keep only the newest."""
    from kvhandoff.adapters.vllm import stats as kstats
    from kvhandoff.adapters.vllm import timing

    saved = dict(timing._TIMINGS)
    timing._TIMINGS.clear()
    try:
        for i in range(timing.KEEP + 10):
            timing.note(f"r{i}", "scheduled", float(i))
        assert len(timing._TIMINGS) == timing.KEEP and "r0" not in timing._TIMINGS
        timing.note(f"r{timing.KEEP + 9}", "recved", 1e6)
        assert timing.transfer_ms(timing.take(f"r{timing.KEEP + 9}")) == (1e6 - timing.KEEP - 9) * 1e3
    finally:
        timing._TIMINGS.clear()
        timing._TIMINGS.update(saved)
    data = kstats.empty()
    for i in range(10 * kstats.READ_SAMPLES):
        kstats.add_read(data, i * 1e-3, 1 << 20)
    assert kstats.READ_SAMPLES <= len(data["read_s"]) == len(data["read_bytes"]) <= 2 * kstats.READ_SAMPLES
    assert data["read_s"][-1] == (10 * kstats.READ_SAMPLES - 1) * 1e-3  # the newest are kept


def test_the_older_get_finished_never_reports_a_failed_read_as_received():
    """vLLM 0.32 and 0.33 call get_transfer_results; a caller of the older get_finished
    cannot hear of a failed READ, so it is held back (and logged), never reported received."""
    from kvhandoff.adapters.vllm.connector import KVHandoffConnector

    connector = object.__new__(KVHandoffConnector)  # only its worker's report is needed
    connector.worker = SimpleNamespace(finish_step=lambda: ({"p1"}, {"d1", "d2"}, {"d2"}))
    with capture_logs() as logs:
        assert connector.get_finished(set()) == ({"p1"}, {"d1"})
    (entry,) = [e for e in logs if e["log_level"] == "error"]
    assert entry["event"] == "vllm.connector.failed_reads_withheld" and entry["request_ids"] == ["d2"]


@pytest.mark.parametrize("engine_id", ["../../home/x", "a/b", "..", "e\x00"])
def test_an_engine_id_that_is_not_one_path_component_is_refused_at_start_up(engine_id):
    """The engine id names the event log's file and the default log_dir."""
    from kvhandoff.adapters.vllm.config import UnsupportedTopology
    from kvhandoff.adapters.vllm.connector import _check_topology

    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_role="kv_producer", engine_id=engine_id))
    with pytest.raises(UnsupportedTopology, match=re.escape(f"engine_id={engine_id!r}")):
        _check_topology(cfg, None)
