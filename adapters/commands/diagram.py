"""`kvhandoff diagram [--side P|D]`: the lifecycle as Mermaid, generated from the machine."""

from __future__ import annotations

from kvhandoff.core.diagram import lifecycle_markdown, mermaid
from kvhandoff.core.events import Side


def add_parser(sub) -> None:
    p = sub.add_parser("diagram", help="print the lifecycle as a Mermaid state diagram")
    p.add_argument("--side", choices=["P", "D"], help="one side only (plain Mermaid)")


def run(args) -> int:
    print(mermaid(Side(args.side)) if args.side else lifecycle_markdown())
    return 0
