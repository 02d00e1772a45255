"""``kvhandoff bench vllm`` in short, as docs/benchmarks.md runs it (``--co-located``) and
in its default mode (isolated) on a hybrid model (``--model gemma3``, as the README names).

Two requests per connector after one warm-up, both P/D pairs running all the
time: both connectors answered, D's tokens equal the reference for both, every
reported number is there, and the engines started NIXL's progress thread where
the default says (P only; the engines' own ``vllm.transport`` log lines).
About 30 s a mode on 2 cores (four engine starts).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

pytestmark = pytest.mark.timeout(600)

KVH, NIXL = "KVHandoffConnector", "NixlConnector (vLLM 0.32)"


# The docs' two forms: co-located on the tiny Llama, and the default (isolated: the pair
# not measured is stopped) on a hybrid model (`--model gemma3`, sliding-window groups).
MODES = {"co-located": ["--co-located"], "isolated-gemma3": ["--model", "gemma3"]}


@pytest.fixture(scope="module", params=list(MODES))
def result(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("bench-vllm")
    r = subprocess.run([sys.executable, "-m", "kvhandoff.adapters.cli", "bench", "vllm", "--json",
                        *MODES[request.param], "--requests", "2", "--warmup", "1",
                        "--idle-seconds", "0.5", "--workdir", str(workdir)],
                       capture_output=True, text=True, timeout=540, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout), workdir, request.param


def test_both_connectors_hand_off_and_decode_the_reference_tokens(result):
    out, _, mode = result
    rows = {row["connector"]: row for row in out["rows"]}
    assert set(rows) == {KVH, NIXL} and out["isolated"] == (mode != "co-located")
    for row in rows.values():
        assert row["requests"] == 2 and row["tokens_match"] is True, row
        for key in ("d_ttft_ms_median", "transfer_ms_median", "p_idle_cpu_percent",
                    "d_idle_cpu_percent"):
            assert row[key] >= 0, (row["connector"], key)
        assert row["d_ttft_ms_median"] > 0 and row["transfer_ms_median"] > 0
    assert out["ratio_d_ttft"] > 0 and out["ratio_transfer"] > 0
    assert out["settings"]["progress_thread"] == "p"


def test_nixl_s_progress_thread_runs_on_p_only_by_default(result):
    _, workdir, _ = result
    chosen = {}
    for side in ("P", "D"):
        text = (Path(workdir) / "kvhandoff" / f"{side}-kvhandoff.engine.log").read_text()
        found = re.findall(r"vllm\.transport .*progress_thread=(True|False)", text)
        assert found, f"{side}'s engine log names no transport"
        chosen[side] = set(found)
    assert chosen == {"P": {"True"}, "D": {"False"}}
