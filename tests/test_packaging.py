"""The package maps every source folder into the kvhandoff namespace."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    found = {"kvhandoff" + "".join(f".{p}" for p in init.parent.relative_to(ROOT).parts)
             for init in ROOT.rglob("__init__.py")
             if not {".venv", "tests", "shared", "build"} & set(init.relative_to(ROOT).parts)}
    assert found == listed


def test_core_is_pure():
    """core/ reads no clock, randomness, socket or thread: time is an argument."""
    forbidden = ("import time", "import random", "import socket", "import threading",
                 "from time", "from random", "import asyncio")
    for path in (ROOT / "core").glob("*.py"):
        text = path.read_text()
        assert not [f for f in forbidden if f in text], path.name


def test_the_product_refers_to_nothing_outside_the_repository():
    """A user's clone has the product only: no design notes beside it."""
    product = [ROOT / "README.md", ROOT / "Makefile", *(ROOT / "docs").glob("*.md")]
    for folder in ("core", "transports", "adapters", "simulations"):
        product += (ROOT / folder).rglob("*.py")
    for path in product:
        text = path.read_text()
        assert "../shared" not in text and "FIELD_NOTES" not in text, path.relative_to(ROOT)
