"""The mutant catalogue stays live: every mutant still applies to the code as it is.

`tests/mutants.py` (``make mutants``) runs the CI-profile suite against each
mutant of the safety rules; this cheap check makes sure code motion never
silently turns a mutant into a no-op.
"""

from __future__ import annotations

import pytest
from mutants import MUTANTS, ROOT, MutantStale, mutate

# The mutants issue #9 asks for, by name.
REQUIRED = {
    "stop_heartbeat_on_cancel", "skip_lease_bound_in_verdict", "free_twice_on_duplicate_release",
    "drop_peer_binding", "accept_release_without_token", "lease_bound_from_receipt",
    "count_duplicate_rank_release", "release_at_post_time", "serve_unconfirmed_reads",
    "never_expire_leases",
}


def test_the_catalogue_holds_every_mutant_the_issue_names_once():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    assert REQUIRED <= set(names)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_matches_its_code_exactly_once_and_changes_it(mutant, tmp_path):
    target = tmp_path / mutant.path
    target.parent.mkdir(parents=True)
    original = (ROOT / mutant.path).read_text()
    target.write_text(original)
    mutate(tmp_path, mutant)
    assert target.read_text() != original


def test_a_stale_mutant_fails_loudly(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "policy.py").write_text("nothing to see\n")
    with pytest.raises(MutantStale, match="occurs 0 times"):
        mutate(tmp_path, next(m for m in MUTANTS if m.path == "core/policy.py"))
