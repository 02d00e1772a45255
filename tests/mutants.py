"""Mutation testing of the safety rules: each mutant is one plausible bug; the suite must fail.

    python tests/mutants.py                 # every mutant (make mutants)
    python tests/mutants.py --only drop_peer_binding
    python tests/mutants.py --check         # only check that every mutant still applies
    python tests/mutants.py --suite sim     # killed by the simulator's searches alone?

Each mutant is a search/replace on one source file: its snippet must occur
exactly once (a moved or edited rule fails loudly here, and the cheap CI test
`tests/test_mutants.py` checks the same on every commit, so code motion cannot
silently disable a mutant).  The tree is copied to a temporary directory, the
mutant applied there (the worktree is never touched), and the copy is imported
as ``kvhandoff`` through a ``PYTHONPATH`` shim.  Then, with the CI profile
(``CI=1``; ``KVH_MUTANT=1``: Hypothesis without shrinking, the same examples):

1. the model test alone (``tests/test_lifecycle_model.py``), and
2. the non-vLLM suite (`SUITE`: core, model, policy, replay, messages, event
   log, simulations, sim transport, cache groups and hybrid simulations),
   stopping at the first failure,

and a table says which killed it.  Exit status 1 if any mutant survived.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The non-vLLM CI suite, quickest first (pytest -x stops at the first failure).
SUITE = (
    "tests/test_lifecycle.py", "tests/test_policy.py", "tests/test_producer_engine.py",
    "tests/test_consumer_engine.py", "tests/test_replay.py",
    "tests/test_messages.py", "tests/test_event_log.py", "tests/test_lifecycle_model.py",
    "tests/test_transport_sim.py", "tests/test_simulations_hypothesis.py",
    "tests/test_simulations_cli.py", "tests/test_simulations_determinism.py",
    "tests/test_simulations.py", "tests/test_groups.py", "tests/test_simulations_hybrid.py",
    "tests/test_simulations_hisparse.py",
)
MODEL_TEST = "tests/test_lifecycle_model.py"
# ``--suite sim``: only the randomized searches (the simulator's scenarios and Hypothesis
# sweeps), no example test: does the simulator find the bug on its own?
SIM_SUITE = (
    "tests/test_simulations_hypothesis.py", "tests/test_simulations.py",
    "tests/test_simulations_hybrid.py", "tests/test_simulations_hisparse.py",
)


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    what: str


class MutantStale(Exception):
    """A mutant's snippet no longer occurs exactly once: the code moved."""


