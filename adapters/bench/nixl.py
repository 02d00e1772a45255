"""``kvhandoff bench nixl --device cpu|cuda [--json]``: real NIXL READs of KV-shaped blocks.

Two processes: the producer P (a `TransportProcess`) owns one payload
allocation (256 MiB host memory for cpu, 1 GiB VRAM for cuda) filled with a
position-dependent pattern; this process is the reader D.  Both sides carve
the payload into the regions of four realistic KV layouts (`LAYOUTS`), so
one physical allocation per side serves every row and is registered once.
Each row READs the whole payload in that layout's blocks, remote order
shuffled (except the first row, whose in-order blocks coalesce into one
descriptor), ``--reps`` times; every repetition's bytes are compared with
the pattern.  The baseline is measured in the same run on the same bytes: a
``torch`` device-to-device copy (cuda) or a ``numpy`` copy (cpu).  Medians.

On one node, VRAM-to-VRAM READs run as CUDA IPC gathers (``path:
cuda_ipc``; see `kvhandoff.transports.nixl.cuda_ipc`); ``--no-vram-ipc``
measures NIXL/UCX alone (``path: nixl``).

``--dst host`` (cuda only): D's destination is *pinned host memory* (a
HiSparse D's host pool) while P's payload stays in VRAM; the baseline is then
a same-run device-to-host ``cudaMemcpy`` (torch ``copy_`` into the pinned
buffer) of the same bytes, and the READs run as CUDA IPC gathers writing the
host memory (``path: cuda_ipc``) or, with ``--no-vram-ipc``, through NIXL.
``--strided`` adds a row whose regions are strided (`KVRegion.stride`: 16 KiB
blocks 32 KiB apart on both sides); its check includes the bytes between
blocks (never written).  Repetitions are interleaved: each round runs the
baseline copy once and every row once, so drift on a shared machine hits all
of them alike; medians over the rounds.

``--transport tcp`` runs the same READs the way they travel between nodes:
UCX restricted to its network transport (`TCP_ENV`: ``tcp`` on ``lo``, plus
``cuda_copy`` to stage VRAM; no ``cma``, shared memory or CUDA IPC, and no
CUDA IPC gathers), with the READ's UCX protocol read back from UCX's own
report (``read_protocols``).  Its baseline is a same-run socket copy of the
same bytes between two processes (``127.0.0.2`` to ``127.0.0.1``, the
two-host addresses of tests/two_hosts.py): the limit of that path here.  On
cuda the device-to-device copy stays the baseline and the socket copy is
reported beside it (``socket_GBps``).

Also measured: the time to register all regions (``registration_ms``, on D),
and the CPU an idle agent burns (``idle_cpu_percent``, P and D after the
READs), next to what NIXL's stock busy-spinning progress thread burns
(``idle_cpu_percent_nixl_default``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime as dt
import glob
import multiprocessing as mp
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How a model's KV cache is cut into regions and blocks of 16 tokens.

    ``arrangement``: ``blocks-first`` (one region; a block holds every
    layer's K and V), ``per-layer`` (one region per layer; a block holds that
    layer's K and V), ``per-layer-kv`` (separate K and V regions per layer).
    """

    model: str
    layers: int
    kv_heads: int
    head_size: int
    arrangement: str
    shuffled: bool = True
    dtype_bytes: int = 2
    tokens: int = 16
    stride_blocks: int = 1  # blocks block_bytes * stride_blocks apart (1: adjacent)

    @property
    def stride(self) -> int:
        return self.block_bytes * self.stride_blocks if self.stride_blocks > 1 else 0

    @property
    def block_bytes(self) -> int:
        per_head = self.tokens * self.head_size * self.dtype_bytes * self.kv_heads
        if self.arrangement == "blocks-first":
            return per_head * 2 * self.layers
        return per_head * (2 if self.arrangement == "per-layer" else 1)

    @property
    def regions(self) -> int:
        return {"blocks-first": 1, "per-layer": self.layers,
                "per-layer-kv": 2 * self.layers}[self.arrangement]

    def num_blocks(self, payload: int) -> int:
        return payload // (self.block_bytes * self.stride_blocks * self.regions)

    def describe(self) -> str:
        order = "shuffled" if self.shuffled else "in order"
        strided = f", strided {self.stride} B" if self.stride else ""
        return (f"{self.model}: {self.layers} layers x K/V x {self.kv_heads} KV heads x "
                f"{self.head_size} x {self.tokens} tokens, bf16, {self.arrangement}, {order}"
                f"{strided}")


