"""What the docs print runs as printed.

* The operator guide's CPU recipe (the fenced bash block after the marker
  ``<!-- test: cpu-recipe -->`` in docs/operator-guide.md) is run with
  ``bash`` from the repository's root, with ``KVH_DIR`` pointing into the
  test's temporary directory: two ``vllm serve`` engines, the example router
  and one completion through it.  The answer must be a completion (HTTP 200,
  non-empty text) and the event logs must show that the KV went from P to D
  (P ``exported`` and ``freed`` it once, D ``finished_recving``) and replay
  clean.  The recipe's ports are fixed (a user copies them): the test checks
  they are free first and fails naming them otherwise.
* ``make demo``, the README's main job, as printed: its summary and D's
  event log (every cancel landed mid-read).
* ``kvhandoff demo --http --json`` as the README prints it: the demo through
  two ``vllm serve`` engines and the router, its JSON object checked.
* ``kvhandoff demo --model gemma3`` and ``--model mamba2`` as the operator
  guide names them (with ``--json``): the hybrid caches' demo, checked as the
  default one is.

Each starts real engines (about a minute each test on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
from conftest import wait_for

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvhandoff.core.log import read_log  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "operator-guide.md"
README = ROOT / "README.md"
MARKER = "<!-- test: cpu-recipe -->"
REPLAY_CHECK = '.venv/bin/kvhandoff replay --check "$KVH_DIR/events"'
pytestmark = pytest.mark.timeout(900)


def recipe(marker: str = MARKER) -> str:
    """The fenced bash block right after ``marker``, as printed."""
    text = GUIDE.read_text()
    assert text.count(marker) == 1, f"{GUIDE.name}: expected the marker {marker!r} once"
    m = re.match(r"\s*```bash\n(.*?)\n```\n", text.split(marker, 1)[1], re.S)
    assert m, f"{GUIDE.name}: no ```bash block right after {marker!r}"
    return m.group(1) + "\n"


def recipe_ports(block: str) -> list[int]:
    ports = re.findall(r"--port (\d+)", block) + re.findall(r'"side_channel_port": (\d+)', block)
    return sorted({int(p) for p in ports})


def assert_ports_free(ports: list[int]) -> None:
    busy = []
    for port in ports:
        with socket.socket() as s:
            # As the servers bind (uvicorn, ZMQ): a connection of an earlier run still in
            # TIME_WAIT does not stop them, so it must not fail this check either.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                s.listen()
            except OSError:
                busy.append(port)
    if busy:
        pytest.fail(f"the CPU recipe uses fixed ports {ports}; {busy} already in use on this "
                    f"host (another recipe or server running?): stop what listens there")


def kill_group(pgid: int) -> None:
    """SIGTERM to every process the recipe started (its process group), then SIGKILL."""
    def gone() -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        return False

    for sig, patience in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        if gone():
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            wait_for(gone, patience, f"the recipe's processes to exit after {sig.name}", 0.2)
            return
        except AssertionError:
            if sig is signal.SIGKILL:
                raise


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} missing)"


def test_the_guide_sends_readers_nowhere_outside_the_repository():
    text = GUIDE.read_text()
    assert "../shared" not in text and "FIELD_NOTES" not in text


def test_the_cpu_recipe_runs_as_printed(tmp_path):
    block = recipe()
    assert "--host 127.0.0.1" in block and "VLLM_CPU_OMP_THREADS_BIND=0 " in block
    ports = recipe_ports(block)
    assert {8000, 8100, 8200, 5600} <= set(ports), ports
    assert_ports_free(ports)
    kvh = tmp_path / "kvh"
    out, err = tmp_path / "recipe.stdout", tmp_path / "recipe.stderr"
    env = {**os.environ, "KVH_DIR": str(kvh)}
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(["bash", "-c", block], cwd=ROOT, env=env, stdout=o, stderr=e,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        try:
            rc = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail("the recipe did not finish within 600 s; P: " + tail(kvh / "P.log")
                        + "\nD: " + tail(kvh / "D.log"))
        logs = "".join(f"\n--- {n}:\n{tail(kvh / n)}" for n in ("P.log", "D.log", "router.log"))
        lines = out.read_text().strip().splitlines()
        assert rc == 0 and lines and lines[-1] == "HTTP 200", (
            f"rc={rc} stdout={lines[-5:]} stderr={tail(err)}{logs}")
        completion = json.loads(lines[-2])
        (choice,) = completion["choices"]
        assert choice["text"].strip(), completion
        assert completion["usage"]["completion_tokens"] > 0, completion

        # The KV really went P -> D: one exported request, read by D, freed once by P.
        p_log, d_log = kvh / "events" / "prefill-0.P0.jsonl", kvh / "events" / "decode-0.D0.jsonl"
        exported = [e.request_id for e in read_log(p_log) if e.kind == "exported"]
        assert len(exported) == 1, exported
        rid = exported[0]
        d_kinds = [e.kind for e in read_log(d_log) if e.request_id == rid]
        assert "reads_posted" in d_kinds and "finished_recving" in d_kinds, d_kinds

        def freed():
            return Counter(e.kind for e in read_log(p_log) if e.request_id == rid)["freed"]
        wait_for(freed, 30, f"P to free {rid}")
        assert freed() == 1
        # The check the guide prints after the recipe, as printed: its log_dir as a directory.
        assert f"`{REPLAY_CHECK}`" in GUIDE.read_text()
        check = subprocess.run(["bash", "-c", REPLAY_CHECK], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, check.stdout + check.stderr
        for both in (r"prefill-0/P0 +freed ", r"decode-0/D0 +finished_recving "):  # P's and D's
            assert re.search(both, check.stdout), check.stdout
        replay_commands_run_on(kvh / "events", rid)
    finally:
        kill_group(proc.pid)


def replay_commands_run_on(events: Path, rid: str) -> None:
    """The guide's two blocks of replay commands (after its alerts, and under "Debugging a
    hand-off"), run in the recipe's log directory, whose engines are the guide's
    ``prefill-0`` and ``decode-0``, with its placeholders filled in: ``/var/log/kvhandoff``
    that directory, ``ID`` and ``cmpl-7f3a-0`` the recipe's request, ``...`` its two logs."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    for marker in ("<!-- test: replay-alert-commands -->", "<!-- test: replay-debug-commands -->"):
        for line in recipe(marker).splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            assert command.startswith("kvhandoff replay "), command
            command = (command.replace("/var/log/kvhandoff", str(events))
                       .replace(" ID", f" {rid}").replace("cmpl-7f3a-0", rid)
                       .replace("...", "prefill-0.P0.jsonl decode-0.D0.jsonl"))
            done = subprocess.run(["bash", "-c", command], cwd=events, env=env,
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
            if "--request" in command:  # that request alone, both halves
                assert f"request {rid}" in done.stdout and "prefill-0/P0" in done.stdout, done.stdout
                assert "decode-0/D0" in done.stdout, done.stdout
            if "--json" in command:
                assert json.loads(done.stdout)["violations"] == []
            if "--trace" in command:
                assert json.loads((events / "t.json").read_text())["traceEvents"]


# ---- make demo: the README's main job -------------------------------------------

def test_make_demo_runs_as_the_readme_prints_it(tmp_path):
    """`make demo` (setup is done: it runs `kvhandoff demo`): two in-process engines, a
    batch with three requests cancelled mid-read and one malformed, checked and replayed."""
    assert "\n    make demo\n" in README.read_text()
    result = subprocess.run(["make", "demo"], cwd=ROOT, capture_output=True, text=True,
                            timeout=800, env={**os.environ, "TMPDIR": str(tmp_path),
                                              "COLUMNS": "400"})  # rich: one line per line
    out = result.stdout
    assert result.returncode == 0, (out[-3000:], result.stderr[-3000:])
    assert "pip install" not in out  # setup was done: make ran the demo only
    assert re.search(r"requests 12: completed 8, cancelled mid-read 3, rejected \(malformed "
                     r"params\) 1", out), out
    assert "tokens equal the single-engine greedy reference: yes" in out, out
    assert "replay --check: 0 violations" in out, out
    (logs,) = re.findall(r"event logs: (.*)", out)
    d_log = next(Path(p) for p in logs.split() if ".D0." in p)
    assert d_log.is_relative_to(tmp_path)
    by_request: dict[str, list[str]] = {}
    for e in read_log(d_log):
        by_request.setdefault(e.request_id, []).append(e.kind)
    cancelled = [k for k in by_request.values() if "client_cancelled" in k]
    assert len(cancelled) == 3, by_request
    for k in cancelled:  # each cancel landed while its READ was in flight
        assert k.index("reads_posted") < k.index("client_cancelled") < k.index("split_completed"), k


# ---- kvhandoff demo --http -----------------------------------------------------

DEMO_HTTP = "kvhandoff demo --http --json"


def _serve_errors(s: dict) -> dict[str, list[str]]:
    """The last error and warning lines of each engine's server log (what a failed run
    shows besides the summary: CI keeps nothing else)."""
    found = {}
    for log in s.get("serve_logs", []):
        text = Path(log).read_text(errors="replace") if Path(log).exists() else ""
        found[Path(log).name] = [line[:400] for line in text.splitlines() if any(
            w in line for w in ("ERROR", "WARNING", "[error", "[warning", "Traceback"))][-15:]
    return found


def test_the_http_demo_runs_as_the_docs_print_it(tmp_path):
    assert "[--http]" in README.read_text() and DEMO_HTTP in GUIDE.read_text()
    kvhandoff = Path(sys.executable).with_name("kvhandoff")
    argv = [str(kvhandoff), *DEMO_HTTP.split()[1:]]
    # The demo's working directory is a new temporary one: under this test's.
    result = subprocess.run(argv, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path)},
                            capture_output=True, text=True, timeout=800)
    lines = result.stdout.splitlines()
    assert len(lines) == 1, (result.stdout[-2000:], result.stderr[-3000:])
    s = json.loads(lines[0])
    assert json.loads((Path(s["workdir"]) / "summary.json").read_text()) == s
    assert s["problems"] == [] and result.returncode == 0, (s["problems"], _serve_errors(s),
                                                             result.stderr[-3000:])
    # A stall the lease absorbed still shows in CI's warnings (which process stood still).
    if max(s["longest_stall_s"].values()) > 5:
        warnings.warn(f"kvhandoff demo --http: a process stood still for seconds (longest "
                      f"per process, s: {s['longest_stall_s']})", stacklevel=1)
    # D failed only the malformed request (and the READ of an attempt whose hang-up was late)
    missed = {m["rid"] for m in s["cancel_missed"]}
    [(_, rejected)] = [(rid, evs) for rid, evs in s["d_failures"].items() if rid not in missed]
    assert [kind for kind, _, _ in rejected][:2] == ["admitted", "rejected"], s["d_failures"]
    assert s["requests"] == 12 and s["completed"] == s["through_router"] == 8, s
    assert s["streamed"] == 4 and s["tokens_match"] is True and s["distinct_outputs"] == 8, s
    assert s["cancelled"] == s["cancel_planned"] == 3, s
    assert s["rejected"] == 1 and s["malformed_status"] >= 400, s
    assert s["malformed_rejected_in_d_log"] is True, s
    assert s["engine_restarts"] == 0, s
    # A hang-up that never reached D was made again with a new request (one more export).
    for missed in s["cancel_missed"]:
        warnings.warn(f"kvhandoff demo --http: a hang-up never reached D while its READ was "
                      f"held, tried again: {missed}", stacklevel=1)
    assert s["p_frees"] == s["p_exports"] == 12 + len(s["cancel_missed"]), s
    assert s["double_frees"] == 0, s
    assert s["replay_violations"] == 0 and s["violations"] == [], s
    assert Path(s["workdir"]).is_relative_to(tmp_path)
    # D logs its requests' parameters (--enable-log-requests): its server log is private.
    assert all(os.stat(log).st_mode & 0o777 == 0o600 for log in s["serve_logs"]), s["serve_logs"]


