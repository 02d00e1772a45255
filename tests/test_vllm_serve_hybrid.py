"""The serve route with hybrid models: ``vllm serve`` P and D behind the example router.

The same route as test_vllm_serve.py (its `Route` and helpers), with the
tiny Gemma-3 (sliding-window + full attention groups) and the tiny Mamba2
(a state group; ``--no-enable-prefix-caching``, as the operator guide says).
The promises users rely on hold here too: D's text equals a plain engine's,
a client that leaves during the reads never lets P free under them, a bad
request fails alone, every export is freed exactly once and
``kvhandoff replay --check`` is clean.
"""

from __future__ import annotations

import pytest
from conftest import wait_for

pytest.importorskip("vllm")
pytest.importorskip("nixl")
httpx = pytest.importorskip("httpx")

from test_vllm_serve import (  # noqa: E402
    Route,
    _replay_check,
    assert_freed_once,
    assert_p_outlived_the_reads,
    assert_serves,
    body,
    cancel_during_read,
    events,
    kinds,
    prefill,
    reference,
    serve_log,
    text_prompt,
    through_router,
    wait_event,
)

pytestmark = pytest.mark.timeout(900)

GROUPS = {"gemma3": 2, "mamba2": 1}


@pytest.fixture(scope="module", params=["gemma3", "mamba2"])
def route(request, tmp_path_factory):
    args = ("--no-enable-prefix-caching",) if request.param == "mamba2" else ()
    r = Route(tmp_path_factory.mktemp(f"serve-{request.param}"), request.param, args)
    r.kind = request.param
    try:
        r.start()
        yield r
    finally:
        r.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_hand_offs_through_the_router_match_a_plain_engine(route, stream):
    prompts = [text_prompt(500 + i + 10 * stream, 40 + 60 * i) for i in range(3)]
    refs = [reference(route, p) for p in prompts]
    assert len({tuple(r["token_ids"]) for r in refs}) == len(refs), "the model ignores its prompt"
    for prompt, ref in zip(prompts, refs, strict=True):
        assert through_router(route, prompt, stream) == (ref["text"], ref["token_ids"])
    exported = [e.request_id for e in events(route.p_log) if e.kind == "exported"]
    for rid in exported[-3:]:
        d_evs = wait_event(route.d_log, rid, "release_sent")
        posted = next(e for e in d_evs if e.kind == "reads_posted")
        assert posted.split_groups == tuple(range(GROUPS[route.kind]))  # a split per group
        assert kinds(d_evs).count("split_completed") == GROUPS[route.kind]
        assert_freed_once(route, rid, released=True)


def test_a_client_gone_during_the_reads_never_lets_p_free_under_them(route):
    assert_p_outlived_the_reads(route, *cancel_during_read(route, 600, True))
    assert_serves(route, 610)


@pytest.mark.parametrize("case", ["a_group_missing", "a_group_too_long", "a_foreign_block"])
def test_params_that_do_not_fit_the_groups_fail_that_request_only(route, case):
    prompt = text_prompt(700 + ["a_group_missing", "a_group_too_long", "a_foreign_block"].index(case),
                         80)
    params = prefill(route, prompt)
    rid = params["remote_request_id"]
    ids = [list(g) for g in params["remote_block_ids"]]
    if case == "a_group_missing":
        ids = ids[1:] if len(ids) > 1 else ids + [[10_000]]
    elif case == "a_group_too_long":
        ids[0] = ids[0] + [max(max(g) for g in ids) + 1]
    else:
        ids[-1][-1] = 1 << 30  # beyond P's pool
    seen = len(serve_log(route.d))
    r = httpx.post(f"{route.d.url}/v1/completions", timeout=120, headers=route.headers,
                   json=body(route, prompt, kv_transfer_params={**params, "remote_block_ids": ids}))
    assert r.status_code >= 400, r.text[:300]
    wait_for(lambda: any("remote_block_ids" in line for line in
                         serve_log(route.d)[seen:].splitlines() if "[error" in line),
             30, "D's log to name remote_block_ids")
    assert_freed_once(route, rid, released=True)  # D named P's request: released at once
    assert_serves(route, 720)


# Last in the file, so last for each model: pytest runs a module-scoped parametrized
# fixture's tests together, in file order (no `phase` mark: that would regroup them).
def test_every_export_is_freed_exactly_once_and_replay_is_clean(route):
    from collections import Counter

    def all_freed():
        evs = events(route.p_log)
        exported = {e.request_id for e in evs if e.kind == "exported"}
        frees = Counter(e.request_id for e in evs if e.kind == "freed")
        return exported and all(frees[r] for r in exported) and (exported, frees)

    exported, frees = wait_for(all_freed, 60, "P to free every exported request")
    assert all(frees[r] == 1 for r in exported)
    result = _replay_check(route.p_log, route.d_log)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "EngineCore encountered a fatal error" not in serve_log(route.d) + serve_log(route.p)