# About 1, 512, 8,192 and 65,536 descriptors for each device's payload.
LAYOUTS: dict[str, tuple[KVLayout, ...]] = {
    "cpu": (  # 256 MiB
        KVLayout("Llama-3.2-1B", 16, 8, 64, "blocks-first", shuffled=False),
        KVLayout("Llama-3.2-1B", 16, 8, 64, "blocks-first"),
        KVLayout("Llama-3.2-1B", 16, 8, 64, "per-layer"),
        KVLayout("Llama-3.2-1B TP4 rank", 16, 2, 64, "per-layer-kv"),
    ),
    "cuda": (  # 1 GiB
        KVLayout("Llama-3.1-8B", 32, 8, 128, "blocks-first", shuffled=False),
        KVLayout("Llama-3.1-8B", 32, 8, 128, "blocks-first"),
        KVLayout("Gemma-2-27B", 46, 16, 128, "per-layer"),
        KVLayout("Qwen2.5-7B", 28, 4, 128, "per-layer-kv"),
    ),
}
# --strided: 16 KiB blocks 32 KiB apart (half the payload read; the gaps never written)
STRIDED = {
    "cpu": KVLayout("Llama-3.2-1B TP4 rank", 16, 2, 64, "per-layer-kv", stride_blocks=2),
    "cuda": KVLayout("Qwen2.5-7B", 28, 4, 128, "per-layer-kv", stride_blocks=2),
}
PAYLOAD = {"cpu": 256 * MiB, "cuda": 1024 * MiB}
# --d-progress: NIXL's own progress thread on D, the vLLM connector's D (no NIXL thread,
# `ReadProgress` at the connector's default periods), or D's polls alone.
D_PROGRESS = ("thread", "connector", "none")

# --transport tcp: UCX as between nodes (the two-host tests' settings, tests/two_hosts.py,
# which a test keeps equal): the network transport alone, on the loopback interface.
TCP_ENV = {
    "cpu": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"},
    "cuda": {"UCX_TLS": "tcp,cuda_copy", "UCX_NET_DEVICES": "lo"},
}
P_HOST, D_HOST = "127.0.0.2", "127.0.0.1"  # the socket baseline's two "hosts"
SAME_NODE_TRANSPORTS = ("cma", "posix", "sysv", "xpmem", "knem", "cuda_ipc")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--payload-mib", type=int, default=None,
                        help="bytes READ per row (default: 256 cpu, 1024 cuda)")
    parser.add_argument("--reps", type=int, default=5, help="READs per row (median reported)")
    parser.add_argument("--progress-delay-us", type=int, default=None,
                        help="progress-thread poll timeout (default: kvhandoff's; 0: NIXL's busy-spin)")
    parser.add_argument("--threads", type=int, default=0,
                        help="UCX worker threads posting one READ (NIXL num_threads)")
    parser.add_argument("--no-vram-ipc", action="store_true",
                        help="send VRAM READs through NIXL/UCX even on one node (no CUDA IPC gather)")
    parser.add_argument("--transport", choices=("default", "tcp"), default="default",
                        help="tcp: UCX's network transport only, as between nodes (see TCP_ENV); "
                             "baseline: a socket copy between two processes")
    parser.add_argument("--dst", choices=("device", "host"), default="device",
                        help="host (cuda only): D's destination is pinned host memory, "
                             "P's payload VRAM; baseline: a device-to-host copy")
    parser.add_argument("--strided", action="store_true",
                        help="add a row of strided regions (blocks 2x their size apart)")
    parser.add_argument("--d-progress", choices=D_PROGRESS, default="thread",
                        help="what progresses D's READs: thread (NIXL's progress thread), "
                             "connector (no NIXL thread; ReadProgress, as the vLLM connector's D), "
                             "none (no thread: D's polls only)")
    parser.add_argument("--d-step-ms", type=float, default=0.0,
                        help="D polls once per step of this many ms, as an engine busy with "
                             "other work (default 0: polls without pause)")
    parser.add_argument("--idle-seconds", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=7)