# ---- kvhandoff demo --model gemma3|mamba2 ----------------------------------------

@pytest.mark.parametrize("model", ["gemma3", "mamba2"])
def test_the_hybrid_demos_run_as_the_guide_names_them(tmp_path, model):
    """Two KV cache groups (sliding window + full attention), or one Mamba state group:
    the same batch as the default demo, each request's groups read, freed once."""
    assert "`kvhandoff demo --model gemma3` and `--model mamba2`" in GUIDE.read_text()
    assert "[--model llama\\|gemma3\\|mamba2]" in README.read_text()
    kvhandoff = Path(sys.executable).with_name("kvhandoff")
    result = subprocess.run([str(kvhandoff), "demo", "--model", model, "--json"], cwd=ROOT,
                            env={**os.environ, "TMPDIR": str(tmp_path)},
                            capture_output=True, text=True, timeout=800)
    lines = result.stdout.splitlines()
    assert len(lines) == 1, (result.stdout[-2000:], result.stderr[-3000:])
    s = json.loads(lines[0])
    assert s["problems"] == [] and result.returncode == 0, (s["problems"], result.stderr[-3000:])
    assert s["model"] == model and s["requests"] == 12, s
    assert json.loads((Path(s["workdir"]) / "summary.json").read_text()) == s
    assert s["completed"] == 8 and s["tokens_match"] is True and s["mismatched"] == [], s
    assert s["cancelled"] == 3 and s["rejected"] == 1, s
    assert s["p_frees"] == s["p_exports"] == 12 and s["double_frees"] == 0, s
    assert s["replay_violations"] == 0 and s["lease_expiries"] == 0, s
    assert Path(s["workdir"]).is_relative_to(tmp_path)
    by_request: dict[str, list] = {}
    d_log = next(Path(p) for p in s["event_logs"] if ".D0." in p)
    for e in read_log(d_log):
        by_request.setdefault(e.request_id, []).append(e)
    groups = {g for evs in by_request.values() for e in evs if e.kind == "reads_posted"
              for g in e.split_groups}
    assert groups == ({0, 1} if model == "gemma3" else {0}), groups
    cancelled = [[e.kind for e in evs] for evs in by_request.values()
                 if any(e.kind == "client_cancelled" for e in evs)]
    assert len(cancelled) == 3, by_request
    for k in cancelled:  # each cancel landed while its READs were in flight
        assert k.index("reads_posted") < k.index("client_cancelled") < k.index("split_completed"), k
    replay = subprocess.run(s["replay_command"].split(), cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PATH": f"{kvhandoff.parent}"
                                                         f":{os.environ.get('PATH', '')}"})
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
    assert "VIOLATION" not in replay.stdout and "freed under read 0," in replay.stdout


