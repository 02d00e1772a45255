"""The simulator's and replay's commands in the docs run as printed, and print what the docs show.

Each block follows a marker ``<!-- test: NAME -->`` in docs/simulation.md or
docs/replay.md: an indented code block, one command per line (a trailing
``\\`` continues it, a trailing ``# ...`` is a comment).  A line holding
``...`` is a template, not a command.  Commands run with ``bash`` in the
test's temporary directory with ``.venv/bin`` first on ``PATH``; the one
substitution is the reproduction's log directory, ``/tmp/kvh-repro``, moved
into that directory.  Output blocks are checked line by line against what
the commands print, so a doc whose sample drifted from the code fails here.
Template lines (``kvhandoff simulate ... --json``) run with ``...`` filled in, and
one-line commands printed in the docs' prose (the picture's redraw, ``kvhandoff
diagram``, ``tests/mutants.py --check`` and ``--only``, the shim's install) run or are matched
with what runs them.  (The operator guide's recipe, ``make demo`` and
``kvhandoff demo --http`` run in tests/test_guide.py.)
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


def templates(doc: Path, name: str) -> list[str]:
    """The block's template lines (holding ``...``), comments left out."""
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block(doc, name) if "..." in line]


def test_the_simulate_templates_do_what_their_comments_say(tmp_path):
    """Each template line of the block, its ``...`` one scenario's three seeds under vLLM
    0.32's policy (the runs break invariants, so each flag shows) and ``DIR`` a new
    directory."""
    lines = templates(SIMULATION, "simulate-commands")
    flags = {line.split("...", 1)[1].split()[0]: line for line in lines}
    assert set(flags) == {"--json", "--log-dir", "--replay", "--engine-logs"}, lines
    runs = "--scenario cancel_during_read --seeds 0..2 --policy vllm-0.32"

    def simulate(flag: str, more: str = "") -> subprocess.CompletedProcess:
        command = flags[flag].replace("...", f"{runs} {more}".strip())
        done = run(command.replace("DIR", str(tmp_path / "logs")), tmp_path)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        return done

    summary = json.loads(simulate("--json").stdout)  # one JSON object
    assert summary["runs"] == 3 and summary["freed_under_read"] > 0
    assert not any(v["invariant"].startswith("replay:") for v in summary["violations"])
    replayed = json.loads(simulate("--replay", "--json").stdout)  # the logs replayed too
    assert any(v["invariant"].startswith("replay:") for v in replayed["violations"]), replayed
    simulate("--log-dir")  # every run's P and D logs, which replay reads
    for seed in range(3):
        for side in "PD":
            assert (tmp_path / "logs" / f"cancel_during_read.vllm-0.32.s{seed}.{side}.jsonl").stat().st_size
    quiet, loud = run(f"kvhandoff simulate {runs}", tmp_path), simulate("--engine-logs")
    assert "lease_expired" not in quiet.stderr and "lease_expired" in loud.stderr, loud.stderr[-500:]


def test_the_gap_command_shows_vllm_0_32_freeing_under_reads(tmp_path):
    (command,) = commands(SIMULATION, "simulate-gap")
    done = run(command, tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    table = done.stdout.split("\n\n", 1)[0].splitlines()[1:]  # the header, a row per scenario
    rows = {line.split()[0]: line.split()[1:] for line in table}
    column = rows["scenario"].index("freed_u_read")
    assert int(rows["cancel_during_read"][column]) > 0  # the bug this project fixes
    assert int(rows["steady_state"][column]) == 0  # no fault, no free under a read
    assert re.search(r"\d+ runs, \d+ requests in", done.stdout)


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


# ---- one-line commands printed in the docs' prose -----------------------------------

def printed(doc: Path, command: str) -> str:
    """``command``, asserted to be printed in ``doc`` as it is run here: in backticks, or as
    a line of an indented code block (a trailing ``# ...`` comment aside)."""
    text = doc.read_text()
    lines = {re.sub(r"\s+#.*$", "", line[4:]).strip()
             for line in text.splitlines() if line.startswith("    ")}
    assert f"`{command}`" in text or command in lines, f"{doc.name} no longer prints `{command}`"
    return command


def test_the_picture_redraw_command_draws_the_committed_picture(tmp_path):
    """docs/lifecycle.md's redraw command, run in a directory of its own (it writes where
    it is told): what it draws has the committed picture's labels and bars."""
    from test_trace import _texts_and_bars

    command = printed(ROOT / "docs" / "lifecycle.md",
                      "python -m kvhandoff.adapters.pictures docs/img/cancel_during_read.svg")
    (tmp_path / "docs" / "img").mkdir(parents=True)
    done = run(command, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    drawn = (tmp_path / "docs" / "img" / "cancel_during_read.svg").read_text()
    committed = (ROOT / "docs" / "img" / "cancel_during_read.svg").read_text()
    assert _texts_and_bars(drawn) == _texts_and_bars(committed)


def test_the_picture_redraw_command_takes_no_flag_for_a_file_name(tmp_path):
    """``--help`` is help: it wrote an SVG file named ``--help`` into the directory."""
    done = run("python -m kvhandoff.adapters.pictures --help", tmp_path)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
    done = run("python -m kvhandoff.adapters.pictures --out x.svg", tmp_path)
    assert done.returncode == 2 and "unrecognized arguments" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_diagram_command_prints_the_graphs_the_lifecycle_page_shows(tmp_path):
    done = run(printed(ROOT / "docs" / "lifecycle.md", "kvhandoff diagram"), tmp_path)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    assert done.stdout.strip() in (ROOT / "docs" / "lifecycle.md").read_text()


def test_the_mutants_check_runs_as_printed(tmp_path):
    """``python tests/mutants.py --check`` from the repository's root (``python``: the
    project's, first on ``PATH``): every mutant still applies to the code it mutates."""
    done = run(printed(ROOT / "docs" / "testing.md", "python tests/mutants.py --check"), ROOT)
    assert done.returncode == 0 and re.search(r"^\d+ mutants apply$", done.stdout, re.M), (
        done.stdout, done.stderr)


def test_the_guide_installs_the_version_shim_as_make_setup_does():
    """The operator guide's shim install is the one `make setup` runs (CI runs it)."""
    guide = printed(ROOT / "docs" / "operator-guide.md",
                    "pip install --no-deps --no-build-isolation adapters/vllm/dist_shim")
    make = (ROOT / "Makefile").read_text()
    assert guide.replace("pip install", "pip install -q").replace(" adapters/", " ./adapters/") in make


@pytest.mark.parametrize("command", ["python tests/mutants.py --only drop_peer_binding",
                                     "python tests/mutants.py --suite sim --only drop_peer_binding"])
def test_a_mutant_run_as_printed_is_killed_and_says_by_what(command):
    """One mutant through the CI suite, and through the simulator's searches alone: the
    table row says which test killed it, and the run exits 0 (1 only when one survives)."""
    done = run(printed(ROOT / "docs" / "testing.md", command), ROOT)
    assert done.returncode == 0, (done.stdout, done.stderr[-2000:])
    row = next(line for line in done.stdout.splitlines() if line.startswith("| `drop_peer"))
    first = row.rsplit("|", 2)[1].strip().strip("`")
    assert row.split("|")[3:5] == [" killed ", " killed "], row
    assert first.startswith("tests/test_") and "::" in first, row
    if "--suite sim" in command:
        from mutants import SIM_SUITE

        assert first.split("::")[0] in SIM_SUITE, row
    assert "1 of 1 killed by the suite" in done.stdout
