"""`kvhandoff simulate`: the command line contract (JSON fields, --check, repro, logs)."""

from __future__ import annotations

import os
import shlex
import sys

import orjson
import pytest
import structlog
import structlog.testing

from kvhandoff.adapters.cli import main
from kvhandoff.adapters.commands.simulate import COLUMNS
from kvhandoff.simulations.world import VIOLATION_METRICS

FIELDS = ("runs", "requests", "freed_under_read", "served_corrupt", "double_frees", "leaks",
          "stuck", "ignored_notifications", "log_hash", "requests_per_s", "violations")


def simulate_json(capsys, *args: str) -> tuple[int, dict]:
    rc = main(["simulate", *args, "--json"])
    return rc, orjson.loads(capsys.readouterr().out)


def test_json_has_every_field_the_issue_asks_for(capsys):
    rc, out = simulate_json(capsys, "--scenario", "steady_state", "--seeds", "0..4")
    assert rc == 0
    for name in FIELDS:
        assert name in out, name
    assert out["runs"] == 5 and out["requests"] > 0 and out["violations"] == []


def test_check_exits_1_and_every_violation_carries_a_command_that_reproduces_it(capsys, tmp_path):
    rc, out = simulate_json(capsys, "--scenario", "cancel_during_read", "--seeds", "0..9",
                            "--policy", "vllm-0.32", "--check")
    assert rc == 1
    assert out["freed_under_read"] > 0
    first = out["violations"][0]
    assert {"scenario", "seed", "invariant", "repro"} <= set(first)
    argv = shlex.split(first["repro"])
    assert argv[:2] == ["kvhandoff", "simulate"]
    argv = [a.replace("/tmp/kvh-repro", str(tmp_path)) for a in argv[1:]]
    rc2 = main([*argv, "--json"])
    again = orjson.loads(capsys.readouterr().out)
    assert rc2 == 1
    assert any(v["invariant"] == first["invariant"] and v["seed"] == first["seed"]
               for v in again["violations"])
    logs = sorted(p.name for p in tmp_path.iterdir())
    stem = f"cancel_during_read.vllm-0.32.s{first['seed']}"
    assert logs == [f"{stem}.D.jsonl", f"{stem}.P.jsonl"]
    # The logs it wrote are real event logs: replay --check sees the same race.
    rc3 = main(["replay", str(tmp_path / f"{stem}.P.jsonl"), str(tmp_path / f"{stem}.D.jsonl"),
                "--check", "--json"])
    replayed = orjson.loads(capsys.readouterr().out)
    assert rc3 == 1
    assert replayed["freed_under_read"] > 0
    assert {v["invariant"] for v in replayed["violations"]} >= {"heartbeat_gap"}


def test_policy_kvhandoff_passes_check_where_vllm_032_fails(capsys):
    rc, out = simulate_json(capsys, "--scenario", "cancel_during_read", "--seeds", "0..9",
                            "--check")
    assert rc == 0 and out["violations"] == [] and out["freed_under_read"] == 0


def test_the_human_summary_names_the_scenarios_and_says_when_all_is_well(capsys):
    assert main(["simulate", "--scenario", "tp2_split_reads", "--seeds", "3..5"]) == 0
    text = capsys.readouterr().out
    assert "tp2_split_reads" in text and "no violations" in text
    # a column for every metric a violation is counted by (served_unproven had none)
    header = text.splitlines()[1].split()
    assert len(header) == len(COLUMNS) + 1 and set(VIOLATION_METRICS) <= set(COLUMNS), header


@pytest.mark.parametrize("args", [["--seeds", "5..2"], ["--seeds", "x"],
                                  ["--scenario", "no_such_scenario"],
                                  ["--policy", "vllm-0.1"], ["--jobs", "1000"],
                                  ["--jobs", "-3"], ["--log-dir", ""]])
