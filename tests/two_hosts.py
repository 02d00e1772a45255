"""Two hosts on one machine: P on 127.0.0.2, D on 127.0.0.1, UCX on its network transport.

Every 127/8 address is this machine's loopback, so P's side channel, P's
advertised address (``remote_host``) and P's HTTP server can live on
``127.0.0.2`` while D lives on ``127.0.0.1``; D's ``trusted_producers`` names
P's address only.  UCX is restricted to ``tcp`` on ``lo``: no ``cma``, no
shared memory, no CUDA IPC, so a READ takes the path it takes between nodes
(a GET over TCP, software-emulated by active messages that P's progress
thread answers).

This module is the one source of that configuration: the tests build P's and
D's settings from `UCX_ENV`, `p_extra` and `d_extra`, and the operator
guide's multi-node block is `guide_block()` verbatim (a test checks it).

`HostProcess` runs the connector's worker half (`HandoffWorker`, one per TP
rank) in a process of its own, started with that host's environment, so
that P and D are two processes whose UCX was configured before it loaded;
`RemoteWorker` drives one rank through it the way vLLM drives a worker
(``start_step`` / ``finish_step``).  UCX's own protocol report
(``UCX_PROTO_INFO=y``, one log file per process) is the evidence of which
transport carried the READ: `read_protocols` parses it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

P_HOST = "127.0.0.2"  # node A: P's side channel, advertised address and HTTP server
D_HOST = "127.0.0.1"  # node B: D
STRANGER = "127.0.0.3"  # a third "host" D does not trust

# UCX on both hosts: the network transport only.  What differs from one host:
# UCX_TLS (one host lets UCX pick cma / shared memory / CUDA IPC) and
# UCX_NET_DEVICES (lo here; between nodes the interface D reaches P on).
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
# The GPU variant: VRAM staged through host memory by cuda_copy, still over tcp.
UCX_ENV_CUDA = {"UCX_TLS": "tcp,cuda_copy", "UCX_NET_DEVICES": "lo"}

# UCX transports that exist only within one node: none of them may carry a byte.
SAME_NODE_TRANSPORTS = ("cma", "posix", "sysv", "xpmem", "knem", "cuda_ipc")

GUIDE_PORTS = {"p_http": 8100, "d_http": 8200, "side_channel": 5600, "router": 8000}


def p_extra(side_channel_port: int) -> dict[str, Any]:
    """P's multi-node keys of ``kv_connector_extra_config``."""
    return {"side_channel_host": P_HOST, "side_channel_port": side_channel_port}


def d_extra(side_channel_port: int, tp_size: int = 1) -> dict[str, Any]:
    """D's multi-node keys: trust P's side channel, one entry per TP rank's port."""
    return {"trusted_producers": [f"{P_HOST}:{side_channel_port + r}" for r in range(tp_size)]}


def _kvt_json(cfg: dict[str, Any]) -> str:
    """``--kv-transfer-config``'s JSON, one key a line (JSON allows the line breaks)."""
    return "{" + ",\n    ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in cfg.items()) + "}"


def guide_block(model: str = "meta-llama/Llama-3.1-8B-Instruct") -> str:
    """The operator guide's multi-node block: exactly the settings the two-host tests run."""
    from kvhandoff.adapters.vllm.serve import ServeSpec

    ports = GUIDE_PORTS
    env = " ".join(f"{k}={v}" for k, v in UCX_ENV.items())
    p = ServeSpec("P", "prefill", model, "prefill-0", p_extra(ports["side_channel"]))
    d = ServeSpec("D", "decode", model, "decode-0", d_extra(ports["side_channel"]))
    p_json, d_json = _kvt_json(p.kv_transfer_config()), _kvt_json(d.kv_transfer_config())
    return "\n".join([
        f"# P, on node A ({P_HOST} in the tests)",
        f"export {env}",
        f"vllm serve {model} --host {P_HOST} --port {ports['p_http']} \\",
        f"  --kv-transfer-config '{p_json}'",
        f"# D, on node B ({D_HOST} in the tests)",
        f"export {env}",
        f"vllm serve {model} --host {D_HOST} --port {ports['d_http']} \\",
        f"  --kv-transfer-config '{d_json}'",
        "# the router: anywhere that reaches both",
        f"python -m kvhandoff.adapters.vllm.router --prefill http://{P_HOST}:{ports['p_http']} \\",
        f"  --decode http://{D_HOST}:{ports['d_http']} --port {ports['router']}",
    ])


