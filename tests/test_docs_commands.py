"""The simulator's and replay's commands in the docs run as printed, and print what the docs show.

Each block follows a marker ``<!-- test: NAME -->`` in docs/simulation.md or
docs/replay.md: an indented code block, one command per line (a trailing
``\\`` continues it, a trailing ``# ...`` is a comment).  A line holding
``...`` is a template, not a command.  Commands run with ``bash`` in the
test's temporary directory with ``.venv/bin`` first on ``PATH``; the one
substitution is the reproduction's log directory, ``/tmp/kvh-repro``, moved
into that directory.  Output blocks are checked line by line against what
the commands print, so a doc whose sample drifted from the code fails here.
(The operator guide's recipe, ``make demo`` and ``kvhandoff demo --http``
run in tests/test_guide.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIMULATION = ROOT / "docs" / "simulation.md"
REPLAY = ROOT / "docs" / "replay.md"
BIN = str(Path(sys.executable).parent)


def block(doc: Path, name: str) -> list[str]:
    """The indented code block right after the marker ``name``: its lines, unindented."""
    marker = f"<!-- test: {name} -->"
    text = doc.read_text()
    assert text.count(marker) == 1, f"{doc.name}: expected the marker {marker!r} once"
    lines, started = [], False
    for line in text.split(marker, 1)[1].splitlines()[1:]:
        if line.startswith("    "):
            lines.append(line[4:])
            started = True
        elif started and line.strip():
            break
        elif started:
            lines.append("")
    while lines and not lines[-1]:
        lines.pop()
    assert lines, f"{doc.name}: no indented block after {marker!r}"
    return lines


def commands(doc: Path, name: str) -> list[str]:
    """The block's commands: continuations joined, comments and templates left out."""
    out: list[str] = []
    joined = ""
    for line in block(doc, name):
        joined += line
        if joined.endswith("\\"):
            joined = joined[:-1]
            continue
        command = re.sub(r"\s+#.*$", "", joined).strip()
        joined = ""
        if command and "..." not in command:
            out.append(command)
    return out


def run(command: str, cwd: Path, repro: Path | None = None) -> subprocess.CompletedProcess:
    if repro is not None:
        command = command.replace("/tmp/kvh-repro", str(repro))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "COLUMNS": "400"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_simulate_commands_run_as_printed(tmp_path):
    cmds = commands(SIMULATION, "simulate-commands")
    assert len(cmds) >= 5 and all(c.startswith("kvhandoff simulate") for c in cmds)
    assert "kvhandoff simulate --list" in cmds
    for command in cmds:
        done = run(command, tmp_path)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        if command.endswith("--list"):
            assert "release_overtakes_export" in done.stdout
        else:
            assert re.search(r"\d+ runs, \d+ requests in", done.stdout), (command, done.stdout)


def test_a_violation_reproduces_as_the_docs_print_it(tmp_path):
    repro = tmp_path / "kvh-repro"
    (command,) = commands(SIMULATION, "repro-command")
    done = run(command, tmp_path, repro)
    assert done.returncode == 1, (done.stdout, done.stderr)  # --check: the seed violates
    # "Every violation prints its command": the one the docs show, exactly.
    assert f"repro: {command}" in [line.strip() for line in done.stdout.splitlines()], done.stdout
    check, request = commands(SIMULATION, "repro-replay")
    assert "--check" in check and "--request" in request
    checked = run(check, tmp_path, repro)
    assert checked.returncode == 1
    (expected,) = block(SIMULATION, "repro-check-output")
    assert expected in (checked.stdout + checked.stderr).splitlines(), checked.stderr
    shown = run(request, tmp_path, repro)
    assert shown.returncode == 0, shown.stderr
    printed = [line.strip() for line in shown.stdout.splitlines()]
    at = 0
    for line in block(SIMULATION, "repro-request-output"):  # in order, each verbatim
        assert line.strip() in printed[at:], f"docs/simulation.md shows {line!r}; replay printed:\n" \
            + shown.stdout
        at = printed.index(line.strip(), at) + 1
    # "The same seed under --policy kvhandoff ... the leases never expire."
    fixed = run("kvhandoff simulate --scenario cancel_during_read --seeds 8..8 --json", tmp_path)
    totals = json.loads(fixed.stdout)
    assert totals["lease_expiries"] == totals["freed_under_read"] == 0 and not totals["violations"]


@pytest.fixture(scope="module")
def two_logs(tmp_path_factory):
    """p.jsonl and d.jsonl, as the replay docs name them: one clean simulated run (TP 1:
    one stream per file) with a req-7 and D's stream longer than 120 events."""
    work = tmp_path_factory.mktemp("replay-docs")
    logs = work / "logs"
    done = run(f"kvhandoff simulate --scenario cancel_during_read --seeds 1..1 --log-dir {logs} "
               "--check", work)
    assert done.returncode == 0, done.stdout
    shutil.copy(logs / "cancel_during_read.kvhandoff.s1.P.jsonl", work / "p.jsonl")
    shutil.copy(logs / "cancel_during_read.kvhandoff.s1.D.jsonl", work / "d.jsonl")
    assert len((work / "d.jsonl").read_bytes().splitlines()) > 120
    return work


@pytest.mark.parametrize("name", ["replay-commands", "replay-trace-commands"])
def test_the_replay_commands_run_as_printed(two_logs, name):
    cmds = commands(REPLAY, name)
    assert cmds and all(c.startswith("kvhandoff replay") for c in cmds)
    everything = run("kvhandoff replay p.jsonl d.jsonl", two_logs).stdout
    for command in cmds:
        done = run(command, two_logs)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        if "--request req-7" in command and "--svg" not in command:
            assert "request req-7" in done.stdout and "request req-6" not in done.stdout
        if "--until 120" in command:  # a prefix of each stream: fewer events than the whole
            assert 0 < len(done.stdout.splitlines()) < len(everything.splitlines())
        if "--json" in command:
            assert json.loads(done.stdout)["violations"] == []
        for out in re.findall(r"--(?:trace|svg) (\S+)", command):
            assert (two_logs / out).stat().st_size > 0, command