def test_bad_arguments_are_refused(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", *args])
    assert e.value.code == 2


def test_replay_of_a_simulate_log_dir_says_how_to_replay_its_runs(tmp_path, capsys):
    """The runs of a sweep reuse the engines' names: they are replayed one at a time, and
    `kvhandoff replay DIR` says so with the first run's two files (it said only that DIR
    held no engine log)."""
    logs = str(tmp_path)
    assert main(["simulate", "--scenario", "steady_state", "--seeds", "3..4",
                 "--log-dir", logs]) == 0
    capsys.readouterr()
    assert main(["replay", logs, "--check"]) == 2
    err = capsys.readouterr().err
    first = f"{logs}/steady_state.kvhandoff.s3"
    assert f"each replayed alone: {first}.P.jsonl {first}.D.jsonl" in err, err
    assert main(["replay", *err.rsplit(": ", 1)[1].split(), "--check"]) == 0


@pytest.mark.parametrize("where", ["a-file", "a-file/below"])
def test_a_log_dir_that_cannot_be_written_is_named_not_raised(tmp_path, capsys, where):
    (tmp_path / "a-file").write_bytes(b"")
    log_dir = str(tmp_path / where)
    assert main(["simulate", "--scenario", "steady_state", "--seeds", "0..0",
                 "--log-dir", log_dir]) == 2
    assert capsys.readouterr().err.startswith(f"kvhandoff simulate: --log-dir {log_dir}: ")


def test_a_reader_that_leaves_or_a_full_disk_is_no_traceback(tmp_path, capsys, monkeypatch):
    """``kvhandoff replay LOG | head`` (the pipe closes under the output) and a full disk
    (``> /dev/full``) raised tracebacks; now exit 1, with a word on stderr for the disk."""
    logs = tmp_path / "logs"
    assert main(["simulate", "--scenario", "swarm", "--seeds", "0..0", "--log-dir",
                 str(logs)]) == 0
    capsys.readouterr()
    replay = ["replay", f"{logs}/swarm.kvhandoff.s0.P.jsonl", f"{logs}/swarm.kvhandoff.s0.D.jsonl"]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    with open(write_end, "w") as gone:
        monkeypatch.setattr(sys, "stdout", gone)
        assert main(replay) == 1
        assert os.stat(gone.fileno()).st_rdev == os.stat(os.devnull).st_rdev  # quiet from now
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        assert main(["diagram"]) == 1
        assert sys.stdout is full  # given back as it was
    assert capsys.readouterr().err.startswith(
        "kvhandoff: cannot write the output: No space left on device")


def test_an_os_error_that_is_not_the_output_s_is_not_blamed_on_it(monkeypatch, tmp_path):
    """Only a failed write of stdout ends quietly; any other OSError stays the command's
    (here a sweep that cannot start its workers, with and without --log-dir)."""
    from kvhandoff.adapters.commands import simulate

    def sweep(*args, **kwargs):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(simulate, "sweep", sweep)
    for extra in ([], ["--log-dir", str(tmp_path)]):
        with pytest.raises(OSError, match="Function not implemented"):
            main(["simulate", "--scenario", "steady_state", "--seeds", "0..0", *extra])


def test_worker_processes_give_the_same_answer_as_one(capsys):
    _, one = simulate_json(capsys, "--scenario", "swarm", "--seeds", "0..63", "--jobs", "1")
    _, two = simulate_json(capsys, "--scenario", "swarm", "--seeds", "0..63", "--jobs", "2")
    assert one["log_hash"] == two["log_hash"] and one["requests"] == two["requests"]
    assert (one["jobs"], two["jobs"]) == (1, 2)


def test_the_simulated_engines_warnings_are_printed_only_when_asked(capsys):
    """A sweep's expected faults log thousands of `producer.lease_expired` lines: they are
    dropped unless --engine-logs, and structlog is left as it was either way."""
    before = structlog.get_config()
    args = ["--scenario", "lease_expiry_boundary", "--seeds", "0..1", "--jobs", "1"]
    with structlog.testing.capture_logs() as quiet:
        assert simulate_json(capsys, *args)[0] == 0
    with structlog.testing.capture_logs() as loud:
        assert simulate_json(capsys, *args, "--engine-logs")[0] == 0
    assert not [e for e in quiet if e["log_level"] != "error"]
    assert {"producer.lease_expired"} <= {e["event"] for e in loud}
    assert structlog.get_config() == before
