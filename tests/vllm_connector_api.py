"""Record the parts of vLLM's API that kvhandoff's connector builds on, from source, without
importing (or installing) that vLLM.

    python tests/vllm_connector_api.py WHEEL_OR_SITE_PACKAGES OUT.json

reads the files below from a vLLM wheel (a zip, e.g. from ``pip download vllm==0.33.0
--no-deps``) or an installed ``site-packages`` directory, parses them with ``ast`` and writes
JSON: the version (``vllm/_version.py`` or the wheel's name), the wheel's sha256 when one was
read, the top-level names of each module kvhandoff imports from (``names``), and for each class
kvhandoff subclasses or calls (``classes``) every public method (and ``__init__``): its kind
(method, classmethod, staticmethod, property), whether it is abstract, and its parameters
(name, kind, whether it has a default).  tests/test_vllm_api.py checks `KVHandoffConnector`
and its metadata and stats classes against each recorded version (tests/data/vllm_api/).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import zipfile

MODULES = {
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": (
        "KVConnectorBase_V1", "SupportsHMA", "KVConnectorMetadata"),
    "vllm/distributed/kv_transfer/kv_connector/factory.py": ("KVConnectorFactory",),
    "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py": (
        "KVConnectorStats", "KVConnectorPromMetrics"),
    "vllm/distributed/parallel_state.py": (),
    "vllm/v1/request.py": (),
    "vllm/v1/metrics/utils.py": (),
}
# Names kvhandoff's adapters import from each module (checked to exist in every version).
IMPORTED = {
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": [
        "KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole",
        "KVConnectorTransferResults", "SupportsHMA"],
    "vllm/distributed/kv_transfer/kv_connector/factory.py": ["KVConnectorFactory"],
    "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py": [
        "KVConnectorPromMetrics", "KVConnectorStats"],
    "vllm/distributed/parallel_state.py": ["get_tensor_model_parallel_rank"],
    "vllm/v1/request.py": ["RequestStatus"],
    "vllm/v1/metrics/utils.py": ["create_metric_per_engine"],
}
_KINDS = {"posonlyargs": "positional_only", "args": "positional_or_keyword"}


def _params(args: ast.arguments) -> list[dict]:
    positional = [(a, _KINDS["posonlyargs"]) for a in args.posonlyargs] + [
        (a, _KINDS["args"]) for a in args.args]
    first_default = len(positional) - len(args.defaults)
    out = [{"name": a.arg, "kind": kind, "default": i >= first_default}
           for i, (a, kind) in enumerate(positional)]
    if args.vararg is not None:
        out.append({"name": args.vararg.arg, "kind": "var_positional", "default": False})
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append({"name": a.arg, "kind": "keyword_only", "default": d is not None})
    if args.kwarg is not None:
        out.append({"name": args.kwarg.arg, "kind": "var_keyword", "default": False})
    return out


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute):
            names.add(target.attr)
        elif isinstance(target, ast.Name):
            names.add(target.id)
    return names


def _methods(cls: ast.ClassDef) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.name.startswith("_") and node.name != "__init__":
            continue
        decorators = _decorator_names(node)
        if "setter" in decorators or "deleter" in decorators:
            continue
        kind = next((k for k in ("classmethod", "staticmethod", "property")
                     if k in decorators), "method")
        out[node.name] = {"kind": kind, "abstract": "abstractmethod" in decorators,
                          "params": _params(node.args)}
    return dict(sorted(out.items()))


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


class _Source:
    def __init__(self, where: str) -> None:
        self.where = where
        self.zip = zipfile.ZipFile(where) if os.path.isfile(where) else None

    def read(self, path: str) -> str:
        if self.zip is not None:
            return self.zip.read(path).decode("utf-8")
        with open(os.path.join(self.where, path), encoding="utf-8") as f:
            return f.read()

    def version(self) -> str:
        if self.zip is not None:
            m = re.match(r"vllm(?:_cpu)?-([0-9][^-]*)-", os.path.basename(self.where))
            if m:
                return m.group(1)
        text = self.read("vllm/_version.py")
        m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
        if m is None:
            m = re.search(r"""version\s*=\s*['"]([^'"]+)['"]""", text)
        return m.group(1).split("+")[0] if m else "unknown"


def extract(where: str) -> dict:
    src = _Source(where)
    record: dict = {"vllm": src.version(), "names": {}, "classes": {}}
    if src.zip is not None:
        with open(where, "rb") as f:
            record["wheel"] = os.path.basename(where)
            record["wheel_sha256"] = hashlib.file_digest(f, "sha256").hexdigest()
    for path, classes in MODULES.items():
        tree = ast.parse(src.read(path))
        defined = _top_level_names(tree)
        record["names"][path] = sorted(n for n in IMPORTED[path] if n in defined)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name in classes:
                record["classes"][node.name] = {
                    "module": path,
                    "bases": [ast.unparse(b) for b in node.bases],
                    "methods": _methods(node)}
    return record


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    record = extract(argv[0])
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"vllm {record['vllm']}: {sum(len(c['methods']) for c in record['classes'].values())} "
          f"methods of {len(record['classes'])} classes -> {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