# UCX's report of the protocol each operation takes (tests only).  To stderr, which C
# does not buffer: the report survives a kill -9 (a log file of UCX's own is written
# out only at a clean exit).  `read_protocols` takes it apart by process id.
EVIDENCE_ENV = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": "stderr"}


# ---- UCX's protocol report ----------------------------------------------------

_TABLE_TITLE = re.compile(r"\|\s*(?P<who>\S+) (?P<scope>[\w-]+) cfg#\d+\s*\|")
_ROW = re.compile(r"\|\s*[\d.]+(?:inf)?\s*\|\s*(?P<how>[^|]+?)\s*\|\s*(?P<lanes>[^|]+?)\s*\|")


@dataclass
class ProtocolReport:
    """What UCX printed (``UCX_PROTO_INFO=y``): per operation, how and over which lanes."""

    tables: list[tuple[str, str, list[tuple[str, str]]]] = field(default_factory=list)

    def reads(self) -> list[tuple[str, str, list[tuple[str, str]]]]:
        """The tables of READs: ``remote memory read by ucp_get*`` (what a NIXL READ is)."""
        return [t for t in self.tables if t[1].startswith("remote memory read")]

    def transports(self) -> set[str]:
        """Every UCX transport named in any table (``tcp``, ``cma``, ...)."""
        out = set()
        for _, _, rows in self.tables:
            for _, lanes in rows:
                out.update(m.group(1) for m in re.finditer(r"(\w+)/[\w.:-]+", lanes))
        return out


_UCX_LINE = re.compile(r"^\[\d+\.\d+\] \[[^:\]]*:\s*(?P<pid>\d+)\s*:[^\]]*\]\s*(?P<text>[|+].*)$")


def read_protocols(*paths: Path) -> ProtocolReport:
    """Parse UCX's protocol tables out of ``paths`` (logs where UCX wrote among others)."""
    by_pid: dict[str, list[str]] = {}
    for path in paths:
        for line in Path(path).read_text(errors="replace").splitlines():
            m = _UCX_LINE.match(line)
            if m:
                by_pid.setdefault(m.group("pid"), []).append(m.group("text"))
    report = ProtocolReport()
    for lines in by_pid.values():
        i = 0
        while i < len(lines):
            m = _TABLE_TITLE.search(lines[i])
            if m and i + 1 < len(lines):
                what = lines[i + 1].strip().strip("|").strip()
                rows = []
                j = i + 2
                while j < len(lines) and not _TABLE_TITLE.search(lines[j]):
                    r = _ROW.search(lines[j])
                    if r and r.group("how") != "Description":
                        rows.append((r.group("how"), r.group("lanes")))
                    j += 1
                report.tables.append((f"{m.group('who')} {m.group('scope')}", what, rows))
                i = j
            else:
                i += 1
    return report


def assert_reads_over_tcp(*paths: Path) -> ProtocolReport:
    """Every READ UCX set up went over tcp; no same-node transport appears anywhere."""
    report = read_protocols(*paths)
    reads = report.reads()
    assert reads, f"no READ protocol reported in {[str(p) for p in paths]} (UCX_PROTO_INFO)"
    for who, what, rows in reads:
        assert rows and all(lanes.startswith("tcp/") for _, lanes in rows), (who, what, rows)
    leaked = report.transports() & set(SAME_NODE_TRANSPORTS)
    assert not leaked, f"same-node UCX transports in use: {sorted(leaked)}"
    return report


# ---- the worker half of one host, in a process of its own ----------------------

BLOCK = 16
LAYERS, HEADS, HEAD = 4, 2, 64
NUM_BLOCKS = 64
PAGE = HEADS * BLOCK * 2 * HEAD * 2  # one layer's K and V of one block, fp16
WINDOW = 32


@dataclass(frozen=True)
class HostSpec:
    """One host's workers: ``side`` ``P`` or ``D``, one `HandoffWorker` per rank."""

    side: str
    engine_id: str
    extra: dict[str, Any]
    env: dict[str, str]
    tp_size: int = 1
    layout: str = "llama"  # or "gemma": a sliding-window and a full-attention group
    seed: int = 1  # P rank r's caches: random from seed + r; D's start zeroed
    output: str = ""  # a file for the process's stdout and stderr (UCX's report among them)


def compat(tp_size: int) -> dict[str, Any]:
    return {"model": "two-hosts", "dtype": "torch.float16", "block_size": BLOCK,
            "num_kv_heads": HEADS, "head_size": HEAD, "num_layers": LAYERS, "tp_size": tp_size}