MUTANTS: tuple[Mutant, ...] = (
    Mutant("stop_heartbeat_on_cancel", "core/lifecycle.py",
           "    DState.READING, DState.CANCELLED_READING,\n})\n",
           "    DState.READING,\n})\n",
           "D stops heartbeating a request when the client cancels, reads or not"),
    Mutant("skip_lease_bound_in_verdict", "core/lifecycle.py",
           "        elif done > rec.safe_until.get(rank, -math.inf):\n",
           "        elif rank not in rec.safe_until:\n",
           "any acknowledgement confirms a read, however late it completed"),
    Mutant("free_twice_on_duplicate_release", "core/lifecycle.py",
           '    ("release_notified", _IGNORED_P, "=", _ignore("after_release"), None),\n',
           '    ("release_notified", _IGNORED_P, P.RELEASED, _end("released"), None),\n',
           "a release after the free releases (and so frees) the request again"),
    Mutant("drop_peer_binding", "core/lifecycle.py",
           "    if rec.consumer and engine != rec.consumer:\n"
           "        ss.ignored[\"wrong_peer\"] += 1\n        return False\n",
           "",
           "P takes heartbeats and releases from any engine that has the token"),
    Mutant("accept_release_without_token", "core/lifecycle.py",
           "    if rec.token and token != rec.token:\n",
           "    if rec.token and token and token != rec.token:\n",
           "a heartbeat or release with no token passes the token check"),
    Mutant("lease_bound_from_receipt", "core/lifecycle.py",
           "ev.sent_at + max(min(ev.time_left, rec.lease_s) - rec.margin, 0.0))\n",
           "ev.t + max(min(ev.time_left, rec.lease_s) - rec.margin, 0.0))\n",
           "D bounds the lease from when the answer arrived, not from when it asked"),
    Mutant("count_duplicate_rank_release", "core/lifecycle.py",
           "    if ev.consumer_rank in rec.notified:\n"
           "        ss.ignored[\"duplicate_release\"] += 1\n        return None\n",
           "",
           "a consumer rank's second release counts as another rank's"),
    Mutant("release_at_post_time", "simulations/decode.py",
           "            self.reading[rid] = imp\n",
           "            self.reading[rid] = imp\n"
           "            for d in range(len(self.agents)):\n"
           "                self.agents[d].send_notif(self.peers[d], encode(Release(\n"
           "                    rid, self.name, d, imp.params.token)))\n",
           "D releases P's blocks when it posts the READs"),
    Mutant("serve_unconfirmed_reads", "core/consumer.py",
           "        ok = rec.state is DState.RECEIVED\n",
           "        ok = not rec.failed\n",
           "D reports unproven reads as received when it gives up waiting for P's word"),
    Mutant("never_expire_leases", "core/policy.py",
           "            if rec.state is PState.EXPORTED and t >= rec.deadline]\n",
           "            if rec.state is PState.EXPORTED and t >= rec.deadline and False]\n",
           "P never reaps an expired lease"),
    Mutant("released_answer_is_proof", "core/lifecycle.py",
           "    rank = ev.p_rank\n    if ev.time_left > 0:\n",
           "    rank = ev.p_rank\n    if ev.time_left == 0:\n"
           "        rec.safe_until[rank] = math.inf\n        return rec\n"
           "    if ev.time_left > 0:\n",
           "a 'released' answer confirms every read (the stale-own-release gap)"),
    Mutant("release_with_the_read", "simulations/policies.py",
           '                         mint_tokens=True)\n',
           '                         mint_tokens=True, release_with_reads=True)\n',
           "kvhandoff's D lets each READ carry its release, before finished_recving"),
    # Hybrid models (issue #10): several splits per request, a window read per group.
    Mutant("report_after_the_first_group", "core/lifecycle.py",
           "        return None not in self.split_done\n",
           "        return self.split_done[:1] != [None]\n",
           "D reports a request (and lets P free) once its first split drained, other groups in flight"),
    Mutant("window_one_block_short", "core/planning.py",
           "        return total - max(0, num_tokens - group.window + 1) // group.block_size\n",
           "        return total - max(0, num_tokens - group.window + 1 + group.block_size) "
           "// group.block_size\n",
           "a sliding-window group reads one block fewer than the last token attends to"),
    # Issue #13: D's timing follows P's lease; forgetting is an event.
    Mutant("heartbeat_period_ignores_p_lease", "core/policy.py",
           "    return min((interval_s, *(lease / HEARTBEATS_PER_LEASE for lease in leases)))\n",
           "    return interval_s\n",
           "D heartbeats at its own period, however short the lease P granted"),
    Mutant("forget_by_age_not_by_end", "core/policy.py",
           "                 or t - rec.t_end > REMEMBER_LEASES * max(lease_s, rec.lease_s))]\n",
           "                 or t - rec.t0 > REMEMBER_LEASES * max(lease_s, rec.lease_s))]\n",
           "an engine forgets a request two leases after it began, not after it ended"),
    Mutant("forget_before_the_request_s_lease", "core/policy.py",
           "                 or t - rec.t_end > REMEMBER_LEASES * max(lease_s, rec.lease_s))]\n",
           "                 or t - rec.t_end > REMEMBER_LEASES * lease_s)]\n",
           "D forgets a request (its params reusable) while P may still hold it under a longer lease"),
    Mutant("replay_keeps_a_forgotten_free", "core/replay.py",
           "                freed_at.pop((stream.engine, stream.rank, rid), None)\n",
           "                pass\n",
           "replay checks a re-used id's reads against the free of its earlier life"),
    Mutant("replay_drops_a_free_with_p_s_record", "core/replay.py",
           "            _forget(result, event)\n",
           "            _forget(result, event)\n"
           "            freed_at.pop((event.stream.engine, event.stream.rank, event.request_id), None)\n",
           "replay stops checking D's READs against a free once P forgot the released request"),
    # Issue #14: P's decisions in one engine.
    Mutant("answer_with_a_lease_p_does_not_hold", "core/producer.py",
           "            left[rid] = lease_time_left(self.state, self.stream, rid, now, engine=sender,\n"
           "                                        token=token)\n",
           "            left[rid] = self.lease_s\n",
           "P answers every heartbeat 'alive for a lease', freed or not, whoever asks"),
    Mutant("free_without_reporting", "core/producer.py",
           "                step.freed.append(rid)\n",
           "                pass\n",
           "P frees a request in its log but never tells the host engine (blocks leak)"),
    # Issue #14: D's decisions in one engine (`core.consumer`), which the simulator and the
    # connector both drive.
    Mutant("report_a_timed_out_read_in_flight", "core/consumer.py",
           "        if not req.in_flight:  # (a failed READ still moving bytes",
           "        if True:  # (a failed READ still moving bytes",
           "D reports (and releases P for) a READ it gave up on while it still moves bytes"),
    Mutant("ack_from_any_agent", "core/consumer.py",
           "            if (isinstance(rec, ConsumerRecord) and req is not None and req.peer == sender\n",
           "            if (isinstance(rec, ConsumerRecord) and req is not None\n",
           "D takes a lease answer from an agent the request does not read from"),
    Mutant("forget_a_cancelled_request_reading", "core/consumer.py",
           "            if self._rec(rid).state is DState.CANCELLED:  # nothing posted: release at once\n",
           "            if self._rec(rid).state is DState.CANCELLED_READING:\n"
           "                self.abandon(rid)\n"
           "            if self._rec(rid).state is DState.CANCELLED:  # nothing posted: release at once\n",
           "D forgets a cancelled request whose READs are in flight (no heartbeat, no report)"),
    Mutant("no_urgent_heartbeat_at_admission", "core/policy.py",
           "        if urgent or new or lost is not None:\n",
           "        if urgent or lost is not None:\n",
           "D waits a whole period before its first heartbeat for a new request"),
    Mutant("asks_leave_unvouched_requests_behind", "core/policy.py",
           "            named.update(rid for rid in rids if now - vouched(rid) >= period * 1.25\n",
           "            named.update(rid for rid in rids if False\n",
           "a request whose keep-alives are lost is not carried by the asks that get through"),
    Mutant("unanswered_keep_alive_waits_a_period", "core/policy.py",
           "        lost = lost if lost is not None and quiet and now - lost >= period / 4 else None\n",
           "        lost = None\n",
           "a keep-alive P never answered is not followed by an ask: with the fence (no asks at "
           "admission) a lease hangs on the next keep-alive alone"),
    Mutant("refused_release_never_sent_again", "core/consumer.py",
           "        if retry:\n            at = release_retry_at(",
           "        if False:\n            at = release_retry_at(",
           "a release the transport refused to send is not planned again: P holds the blocks "
           "until the lease runs out"),
    Mutant("release_before_export_ignored", "core/producer.py",
           "        if (isinstance(rec, ProducerRecord) and rec.state is PState.PREFILLING\n",
           "        if (False and isinstance(rec, ProducerRecord)\n",
           "P drops a release that reached it before its export: the blocks stay pinned a lease"),
    Mutant("fence_trusts_any_value", "core/consumer.py",
           "if value == req.fence[1] and self._record(FenceHeld,",
           "if value is not None and self._record(FenceHeld,",
           "D takes any value its fence READ finds (cleared, another request's) as proof"),
    Mutant("free_keeps_the_fence", "core/producer.py",
           "                        step.fences.append((slot, CLEARED))\n",
           "",
           "P frees a request's blocks without clearing its fence slot: a later fence READ "
           "still finds the request's value"),
    Mutant("fence_bound_from_completion", "core/lifecycle.py",
           "rec.safe_until[rank] = max(rec.safe_until.get(rank, -math.inf), ev.posted_at)",
           "rec.safe_until[rank] = max(rec.safe_until.get(rank, -math.inf), ev.t)",
           "a fence proves the source held until the fence READ completed, not when it was "
           "posted (a split that completed in between is taken as proven)"),
    Mutant("shared_pool_rank_skips_every_group", "core/planning.py",
           "        if not l_ids or (local_rank and local.shared_host_pool and in_host_pool(g)):\n",
           "        if not l_ids or (local_rank and local.shared_host_pool):\n",
           "with a HiSparse host pool shared by D's ranks, a rank other than 0 skips its "
           "device groups too (its indexer never read, served as if it had been)"),
    Mutant("refused_export_stays_pinned", "core/producer.py",
           "                self._unpinned.append(rid)\n",
            "",
            "an export the fold refuses is never named: vLLM keeps its blocks for ever"),
    Mutant("refused_live_export_freed", "core/producer.py",
           "            if rec is None or rec.state in (PState.NEW, PState.PREFILLING, PState.FREED):\n",
           "            if True:\n",
           "an export refused while the id's earlier life is live is named too: vLLM hears "
           "of the id twice (its scheduler asserts on the second)"),
    Mutant("heartbeat_names_only_max_ids", "core/consumer.py",
           "                      for at in range(0, max(len(ordered), 1), MAX_IDS)]\n",
           "                      for at in range(0, 1)]\n",
           "past MAX_IDS requests due at one P rank, D heartbeats only the first MAX_IDS: P's "
           "leases of the rest run out under their READs"),
)


