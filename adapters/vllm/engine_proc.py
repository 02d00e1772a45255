"""One vLLM engine in its own process, driven over a small ZMQ control socket.

The demo, the benchmark and the end-to-end tests start a prefill (P) and a
decode (D) engine as two processes, exactly as a deployment would, and talk to
each through this server: add a request, abort it, read what finished.  The
engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
connector's scheduler and worker halves live in this process too and the
server can flush their event logs and read their stats.

Control messages are JSON objects (orjson), never pickles.  stdout belongs to
NIXL's own logging; nothing here reads it.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson


@dataclass(slots=True)
class EngineSpec:
    """How to start one engine.  ``connector``: ``kvhandoff`` | ``nixl`` | ``none`` |
    ``multi`` (D only: ``MultiConnector[KVHandoffConnector, DecodeBenchConnector]``,
    kvhandoff first so it claims the remote-prefill requests; DecodeBench fills
    every other request's prompt with dummy KV, docs/operator-guide.md)."""

    name: str
    role: str  # "prefill" | "decode" | "single"
    model_dir: str
    control: str  # zmq endpoint the parent has bound
    connector: str = "kvhandoff"
    engine_id: str = ""
    side_channel_port: int = 0
    extra_config: dict[str, Any] = field(default_factory=dict)
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    seed: int = 0
    kv_load_failure_policy: str = "fail"
    idle_step_s: float = 0.01
    enable_prefix_caching: bool = True

    def to_json(self) -> str:
        return orjson.dumps(asdict(self)).decode()

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        return cls(**orjson.loads(text))


def engine_env(spec: EngineSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an engine process needs (a 2-core CPU machine: docs/operator-guide.md)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.kv_cache_gib))
    env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    if spec.side_channel_port:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _kv_transfer_config(spec: EngineSpec) -> dict[str, Any] | None:
    if spec.connector == "none" or spec.role == "single":
        return None
    role = "kv_producer" if spec.role == "prefill" else "kv_consumer"
    cfg: dict[str, Any] = {
        "kv_role": role,
        "engine_id": spec.engine_id or spec.name,
        "kv_load_failure_policy": spec.kv_load_failure_policy,
    }
    if spec.connector in ("kvhandoff", "multi"):
        cfg["kv_connector"] = "KVHandoffConnector"
        cfg["kv_connector_module_path"] = "kvhandoff.adapters.vllm"
        extra = dict(spec.extra_config)
        if spec.side_channel_port:
            extra.setdefault("side_channel_port", spec.side_channel_port)
        cfg["kv_connector_extra_config"] = extra
        if spec.connector == "multi":
            if role != "kv_consumer":
                raise ValueError("connector 'multi' is for the decode engine only")
            # MultiConnector gives each child the parent's engine_id; a child
            # that names one too is refused (KVTransferConfig(**ktc, engine_id=...)).
            child = {k: v for k, v in cfg.items() if k != "engine_id"}
            bench = {"kv_connector": "DecodeBenchConnector", "kv_role": role}
            cfg = {k: cfg[k] for k in ("kv_role", "engine_id", "kv_load_failure_policy")}
            cfg["kv_connector"] = "MultiConnector"
            cfg["kv_connector_extra_config"] = {"connectors": [child, bench]}
    elif spec.connector == "nixl":
        cfg["kv_connector"] = "TimedNixlConnector"
        cfg["kv_connector_module_path"] = "kvhandoff.adapters.vllm.timing"
        cfg["kv_connector_extra_config"] = dict(spec.extra_config)
    else:
        raise ValueError(f"unknown connector {spec.connector!r} (kvhandoff | multi | nixl | none)")
    return cfg


