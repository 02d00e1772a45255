"""A small SVG picture of request timelines (`core.trace`), for the docs and for a report.

`render_svg` draws one panel per (title, `Timeline`), side by side, on one
time scale (each panel's time starts at its first shown event).  Per request
and stream: P's ``prefill`` and ``lease`` on one row; D's ``request`` on one
row and each READ split on a row of its own (``split i · P<rank>``, and
``g<group>`` for a hybrid model's groups).  Marks: heartbeats (ticks; grey
lines are the ``heartbeat`` arrows from D's send to P's receipt),
acknowledgements (dots: green alive, red gone), client cancels (red cross),
lease expiries (orange diamond), rejections, aborts and failed splits (red
triangle, with the reason), and P's ``freed`` (a dashed red line across the
request's rows).  The part of a split that ran on after its P rank freed the
source is drawn red: that is "P frees under the READ".

Every string from a log goes through `printable` and is XML-escaped.  Pure:
returns the document as a string.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from kvhandoff.core.events import Side
from kvhandoff.core.safelog import printable
from kvhandoff.core.trace import Mark, Timeline

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
LABEL_W, PLOT_W, RIGHT_PAD, GAP = 118, 400, 16, 24
ROW_H, BAR_H, TITLE_H, HEAD_H, AXIS_H, LEGEND_ROW = 20, 10, 30, 18, 30, 16
PANEL_W = LABEL_W + PLOT_W + RIGHT_PAD
COLOURS = {"prefill": "#a6bddb", "lease": "#3b6fb6", "request": "#5aa05a", "split": "#f0a53c",
           "split_failed": "#c0392b", "after_free": "#d62728", "tick": "#333333",
           "arrow": "#9a9a9a", "alive": "#2e8b57", "gone": "#d62728", "cancel": "#d62728",
           "expired": "#e67e22", "freed": "#d62728", "problem": "#c0392b", "text": "#222222",
           "muted": "#666666", "grid": "#e6e6e6"}


def _text(s: object, limit: int = 0) -> str:
    t = printable(s)
    if limit and len(t) > limit:
        t = t[:limit - 1] + "…"
    return escape(t, {'"': "&quot;"})


def _f(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _step(span: float) -> float:
    """A round tick step giving at most 8 ticks over ``span`` seconds."""
    if span <= 0:
        return 1.0
    raw = span / 8
    k = 10 ** math.floor(math.log10(raw))
    return next(m * k for m in (1, 2, 5, 10) if m * k >= raw)


def _tick_label(v: float, step: float) -> str:
    if step >= 1:
        return f"{v:g} s"
    return f"{v * 1000:.{max(0, -math.floor(math.log10(step * 1000)))}f} ms"


class _Panel:
    """One panel's rows: (label, kind, stream, request, split) laid out top to bottom."""

    def __init__(self, title: str, tl: Timeline, request: str | None) -> None:
        self.title, self.tl = title, tl
        wanted = [request] if request is not None else tl.request_ids()
        self.spans = [s for s in tl.spans if s.request_id in wanted]
        self.marks = [m for m in tl.marks if m.request_id in wanted]
        self.arrows = [a for a in tl.arrows if a.name == "heartbeat" and a.src.request_id in wanted]
        times = [s.start for s in self.spans] + [s.end for s in self.spans] + [m.t for m in self.marks]
        self.t0 = min(times, default=0.0)
        self.t1 = max(times, default=0.0)
        self.rows: list[tuple[str, str, object, str, int]] = []  # label, kind, stream, rid, split
        hybrid = any(s.args.get("group") for s in self.spans if s.name == "split")
        for rid in wanted:
            streams = [s for s in tl.streams if rid in tl.requests[s]]
            if request is None:
                self.rows.append((rid, "head", None, rid, -1))
            for stream in streams:
                self.rows.append((str(stream), "main", stream, rid, -1))
                if stream.side is Side.D:
                    splits = sorted({(s.split, s.args["p_rank"], s.args["group"])
                                     for s in self.spans
                                     if s.stream == stream and s.request_id == rid
                                     and s.name == "split"})
                    seen = set()
                    for i, rank, group in splits:
                        if i in seen:
                            continue
                        seen.add(i)
                        label = f"split {i} · P{rank}" + (f" · g{group}" if hybrid else "")
                        self.rows.append((label, "split", stream, rid, i))
        self.height = TITLE_H + sum(HEAD_H if k == "head" else ROW_H for _, k, *_ in self.rows)


