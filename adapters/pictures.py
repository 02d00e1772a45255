"""The pictures in the docs that are drawn from simulator runs, and how to redraw them.

``cancel_during_read_svg`` is docs/img/cancel_during_read.svg: the simulator's
``cancel_during_read`` scenario, one seed and one request, under the vLLM
0.32 policy model (D stops heartbeating at the client's cancel; P's lease
runs out and P frees the blocks while the READ still copies them) and under
kvhandoff's (D heartbeats until the READ drains; P frees after it), side by
side on one time scale, drawn by `core.svg` from `core.trace`'s timeline of
the two runs' event logs.  A test checks that the committed file is what
this draws; redraw it with::

    python -m kvhandoff.adapters.pictures docs/img/cancel_during_read.svg
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import structlog

from kvhandoff.core.log import read_logs
from kvhandoff.core.svg import render_svg
from kvhandoff.core.trace import Timeline, timeline
from kvhandoff.simulations.runner import log_paths, run_one

SCENARIO, SEED, REQUEST = "cancel_during_read", 0, "req-0"
TITLES = {"vllm-0.32": "vLLM 0.32: P frees under the READ",
          "kvhandoff": "kvhandoff: heartbeats until the READ drains"}


def simulated_timeline(scenario: str, seed: int, policy: str) -> Timeline:
    """The timeline of one simulator run, read back from its event logs as replay reads them."""
    result = run_one(scenario, seed, policy)
    with tempfile.TemporaryDirectory(prefix="kvh-picture-") as tmp:
        paths = log_paths(tmp, scenario, seed, policy)
        for path, data in zip(paths, (result.p_log, result.d_log), strict=True):
            with open(path, "wb") as f:
                f.write(data)
        return timeline(read_logs(paths))


def cancel_during_read_svg() -> str:
    return render_svg([(TITLES[policy], simulated_timeline(SCENARIO, SEED, policy))
                       for policy in ("vllm-0.32", "kvhandoff")], request=REQUEST)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvhandoff.adapters.pictures",
                                     description="Redraw the docs' cancel-during-read picture.")
    parser.add_argument("out", nargs="?", default=os.path.join("docs", "img", "cancel_during_read.svg"),
                        help="the SVG file to write (default: %(default)s)")
    out = parser.parse_args(argv).out
    if not structlog.is_configured():  # the simulated engines' warnings: stderr, not stdout
        structlog.configure(logger_factory=lambda *_: structlog.PrintLogger(sys.stderr))
    with open(out, "w", encoding="utf-8") as f:
        f.write(cancel_during_read_svg())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