def mutate(root: pathlib.Path, mutant: Mutant) -> None:
    """Apply ``mutant`` to the tree at ``root``; raise `MutantStale` unless it matches once."""
    path = root / mutant.path
    text = path.read_text()
    found = text.count(mutant.old)
    if found != 1:
        raise MutantStale(f"mutant {mutant.name}: its snippet occurs {found} times in "
                          f"{mutant.path} (expected once): update tests/mutants.py")
    path.write_text(text.replace(mutant.old, mutant.new))


def _copy_tree(dst: pathlib.Path) -> pathlib.Path:
    tree = dst / "kvhandoff"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", ".hypothesis", ".pytest_cache", ".venv", ".pyshim", "*.egg-info"))
    return tree


def _pytest(tree: pathlib.Path, files: tuple[str, ...] | list[str], timeout: int) -> tuple[bool, str]:
    """Run pytest in ``tree`` (imported as kvhandoff): (passed, first failing test)."""
    env = dict(os.environ, CI="1", KVH_MUTANT="1", PYTHONPATH=str(tree.parent),
               PYTHONDONTWRITEBYTECODE="1")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider",
             "-p", "no:randomly", *files],
            cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"(timed out after {timeout}s)"
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    if proc.returncode == 0:
        return True, ""
    return False, failed[0] if failed else f"(exit {proc.returncode})"


