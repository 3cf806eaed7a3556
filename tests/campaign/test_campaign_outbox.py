"""A short run of the group transport's and the outbox's campaigns (`tests.campaign.groups`,
`tests.campaign.outbox`), and the outbox's catching a dispatcher that ignores a late reply.

A seed gives the same run wherever it runs, so the seeds below stay what they are: about a
second of CPU a run of the outbox (reading its 512 lanes on the embedded backend dominates),
under half a second one of groups.
"""

from __future__ import annotations

import functools

import pytest

from tests.campaign import mutants
from tests.campaign.engine import Report, run_seeds

#: Runs at a time: this machine has two cores.
JOBS = 2
GROUP_SEEDS = range(4)
#: The outbox's seeds, with and without the mutant (seeds 0 and 2 catch it, seed 0 as an
#: overlap: another dispatcher had taken the lane over).
OUTBOX_SEEDS = range(3)
MUTANT = "ignores-late-reply"
#: What a start of a delivery whose claim was answered too late shows.
STARTS = ("late_starts", "overlaps")


@functools.cache
def _report(primitive: str, seeds: range, mutant: str | None = None) -> Report:
    return run_seeds(primitive, seeds, mutant, jobs=JOBS)


def _explained(report: Report) -> str:
    return "\n".join([report.line(), *report.described()])


def test_group_runs_keep_every_guarantee() -> None:
    report = _report("groups", GROUP_SEEDS)
    assert report.runs == len(GROUP_SEEDS) and report.items > 0
    assert report.violations == 0, _explained(report)


def test_outbox_runs_keep_every_guarantee_and_their_summaries_agree() -> None:
    report = _report("outbox", OUTBOX_SEEDS)
    assert report.runs == len(OUTBOX_SEEDS) and report.items > 0
    assert report.violations == 0, _explained(report)


def test_a_dispatcher_that_ignores_a_late_reply_is_caught() -> None:
    """`lease.startable` always True: a claim answered after its lanes' lease ended starts its
    handlers, seen as late starts, or as overlaps when another dispatcher took a lane over
    meanwhile; judged by those counters, against the same seeds without it."""
    if not mutants.MUTANTS[MUTANT].available():
        pytest.skip(f"{MUTANT}: the code it patches is not in this version of the library")
    broken = _report("outbox", OUTBOX_SEEDS, MUTANT)
    assert any(broken.counts[c] for c in STARTS), _explained(broken)
    clean = _report("outbox", OUTBOX_SEEDS)
    assert not any(clean.counts[c] for c in STARTS), _explained(clean)
