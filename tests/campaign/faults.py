"""Seeded faults at every command of one worker (`Faults`, a `mongoq.testing` hook): yields, an
error before the command applies, a reply lost after it applied, partitions (commands held on
the clock, applied late, their replies later still) and crashes (nothing sent arrives any more).
`FaultRates` says how often; the scenario says when a partition or a crash comes. It also
counts the commands a worker sends at one instant of the clock: more than `SPIN` is a busy loop
(`engine.Run.spun`), which the library promises never to run (a document it cannot use, a
refusal it retries at once, a handler it cancels again and again)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import anyio.lowlevel
from pymongo.errors import AutoReconnect, NetworkTimeout, OperationFailure

from mongoq.testing import Operation

if TYPE_CHECKING:
    from tests.campaign.engine import Run

__all__ = ["SPIN", "FaultRates", "Faults"]

#: Commands one worker may send while the clock stands still (the most seen in a good run is
#: about 25: a batch's claims, settles and reads); more is a busy loop.
SPIN = 100


@dataclass(frozen=True)
class FaultRates:
    """How often one worker's commands fail, yield, and how late replies come in a partition."""

    fail_before: float = 0.0
    fail_after: float = 0.0
    #: chance that a command yields to the event loop (1-3 times) before it runs, and after
    yields: float = 0.0
    #: most seconds a command held by a partition waits beyond its end before it applies
    apply_jitter: float = 1.0
    #: most seconds a reply waits beyond a partition's end (or its command's late application)
    reply_delay: float = 0.0

    @classmethod
    def draw(cls, rng: random.Random, lease: float) -> FaultRates:
        return cls(
            fail_before=rng.choice((0.0, 0.02, 0.05, 0.1)),
            fail_after=rng.choice((0.0, 0.02, 0.05, 0.1)),
            yields=rng.choice((0.0, 0.5, 1.0)),
            reply_delay=lease * rng.uniform(0.2, 1.6),
        )


class Faults:
    """Seeded faults at every command of one worker; the first hook of its view."""

    def __init__(self, run: Run, name: str, rates: FaultRates) -> None:
        self.run = run
        self.name = name
        self.clock = run.clock
        self.rng = run.rng_for("faults", name)
        self.rates = rates
        self.enabled = True
        self.crashed = False
        self.commands = 0
        self.until: datetime | None = None  # the partition's end
        self._late: set[int] = set()
        self._instant: datetime | None = None  # when the commands of `_burst` were sent
        self._burst = 0

    def partition(self, seconds: float) -> None:
        """From now on for `seconds`, commands wait, then apply late; replies come later."""
        end = self.clock.now() + timedelta(seconds=seconds)
        self.until = end if self.until is None else max(self.until, end)

    def crash(self) -> None:
        """Nothing this worker sends arrives any more (kill -9)."""
        self.crashed = True

    def _partitioned(self) -> bool:
        return self.enabled and self.until is not None and self.clock.now() < self.until

    async def _yield(self) -> None:
        if self.rates.yields and self.rng.random() < self.rates.yields:
            for _ in range(self.rng.randint(1, 3)):
                await anyio.lowlevel.checkpoint()

    def _refused(self, op: Operation) -> AutoReconnect:
        return AutoReconnect(f"campaign: {self.name} crashed; {op.collection}.{op.name} not sent")

    async def before(self, op: Operation) -> None:
        self.commands += 1
        now = self.clock.now()
        if now != self._instant:
            self._instant, self._burst = now, 0
        self._burst += 1
        if self._burst == SPIN:
            self.run.spun(self.name, op)
        if self.crashed:
            raise self._refused(op)
        if not self.enabled:
            return
        await self._yield()
        if self._partitioned():
            assert self.until is not None
            jitter = self.rng.uniform(0, self.rates.apply_jitter)
            await self.clock.sleep_until(self.until + timedelta(seconds=jitter))
            self._late.add(id(op))
            if self.crashed:
                raise self._refused(op)
        if self.rng.random() < self.rates.fail_before:
            raise AutoReconnect(f"campaign: connection lost before {op.collection}.{op.name}")

    async def after(self, op: Operation, error: BaseException | None) -> None:
        late = id(op) in self._late
        self._late.discard(id(op))
        if self.crashed:
            if error is None:
                raise NetworkTimeout(f"campaign: {self.name} crashed; no reply")
            return
        if not self.enabled:
            return
        if late or self._partitioned():
            start = max(self.until or self.clock.now(), self.clock.now())
            delay = self.rng.uniform(0, self.rates.reply_delay)
            await self.clock.sleep_until(start + timedelta(seconds=delay))
        await self._yield()
        applied = error is None or isinstance(error, OperationFailure)
        if applied and self.rng.random() < self.rates.fail_after:
            raise NetworkTimeout(f"campaign: reply lost after {op.collection}.{op.name} applied")