def render_svg(panels: Sequence[tuple[str, Timeline]], request: str | None = None) -> str:
    """An SVG document: one panel per (title, timeline), side by side; ``request``: only it."""
    laid = [_Panel(title, tl, request) for title, tl in panels]
    span = max((p.t1 - p.t0 for p in laid), default=0.0) or 1.0
    width = len(laid) * PANEL_W + (len(laid) - 1) * GAP
    plot_h = max((p.height for p in laid), default=TITLE_H)
    legend = _legend(plot_h + AXIS_H + 6, width)
    height = plot_h + AXIS_H + 6 + legend[0] * LEGEND_ROW + 4
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="{FONT}" font-size="11">',
           "<defs><marker id=\"arrowhead\" viewBox=\"0 0 6 6\" refX=\"5\" refY=\"3\" "
           "markerWidth=\"5\" markerHeight=\"5\" orient=\"auto\"><path d=\"M0,0 L6,3 L0,6 z\" "
           f"fill=\"{COLOURS['arrow']}\"/></marker></defs>",
           f"<title>{_text(' | '.join(p.title for p in laid))}</title>",
           f'<rect width="{width}" height="{height}" fill="white"/>']
    for n, panel in enumerate(laid):
        left = n * (PANEL_W + GAP)
        out += _draw_panel(panel, left, span, plot_h)
    out += legend[1]
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _draw_panel(panel: _Panel, left: float, span: float, plot_h: float) -> list[str]:
    x0 = left + LABEL_W

    def x(t: float) -> float:
        return x0 + (t - panel.t0) / span * PLOT_W

    out = ['<g class="panel">',
           f'<text x="{_f(left + 4)}" y="18" font-size="13" font-weight="bold" '
           f'fill="{COLOURS["text"]}">{_text(panel.title)}</text>']
    # time grid and axis
    step = _step(span)
    axis_y = plot_h + 4
    v = 0.0
    while v <= span + 1e-9:
        gx = x0 + v / span * PLOT_W
        out.append(f'<line x1="{_f(gx)}" y1="{TITLE_H}" x2="{_f(gx)}" y2="{_f(axis_y)}" '
                   f'stroke="{COLOURS["grid"]}"/>')
        label = _tick_label(v, step)
        anchor = "end" if gx + 3 * len(label) > left + PANEL_W else "middle"
        out.append(f'<text x="{_f(gx)}" y="{_f(axis_y + 13)}" text-anchor="{anchor}" '
                   f'fill="{COLOURS["muted"]}" font-size="10">{label}</text>')
        v = round(v + step, 12)
    out.append(f'<line x1="{_f(x0)}" y1="{_f(axis_y)}" x2="{_f(x0 + PLOT_W)}" y2="{_f(axis_y)}" '
               f'stroke="{COLOURS["muted"]}"/>')
    out.append(f'<text x="{_f(x0 + PLOT_W)}" y="{_f(axis_y + 25)}" text-anchor="end" '
               f'fill="{COLOURS["muted"]}" font-size="10">time since the first event shown'
               f'</text>')
    # rows
    y = TITLE_H
    row_y: dict[tuple, float] = {}  # (stream, rid, split) -> row centre
    req_rows: dict[str, list[float]] = {}
    for label, kind, stream, rid, split in panel.rows:
        if kind == "head":
            out.append(f'<text x="{_f(left + 4)}" y="{_f(y + 13)}" font-weight="bold" '
                       f'fill="{COLOURS["text"]}">request {_text(rid, 40)}</text>')
            y += HEAD_H
            continue
        cy = y + ROW_H / 2
        row_y[stream, rid, split] = cy
        req_rows.setdefault(rid, []).append(cy)
        indent = 4 if kind == "main" else 14
        colour = COLOURS["text"] if kind == "main" else COLOURS["muted"]
        out.append(f'<text x="{_f(left + indent)}" y="{_f(cy + 4)}" fill="{colour}">'
                   f'{_text(label, 18)}</text>')
        y += ROW_H
    # where P freed each request's source, per (P engine, P rank, request)
    freed_at: dict[tuple, float] = {}
    for m in panel.marks:
        if m.kind == "freed":
            freed_at.setdefault((m.stream.engine, m.stream.rank, m.request_id), m.t)
    # spans
    for s in panel.spans:
        split = s.split if s.name == "split" else -1
        cy = row_y.get((s.stream, s.request_id, split))
        if cy is None:
            continue
        h = BAR_H if s.name != "prefill" else BAR_H * 0.6
        colour = COLOURS["split_failed"] if s.end_args.get("result") == "failed" else COLOURS[s.name]
        x1, x2 = x(s.start), max(x(s.end), x(s.start) + 1.5)
        out.append(f'<rect x="{_f(x1)}" y="{_f(cy - h / 2)}" width="{_f(x2 - x1)}" '
                   f'height="{_f(h)}" fill="{colour}" rx="1.5"><title>{_text(s.name)} '
                   f'{_text(s.request_id)} {_f(s.start - panel.t0)}–{_f(s.end - panel.t0)} s'
                   f'</title></rect>')
        if s.name == "split":
            t_free = freed_at.get((s.args.get("p_engine"), s.args.get("p_rank"), s.request_id))
            if t_free is not None and s.start < t_free < s.end:
                fx = x(t_free)
                out.append(f'<rect x="{_f(fx)}" y="{_f(cy - h / 2)}" width="{_f(x2 - fx)}" '
                           f'height="{_f(h)}" fill="{COLOURS["after_free"]}" rx="1.5">'
                           f'<title>read on after P freed its source</title></rect>')
                out.append(f'<text x="{_f(fx + 3)}" y="{_f(cy - h / 2 - 2)}" font-size="9" '
                           f'fill="{COLOURS["after_free"]}">read after P freed</text>')
    # P's frees, across the request's rows (one label where several frees meet)
    last_label: dict[str, float] = {}
    for (_, _, rid), t in sorted(freed_at.items(), key=lambda kv: kv[1]):
        ys = req_rows.get(rid)
        if ys:
            fx = x(t)
            top = min(ys) - ROW_H / 2
            out.append(f'<line x1="{_f(fx)}" y1="{_f(top)}" x2="{_f(fx)}" '
                       f'y2="{_f(max(ys) + ROW_H / 2)}" stroke="{COLOURS["freed"]}" '
                       f'stroke-dasharray="3,2" stroke-width="1"/>')
            if fx - last_label.get(rid, -math.inf) > 40:
                last_label[rid] = fx
                out.append(f'<text x="{_f(fx - 3)}" y="{_f(top + 1)}" text-anchor="end" '
                           f'font-size="9" fill="{COLOURS["freed"]}">P freed</text>')
    # heartbeat arrows, D's send to P's receipt
    for a in panel.arrows:
        ys, yd = row_y.get((a.src.stream, a.src.request_id, -1)), row_y.get(
            (a.dst.stream, a.dst.request_id, -1))
        if ys is None or yd is None:
            continue
        end = yd + (BAR_H / 2 + 1 if yd < ys else -(BAR_H / 2 + 1))
        out.append(f'<line x1="{_f(x(a.src.t))}" y1="{_f(ys)}" x2="{_f(x(a.dst.t))}" '
                   f'y2="{_f(end)}" stroke="{COLOURS["arrow"]}" stroke-width="0.8" '
                   f'marker-end="url(#arrowhead)"/>')
    # marks
    labelled: set[tuple] = set()
    for m in panel.marks:
        cy = row_y.get((m.stream, m.request_id, -1))
        if cy is None:
            continue
        out += _mark(m, x(m.t), cy, labelled, x0 + PLOT_W + RIGHT_PAD)
    out.append("</g>")
    return out


