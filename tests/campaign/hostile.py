"""The campaign's hostile faults, beside the command faults of ``faults``: handlers that swallow
their cancellation (`Runaways`) and the shapes of documents no worker can use (`SHAPES`), each
drawn per run from its seed; and the checks of what the library promises about runaways
(`check_runaways`). What a poisoned document must become is the scenario's to check (only it
knows its documents: ``tasks.check_poisoned``).

A runaway is a handler execution with a bare ``except BaseException`` around its sleeps: its
first cancellation (a time limit, a lost lease, an operator's cancel, a hard stop, a crash) is
caught, and it goes on for a drawn while (a fifth of `GRACE` to six times it, or, one time in
four, until the run is over), swallowing every further cancellation, then ends as its `Act`
says. The library cancels a handler once and, `GRACE` seconds of the clock later, abandons one
still running: it stops renewing its lease, frees its slot, counts it ``lost``, logs one WARNING
naming it. `check_runaways` holds it to that:

- abandoned on time: a runaway still running `GRACE` (+ `SLACK`) after it swallowed its
  cancellation was abandoned (the WARNING naming it came) by then, and one that ended before
  `GRACE` (- `SLACK`) was not;
- its lease no longer renewed: the lease of its claim on its item (where the primitive's lease is
  the item's own) is never seen ending later than `GRACE` plus one lease after it swallowed;
- no busy loop: an execution cancelled more than `BUSY` times (the library's cancellation
  delivered again at every checkpoint) is one, and it gives up (the run would spin).

Whether a worker with a runaway stops is `engine.check_stops`; that a start overlaps no live
lease (an abandoned handler runs on after its lease ended) is `engine.Run.start`'s as ever.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from mongoq.runtime.handler import GRACE

if TYPE_CHECKING:
    from tests.campaign.engine import Execution, Run

__all__ = ["BUSY", "GRACE", "SHAPES", "SLACK", "Runaway", "Runaways", "check_runaways"]

#: Clock seconds a judgement of "when" allows: a step of the driver and the settles around it.
SLACK = 1.0
#: Cancellations one execution may see: its first, the one that ends the run, and one to spare.
BUSY = 3
#: A hand edit no worker can use, as (field, value): what another program or a bad restore
#: leaves in a task document.
SHAPES: tuple[tuple[str, Any], ...] = tuple(
    (field, value)
    for field in ("attempts", "priority")
    for value in ("x", None, True, math.nan, {"n": 1})
)
#: A runaway that goes on "for good" sleeps in naps this long (until the run is over).
_NAP = 3600.0


@dataclass(eq=False)
class Runaway:
    """One handler execution that swallows its cancellation."""

    execution: Execution
    #: how the library's log names it: a part of the WARNING's ``mongoq_handler``
    name: str
    #: clock seconds it goes on after its first cancellation (``inf``: until the run is over)
    seconds: float
    #: (collection, document id, token): the lease of its claim on its item, where the
    #: primitive's lease is the item's own (None: not judged)
    lease: tuple[str, Any, str] | None
    swallowed: datetime | None = None
    ended: datetime | None = None
    caught: int = 0
    task: asyncio.Task[Any] | None = None

    def describe(self, run: Run) -> str:
        execution = self.execution
        going = "for good" if math.isinf(self.seconds) else f"for {self.seconds:g} s"
        return (
            f"{execution.item!r} (started by {execution.worker}, claim "
            f"{(execution.token or '?')[:6]}, at {run.at(execution.started)}), which swallowed "
            f"its cancellation at {run.at(self.swallowed)} and went on {going}"
        )


class Runaways:
    """One run's runaways: the share of handler executions that swallow their cancellation
    (drawn per run: none in a quarter of the runs, else 30-90 %), and those that did
    (`Run.runaways`)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.share = run.rng_for("runaways").choice((0.0, 0.3, 0.6, 0.9))

    def draw(
        self, execution: Execution, name: str, lease: tuple[str, Any, str] | None, *key: Any
    ) -> Runaway | None:
        """Whether the execution `key` names is a runaway, and for how long it goes on."""
        if not self.share:
            return None
        rng = self.run.rng_for("runaway", *key)
        if rng.random() >= self.share:
            return None
        seconds = math.inf if rng.random() < 0.25 else round(GRACE * rng.uniform(0.2, 6.0), 2)
        return Runaway(execution, name, seconds, lease)

    async def sleep(self, execution: Execution, seconds: float, runaway: Runaway | None) -> None:
        """A handler's work: `seconds` of the clock. A cancellation ends it (recorded as such,
        raised on) unless it is a `runaway`: then it goes on (`go_on`)."""
        try:
            await self.run.clock.sleep(seconds)
        except BaseException:
            if runaway is None or not await self.go_on(runaway):
                execution.end(self.run.clock.now(), "cancelled")
                raise

    async def go_on(self, runaway: Runaway) -> bool:
        """What a runaway does once its first cancellation is caught: sleep on for its while,
        swallowing every cancellation. True when it went on to its end; False (its caller
        raises the cancellation) when the run is over, or on a busy loop."""
        run = self.run
        clock = run.clock
        runaway.swallowed = clock.now()
        runaway.caught = 1
        runaway.task = asyncio.current_task()
        run.runaways.append(runaway)
        end = None if math.isinf(runaway.seconds) else runaway.swallowed + timedelta(
            seconds=runaway.seconds
        )  # fmt: skip
        try:
            while not run.over:
                left = _NAP if end is None else (end - clock.now()).total_seconds()
                if left <= 0:
                    return True
                try:
                    await clock.sleep(min(left, _NAP))
                except BaseException:
                    runaway.caught += 1
                    if run.over:
                        return False
                    if runaway.caught > BUSY:
                        run.violation(
                            "runaways",
                            f"busy loop: {runaway.describe(run)} was cancelled "
                            f"{runaway.caught} times by {run.at(clock.now())}",
                        )
                        return False
            return False
        finally:
            runaway.ended = clock.now()


