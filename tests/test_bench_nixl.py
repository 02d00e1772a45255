"""`kvhandoff bench nixl --device cpu --json` as docs/benchmarks.md prints it: same-host NIXL
READs on this machine, every row's bytes verified (the numbers are docs/benchmarks.md's; a
unit test times nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "kvhandoff bench nixl --device cpu --json"
pytestmark = pytest.mark.timeout(600)


def test_bench_nixl_on_this_host_reads_and_verifies_every_row():
    assert f" {COMMAND}\n" in (ROOT / "docs" / "benchmarks.md").read_text()
    kvhandoff = Path(sys.executable).with_name("kvhandoff")
    done = subprocess.run([str(kvhandoff), *COMMAND.split()[1:]], capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    rows = out["rows"]
    # The layouts the docs' table names: one 256 MiB region, 512 blocks, and the per-layer
    # and per-layer-and-K/V layouts of two real models (neighbours may coalesce).
    assert [r["descriptors"] for r in rows][:2] == [1, 512] and len(rows) == 4, rows
    assert rows[2]["descriptors"] > 8000 and rows[3]["descriptors"] > 60000, rows
    for r in rows:
        assert r["verified"] and r["bytes"] == 256 << 20, r
        assert r["read_GBps"] > 0 and r["baseline_GBps"] > 0 and r["path"], r
    assert out["registration_ms"] > 0 and out["regions"] > 0
    assert set(out["idle_cpu_percent_by_side"]) == {"p", "d"}
