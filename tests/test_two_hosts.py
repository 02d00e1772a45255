"""The multi-node path on one machine: the connector's worker pair as two hosts.

P's worker ranks run in one process whose side channel and advertised
address are ``127.0.0.2`` (set through ``VLLM_NIXL_SIDE_CHANNEL_HOST``, as
vLLM's NixlConnector users do), D's in another on ``127.0.0.1`` whose
``trusted_producers`` names P's address and ports only, and both run UCX on
its network transport alone (`two_hosts.UCX_ENV`).  Every READ's bytes are
checked, and UCX's own protocol report (``UCX_PROTO_INFO``) must show every
READ as a GET over ``tcp`` and no same-node transport anywhere
(tests/two_hosts.py says why this is the inter-node path).  The serve route
over the same setup: tests/test_vllm_serve_two_hosts.py.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from conftest import counting_listener, poll_pause
from structlog.testing import capture_logs

pytest.importorskip("torch")
pytest.importorskip("nixl")

import two_hosts as th  # noqa: E402
from two_hosts import D_HOST, P_HOST, STRANGER, HostProcess, HostSpec  # noqa: E402

from kvhandoff.adapters.vllm.cluster import free_port  # noqa: E402
from kvhandoff.adapters.vllm.demo import analyse_logs  # noqa: E402
from kvhandoff.adapters.vllm.metadata import Admit, Export, Read, StepPlan  # noqa: E402
from kvhandoff.adapters.vllm.params import RemotePrefill  # noqa: E402
from kvhandoff.core.log import read_log  # noqa: E402

LEASE = 3.0
BLOCK = th.BLOCK
pytestmark = pytest.mark.timeout(180)


class Pair:
    """P's and D's hosts: ``tp_size`` worker ranks each, event logs and UCX logs in ``tmp``."""

    def __init__(self, tmp: Path, tp_size: int = 1, layout: str = "llama") -> None:
        self.tmp, self.tp_size = tmp, tp_size
        self.port = free_port(P_HOST, tp_size)
        self.outputs = (tmp / "P.host.log", tmp / "D.host.log")  # UCX's report goes here
        common = {"lease_s": LEASE, "heartbeat_interval_s": 0.3, "lease_margin_s": 0.2,
                  "log_dir": str(tmp / "events"), "read_timeout_s": 10.0}
        p_cfg = th.p_extra(self.port)
        p_env = {**th.UCX_ENV, **th.EVIDENCE_ENV,
                 "VLLM_NIXL_SIDE_CHANNEL_HOST": p_cfg["side_channel_host"]}
        p_extra = {**common, "side_channel_port": p_cfg["side_channel_port"]}
        d_env = {**th.UCX_ENV, **th.EVIDENCE_ENV}
        d_extra = {**common, **th.d_extra(self.port, tp_size), "debug_read_delay_param": True}
        self.p_host = HostProcess(HostSpec("P", "P-2h", p_extra, p_env, tp_size, layout,
                                               output=str(self.outputs[0])))
        try:
            self.d_host = HostProcess(HostSpec("D", "D-2h", d_extra, d_env, tp_size, layout,
                                                   output=str(self.outputs[1])))
        except BaseException:
            self.p_host.close()
            raise
        self.p = [self.p_host.rank(r) for r in range(tp_size)]
        self.d = [self.d_host.rank(r) for r in range(tp_size)]

    def close(self) -> None:
        self.d_host.close()
        self.p_host.close()

    def export(self, rid: str, n: int, token: str) -> None:
        for p in self.p:
            p.start_step(StepPlan(prefill_started=[rid]))
            p.finish_step()
            p.start_step(StepPlan(exports=[Export(rid, n, token)]))
            p.finish_step()

    def params(self, rid: str, ids: tuple[tuple[int, ...], ...], tokens: int, token: str,
               **kw) -> dict:
        return RemotePrefill("P-2h", rid, P_HOST, self.port, self.tp_size, ids, tokens, LEASE,
                             token=token, **kw).to_wire()

    def pump(self, until, timeout: float = 15.0) -> tuple[set, set, set]:
        """Step every rank of both hosts until ``until(sent, recved, failed)``; sets per side
        hold (rank, request id) pairs."""
        sent, recved, failed = set(), set(), set()
        deadline = time.monotonic() + timeout
        while not until(sent, recved, failed):
            assert time.monotonic() < deadline, (sent, recved, failed)
            for p in self.p:
                s, _, _ = p.finish_step()
                sent |= {(p.rank, x) for x in s}
            for d in self.d:
                _, r, f = d.finish_step()
                recved |= {(d.rank, x) for x in r}
                failed |= {(d.rank, x) for x in f}
            poll_pause(0.002)
        return sent, recved, failed

    def all_ranks(self, rid: str) -> set:
        return {(r, rid) for r in range(self.tp_size)}

    def logs(self) -> list[str]:
        return [w.flush() for w in self.p + self.d]


@pytest.fixture
def pair_factory(tmp_path):
    made: list[Pair] = []

    def make(tp_size: int = 1, layout: str = "llama") -> Pair:
        made.append(Pair(tmp_path, tp_size, layout))
        return made[-1]
    yield make
    for p in made:
        p.close()


def _kinds(path: str, rid: str) -> list[str]:
    return [e.kind for e in read_log(path) if e.request_id == rid]


def _refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return False
    except OSError:
        return True


@pytest.mark.parametrize("tp_size", [1, 2], ids=["tp1", "tp2"])
def test_a_hand_off_between_two_hosts_reads_p_s_bytes_over_tcp(pair_factory, tp_size):
    pair = pair_factory(tp_size)
    pair.export("r1", 3, "tok-1")
    params = pair.params("r1", ((5, 9, 10),), 3 * BLOCK, "tok-1")
    assert params["remote_host"] == P_HOST  # what the router hands D: P's address
    for d in pair.d:
        d.start_step(StepPlan(admits=[Admit("L1", params, "", 3 * BLOCK)],
                              reads=[Read("L1", [[1, 2, 3]])]))
    everyone = pair.all_ranks("r1")
    sent, recved, failed = pair.pump(lambda s, r, f: everyone <= s
                                     and pair.all_ranks("L1") <= r)
    assert failed == set()
    for p, d in zip(pair.p, pair.d, strict=True):
        # D rank r read P rank r (its own side channel port) and nothing else.
        assert d.peers() == [(P_HOST, pair.port + d.rank)]
        assert d.blocks([1, 2, 3]) == p.blocks([5, 9, 10])
        assert d.written_blocks() == [1, 2, 3]
        # P's side channel lives on 127.0.0.2 alone: D on 127.0.0.1 reached another "host".
        assert _refused(D_HOST, pair.port + p.rank) and not _refused(P_HOST, pair.port + p.rank)
    if tp_size == 2:  # the ranks hold different bytes: a crossed pairing would not pass
        assert pair.p[0].blocks([5]) != pair.p[1].blocks([5])
    a = analyse_logs(pair.logs())  # (its double-free count is per request id, not per rank)
    assert a["replay_violations"] == 0 and a["p_frees"] == tp_size
    assert all(_kinds(p.flush(), "r1").count("freed") == 1 for p in pair.p)  # once per P rank
    report = th.assert_reads_over_tcp(*pair.outputs)
    assert any(who.startswith("D") for who, _, _ in report.reads())


def test_a_cancel_during_a_read_between_two_hosts_keeps_p_s_lease(pair_factory):
    """The heartbeats that keep P's lease cross the hosts as UCX notifications over tcp."""
    pair = pair_factory(1)
    (p,), (d,) = pair.p, pair.d
    pair.export("r2", 2, "tok-2")
    params = pair.params("r2", ((7, 8),), 2 * BLOCK, "tok-2", debug_read_delay_s=LEASE * 1.5)
    d.start_step(StepPlan(admits=[Admit("L2", params, "", 2 * BLOCK)],
                          reads=[Read("L2", [[20, 21]])]))
    pair.pump(lambda s, r, f: d.d_state("r2") == "READING")
    d.start_step(StepPlan(cancels=["L2"]))  # the client went away with the READ in flight
    pair.pump(lambda s, r, f: (0, "r2") in s and (0, "L2") in r, timeout=LEASE * 4)
    kinds = _kinds(p.flush(), "r2")
    assert "lease_expired" not in kinds and kinds.count("freed") == 1
    assert kinds.count("heartbeat_received") >= 5
    assert "client_cancelled" in _kinds(d.flush(), "r2")
    assert d.blocks([20, 21]) == p.blocks([7, 8])
    th.assert_reads_over_tcp(*pair.outputs)


