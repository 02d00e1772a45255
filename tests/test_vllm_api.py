"""The connector against vLLM's connector API as each checked version declares it.

vLLM 0.32 is installed here; 0.33 is not (no engine of it can run on this
machine): its API is recorded from the wheel's source by
tests/vllm_connector_api.py (``pip download vllm==0.33.0 --no-deps``, then
``python tests/vllm_connector_api.py vllm-0.33.0-*.whl
tests/data/vllm_api/vllm-0.33.0.json``), as is 0.32's from the installed
package.  For every recorded version: every method of ``KVConnectorBase_V1``
and ``SupportsHMA`` exists on ``KVHandoffConnector`` with the same kind
(method, classmethod, property) and a signature that accepts every call the
base's accepts; the abstract ones are the connector's own; the same for
the metadata and stats classes kvhandoff subclasses; every name kvhandoff
imports from vLLM exists.  A method a later version adds is defined by the
connector itself, so it answers under the installed version too.
"""

from __future__ import annotations

import inspect
import json
import pathlib

import pytest

pytest.importorskip("vllm")

from vllm_connector_api import extract  # noqa: E402

from kvhandoff.adapters.vllm import stats as kstats  # noqa: E402
from kvhandoff.adapters.vllm.config import UnsupportedTopology  # noqa: E402
from kvhandoff.adapters.vllm.connector import (  # noqa: E402
    KVHandoffConnector,
    KVHandoffMetadata,
    KVHandoffStats,
)

DATA = pathlib.Path(__file__).parent / "data" / "vllm_api"
VERSIONS = sorted(p.stem.removeprefix("vllm-") for p in DATA.glob("vllm-*.json"))
# kvhandoff's class for each recorded vLLM class it subclasses
OURS = {"KVConnectorBase_V1": KVHandoffConnector, "SupportsHMA": KVHandoffConnector,
        "KVConnectorMetadata": KVHandoffMetadata, "KVConnectorStats": KVHandoffStats,
        "KVConnectorPromMetrics": kstats.prom_metrics_class()}
_KIND = {inspect.Parameter.POSITIONAL_ONLY: "positional_only",
         inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
         inspect.Parameter.VAR_POSITIONAL: "var_positional",
         inspect.Parameter.KEYWORD_ONLY: "keyword_only",
         inspect.Parameter.VAR_KEYWORD: "var_keyword"}


def _api(version: str) -> dict:
    return json.loads((DATA / f"vllm-{version}.json").read_text())


def _owner(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


def _ours(cls: type, name: str) -> bool:
    owner = _owner(cls, name)
    return owner is not None and owner.__module__.startswith("kvhandoff.")


def _kind_and_params(cls: type, name: str) -> tuple[str, list[dict]]:
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, property):
        return "property", []
    kind = ("classmethod" if isinstance(raw, classmethod) else
            "staticmethod" if isinstance(raw, staticmethod) else "method")
    func = raw.__func__ if isinstance(raw, classmethod | staticmethod) else raw
    params = [{"name": p.name, "kind": _KIND[p.kind], "default": p.default is not p.empty}
              for p in inspect.signature(func).parameters.values()]
    return kind, params