def _mark(m: Mark, mx: float, cy: float, labelled: set, right: float) -> list[str]:
    k = m.kind
    title = f"<title>{_text(k)} t={m.t:.6f}</title>"
    if k in ("heartbeat_sent", "heartbeat_received"):
        return [f'<line x1="{_f(mx)}" y1="{_f(cy - 6)}" x2="{_f(mx)}" y2="{_f(cy + 6)}" '
                f'stroke="{COLOURS["tick"]}" stroke-width="1">{title}</line>']
    if k == "lease_acknowledged":
        colour = COLOURS["alive"] if m.args.get("time_left", 0) > 0 else COLOURS["gone"]
        return [f'<circle cx="{_f(mx)}" cy="{_f(cy + 8)}" r="1.8" fill="{colour}">{title}'
                f'</circle>']
    if k == "client_cancelled":
        out = [f'<path d="M{_f(mx - 4)},{_f(cy - 4)} L{_f(mx + 4)},{_f(cy + 4)} '
               f'M{_f(mx - 4)},{_f(cy + 4)} L{_f(mx + 4)},{_f(cy - 4)}" '
               f'stroke="{COLOURS["cancel"]}" stroke-width="2">{title}</path>']
        return out + _label(m, mx, cy, "cancel", COLOURS["cancel"], labelled, right)
    if k == "lease_expired":
        out = [f'<path d="M{_f(mx)},{_f(cy - 5)} L{_f(mx + 5)},{_f(cy)} L{_f(mx)},{_f(cy + 5)} '
               f'L{_f(mx - 5)},{_f(cy)} z" fill="{COLOURS["expired"]}">{title}</path>']
        return out + _label(m, mx, cy, "lease expired", COLOURS["expired"], labelled, right)
    if k in ("rejected", "aborted", "split_failed"):
        why = m.args.get("reason", "")
        out = [f'<path d="M{_f(mx)},{_f(cy - 5)} L{_f(mx + 5)},{_f(cy + 4)} '
               f'L{_f(mx - 5)},{_f(cy + 4)} z" fill="{COLOURS["problem"]}">{title}</path>']
        return out + _label(m, mx, cy, f"{k}: {why}", COLOURS["problem"], labelled, right)
    return []