def run(args: argparse.Namespace) -> dict:
    # stdout belongs to the one JSON object the CLI prints after we return, but
    # UCX (C, file descriptor 1), NIXL's Python logger and structlog's default
    # all print there: send descriptor 1 and sys.stdout to stderr meanwhile.
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return _run(args)
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _run(args: argparse.Namespace) -> dict:
    from kvhandoff.transports.base import MemoryKind
    from kvhandoff.transports.nixl import NixlOptions

    device = args.device
    payload = (args.payload_mib * MiB) if args.payload_mib else PAYLOAD[device]
    kind = MemoryKind.VRAM if device == "cuda" else MemoryKind.DRAM
    host_dst = getattr(args, "dst", "device") == "host"
    if host_dst and device != "cuda":
        raise SystemExit("bench nixl --dst host needs --device cuda")
    d_kind = MemoryKind.DRAM if host_dst else kind
    defaults = NixlOptions()
    delay = defaults.progress_delay_us if args.progress_delay_us is None else args.progress_delay_us
    tcp = getattr(args, "transport", "default") == "tcp"
    vram_ipc = not args.no_vram_ipc and not tcp  # between nodes there is no CUDA IPC
    options = NixlOptions(progress_delay_us=delay, num_threads=args.threads, vram_ipc=vram_ipc)
    env: dict[str, str] = {}
    evidence = ""
    if tcp:
        env = dict(TCP_ENV[device])
        if not _ucx_loaded():  # UCX reads its log settings when it loads
            evidence = tempfile.mkdtemp(prefix="kvh-bench-ucx-")
            env |= {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": os.path.join(evidence, "ucx-%p.log")}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # D is this process: before its agent (and UCX's context) starts
    layouts = LAYOUTS[device] + ((STRIDED[device],) if getattr(args, "strided", False) else ())
    views, plans = _views(layouts, payload)
    rng = np.random.default_rng(args.seed)
    tag = f"{os.getpid()}"

    xp = _Arrays(device, host_dst)
    try:
        result = _measure(args, device, payload, kind, d_kind, options, layouts, views, plans,
                          rng, tag, xp, env)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    idle_default = _idle_default(args.idle_seconds)
    result |= {
        "device": device,
        "machine": xp.machine(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "payload_bytes": payload,
        "reps": args.reps,
        "idle_cpu_percent_nixl_default": round(idle_default, 2),
        "options": {"progress_delay_us": delay, "num_threads": args.threads,
                    "vram_ipc": vram_ipc, "transport": "tcp" if tcp else "default",
                    "dst": "host" if host_dst else "device",
                    "d_progress": getattr(args, "d_progress", "thread"),
                    "d_step_ms": getattr(args, "d_step_ms", 0.0)},
        "versions": _versions(),
        "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")} | env,
    }
    if tcp:
        result["read_protocols"] = (read_protocols(evidence) if evidence
                                    else "not recorded: UCX was loaded before the bench set "
                                         "UCX_PROTO_INFO")
    result["targets"] = _targets(device, result)
    return result