def names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def layout_of(kind: str) -> Any:
    from hybrid_layouts import gemma_layout, one_group_layout

    if kind == "gemma":
        return gemma_layout(NUM_BLOCKS, BLOCK, PAGE, WINDOW, LAYERS)
    return one_group_layout(names(), NUM_BLOCKS, BLOCK, PAGE)


def _caches(kind: str, fill: bool, seed: int) -> tuple[dict[str, Any], Any]:
    """(layer name -> view, the backing tensor): vLLM's layer-outermost allocation."""
    import torch

    slots = LAYERS // 2 if kind == "gemma" else LAYERS
    shape = (slots, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(shape, generator=gen).half() if fill else torch.zeros(shape).half()
    if kind == "gemma":  # layer slot k holds sliding layer 2k and full layer 2k + 1
        return {n: buf[i // 2] for i, n in enumerate(names())}, buf
    return {n: buf[i] for i, n in enumerate(names())}, buf


class _Host:
    def __init__(self, spec: HostSpec) -> None:
        from kvhandoff.adapters.vllm.config import HandoffConfig
        from kvhandoff.adapters.vllm.worker import HandoffWorker
        from kvhandoff.core.events import Side

        self.workers: dict[int, Any] = {}
        self.buffers: dict[int, Any] = {}
        side = Side.P if spec.side == "P" else Side.D
        layout = layout_of(spec.layout)
        for rank in range(spec.tp_size):
            # The host's environment is the config's (VLLM_NIXL_SIDE_CHANNEL_HOST included).
            cfg = HandoffConfig.from_extra(spec.extra, env=dict(os.environ))
            w = HandoffWorker(cfg, spec.engine_id, side, rank, spec.tp_size, compat(spec.tp_size))
            caches, buf = _caches(spec.layout, side is Side.P, spec.seed + rank)
            w.register_kv_caches(caches, layout)
            self.workers[rank], self.buffers[rank] = w, buf

    def call(self, rank: int, method: str, *args: Any) -> Any:
        return getattr(self.workers[rank], method)(*args)

    def attr(self, rank: int, name: str) -> Any:
        return getattr(self.workers[rank], name)

    def blocks(self, rank: int, ids: list[int]) -> bytes:
        """The bytes of blocks ``ids`` in every layer slot, in that order."""
        return self.buffers[rank][:, list(ids)].contiguous().numpy().tobytes()

    def written_blocks(self, rank: int) -> list[int]:
        """Block ids with any nonzero byte in any layer slot."""
        nz = self.buffers[rank].abs().flatten(2).sum(-1).sum(0)
        return [int(b) for b in nz.nonzero().flatten()]

    def d_state(self, rank: int, rid: str) -> str | None:
        w = self.workers[rank]
        rec = w.state.record(w.stream, rid)
        return rec.state.name if rec is not None else None

    def peers(self, rank: int) -> list[tuple[str, int]]:
        return sorted(self.workers[rank]._peers)

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


def _host_main(conn: Any, spec: HostSpec) -> None:
    if spec.output:
        fd = os.open(spec.output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.dup2(2, 1)  # UCX and NIXL print to stdout; keep the pipe protocol clean
    sys.stdout = sys.stderr
    os.environ.update(spec.env)  # before anything loads UCX
    try:
        host = _Host(spec)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        try:
            value = getattr(host, method)(*args)
            conn.send(("ok", value))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        if method == "close":
            return


class HostProcess:
    """A host's worker ranks in a spawned process; `rank` gives a `RemoteWorker`."""

    def __init__(self, spec: HostSpec, timeout_s: float = 60.0) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_host_main, args=(child, spec), daemon=True,
                                 name=f"kvh-host-{spec.side}")
        self._proc.start()
        child.close()
        self.pid = self._recv("start")

    def _recv(self, what: str) -> Any:
        if not self._conn.poll(self.timeout_s):
            raise TimeoutError(f"host {self.spec.side}: no answer to {what} in {self.timeout_s} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"host {self.spec.side}: {what} failed:\n{value}")
        return value

    def __call__(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        return self._recv(method)

    def rank(self, r: int) -> RemoteWorker:
        return RemoteWorker(self, r)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self("close")
            except (RuntimeError, TimeoutError, EOFError, BrokenPipeError):
                pass
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)


class RemoteWorker:
    """One rank of a `HostProcess`, driven as vLLM drives a worker."""

    def __init__(self, host: HostProcess, rank: int) -> None:
        self.host, self.rank = host, rank
        self.log_path = host("attr", rank, "log_path")

    def start_step(self, plan: Any) -> None:
        self.host("call", self.rank, "start_step", plan)

    def finish_step(self) -> tuple[set[str], set[str], set[str]]:
        return self.host("call", self.rank, "finish_step")

    def flush(self) -> str:
        return self.host("call", self.rank, "flush")

    def blocks(self, ids: list[int] | tuple[int, ...]) -> bytes:
        return self.host("blocks", self.rank, list(ids))

    def written_blocks(self) -> list[int]:
        return self.host("written_blocks", self.rank)

    def d_state(self, rid: str) -> str | None:
        return self.host("d_state", self.rank, rid)

    def peers(self) -> list[tuple[str, int]]:
        return self.host("peers", self.rank)


# ---- a Qwen4-exp-shaped host: vLLM-planned tensors (tests/qwen4_plans.json) ----------


def _qwen4_plan(name: str, rank: int) -> tuple[Any, Any]:
    """``(layout, alloc)`` of one rank of a Qwen4-exp variant (`qwen4_layout_name`), or of
    the DSA-shaped stack's P with HiSparse off (`hisparse_p_layout_name`), planned by vLLM
    here and allocated by its own allocator."""
    import qwen4_layouts as q

    if name.startswith("hisparse-p:"):
        from kvhandoff.adapters.vllm.layout import cache_layout

        _, configs, _ = q.plan_hisparse(q.Variant(*json.loads(name.removeprefix(
            "hisparse-p:"))), False)
        return (cache_layout(configs[rank]),
                lambda device, seed=None: q.allocate(configs[rank], device, seed))
    data = json.loads((Path(__file__).parent / q.FIXTURE).read_text())
    return q.load_plan(data, q.Variant(*json.loads(name.removeprefix("qwen4:"))), rank)


class _Qwen4Host(_Host):
    """A host whose ranks hold a Qwen4-exp variant's allocation (one int8 buffer per
    rank, per-layer views as vLLM lays them out); P's filled from ``seed + rank``."""

    def __init__(self, spec: HostSpec) -> None:  # noqa: D107 (no super: other caches)
        from kvhandoff.adapters.vllm.config import HandoffConfig
        from kvhandoff.adapters.vllm.worker import HandoffWorker
        from kvhandoff.core.events import Side

        self.workers, self.buffers = {}, {}
        side = Side.P if spec.side == "P" else Side.D
        for rank in range(spec.tp_size):
            layout, alloc = _qwen4_plan(spec.layout, rank)
            cfg = HandoffConfig.from_extra(spec.extra, env=dict(os.environ))
            compat_ = {"model": "q4", "tp_size": spec.tp_size}
            w = HandoffWorker(cfg, spec.engine_id, side, rank, spec.tp_size, compat_)
            views, raw = alloc("cpu", spec.seed + rank if side is Side.P else None)
            w.register_kv_caches(views, layout)
            self.workers[rank], self.buffers[rank] = w, raw

    def raw(self, rank: int) -> bytes:
        """The rank's whole allocation, as bytes."""
        return self.buffers[rank].numpy().tobytes()


def qwen4_layout_name(mtp: int, prefix_caching: bool, tp: int) -> str:
    """`HostSpec.layout` of a Qwen4-exp host (`Qwen4HostProcess`)."""
    return "qwen4:" + json.dumps([mtp, prefix_caching, tp])


def hisparse_p_layout_name(mtp: int, tp: int) -> str:
    """`HostSpec.layout` of a P with HiSparse off on the DSA-shaped stack (issue #16)."""
    return "hisparse-p:" + json.dumps([mtp, False, tp])


def _qwen4_host_main(conn: Any, spec: HostSpec) -> None:
    global _Host
    plain, _Host = _Host, _Qwen4Host  # _host_main builds `_Host(spec)`: this process's only host
    try:
        _host_main(conn, spec)
    finally:
        _Host = plain


class Qwen4HostProcess(HostProcess):
    """`HostProcess` whose ranks hold a Qwen4-exp variant (``spec.layout`` from
    `qwen4_layout_name`); ``raw(rank)`` is the rank's allocation."""

    def __init__(self, spec: HostSpec, timeout_s: float = 60.0) -> None:  # noqa: D107
        self.spec = spec
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_qwen4_host_main, args=(child, spec), daemon=True,
                                 name=f"kvh-q4-host-{spec.side}")
        self._proc.start()
        child.close()
        self.pid = self._recv("start")

    def raw(self, rank: int) -> bytes:
        return self("raw", rank)