def _label(m: Mark, mx: float, cy: float, text: str, colour: str, labelled: set,
           right: float) -> list[str]:
    """``text`` (from the log: escaped here) beside a mark, once per stream, request and kind;
    to its left where it would run past the panel's right edge."""
    key = (m.stream, m.request_id, m.kind)
    if key in labelled:
        return []
    labelled.add(key)
    shown = _text(text, 48)
    if mx + 6 + 5 * len(printable(text)[:48]) > right:
        return [f'<text x="{_f(mx - 6)}" y="{_f(cy - 5)}" text-anchor="end" font-size="9" '
                f'fill="{colour}">{shown}</text>']
    return [f'<text x="{_f(mx + 6)}" y="{_f(cy - 5)}" font-size="9" fill="{colour}">'
            f'{shown}</text>']


def _legend(y: float, width: float) -> tuple[int, list[str]]:
    """(rows, elements) of the legend, wrapped to ``width``."""
    items = [("rect", COLOURS["prefill"], "prefill (P)"), ("rect", COLOURS["lease"], "lease (P)"),
             ("rect", COLOURS["request"], "request (D)"), ("rect", COLOURS["split"], "READ split"),
             ("rect", COLOURS["after_free"], "read after P freed"),
             ("tick", COLOURS["tick"], "heartbeat sent / received (grey arrow: D to P)"),
             ("dot", COLOURS["alive"], "P's answer (green: alive, red: gone)"),
             ("cross", COLOURS["cancel"], "client cancel"),
             ("diamond", COLOURS["expired"], "lease expired"),
             ("dash", COLOURS["freed"], "P freed")]
    out = ['<g class="legend" font-size="10">']
    x, row = 8.0, 0
    for shape, colour, label in items:
        w = 22 + 6 * len(label)
        if x + w > width:
            x, row = 8.0, row + 1
        cy = y + 8 + row * 16
        if shape == "rect":
            out.append(f'<rect x="{_f(x)}" y="{_f(cy - 5)}" width="14" height="10" '
                       f'fill="{colour}" rx="1.5"/>')
        elif shape == "tick":
            out.append(f'<line x1="{_f(x + 7)}" y1="{_f(cy - 6)}" x2="{_f(x + 7)}" '
                       f'y2="{_f(cy + 6)}" stroke="{colour}"/>')
        elif shape == "cross":
            out.append(f'<path d="M{_f(x + 3)},{_f(cy - 4)} L{_f(x + 11)},{_f(cy + 4)} '
                       f'M{_f(x + 3)},{_f(cy + 4)} L{_f(x + 11)},{_f(cy - 4)}" '
                       f'stroke="{colour}" stroke-width="2"/>')
        elif shape == "dot":
            out.append(f'<circle cx="{_f(x + 7)}" cy="{_f(cy)}" r="2.5" fill="{colour}"/>')
        elif shape == "diamond":
            out.append(f'<path d="M{_f(x + 7)},{_f(cy - 5)} L{_f(x + 12)},{_f(cy)} '
                       f'L{_f(x + 7)},{_f(cy + 5)} L{_f(x + 2)},{_f(cy)} z" fill="{colour}"/>')
        else:
            out.append(f'<line x1="{_f(x + 7)}" y1="{_f(cy - 6)}" x2="{_f(x + 7)}" '
                       f'y2="{_f(cy + 6)}" stroke="{colour}" stroke-dasharray="3,2"/>')
        out.append(f'<text x="{_f(x + 18)}" y="{_f(cy + 4)}" fill="{COLOURS["text"]}">'
                   f'{escape(label)}</text>')
        x += w
    out.append("</g>")
    return row + 1, out