def test_the_http_demo_counts_a_process_that_died_or_restarted(tmp_path):
    """engine_restarts is no constant: a process gone, or one with a new start time, counts."""
    import psutil

    from kvhandoff.adapters.vllm.http_demo import _gone

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        me = psutil.Process(proc.pid)
        procs = {(me.pid, me.create_time(), "python")}
        assert _gone(procs) == []
        # same pid, another process
        assert _gone({(me.pid, me.create_time() - 5, "python")}) == [f"python({me.pid})"]
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert _gone(procs) == [f"python({me.pid})"]


def test_a_demo_summary_names_each_check_that_failed():
    """`problems` is computed from the summary's own numbers: a clean one has none, and
    each broken number is named with what was found (the demos exit 1 on any)."""
    from kvhandoff.adapters.vllm.demo import demo_problems
    from kvhandoff.adapters.vllm.http_demo import http_demo_problems

    clean = {"completed": 8, "through_router": 8, "failed": {}, "d_failures": {},
             "tokens_match": True,
             "mismatched": [], "cancelled": 3, "cancel_planned": 3, "cancel_events": {},
             "cancel_missed": [{"rid": "r0", "events": [], "d_api_server_abort": False}],
             "rejected": 1, "malformed_status": 400, "engine_restarts": 0,
             "engine_processes_gone": [], "p_exports": 12, "p_frees": 12, "double_frees": 0,
             "replay_violations": 0}
    assert http_demo_problems(clean) == [] and demo_problems(clean) == []
    broken = {"cancelled": 2, "cancel_events": {"r1": ["reads_posted"]}, "p_frees": 11,
              "engine_restarts": 1, "engine_processes_gone": ["python(7)"]}
    found = http_demo_problems(clean | broken)
    assert len(found) == 3, found
    assert "2 of 3 cancels landed mid-read" in found[0] and "'r1': ['reads_posted']" in found[0]
    assert "never reached D: [{'rid': 'r0'" in found[0]  # a missed attempt: no problem alone
    assert "python(7)" in found[1] and "exported 12 requests and freed 11" in found[2]
    assert demo_problems(clean | {"tokens_match": False, "mismatched": ["r4"]}) == [
        "tokens do not equal the reference (mismatched: ['r4'])"]