def _uses_mla(model_dir: str) -> bool:
    """Whether the model's config declares multi-head latent attention (DeepSeek-V2 style)."""
    try:
        config = orjson.loads((Path(model_dir) / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return False
    return bool(config.get("kv_lora_rank"))


def build_engine(spec: EngineSpec) -> Any:
    from vllm import EngineArgs, LLMEngine

    kv_cfg = _kv_transfer_config(spec)
    args = EngineArgs(
        model=spec.model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=spec.max_model_len,
        enforce_eager=True,
        seed=spec.seed,
        kv_transfer_config=kv_cfg,
        enable_prefix_caching=spec.enable_prefix_caching,
        # vllm-cpu picks its AMX MLA backend on a CPU with AMX tiles, which takes only
        # bf16/fp16/int8 weights; these engines run fp32, so MLA takes the reference one.
        attention_backend="CPU_MLA" if _uses_mla(spec.model_dir) else None,
    )
    return LLMEngine.from_engine_args(args)


class _Server:
    def __init__(self, spec: EngineSpec) -> None:
        import zmq

        self.spec = spec
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(spec.control)
        self.engine = build_engine(spec)
        self.added: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.running = True

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.send(orjson.dumps(msg, option=orjson.OPT_SERIALIZE_NUMPY))

    def handle(self, msg: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        op = msg.get("op")
        if op == "add":
            extra = {}
            if msg.get("kv_transfer_params") is not None:
                extra["kv_transfer_params"] = msg["kv_transfer_params"]
            params = SamplingParams(
                max_tokens=int(msg["max_tokens"]),
                temperature=0.0,
                ignore_eos=True,
                extra_args=extra or None,
            )
            rid = msg["rid"]
            self.added[rid] = time.monotonic()
            try:
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=msg["prompt"]), params)
            except Exception as exc:  # a request the engine refuses is that request's error
                self.added.pop(rid, None)
                self.send({"op": "done", "rid": rid, "token_ids": [], "finish_reason": "refused",
                           "error": f"{type(exc).__name__}: {exc}"})
                return
            if msg.get("abort_immediately"):
                # Aborted before any engine step could schedule it.
                self.handle({"op": "abort", "rids": [rid]})
        elif op == "abort":
            rids = [r for r in msg["rids"] if r in self.added]
            self.engine.abort_request(rids)
            now = time.monotonic()
            for rid in rids:  # vLLM emits no output for an aborted request: say it here
                added = self.added.pop(rid)
                self.first_token.pop(rid, None)
                self.send({"op": "done", "rid": rid, "token_ids": [], "finish_reason": "aborted",
                           "kv_transfer_params": None, "ttft_ms": None,
                           "e2e_ms": (now - added) * 1e3, "transfer_ms": None})
        elif op == "flush":
            self.send({"op": "flushed", "logs": _flush_connector_logs()})
        elif op == "stats":
            self.send({"op": "stats", "stats": _connector_stats()})
        elif op == "shutdown":
            self.running = False
        else:
            self.send({"op": "error", "error": f"unknown op {op!r}"})

    def outputs(self, outs: list[Any]) -> None:
        from kvhandoff.adapters.vllm import timing

        now = time.monotonic()
        for out in outs:
            rid = out.request_id
            comp = out.outputs[0] if out.outputs else None
            if comp is not None and comp.token_ids and rid not in self.first_token:
                self.first_token[rid] = now
            if not out.finished:
                continue
            added = self.added.pop(rid, now)
            first = self.first_token.pop(rid, None)
            t_entry = None
            for key in list(timing._TIMINGS):
                if key == rid or key.rsplit("-", 1)[0] == rid:
                    t_entry = timing.take(key)
                    break
            self.send({
                "op": "done",
                "rid": rid,
                "token_ids": list(comp.token_ids) if comp is not None else [],
                "finish_reason": comp.finish_reason if comp is not None else None,
                "kv_transfer_params": out.kv_transfer_params,
                "ttft_ms": (first - added) * 1e3 if first is not None else None,
                "e2e_ms": (now - added) * 1e3,
                "transfer_ms": timing.transfer_ms(t_entry),
            })

    def _core_has_requests(self) -> bool:
        core = getattr(getattr(self.engine, "engine_core", None), "engine_core", None)
        sched = getattr(core, "scheduler", None)
        return bool(sched is not None and sched.has_requests())

    def serve(self) -> None:
        import zmq

        self.send({"op": "ready", "pid": os.getpid(), "logs": _flush_connector_logs()})
        last_step = 0.0
        while self.running:
            # Like vLLM's EngineCore loop: keep stepping while the scheduler
            # holds anything (delayed frees included), not only while the
            # frontend waits for tokens; fully idle, step only to poll.
            busy = self.engine.has_unfinished_requests() or self._core_has_requests()
            timeout_ms = 0 if busy else int(self.spec.idle_step_s * 1e3)
            if self.sock.poll(timeout_ms, zmq.POLLIN):
                while self.sock.poll(0, zmq.POLLIN):
                    self.handle(orjson.loads(self.sock.recv()))
                busy = self.engine.has_unfinished_requests() or self._core_has_requests()
            now = time.monotonic()
            if busy or now - last_step >= self.spec.idle_step_s:
                last_step = now
                self.outputs(self.engine.step())
        _flush_connector_logs()
        self.send({"op": "bye"})
        self.sock.close()


def _flush_connector_logs() -> list[str]:
    try:
        from kvhandoff.adapters.vllm.connector import flush_all_logs
    except ImportError:
        return []
    return flush_all_logs()


def _connector_stats() -> dict[str, Any]:
    try:
        from kvhandoff.adapters.vllm.connector import stats_snapshot
    except ImportError:
        return {}
    return stats_snapshot()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = EngineSpec.from_json(argv[0])
    try:
        server = _Server(spec)
        server.serve()
    except BaseException:  # an engine that cannot start (a refused topology) must exit
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    # Skip interpreter teardown: vLLM/NIXL threads can hang a clean exit.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