def _measure(args, device, payload, kind, d_kind, options, layouts, views, plans, rng, tag,
             xp, env) -> dict:
    from kvhandoff.adapters.vllm.config import HandoffConfig
    from kvhandoff.transports.base import KVRegion
    from kvhandoff.transports.nixl import NixlTransport, ReadSplit, runs_array
    from kvhandoff.transports.nixl.process import TransportProcess, pattern
    from kvhandoff.transports.nixl.progress import ReadProgress

    tcp = bool(env)
    d_progress = getattr(args, "d_progress", "thread")
    step_s = getattr(args, "d_step_ms", 0.0) / 1e3
    with TransportProcess(f"bench-P-{tag}", options, env=env) as p:
        p.allocate_views(kind, 0, payload, args.seed, views)
        d = NixlTransport(f"bench-D-{tag}",
                          dataclasses.replace(options, progress_thread=d_progress == "thread"))
        lock = threading.Lock()
        cfg = HandoffConfig()
        pump = (ReadProgress(d, lock, cfg.notif_poll_s, cfg.idle_poll_s).start()
                if d_progress == "connector" else None)

        def _read_once(d, peer, split):
            return _timed_read(d, peer, split, step_s, lock, pump)
        try:
            dst = xp.zeros(payload)
            regions = [KVRegion(v.name, dst[v.offset:v.offset + v.span], v.num_blocks,
                                v.block_bytes, d_kind, 0, v.stride) for v in views]
            t0 = time.perf_counter()
            d.register(regions)
            registration_ms = (time.perf_counter() - t0) * 1e3
            peer = d.add_peer(p.metadata())
            p.add_peer(d.metadata())
            expected = xp.pattern(pattern, args.seed, payload)
            socket_gbps = _socket_baseline(args.seed, payload, args.reps) if tcp else None
            reads = []
            for layout, plan in zip(layouts, plans, strict=True):
                nb = plan["num_blocks"]
                order = rng.permutation(nb) if layout.shuffled else np.arange(nb)
                split = ReadSplit(runs_array(order, np.arange(nb)),
                                  tuple((n, n) for n in plan["names"]))
                _read_once(d, peer, split)  # warm-up: first-touch, connection, IPC mapping
                reads.append({"order": order, "split": split, "times": [], "posts": [], "polls": [],
                              "verified": True, "descs": 0, "path": "nixl"})
            xp.copy(dst, expected)  # the baseline's warm-up
            copies = []
            for _ in range(args.reps):  # interleaved: one baseline copy, then every row once
                copies.append(xp.copy(dst, expected))
                for plan, r in zip(plans, reads, strict=True):
                    xp.clear(dst)
                    before, ipc_before = d.descriptors_posted, d.ipc_descriptors
                    elapsed, posting, polls = _read_once(d, peer, r["split"])
                    r["descs"] = d.descriptors_posted - before
                    r["path"] = "cuda_ipc" if d.ipc_descriptors > ipc_before else "nixl"
                    r["times"].append(elapsed)
                    r["posts"].append(posting)
                    r["polls"].append(polls)
                    r["verified"] &= xp.verify(dst, expected, [views[i] for i in plan["index"]],
                                               r["order"])
            copy_gbps = payload / statistics.median(copies) / 1e9
            # cpu over tcp: the socket is the path's limit; cuda: the copy stays the baseline
            baseline = socket_gbps if (tcp and device == "cpu") else copy_gbps
            rows = []
            for layout, plan, r in zip(layouts, plans, reads, strict=True):
                moved = plan["num_blocks"] * layout.block_bytes * layout.regions
                descs = r["descs"]
                read_gbps = moved / statistics.median(r["times"]) / 1e9
                extra = {}
                if socket_gbps is not None:
                    extra = {"socket_GBps": round(socket_gbps, 3),
                             "ratio_to_socket": round(read_gbps / socket_gbps, 4)}
                if layout.stride:
                    extra["stride"] = layout.stride
                rows.append({
                    "layout": layout.describe(),
                    "descriptors": descs,
                    "block_bytes": layout.block_bytes,
                    "descriptor_bytes": moved // descs,
                    "bytes": moved,
                    "read_GBps": round(read_gbps, 3),
                    "baseline_GBps": round(baseline, 3),
                    "ratio": round(read_gbps / baseline, 4),
                    "post_us_per_descriptor": round(statistics.median(r["posts"]) * 1e6 / descs,
                                                    4),
                    "read_ms_median": round(statistics.median(r["times"]) * 1e3, 3),
                    "polls_median": statistics.median(r["polls"]),
                    "verified": bool(r["verified"]),
                    "path": r["path"],
                } | extra)
            idle_p = p.call("idle_cpu_percent", args.idle_seconds)
            idle_d = _idle_cpu_percent(args.idle_seconds)
            registrations_d = len(d.registrations)
        finally:
            if pump is not None:
                pump.close()
            d.close()
    _ucx_log_flush()  # P's UCX wrote its report when its process exited; ours is buffered
    return {
        "rows": rows,
        "baseline": ("socket copy between two processes" if tcp and device == "cpu"
                     else "torch device-to-host copy into pinned memory" if xp.host_dst
                     else "torch device-to-device copy" if device == "cuda" else "numpy copy"),
        "copy_GBps": round(copy_gbps, 3),
        "registration_ms": round(registration_ms, 3),
        "regions": len(views),
        "registrations_d": registrations_d,
        "idle_cpu_percent": round(max(idle_p, idle_d), 2),
        "idle_cpu_percent_by_side": {"p": round(idle_p, 2), "d": round(idle_d, 2)},
    }