def accepts_every_call(base: list[dict], ours: list[dict]) -> list[str]:
    """What a call the base signature accepts would break on ours ([] when nothing)."""
    problems = []
    pos_kinds = ("positional_only", "positional_or_keyword")
    b_pos = [p for p in base if p["kind"] in pos_kinds]
    o_pos = [p for p in ours if p["kind"] in pos_kinds]
    o_names = {p["name"]: p for p in ours if p["kind"] in ("positional_or_keyword", "keyword_only")}
    var_pos = any(p["kind"] == "var_positional" for p in ours)
    var_kw = any(p["kind"] == "var_keyword" for p in ours)
    for i, b in enumerate(b_pos):
        o = o_pos[i] if i < len(o_pos) else None
        if o is None and not var_pos:
            problems.append(f"no positional parameter for {b['name']!r}")
        if b["kind"] == "positional_or_keyword" and not var_kw and (
                b["name"] not in o_names or (o is not None and o["name"] != b["name"])):
            problems.append(f"{b['name']!r} cannot be passed by name")
        if o is not None and b["default"] and not o["default"]:
            problems.append(f"{o['name']!r} has no default ({b['name']!r} has one)")
    for b in base:
        if b["kind"] == "keyword_only":
            o = o_names.get(b["name"])
            if o is None and not var_kw:
                problems.append(f"keyword {b['name']!r} not accepted")
            if o is not None and b["default"] and not o["default"]:
                problems.append(f"keyword {b['name']!r} has no default")
        if b["kind"] in ("var_positional", "var_keyword") and not any(
                p["kind"] == b["kind"] for p in ours):
            problems.append(f"no {b['kind']} parameter (the base takes *{b['name']})")
    b_names = {p["name"] for p in base}
    for i, o in enumerate(ours):
        if o["default"] or o["kind"] in ("var_positional", "var_keyword"):
            continue
        covered = (i < len(b_pos) if o["kind"] in pos_kinds else False) or o["name"] in b_names
        if not covered:
            problems.append(f"{o['name']!r} is required but vLLM does not pass it")
    return problems


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("base_name", sorted(OURS))
def test_kvhandoff_answers_every_method_of_the_base_class(version, base_name):
    recorded = _api(version)["classes"][base_name]
    cls = OURS[base_name]
    problems = []
    for name, spec in recorded["methods"].items():
        if not hasattr(cls, name):
            problems.append(f"{name}: missing")
            continue
        if spec["abstract"] and not _ours(cls, name):
            problems.append(f"{name}: abstract in vLLM {version}, not implemented")
        kind, params = _kind_and_params(cls, name)
        if kind != spec["kind"]:
            problems.append(f"{name}: a {kind}, vLLM {version} declares a {spec['kind']}")
            continue
        if not _ours(cls, name) or kind == "property":
            continue  # inherited from the installed vLLM: its own signature
        problems += [f"{name}: {p}" for p in accepts_every_call(spec["params"], params)]
    assert not problems, f"{cls.__name__} against vLLM {version}'s {base_name}: {problems}"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_name_kvhandoff_imports_from_vllm_exists(version):
    from vllm_connector_api import IMPORTED

    assert _api(version)["names"] == {path: sorted(names) for path, names in IMPORTED.items()}
    factory = _api(version)["classes"]["KVConnectorFactory"]["methods"]
    assert [p["name"] for p in factory["register_connector"]["params"]] == [
        "cls", "name", "module_path", "class_name"]
    assert [p["name"] for p in factory["get_connector_class_by_name"]["params"]] == [
        "cls", "connector_name"]


def test_methods_a_later_vllm_adds_are_the_connector_s_own():
    """Answered under the installed vLLM too (0.32 has no such methods in its base class)."""
    installed = _api(VERSIONS[0])["classes"]["KVConnectorBase_V1"]["methods"]
    added = {name for v in VERSIONS[1:]
             for name in _api(v)["classes"]["KVConnectorBase_V1"]["methods"]} - installed.keys()
    assert {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"} <= added
    for name in added:
        assert name in KVHandoffConnector.__dict__, name


def test_sleep_mode_is_refused():
    """vLLM 0.33 asks ``supports_sleep_mode`` before enabling sleep mode and refuses the engine
    when it is False; should it call the sleep hooks anyway, they refuse by name."""
    assert KVHandoffConnector.supports_sleep_mode(object()) is False
    connector = object.__new__(KVHandoffConnector)  # the hooks need no engine state
    for hook in (connector.unregister_kv_caches, connector.restore_kv_caches):
        with pytest.raises(UnsupportedTopology, match="sleep mode"):
            hook()


def test_the_recorded_032_api_is_what_the_installed_vllm_declares():
    """The recorder reads the installed package as it reads a wheel."""
    import vllm

    installed = vllm.__version__.split("+")[0]
    if installed not in VERSIONS:
        pytest.skip(f"vLLM {installed} is installed; recorded: {VERSIONS}")
    site = pathlib.Path(vllm.__file__).parents[1]
    assert extract(str(site)) == _api(installed)


def test_the_check_refuses_an_incompatible_signature():
    base = [{"name": "self", "kind": "positional_or_keyword", "default": False},
            {"name": "request", "kind": "positional_or_keyword", "default": False},
            {"name": "n", "kind": "positional_or_keyword", "default": True}]
    ok = [dict(p) for p in base]
    assert accepts_every_call(base, ok) == []
    assert accepts_every_call(base, ok[:2] + [{"name": "kw", "kind": "var_keyword",
                                                "default": False}])  # n by position fails
    renamed = [ok[0], {**ok[1], "name": "req"}, ok[2]]
    assert "'request' cannot be passed by name" in accepts_every_call(base, renamed)
    no_default = [ok[0], ok[1], {**ok[2], "default": False}]
    assert accepts_every_call(base, no_default)
    extra = ok + [{"name": "more", "kind": "keyword_only", "default": False}]
    assert accepts_every_call(base, extra) == ["'more' is required but vLLM does not pass it"]