# P prefilled 99 of a 100-token prompt: 7 blocks.  The window keeps positions 4-6.
P_SLIDING, P_FULL = (30, 31, 9), (10, 11, 12, 13, 14, 15, 16)
D_SLIDING, D_FULL = [0, 0, 0, 0, 40, 41, 42], [50, 51, 52, 53, 54, 55, 56]


def test_a_hybrid_hand_off_between_two_hosts_reads_each_group_over_tcp(pair_factory):
    pair = pair_factory(1, "gemma")
    (p,), (d,) = pair.p, pair.d
    pair.export("g1", len(P_SLIDING) + len(P_FULL), "tok-g1")
    params = pair.params("g1", (P_SLIDING, P_FULL), 99, "tok-g1")
    d.start_step(StepPlan(admits=[Admit("G1", params, "", 100)],
                          reads=[Read("G1", [D_SLIDING, D_FULL])]))
    sent, recved, failed = pair.pump(lambda s, r, f: (0, "g1") in s and (0, "G1") in r)
    assert failed == set()
    src, dst = list(P_SLIDING) + list(P_FULL), D_SLIDING[4:] + D_FULL
    assert d.blocks(dst) == p.blocks(src)
    assert d.written_blocks() == sorted(dst)  # the window's null positions stayed untouched
    posted = next(e for e in read_log(d.flush()) if e.request_id == "g1" and e.kind == "reads_posted")
    assert posted.split_groups == (0, 1)  # one READ per group
    a = analyse_logs(pair.logs())
    assert a["replay_violations"] == 0 and a["p_frees"] == 1
    th.assert_reads_over_tcp(*pair.outputs)


