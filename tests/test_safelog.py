"""kvhandoff's log lines, as vLLM leaves structlog configured, show what clients and peers
wrote escaped and bounded (`core.safelog`)."""

from __future__ import annotations

import io

import structlog

from kvhandoff.core.errors import GeometryMismatch
from kvhandoff.core.safelog import MAX_CHARS, bounded_repr, get_logger

# No space, '=' or quote: structlog's console renderer writes such a value unquoted, as is.
FORGED = "id\x1b[1A\x1b[2K\x1b[1G2030-01-01_[info_____]_vllm.worker.all_clear\u2028\x85"


def _rendered(call) -> str:
    """What ``call(logger)`` writes with structlog's default processors (its console
    renderer: `vllm serve` configures none) into a buffer."""
    out = io.StringIO()
    before = structlog.get_config()
    structlog.reset_defaults()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(out),
                        processors=[p for p in structlog.get_config()["processors"]
                                    if not isinstance(p, structlog.dev.ConsoleRenderer)]
                        + [structlog.dev.ConsoleRenderer(colors=False)])
    try:
        call(get_logger("test"))
    finally:
        structlog.configure(**before)
    return out.getvalue()


def test_a_client_written_id_cannot_draw_a_line_of_its_own():
    text = _rendered(lambda log: log.error("vllm.worker.request_failed",
                                           local_request_id=FORGED, reason="bad"))
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text.isprintable() or text[:-1].isprintable()
    assert "\x1b" not in text and "\u2028" not in text and "\x85" not in text
    assert "local_request_id=id\\x1b[1A\\x1b[2K" in text


def test_a_huge_string_is_cut_and_its_length_said():
    text = _rendered(lambda log: log.warning("vllm.side_channel.refused", error="A" * 10_000_000))
    assert len(text) < MAX_CHARS + 200
    assert "... (10000000 chars)" in text


def test_ordinary_values_are_passed_as_they_are():
    text = _rendered(lambda log: log.info("producer.lease_expired", request_id="cmpl-1-ab",
                                          lease_s=30.0, ranks=(0, 1)))
    assert "request_id=cmpl-1-ab" in text and "lease_s=30.0" in text and "ranks=(0, 1)" in text


def test_an_error_naming_a_peer_s_value_is_bounded():
    e = GeometryMismatch("peer P: block_size", 16, "B" * 10_000_000)
    assert len(str(e)) < 300 and "peer P: block_size: expected 16, found 'BBB" in str(e)
    assert bounded_repr("\x1b" * 3) == repr("\x1b" * 3)
