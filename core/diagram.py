"""Mermaid state diagrams generated from the lifecycle's `transitions.Machine`s."""

from __future__ import annotations

from kvhandoff.core.events import Side
from kvhandoff.core.lifecycle import TERMINAL, build_machine

_TITLES = {Side.P: "Producer (P), per request and P rank",
           Side.D: "Consumer (D), per request and D rank"}


def mermaid(side: Side) -> str:
    """One side's lifecycle as a ``stateDiagram-v2``; NEW is drawn as the start."""
    machine = build_machine(side)
    edges: dict[tuple[str, str], list[str]] = {}
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            for t in transitions:
                label = trigger
                if t.conditions:
                    label += f" [{t.conditions[0].func.lstrip('_')}]"
                elif t.prepare and t.prepare[0].startswith("ignore"):
                    label += " (ignored, counted)"
                dest = t.dest if t.dest is not None else source
                edges.setdefault((source, dest), []).append(label)
    lines = ["stateDiagram-v2", f"    %% {_TITLES[side]}"]
    for (source, dest), labels in edges.items():
        src = "[*]" if source == "NEW" else source
        dst = "[*]" if dest == "NEW" else dest
        if src == dst == "[*]":
            continue  # notifications for unknown requests: counted, no state
        lines.append(f"    {src} --> {dst}: {', '.join(sorted(set(labels)))}")
    for state in sorted(TERMINAL):
        if state in machine.states:
            lines.append(f"    {state} --> [*]")
    return "\n".join(lines)


def lifecycle_markdown() -> str:
    parts = []
    for side in Side:
        parts.append(f"### {_TITLES[side]}\n\n```mermaid\n{mermaid(side)}\n```\n")
    return "\n".join(parts)
