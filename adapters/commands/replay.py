"""`kvhandoff replay LOG [LOG ...] [--request ID] [--until SEQ] [--check] [--partial] [--json]
[--trace FILE] [--svg FILE]`.

A LOG that is a directory stands for the engine logs in it (`core.log.logs_in`:
each rank's ``<engine_id>.<P|D><rank>.jsonl``, as the connector's ``log_dir``
holds them; a restarted engine's predecessor is left out).

The text output passes every string that came from a log (request and engine
ids, reasons, a violation's event and detail, a corrupt log's message) through
`printable`: clients write some of them, and one event must stay one line with
no control character reaching the terminal.  ``--json`` carries them exactly
(JSON escapes them).

``--trace FILE`` writes the logs as Chrome trace-event JSON (`core.trace`:
open it in ui.perfetto.dev or chrome://tracing) and ``--svg FILE`` as a
picture (`core.svg`); ``--request`` and ``--until`` narrow both as they narrow
the timeline.  With either, the text output prints where they went instead of
the per-request timeline (the summary and ``--check`` are unchanged);
``--json`` adds ``trace`` / ``svg`` (the paths) to its object.
"""

from __future__ import annotations

import os
import sys

import orjson

from kvhandoff.core.errors import LogCorrupt
from kvhandoff.core.log import logs_in, read_logs
from kvhandoff.core.replay import render_timeline, replay
from kvhandoff.core.safelog import printable


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="fold event logs, show timelines, check invariants")
    p.add_argument("logs", nargs="+", metavar="LOG",
                   help="event logs (P's and D's together), or log_dir directories: each "
                        "engine rank's current log in them")
    p.add_argument("--request", metavar="ID", help="only this request's timeline")
    p.add_argument("--until", type=int, metavar="SEQ", help="fold each stream up to SEQ")
    p.add_argument("--check", action="store_true",
                   help="exit 1 on any invariant violation, or when a P log D's requests "
                        "name is missing (unless --partial)")
    p.add_argument("--partial", action="store_true",
                   help="accept logs without the P engines D's requests name")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", metavar="FILE",
                   help="write Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing)")
    p.add_argument("--svg", metavar="FILE", help="write the timeline as an SVG picture")


def log_files(paths: list[str]) -> list[str]:
    """``paths`` with each directory replaced by the engine logs in it (none: `FileNotFoundError`)."""
    files: list[str] = []
    for path in paths:
        if not os.path.isdir(path):
            files.append(path)
            continue
        found = logs_in(path)
        if not found:
            runs = sorted(name[:-len(".P.jsonl")] for name in os.listdir(path)
                          if name.endswith(".P.jsonl"))
            first = os.path.join(path, runs[0]) if runs else ""
            hint = (f"; it holds `kvhandoff simulate --log-dir` runs, each replayed alone: "
                    f"{first}.P.jsonl {first}.D.jsonl" if runs else "")
            raise FileNotFoundError(f"{path}: no engine log in this directory "
                                    f"(<engine_id>.<P|D><rank>.jsonl){hint}")
        files.extend(found)
    return files