@pytest.mark.parametrize(("host", "shift", "rank"), [
    (STRANGER, 0, 0),  # another loopback "host", P's port
    (P_HOST, 1, 0),  # P's host, another port (another process there)
    (P_HOST, 0, 1),  # D rank 1 dials P's port + 1: trusted for rank 0 only
], ids=["other-host", "other-port", "rank-port"])
def test_d_refuses_a_producer_outside_its_trusted_list_before_a_packet_leaves(
        tmp_path, host, shift, rank):
    from kvhandoff.adapters.vllm.config import HandoffConfig
    from kvhandoff.adapters.vllm.worker import HandoffWorker
    from kvhandoff.core.events import Side

    port = free_port(P_HOST, 3)
    extra = {"lease_s": LEASE, "log_dir": str(tmp_path), **th.d_extra(port, tp_size=1)}
    d = HandoffWorker(HandoffConfig.from_extra(extra, env={}), "D-t", Side.D, rank, 2,
                      th.compat(2))
    dialed = (host, port + shift + rank)
    listener, attempts = counting_listener(*dialed)
    try:
        caches, _ = th._caches("llama", False, 0)
        d.register_kv_caches(caches, th.layout_of("llama"))
        params = RemotePrefill("P-2h", "r8", host, port + shift, 2, ((1,),), BLOCK, LEASE,
                               token="tok-8").to_wire()
        with capture_logs() as logs:
            d.start_step(StepPlan(admits=[Admit("L8", params, "", BLOCK)],
                                  reads=[Read("L8", [[1]])]))
            _, recved, failed = d.finish_step()
        assert recved == failed == {"L8"}
        assert d._handshakes == {} and d._peers == {}  # no handshake was even started
        (entry,) = [e for e in logs if e["log_level"] == "error"]
        assert "UntrustedProducer" in entry["error"] and f"{dialed[0]}:{dialed[1]}" in entry["error"]
        assert attempts == [], f"D connected to {dialed}, outside trusted_producers"
    finally:
        listener.close()
        d.close()


def test_the_operator_guide_s_multi_node_block_is_what_these_tests_run():
    """One source: the guide shows `two_hosts.guide_block()` verbatim, and the bench's
    ``--transport tcp`` uses the same UCX settings."""
    from kvhandoff.adapters.bench.nixl import TCP_ENV

    guide = (Path(__file__).resolve().parents[1] / "docs" / "operator-guide.md").read_text()
    assert f"```bash\n{th.guide_block()}\n```" in guide
    assert TCP_ENV == {"cpu": th.UCX_ENV, "cuda": th.UCX_ENV_CUDA}


def test_bench_nixl_over_tcp_reads_over_tcp_and_verifies_every_byte():
    """``kvhandoff bench nixl --transport tcp`` (small): each row verified, UCX's report
    names only tcp for the READ, and the socket copy of the same bytes is measured."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvhandoff.adapters.bench.nixl", "--transport", "tcp",
         "--payload-mib", "4", "--reps", "1", "--idle-seconds", "0.1", "--json"],
        capture_output=True, text=True, timeout=300, check=True)
    r = json.loads(out.stdout)
    assert r["options"]["transport"] == "tcp" and r["options"]["vram_ipc"] is False
    assert r["baseline"] == "socket copy between two processes"
    assert all(row["verified"] and row["socket_GBps"] > 0 for row in r["rows"])
    reads = r["read_protocols"]["reads"]
    assert reads and all(row.endswith("tcp/lo") for x in reads for row in x["rows"]), reads
    assert r["read_protocols"]["same_node_transports"] == []
    assert r["targets"]["reads_over_tcp_only"] is True


def test_d_s_reads_over_tcp_move_between_its_engine_steps():
    """A GET over tcp takes several UCX rounds; a busy D polls once per engine step.
    The connector's D (no NIXL progress thread, `ReadProgress` between steps) has every
    64 MiB READ done by its fifth poll at 100 ms steps (by the second or third on a quiet
    machine; the fourth once, with a CI run and other tests on the two cores).  (D's
    polls alone needed 8-14 polls on a quiet machine, docs/nixl.md: this checks the path
    end to end; `tests/test_wakeup.py` checks `ReadProgress` itself.)"""
    import json
    import subprocess
    import sys

    d_progress = "connector"
    out = subprocess.run(
        [sys.executable, "-m", "kvhandoff.adapters.bench.nixl", "--transport", "tcp",
         "--payload-mib", "64", "--reps", "1", "--idle-seconds", "0.1", "--json",
         "--d-progress", d_progress, "--d-step-ms", "100"],
        capture_output=True, text=True, timeout=300, check=True)
    r = json.loads(out.stdout)
    assert r["options"]["d_progress"] == d_progress and r["options"]["d_step_ms"] == 100
    assert all(row["verified"] for row in r["rows"])
    assert all(row["polls_median"] <= 5 for row in r["rows"]), [
        (row["descriptors"], row["polls_median"]) for row in r["rows"]]
