"""kvhandoff's log lines, as vLLM leaves structlog configured, show what clients and peers
wrote escaped and bounded (`core.safelog`)."""

from __future__ import annotations

import pathlib
import re

import structlog
from structlog.testing import capture_logs

from kvhandoff.core.errors import GeometryMismatch
from kvhandoff.core.safelog import MAX_CHARS, bounded_repr, get_logger, shown

ROOT = pathlib.Path(__file__).resolve().parents[1]
# No space, '=' or quote: structlog's console renderer writes such a value unquoted, as is.
FORGED = "id\x1b[1A\x1b[2K\x1b[1G2030-01-01_[info_____]_vllm.worker.all_clear\u2028\x85"


def _rendered(call) -> str:
    """What ``call(logger)`` writes through structlog's console renderer, the renderer of
    its default configuration (`vllm serve` configures none), without touching the
    process's structlog configuration."""
    with capture_logs() as logs:
        call(get_logger("test"))
    render = structlog.dev.ConsoleRenderer(colors=False)
    return "".join(render(None, e.pop("log_level"), e) + "\n" for e in logs)


def test_a_client_written_id_cannot_draw_a_line_of_its_own():
    text = _rendered(lambda log: log.error("vllm.worker.request_failed",
                                           local_request_id=FORGED, reason="bad"))
    assert text.count("\n") == 1 and text[:-1].isprintable()
    assert "local_request_id=id\\x1b[1A\\x1b[2K" in text


def test_a_literal_backslash_escape_reads_apart_from_an_escaped_control_character():
    assert shown("a\x1b") != shown("a\\x1b")
    text = _rendered(lambda log: log.info("x", a="a\x1b", b="a\\x1b"))
    assert "a=a\\x1b" in text and "b=a\\\\x1b" in text


def test_a_huge_string_is_cut_before_it_is_escaped_and_its_length_said():
    text = _rendered(lambda log: log.warning("vllm.side_channel.refused", error="A" * 10_000_000))
    assert len(text) < MAX_CHARS + 200 and "... (10000000 chars)" in text
    escaped = shown("\x1b" * 10_000_000)  # a pass over 10 MB took seconds
    assert escaped == "\\x1b" * MAX_CHARS + "... (10000000 chars)"


def test_ordinary_values_are_passed_as_they_are():
    text = _rendered(lambda log: log.info("producer.lease_expired", request_id="cmpl-1-ab",
                                          lease_s=30.0, ranks=(0, 1)))
    assert "request_id=cmpl-1-ab" in text and "lease_s=30.0" in text and "ranks=(0, 1)" in text


def test_an_error_naming_a_peer_s_value_is_bounded():
    e = GeometryMismatch("peer P: block_size", 16, "B" * 10_000_000)
    assert len(str(e)) < 300 and "peer P: block_size: expected 16, found 'BBB" in str(e)
    assert bounded_repr("\x1b" * 3) == repr("\x1b" * 3)


def test_no_kvhandoff_module_logs_around_it():
    """Every logger of the product is `get_logger`'s: one that calls structlog itself
    writes what a client sent as it is."""
    product = [p for d in ("core", "adapters", "transports", "simulations")
               for p in (ROOT / d).rglob("*.py")]
    assert len(product) > 50
    offenders = [str(p.relative_to(ROOT)) for p in product if p.name != "safelog.py"
                 and re.search(r"structlog\.(get_logger|wrap_logger)\(", p.read_text())]
    assert offenders == []