def test_a_stream_that_fails_midway_is_a_failed_request_with_d_s_account():
    """vLLM ends a stream whose request failed (a KV load under the fail policy) with a
    ``data: {"error": ...}`` chunk and no choices: the request counts as failed, named
    with vLLM's error and every event D logged for the failed hand-off."""
    from types import SimpleNamespace as E

    import httpx

    from kvhandoff.adapters.vllm.http_demo import _failures, _streamed, http_demo_problems

    sse = (b'data: {"choices": [{"text": "a", "token_ids": [7], "finish_reason": null}]}\n\n'
           b'data: {"error": {"message": "Internal server error", "code": 500}}\n\n'
           b"data: [DONE]\n\n")
    client = httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, content=sse)))
    got = _streamed(client, "http://d/v1/completions", {"prompt": "x"})
    assert got["finish_reason"] == "error" and got["token_ids"] == [7], got
    assert got["error"]["message"] == "Internal server error", got
    d_log = [E(kind="admitted", request_id="r1", t=5.0),
             E(kind="reads_posted", request_id="r1", t=5.5),
             E(kind="admitted", request_id="ok", t=5.6),
             E(kind="split_failed", request_id="r1", t=9.0, reason="read timeout"),
             E(kind="release_sent", request_id="ok", t=9.1, notify_only=False),
             E(kind="admitted", request_id="gone", t=9.2),
             E(kind="client_cancelled", request_id="gone", t=9.3),
             E(kind="release_sent", request_id="gone", t=9.4, notify_only=True),
             E(kind="release_sent", request_id="r1", t=9.5, notify_only=True)]
    failures = _failures(d_log)
    assert failures == {"r1": [("admitted", 0.0, ""), ("reads_posted", 0.5, ""),
                               ("split_failed", 4.0, "read timeout"),
                               ("release_sent", 4.5, "")]}, failures
    summary = {"completed": 7, "through_router": 8, "failed": {"3": got},
               "d_failures": failures, "tokens_match": True, "mismatched": [],
               "cancelled": 3, "cancel_planned": 3, "cancel_events": {}, "cancel_missed": [],
               "rejected": 1, "malformed_status": 400, "engine_restarts": 0,
               "engine_processes_gone": [], "p_exports": 12, "p_frees": 12,
               "double_frees": 0, "replay_violations": 0}
    [problem] = http_demo_problems(summary)
    assert "7 of 8" in problem and "Internal server error" in problem, problem
    assert "read timeout" in problem, problem