def _refuse(message: str) -> int:
    print(f"kvhandoff replay: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    try:
        files = log_files(args.logs)
        events = read_logs(files)
    except (LogCorrupt, OSError) as e:
        return _refuse(printable(e))
    for option in ("trace", "svg"):
        out = getattr(args, option)
        if out and any(_same_file(out, f) for f in files):
            return _refuse(f"--{option} {printable(out)} is one of the logs replayed: "
                           f"it would be overwritten")
        why = out and _unwritable(out)
        if why:  # checked before anything is written: no --trace left behind a bad --svg
            return _refuse(f"--{option} {printable(out)}: {why}")
    if args.request is not None and not any(e.request_id == args.request for e in events):
        return _refuse(f"--request {printable(args.request)}: no event of this request "
                       f"in the logs")
    drawn = args.trace or args.svg
    result = replay(events, request=args.request, until=args.until,
                    keep_timeline=not (args.json or drawn))
    summary = result.summary()
    if args.check and not summary["events"]:  # an empty log, or --until before every event
        return _refuse("--check: no event was folded: nothing was checked")
    written: dict[str, str] = {}
    if drawn:
        try:
            written = write_pictures(events, args)
        except _WriteFailed as e:
            return _refuse(printable(e))
        summary.update(written)
    missing = summary["missing_producers"]
    shown_missing = ", ".join(printable(engine) for engine in missing)
    summary["partial"] = bool(args.partial)
    if args.json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    else:
        for what, path in written.items():
            print(f"{what} written to {printable(path)}" + (
                " (open it in ui.perfetto.dev or chrome://tracing)" if what == "trace" else ""))
        if not written:
            print(render_timeline(result.timeline))
        print(f"\n{summary['events']} events, {summary['requests']} requests, "
              f"states {printable(summary['states'])}, ignored notifications "
              f"{summary['ignored_notifications']}, freed under read "
              f"{summary['freed_under_read']}, state hash {summary['state_hash']}")
        for v in result.violations:
            print(f"VIOLATION {printable(v.invariant)}: {printable(v.event)}: "
                  f"{printable(v.detail)}")
        if missing:
            print(f"WARNING: D's requests read from P engine(s) {shown_missing} whose log "
                  f"was not given: the cross-engine checks (served_freed, freed_under_read) "
                  f"did not see their side")
    if args.check and missing and not args.partial:
        print(f"kvhandoff replay --check: no log of P engine(s) {shown_missing}; pass "
              f"them too, or --partial to check D's side alone", file=sys.stderr)
        return 1
    if args.check and result.violations:
        first = result.violations[0]
        print(f"kvhandoff replay --check: {len(result.violations)} violation(s); first: "
              f"{printable(first.invariant)} at {printable(first.event)}: "
              f"{printable(first.detail)}", file=sys.stderr)
        return 1
    return 0


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def _unwritable(path: str) -> str:
    """Why ``path`` cannot be written, or "" when it looks as if it can."""
    if os.path.isdir(path):
        return "is a directory"
    if os.path.exists(path):
        return "" if os.access(path, os.W_OK) else "permission denied"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return "no such directory"
    return "" if os.access(parent, os.W_OK | os.X_OK) else "permission denied"


class _WriteFailed(Exception):
    """``--trace`` or ``--svg`` could not be written (named, with why)."""


def _write(option: str, path: str, data: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise _WriteFailed(f"--{option} {path}: {e.strerror or e}") from None


def write_pictures(events: list, args) -> dict[str, str]:
    """Write ``--trace`` and ``--svg`` for ``events`` narrowed as the timeline is; their paths."""
    from kvhandoff.core.svg import render_svg
    from kvhandoff.core.trace import timeline, trace_events

    if args.until is not None:
        events = [e for e in events if e.seq <= args.until]
    if args.request is not None:
        events = [e for e in events if e.request_id == args.request]
    tl = timeline(events)
    outputs: list[tuple[str, str, bytes]] = []
    if args.trace:
        # No displayTimeUnit: Perfetto reads ts in that unit (the format says it only
        # sets the display), so "ms" would stretch the trace a thousandfold there.
        doc = {"traceEvents": trace_events(tl),
               "otherData": {"source": "kvhandoff replay --trace",
                             "clock": "each engine's own clock, as logged (ts = t x 10^6)"}}
        outputs.append(("trace", args.trace, orjson.dumps(doc)))
    if args.svg:
        title = ", ".join(sorted({str(s) for s in tl.streams}))
        outputs.append(("svg", args.svg,
                        render_svg([(title, tl)], request=args.request).encode()))
    made: list[str] = []  # files this run created: removed if a later one cannot be written
    try:
        for option, path, data in outputs:
            new = not os.path.lexists(path)
            _write(option, path, data)
            if new:
                made.append(path)
    except _WriteFailed:
        for path in made:
            os.unlink(path)
        raise
    return {option: path for option, path, _ in outputs}