def _socket_sender(port: int, seed: int, nbytes: int, reps: int) -> None:
    """The socket baseline's sender (a spawned child): P's bytes, from P's "host" to D's."""
    from kvhandoff.transports.nixl.process import pattern

    data = memoryview(pattern(seed, nbytes).copy())
    with socket.socket() as s:
        s.bind((P_HOST, 0))
        s.connect((D_HOST, port))
        for _ in range(reps):
            if s.recv(1) != b"g":
                return
            s.sendall(data)


def _socket_baseline(seed: int, nbytes: int, reps: int) -> float:
    """GB/s of a TCP socket copy of the READ's bytes between two processes (median of
    ``reps``, one more to warm up), every copy verified: the limit of the tcp path here."""
    from kvhandoff.transports.nixl.process import pattern

    expected = pattern(seed, nbytes)
    dst = np.zeros(nbytes, dtype=np.uint8)
    with socket.socket() as listener:
        listener.bind((D_HOST, 0))
        listener.listen(1)
        sender = mp.get_context("spawn").Process(
            target=_socket_sender, args=(listener.getsockname()[1], seed, nbytes, reps + 1),
            daemon=True, name="kvh-bench-socket-sender")
        sender.start()
        listener.settimeout(60)
        conn, _ = listener.accept()
        times = []
        with conn:
            view = memoryview(dst)
            for _ in range(reps + 1):
                dst.fill(0)
                t0 = time.perf_counter()
                conn.sendall(b"g")
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:], nbytes - got)
                    if n == 0:
                        raise RuntimeError("socket baseline: the sender went away")
                    got += n
                times.append(time.perf_counter() - t0)
                if not np.array_equal(dst, expected):
                    raise RuntimeError("socket baseline: the bytes differ")
        sender.join(30)
    return nbytes / statistics.median(times[1:]) / 1e9


def _ucx_loaded() -> bool:
    with open("/proc/self/maps") as maps:
        return any("libucs" in line for line in maps)


def _ucx_log_flush() -> None:
    """Write out this process's buffered UCX log (UCX flushes it only at exit or on errors)."""
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libucs" in line and "/" in line]
    if not paths:
        return
    try:
        ctypes.CDLL(paths[0], mode=os.RTLD_NOLOAD | os.RTLD_LAZY).ucs_log_flush()
    except (OSError, AttributeError):
        pass


_ROW = re.compile(r"\|\s*[\d.]+(?:inf)?\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|")