def test_the_http_demo_s_watch_names_the_process_that_stood_still():
    """``longest_stall_s``: how long each server's ``/health`` took (here: a server that
    answers its next call after 1 s; a quiet one is not charged for it) and how late this
    process's tick woke (here: the GIL held a whole switch interval at a time)."""
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvhandoff.adapters.vllm.http_demo import _Watch

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            slow = self.server.slow  # type: ignore[attr-defined]
            if slow.is_set():  # once
                slow.clear()
                time.sleep(1.0)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Health) for _ in range(2)]
    for server in servers:
        server.slow = threading.Event()
        threading.Thread(target=server.serve_forever, daemon=True).start()
    urls = {name: f"http://127.0.0.1:{server.server_port}" for name, server
            in zip(("quiet", "slow"), servers, strict=True)}
    watch = _Watch(urls)
    try:
        servers[1].slow.set()
        wait_for(lambda: watch.worst["slow"] >= 1.0, 30, "the slow server's /health charged")
        before = dict(watch.worst)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1.0)
        try:
            end = time.monotonic() + 2.5
            while time.monotonic() < end:  # holds the GIL a second at a time
                pass
        finally:
            sys.setswitchinterval(interval)
    finally:
        worst = watch.stop()
        for server in servers:
            server.shutdown()
            server.server_close()
    assert before["quiet"] < before["slow"], before
    assert worst["demo"] >= 0.5, worst  # (a server's time includes this process's stall)


def test_the_demos_print_paths_ids_and_errors_as_they_are():
    """The human summary prints what it was given, markup-like text included: a workdir
    under ``/tmp/[x]``, an id or an error holding ``[red]`` or ``[/]`` (rich read them as
    markup: changed styles, or a MarkupError that lost the summary)."""
    import io

    from rich.console import Console

    from kvhandoff.adapters.commands.demo import _print_http_human, _print_human

    odd = "/tmp/[x]/[/]kvh-[red]1"
    s = {"model": "llama", "engine_start_s": 1, "requests": 12, "through_router": 8,
         "streamed": 4, "completed": 7, "cancelled": 3, "cancel_planned": 3, "rejected": 1,
         "malformed_status": 400, "failed": {"5": {"status": 400, "error": "[/]bad [red]x"}},
         "cancel_missed": [{"rid": "cmpl-[red]1", "d_api_server_abort": False}],
         "tokens_match": True, "distinct_outputs": 7, "latency_ms_median": 5,
         "engine_restarts": 0, "exit_codes": {}, "serve_logs": [f"{odd}/D.serve.log"],
         "replay_command": f"kvhandoff replay --check {odd}/p.jsonl", "p_exports": 12,
         "p_frees": 12, "double_frees": 0, "lease_expiries": 0, "notify_only_releases": 0,
         "replay_violations": 1, "state_hash": "0" * 16,
         "violations": [{"invariant": "[/]x", "event": "[red]e", "detail": "[bold]d"}],
         "d_ttft_ms_median": 1, "transfer_ms_median": 1, "event_logs": [f"{odd}/d.jsonl"]}
    for show in (_print_human, _print_http_human):
        out = io.StringIO()
        show(s, Console(file=out, width=400, color_system=None))
        text = out.getvalue()
        assert f"{odd}/" in text and "[/]x [red]e: [bold]d" in text, text
    assert "cmpl-[red]1" in text and "[/]bad [red]x" in text, text