def run(mutants: list[Mutant], timeout: int, suite: tuple[str, ...] = SUITE) -> list[dict]:
    rows = []
    for mutant in mutants:
        with tempfile.TemporaryDirectory(prefix="kvh-mutant-") as tmp:
            tree = _copy_tree(pathlib.Path(tmp))
            mutate(tree, mutant)
            start = time.perf_counter()
            model_passed, model_failure = _pytest(tree, [MODEL_TEST], timeout)
            suite_passed, suite_failure = _pytest(tree, suite, timeout)
            rows.append({"mutant": mutant.name, "what": mutant.what,
                         "model": not model_passed, "suite": not suite_passed,
                         "first_failure": suite_failure or model_failure,
                         "seconds": round(time.perf_counter() - start, 1)})
        print(_row(rows[-1]), flush=True)
    return rows


def _row(r: dict) -> str:
    killed = "killed" if r["suite"] else "**SURVIVED**"
    model = "killed" if r["model"] else "survived"
    return f"| `{r['mutant']}` | {r['what']} | {model} | {killed} | `{r['first_failure']}` |"


HEADER = ("| mutant | the bug | model test | CI-profile suite | first failing test |\n"
          "|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", metavar="NAME", help="run only this mutant")
    ap.add_argument("--check", action="store_true", help="only check that every mutant applies")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    ap.add_argument("--suite", choices=("ci", "sim"), default="ci",
                    help="ci: the non-vLLM CI suite; sim: the simulator's searches alone")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.only and len(chosen) != len(args.only):
        ap.error(f"unknown mutant in {args.only}; known: {', '.join(m.name for m in MUTANTS)}")
    with tempfile.TemporaryDirectory(prefix="kvh-mutant-check-") as tmp:
        for m in chosen:  # fail loudly before spending minutes on the others
            tree = pathlib.Path(tmp) / m.name
            tree.mkdir()
            (tree / m.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / m.path, tree / m.path)
            mutate(tree, m)
    if args.check:
        print(f"{len(chosen)} mutants apply")
        return 0
    suite = SUITE if args.suite == "ci" else SIM_SUITE
    print(f"{len(chosen)} mutants, suite: {' '.join(suite)} (CI=1), {time.strftime('%Y-%m-%d')}")
    print(HEADER, flush=True)
    rows = run(chosen, args.timeout, suite)
    survived = [r["mutant"] for r in rows if not r["suite"]]
    print(f"\n{len(rows) - len(survived)} of {len(rows)} killed by the suite, "
          f"{sum(r['model'] for r in rows)} by the model test alone"
          + (f"; SURVIVED: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