def read_protocols(log_dir: str) -> dict:
    """The protocols UCX reported (``UCX_PROTO_INFO``) for READs, from its log files.

    ``reads``: for each "remote memory read" table, what it says and the
    (method, lanes) of each size range; ``same_node_transports``: any of
    `SAME_NODE_TRANSPORTS` named in any table of any process (none over tcp).
    """
    reads: list[dict] = []
    seen: set[str] = set()
    for path in sorted(glob.glob(os.path.join(log_dir, "ucx-*.log"))):
        with open(path, errors="replace") as f:
            lines = [re.sub(r"^\[[^]]*\] \[[^]]*\]\s*", "", x) for x in f]
        for i, line in enumerate(lines):
            seen.update(t for t in SAME_NODE_TRANSPORTS
                        if line.startswith("|") and re.search(rf"\b{t}/", line))
            if line.startswith("|") and "remote memory read" in line:
                rows = []
                for nxt in lines[i + 1:]:
                    if "cfg#" in nxt or not nxt.startswith(("|", "+")):
                        break
                    m = _ROW.search(nxt)
                    if m and m.group(1) != "Description":
                        rows.append(f"{m.group(1)} {m.group(2)}")
                reads.append({"what": line.strip().strip("|").strip(), "rows": rows})
    return {"reads": reads, "same_node_transports": sorted(seen)}


def _views(layouts, payload):
    from kvhandoff.transports.nixl.process import RegionView

    views: list[RegionView] = []
    plans = []
    for n, layout in enumerate(layouts):
        nb = layout.num_blocks(payload)
        size = nb * (layout.stride or layout.block_bytes)
        names, index = [], []
        for r in range(layout.regions):
            name = f"row{n}.region{r}"
            index.append(len(views))
            views.append(RegionView(name, r * size, nb, layout.block_bytes, layout.stride))
            names.append(name)
        plans.append({"num_blocks": nb, "names": names, "index": index})
    return views, plans


def _timed_read(d, peer, split, step_s: float, lock, pump) -> tuple[float, float, int]:
    """(total s, posting s, D's polls) of one READ; D polls once per ``step_s`` (0: without
    pause), as an engine step does."""
    t0 = time.perf_counter()
    with lock:
        handle = d.post_split_read(peer, [split])
    t1 = time.perf_counter()
    if pump is not None:
        pump.wake()
    polls = 0
    while True:
        with lock:
            done = d.poll()
        polls += 1
        if done:
            break
        if step_s:
            time.sleep(step_s)
    t2 = time.perf_counter()
    (c,) = done
    if not c.ok or c.handle != handle:
        raise RuntimeError(f"bench READ failed: {c}")
    return t2 - t0, t1 - t0, polls


def src_bytes(a: Any) -> int:
    return a.nbytes if isinstance(a, np.ndarray) else a.numel() * a.element_size()


def _idle_cpu_percent(seconds: float) -> float:
    t0, w0 = os.times(), time.monotonic()
    time.sleep(seconds)
    t1, w1 = os.times(), time.monotonic()
    return 100.0 * ((t1.user - t0.user) + (t1.system - t0.system)) / (w1 - w0)


