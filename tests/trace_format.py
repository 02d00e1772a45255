"""What a Chrome trace-event file must be for ui.perfetto.dev and chrome://tracing to open it.

`check_trace` checks a document written by ``kvhandoff replay --trace``
against the Trace Event Format and returns a summary for further asserts:

* the JSON object form: ``traceEvents`` (a list) and no ``displayTimeUnit`` (the format
  makes it a display setting, but Perfetto reads every ``ts`` in that unit: "ms" would
  stretch the trace a thousandfold there);
* every event has a known ``ph``; every event but metadata has a finite
  number ``ts`` and integer ``pid`` and ``tid``;
* metadata: a ``process_name`` for every pid and a ``thread_name`` for
  every (pid, tid) that an event uses;
* ``B``/``E`` on one thread nest like a stack (an ``E`` closes the latest
  open ``B`` of the same name and category, never earlier than it began) and
  none is left open: no overlapping spans on a thread;
* ``b``/``e``: each id (with its category) begins once and ends once, later
  or at the same time, with the same name;
* flow ``s``/``f``: each (category, name, id) starts once and finishes once,
  not earlier than it started, and each is bound to an instant ``i`` at the
  same pid, tid and ts that comes before it in the file;
* with ``times`` ({(stream, seq): t} from the logs): every instant's ``ts``
  is its event's ``t`` in microseconds.
"""

from __future__ import annotations

import math
from collections import Counter

PHASES = set("MBEbeisf")


def check_trace(doc: dict, times: dict | None = None) -> dict:
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list)
    assert "displayTimeUnit" not in doc
    events = doc["traceEvents"]
    process_names: dict[int, str] = {}
    thread_names: dict[tuple[int, int], str] = {}
    used_threads: set[tuple[int, int]] = set()
    stacks: dict[tuple[int, int], list[dict]] = {}
    async_open: dict[tuple, dict] = {}
    async_done: set[tuple] = set()
    flow_start: dict[tuple, dict] = {}
    flow_end: dict[tuple, dict] = {}
    instants: set[tuple] = set()
    phases: Counter = Counter()
    for n, e in enumerate(events):
        ph = e.get("ph")
        assert ph in PHASES, (n, e)
        phases[ph] += 1
        if ph == "M":
            if e["name"] == "process_name":
                process_names[e["pid"]] = e["args"]["name"]
            elif e["name"] == "thread_name":
                thread_names[e["pid"], e["tid"]] = e["args"]["name"]
            continue
        ts = e.get("ts")
        assert type(ts) in (int, float) and math.isfinite(ts), (n, e)
        assert type(e.get("pid")) is int and type(e.get("tid")) is int, (n, e)
        where = (e["pid"], e["tid"])
        used_threads.add(where)
        if ph == "B":
            stacks.setdefault(where, []).append(e)
        elif ph == "E":
            stack = stacks.get(where)
            assert stack, f"E without an open B on {where}: {e}"
            top = stack.pop()
            assert (top["name"], top.get("cat")) == (e["name"], e.get("cat")), (top, e)
            assert e["ts"] >= top["ts"], (top, e)
        elif ph == "b":
            key = (e["cat"], e["id"])
            assert key not in async_open and key not in async_done, f"id reused: {e}"
            async_open[key] = e
        elif ph == "e":
            key = (e["cat"], e["id"])
            begin = async_open.pop(key, None)
            assert begin is not None, f"e without its b: {e}"
            assert begin["name"] == e["name"] and e["ts"] >= begin["ts"], (begin, e)
            async_done.add(key)
        elif ph == "i":
            assert e.get("s") in ("t", "p", "g"), e
            instants.add((*where, ts))
            if times is not None:
                t = times[process_names[e["pid"]], e["args"]["seq"]]
                assert ts == round(t * 1e6, 3), (e, t)
        else:  # s, f
            key = (e["cat"], e["name"], e["id"])
            seen = flow_start if ph == "s" else flow_end
            assert key not in seen, f"flow {ph} repeated: {e}"
            seen[key] = e
            assert (*where, ts) in instants, f"flow event bound to no instant: {e}"
    assert not any(stacks.values()), f"B without E: {[s for s in stacks.values() if s]}"
    assert not async_open, f"b without e: {list(async_open.values())[:3]}"
    assert flow_start.keys() == flow_end.keys(), "a flow s without its f or the reverse"
    for key, s in flow_start.items():
        assert flow_end[key]["ts"] >= s["ts"], (s, flow_end[key])
        assert flow_end[key].get("bp") == "e", flow_end[key]  # binds to its instant
    for pid, _ in used_threads:
        assert pid in process_names, f"no process_name for pid {pid}"
    missing = used_threads - thread_names.keys()
    assert not missing, f"no thread_name for {sorted(missing)[:5]}"
    return {"phases": phases, "processes": process_names, "threads": thread_names,
            "flows": Counter(k[1] for k in flow_start)}
