"""The run-loop fault campaign, short: a few seeds per primitive count no violation at all, and
each deliberate breakage of `tests.campaign.mutants` is caught within a bounded number of seeds.
The long campaign is ``python -m tests.campaign --primitive all --seeds 1000 --jobs 2``.
"""

from __future__ import annotations

import pytest

from tests.campaign import mutants
from tests.campaign.engine import COUNTERS, Report, run_seeds, until_caught

#: Runs at a time: this machine has two cores.
JOBS = 2
#: Seeds per primitive of the short campaign.
SEEDS = {"tasks": range(3), "facade": range(4)}
#: Per mutant, the primitive whose campaign must catch it and how many seeds it may take (the
#: first seeds that catch each, in this order: 1, 3, 0, then 0, 0 and 0 for the mutants of
#: issue 34's hostile documents and runaway handlers).
CAUGHT_BY = {
    "settle-without-fence": ("tasks", 10),
    "lease-from-reply": ("tasks", 40),
    "ignores-late-reply": ("tasks", 10),
    "claim-retries-refused-document": ("tasks", 10),
    "renewal-keeps-runaway-lease": ("tasks", 10),
    "runaway-never-abandoned": ("tasks", 10),
}


def _described(report: Report) -> str:
    return "\n".join([report.line(), *report.described()])


@pytest.mark.parametrize("primitive", sorted(SEEDS))
def test_a_short_campaign_counts_no_violation(primitive: str) -> None:
    report = run_seeds(primitive, SEEDS[primitive], jobs=JOBS)
    assert report.runs == len(SEEDS[primitive])
    assert report.items > 0
    assert report.counts == dict.fromkeys(COUNTERS, 0), _described(report)


def test_every_mutant_has_a_test() -> None:
    assert set(CAUGHT_BY) == set(mutants.MUTANTS)


@pytest.mark.parametrize("mutant", sorted(CAUGHT_BY))
def test_the_campaign_catches_the_mutant(mutant: str) -> None:
    if not mutants.MUTANTS[mutant].available():
        pytest.skip(f"{mutant}: the code it patches is not in this version of the library")
    patched = [mutants._resolve(patch.target) for patch in mutants.MUTANTS[mutant].patches]
    originals = [getattr(owner, name) for owner, name in patched]
    primitive, bound = CAUGHT_BY[mutant]
    seed, report = until_caught(primitive, mutant, bound, jobs=JOBS)
    assert seed is not None, f"{mutant} not caught in {bound} seeds:\n{_described(report)}"
    # The library is itself again afterwards.
    assert [getattr(owner, name) for owner, name in patched] == originals