def _idle_default(seconds: float) -> float:
    """An idle agent with NIXL's own progress-thread setting (delay 0), for comparison."""
    from kvhandoff.transports.nixl import NixlOptions
    from kvhandoff.transports.nixl.process import TransportProcess

    with TransportProcess(f"bench-idle-default-{os.getpid()}",
                          NixlOptions(progress_delay_us=0)) as p:
        return p.call("idle_cpu_percent", seconds)


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("nixl", "nixl-cu13", "nixl-cu12", "torch", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _targets(device: str, r: dict) -> dict:
    rows = r["rows"]
    out: dict[str, bool] = {"all_verified": all(x["verified"] for x in rows),
                            "idle_le_10pct": r["idle_cpu_percent"] <= 10.0}
    if device == "cuda" and r["options"]["dst"] == "host":
        out["ratio_ge_0.8_of_device_to_host_copy"] = all(x["ratio"] >= 0.8 for x in rows)
    elif device == "cuda" and r["options"]["transport"] == "default":
        big = [x for x in rows if x["descriptor_bytes"] >= 256 * 1024]
        many = [x for x in rows if x["descriptors"] >= 8192]
        top = [x for x in rows if x["descriptors"] >= 60000]
        out["ratio_ge_0.5_for_blocks_ge_256KiB"] = all(x["ratio"] >= 0.5 for x in big)
        out["ratio_ge_0.25_at_8192_plus_descriptors"] = all(x["ratio"] >= 0.25 for x in many)
        out["post_le_1us_per_descriptor_at_65536"] = all(
            x["post_us_per_descriptor"] <= 1.0 for x in top)
    elif device == "cpu" and r["options"]["transport"] == "default":
        big = [x for x in rows if x["descriptor_bytes"] >= MiB]
        out["ratio_ge_0.7_for_blocks_ge_1MiB"] = all(x["ratio"] >= 0.7 for x in big)
    if r["options"]["transport"] == "tcp":
        proto = r.get("read_protocols")
        if isinstance(proto, dict):
            out["reads_over_tcp_only"] = bool(proto["reads"]) and all(
                row.split()[-1].startswith("tcp/") for x in proto["reads"] for row in x["rows"]) \
                and not proto["same_node_transports"]
    return out


class _Arrays:
    """The few array operations the bench needs, on numpy (cpu) or torch (cuda).

    ``host_dst``: D's buffer is pinned host memory, the source VRAM (cuda only).
    """

    def __init__(self, device: str, host_dst: bool = False) -> None:
        self.device = device
        self.host_dst = host_dst
        if device == "cuda":
            import torch

            self.torch = torch
            if not torch.cuda.is_available():
                raise SystemExit("bench nixl --device cuda: no CUDA device visible")

    def zeros(self, n: int):
        if self.device == "cuda":
            if self.host_dst:
                return self.torch.zeros(n, dtype=self.torch.uint8, pin_memory=True)
            return self.torch.zeros(n, dtype=self.torch.uint8, device="cuda:0")
        return np.zeros(n, dtype=np.uint8)

    def pattern(self, fn, seed: int, n: int):
        if self.device == "cuda":
            return fn(seed, n, self.torch, "cuda:0").clone()
        return fn(seed, n).copy()

    def clear(self, a) -> None:
        if self.device == "cuda":
            a.zero_()
            self.torch.cuda.synchronize()
        else:
            a.fill(0)

    def copy(self, dst, src) -> float:
        """Seconds for one copy of ``src`` into ``dst`` (device to device, or to host)."""
        if self.device == "cuda":
            self.torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            self.torch.cuda.synchronize()
            return time.perf_counter() - t0
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    def verify(self, dst, src, views, order: np.ndarray) -> bool:
        """Each view's rows hold the source's rows ``order``; a strided view's bytes
        between blocks are still zero."""
        if self.device == "cuda":
            torch = self.torch
            if self.host_dst:
                dst = dst.to("cuda:0")  # compare on the GPU: 1 GiB on the host is slow
            idx = torch.as_tensor(order, device="cuda:0")
            for v in views:
                pitch = v.stride or v.block_bytes
                got = dst[v.offset:v.offset + v.num_blocks * pitch].view(v.num_blocks, pitch)
                want = src[v.offset:v.offset + v.num_blocks * pitch].view(v.num_blocks, pitch)
                if not torch.equal(got[:, :v.block_bytes],
                                   want[:, :v.block_bytes].index_select(0, idx)):
                    return False
                if pitch > v.block_bytes and bool(got[:, v.block_bytes:].any()):
                    return False
            return True
        for v in views:
            pitch = v.stride or v.block_bytes
            got = dst[v.offset:v.offset + v.num_blocks * pitch].reshape(v.num_blocks, pitch)
            want = src[v.offset:v.offset + v.num_blocks * pitch].reshape(v.num_blocks, pitch)
            if not np.array_equal(got[:, :v.block_bytes], want[order, :v.block_bytes]):
                return False
            if pitch > v.block_bytes and got[:, v.block_bytes:].any():
                return False
        return True

    def machine(self) -> str:
        cpu = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.node()}"
        if self.device == "cuda":
            return f"{self.torch.cuda.get_device_name(0)}; {cpu}"
        return cpu


def main(argv: list[str] | None = None) -> int:
    import orjson

    parser = argparse.ArgumentParser(prog="python -m kvhandoff.adapters.bench.nixl",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        for key, value in result.items():
            if key == "rows":
                for row in value:
                    print("  " + "  ".join(f"{k}={v}" for k, v in row.items() if k != "layout"))
            else:
                print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
