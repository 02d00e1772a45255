"""Constructors of frozen slotted dataclasses that skip the dataclass ``__init__``.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``;
setting the slots through their descriptors makes the same object in about half
the time.  The hot paths that build many small objects (decoded log lines,
recorded events, decoded wire messages) generate one such function per class,
once, as dataclasses generates ``__init__``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields


def slot_builder(cls: type, params: str, values: Mapping[str, str], namespace: Mapping = (),
                 guard: str = "") -> Callable:
    """``build(<params>)`` returning a ``cls`` whose slot ``name`` is set to the Python
    expression ``values[name]`` (over the parameters and ``namespace``); every field of
    the dataclass must be named.  ``guard``, when given, is one statement run first (it
    may return)."""
    missing = {f.name for f in fields(cls)} - set(values)
    if missing:
        raise ValueError(f"{cls.__name__}: no value for slots {sorted(missing)}")
    ns: dict = {"new": object.__new__, "cls": cls, **dict(namespace)}
    body = [f"def build({params}):"]
    if guard:
        body.append(f"    {guard}")
    body.append("    e = new(cls)")
    for i, (name, expr) in enumerate(values.items()):
        ns[f"set{i}"] = getattr(cls, name).__set__
        body.append(f"    set{i}(e, {expr})")
    body.append("    return e")
    exec("\n".join(body), ns)
    return ns["build"]