def _abandonments(run: Run) -> dict[int, datetime]:
    """When the library logged the abandonment of each runaway (its WARNING naming it, about
    `GRACE` after it swallowed its cancellation), by the runaway's index in `Run.runaways`; one
    it did not abandon is absent. A WARNING goes to one runaway only: of those it names and
    could be about, one still running when it came (only a running handler is abandoned), then
    the one whose due time it is closest to; the same item run twice by one worker (its first
    lease lost) names two runaways alike."""
    found: dict[int, datetime] = {}
    for at, name in run.abandoned:
        fits = []
        for index, runaway in enumerate(run.runaways):
            assert runaway.swallowed is not None
            off = abs((at - (runaway.swallowed + timedelta(seconds=GRACE))).total_seconds())
            if index not in found and runaway.name in name and off <= SLACK:
                ended_before = runaway.ended is not None and runaway.ended < at
                fits.append((ended_before, off, index))
        if fits:
            found[min(fits)[2]] = at
    return found


def check_runaways(run: Run, lease: float | None) -> None:
    """The checks of every runaway of the run (see the module docstring); `lease` is the
    primitive's lease in seconds (None: leases not judged, as for a run that hung)."""
    now = run.clock.now()
    abandonments = _abandonments(run)
    for index, runaway in enumerate(run.runaways):
        assert runaway.swallowed is not None
        went = ((runaway.ended or now) - runaway.swallowed).total_seconds()
        abandoned = abandonments.get(index)
        if went > GRACE + SLACK and abandoned is None:
            run.violation(
                "runaways",
                f"not abandoned: {runaway.describe(run)}, and was still running "
                f"{GRACE:g} s later (at {run.at(runaway.swallowed + timedelta(seconds=GRACE))})",
            )
        elif went < GRACE - SLACK and abandoned is not None:
            run.violation(
                "runaways",
                f"abandoned early: {runaway.describe(run)}, ended at {run.at(runaway.ended)}, "
                f"yet was abandoned at {run.at(abandoned)}",
            )
        if runaway.lease is None or lease is None:
            continue
        seen = run.held_until.get(runaway.lease)
        bound = runaway.swallowed + timedelta(seconds=GRACE + lease + SLACK)
        if seen is not None and seen > bound:
            run.violation(
                "runaways",
                f"renewed: {runaway.describe(run)}; its lease was seen held until "
                f"{run.at(seen)}, later than {GRACE:g} s and a lease after",
            )
