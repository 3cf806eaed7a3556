"""One batch slot of a run loop: claim many, renew together, settle together.

A primitive's ``run(batch_size=N)`` claims up to N items at once and hands the batch to
`run_batch`, which runs their handlers one after another under one keep-alive, settles each
failure as it happens, and settles the rest together at the end, shielded and bounded in time:
what finished is completed in one call; the item cut short by a cancellation counts as an
attempt; items never started are given back without counting one. The primitive supplies a
`BatchHolder` (its renewals and settles, with their fencing) and names its outcomes; the slot
never touches the database itself. Owns no collections.

Invariants the slot keeps for every primitive:
- an item a renewal found lost is never started, and never settled, by this slot; if its
  handler is running, it is cancelled (its work could not be recorded);
- a handler past its time limit is cancelled and settled as a failure (`HandlerTimeout`); one
  that ignores its cancellation past the grace is abandoned, counted lost, never settled;
- before a handler starts, its lease is known to hold with a third of it left
  (`mongoq.runtime.lease`): by the claim or the last full renewal, each dated from before its
  request, or by a renewal of that item alone; an item whose lease cannot be shown live is
  not started and is given back at the end, fenced (a no-op once another worker claimed it);
- a renewal's driver error renews nothing, and reaches neither the handler nor the loop;
- every item ends counted exactly once: done, failed/retried, released, lost or unknown.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.lowlevel

from mongoq import _driver
from mongoq.clock import Clock
from mongoq.errors import HandlerAbandoned, LeaseLost
from mongoq.runtime import lease as leases
from mongoq.runtime.handler import call_handler
from mongoq.runtime.keepalive import KeepAlive

__all__ = ["BatchHolder", "run_batch"]

log = logging.getLogger("mongoq.worker")

Item = TypeVar("Item")
ItemContra = TypeVar("ItemContra", contravariant=True)


class BatchHolder(Protocol[ItemContra]):
    """What a primitive gives its batch slot. Settles return the outcome to count (``"lost"``
    when the fence no longer matched); renewals return, per item, whether it is still held."""

    #: the summary field of an item completed (``"completed"``, ``"acked"``)
    done: str

    def lease_end(self, item: ItemContra) -> datetime: ...

    async def renew(self, items: Sequence[ItemContra]) -> list[bool]: ...

    async def renew_one(self, item: ItemContra) -> bool:
        """Renew one item before its handler starts, when the last renewal is too old."""
        ...

    async def handle(self, item: ItemContra) -> Any:
        """Run the user's handler; its return value is the item's result."""
        ...

    async def settle_failure(self, item: ItemContra, error: Exception) -> str: ...

    async def complete(self, items: Sequence[ItemContra], results: Sequence[Any]) -> list[bool]: ...

    async def settle_cut_short(self, item: ItemContra) -> str:
        """The item whose handler a cancellation interrupted: an attempt that counts."""
        ...

    async def give_back(self, item: ItemContra) -> str:
        """An item never handed to the handler: released without counting an attempt."""
        ...


@dataclass(eq=False)
class _Batch(Generic[Item]):
    holder: BatchHolder[Item]
    items: list[Item]
    clock: Clock
    lease: float
    count: Callable[[str, int], None]
    describe: Callable[[Item], str]
    log: logging.Logger
    #: seconds a handler may run (None: no limit)
    limit: float | None = None
    #: hears how long each handler ran
    timed: Callable[[float], None] | None = None
    #: held by this slot: renewals cover them
    unsettled: list[Item] = field(init=False)
    finished: list[tuple[Item, Any]] = field(init=False, default_factory=list)
    #: every item holds until then
    confirmed: datetime = field(init=False)
    #: the item whose handler runs, and what a renewal that finds it lost sets to cancel it
    running: tuple[Item, anyio.CancelScope] | None = field(default=None, init=False)
    #: the item started last and not finished: cut short by a cancellation, an attempt
    current: Item | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.unsettled = list(self.items)
        self.confirmed = self.holder.lease_end(self.items[0])

    async def renew(self) -> bool | None:
        if not self.unsettled:
            return None
        renewing = list(self.unsettled)
        sent = self.clock.now()  # the database dates the renewal no earlier
        held = await self.holder.renew(renewing)
        gone = [
            item
            for item, ok in zip(renewing, held, strict=True)
            if not ok and item in self.unsettled  # (else settled meanwhile, counted there)
        ]
        for item in gone:  # taken over: never start (or settle) it here
            self.unsettled.remove(item)
            if self.running is not None and self.running[0] is item:
                self.running[1].cancel()  # and stop its handler: its work cannot count
        await self._count_lost(gone)
        if any(held):  # every item still unsettled was among the renewed
            self.confirmed = leases.renewed_until(sent, self.lease)
        return any(held)

    async def still_held(self, item: Item) -> bool:
        """Whether `item` may start now: still this slot's, its lease live with the margin left
        (renewed for it alone when the batch's lease is too short). An item found lost is
        counted here; one that cannot be shown live stays unsettled, to be given back."""
        if item not in self.unsettled:
            return False
        liveness = await leases.confirm(
            self.confirmed, clock=self.clock, lease=self.lease,
            renew=partial(self.holder.renew_one, item), name=self.describe(item),
        )  # fmt: skip
        if item not in self.unsettled:  # a renewal of the whole batch found it lost meanwhile
            return False
        if liveness is leases.Liveness.LOST:
            self.unsettled.remove(item)
            await self._count_lost([item])
        return liveness is leases.Liveness.LIVE

    async def _count_lost(self, items: Sequence[Item]) -> None:
        """Count items no longer held (already out of `unsettled`): ``lost``, or what the
        holder says they became instead (its `lost_outcomes`: a task cancelled rather than
        taken over). Shielded and bounded like the final settles, and ``lost`` when the
        holder cannot tell: every item is counted once, whatever happens meanwhile."""
        outcomes = ["lost"] * len(items)
        ask = getattr(self.holder, "lost_outcomes", None)
        if items and ask is not None:
            with anyio.move_on_after(self.lease, shield=True):
                try:
                    outcomes = list(await ask(items))
                except _driver.DRIVER_ERRORS as exc:
                    self.log.warning("telling what %d lost item(s) became failed (%s)",
                                     len(items), exc)  # fmt: skip
        for outcome in outcomes:
            self.count(outcome, 1)

    async def settle(self, item: Item, call: Callable[[], Awaitable[str]]) -> None:
        if item not in self.unsettled:  # a renewal found it lost (and counted it) meanwhile
            return
        self.unsettled.remove(item)
        with anyio.CancelScope(shield=True):  # as the final settles
            try:
                outcome = await call()
            except _driver.DRIVER_ERRORS:
                outcome = "unknown"
                self.log.warning(
                    "settling %s failed; its lease will expire",
                    self.describe(item),
                    exc_info=True,
                )
        self.count(outcome, 1)

    async def run(self) -> None:
        interval = self.lease / 3
        keepalive = KeepAlive(
            clock=self.clock,
            interval=interval,
            renew=self.renew,
            first_at=self.holder.lease_end(self.items[0]) - timedelta(seconds=2 * interval),
            name=f"batch of {len(self.items)}",
        )
        told = getattr(self.holder, "told", None)  # (the primitive's signals to renew now)
        try:
            with told(self.items, keepalive.renew_now) if told else contextlib.nullcontext():
                await self._run_items(keepalive)
        finally:
            # Shielded, so a cancelled worker still settles what it holds; bounded, so a dead
            # server cannot hold the shutdown longer than the lease would have lasted.
            with anyio.move_on_after(self.lease, shield=True):
                await self._settle_rest(self.current)

    async def _run_items(self, keepalive: KeepAlive) -> None:
        """Each item's handler in turn, under `keepalive`; `current` is the item whose handler
        runs (cut short by a cancellation, it counts as an attempt)."""
        async with keepalive:
            for item in self.items:
                # A hard stop that came while the last item ended (its guard swallowing it)
                # gives this one back unstarted, no attempt spent.
                self.current = None
                await anyio.lowlevel.checkpoint_if_cancelled()
                self.current = item
                if not await self.still_held(item):
                    continue  # taken over meanwhile: never run it twice at once
                await self._run_one(item)
            self.current = None

    async def _run_one(self, item: Item) -> None:
        guard = anyio.CancelScope()
        self.running = (item, guard)
        try:
            result = await call_handler(
                partial(self.holder.handle, item), clock=self.clock, limit=self.limit,
                guard=guard, timed=self.timed, name=self.describe(item),
            )  # fmt: skip
        except HandlerAbandoned:  # still running: never settled, never renewed
            if item in self.unsettled:
                self.unsettled.remove(item)
                self.count("lost", 1)
        except Exception as exc:
            if isinstance(exc, LeaseLost) and guard.cancel_called:
                return  # cancelled; counted lost by the renewal that found it
            await self.settle(item, partial(self.holder.settle_failure, item, exc))
        else:
            # Finished: a cancellation from here on still completes it.
            self.finished.append((item, result))
        finally:
            self.running = None

    async def _settle_rest(self, current: Item | None) -> None:
        try:
            # Leave out what a renewal already found lost (and counted).
            finished = [(item, result) for item, result in self.finished if item in self.unsettled]
            if finished:
                batch = [item for item, _ in finished]
                done = await self.holder.complete(batch, [result for _, result in finished])
                self.count(self.holder.done, sum(done))
                for item in batch:
                    self.unsettled.remove(item)
                await self._count_lost(
                    [item for item, ok in zip(batch, done, strict=True) if not ok]
                )
            for item in list(self.unsettled):
                if item is current:
                    await self.settle(item, partial(self.holder.settle_cut_short, item))
                else:
                    await self.settle(item, partial(self.holder.give_back, item))
        except _driver.DRIVER_ERRORS:
            self.count("unknown", len(self.unsettled))
            self.log.warning(
                "settling a batch failed; %d lease(s) will expire",
                len(self.unsettled),
                exc_info=True,
            )


async def run_batch(
    holder: BatchHolder[Item],
    items: list[Item],
    *,
    clock: Clock,
    lease: float,
    count: Callable[[str, int], None],
    describe: Callable[[Item], str] = repr,
    logger: logging.Logger = log,
    handler_timeout: float | None = None,
    timed: Callable[[float], None] | None = None,
) -> None:
    """Process one claimed batch with `holder` (see the module docstring); `lease` is the lease
    length in seconds (renewals every third of it), `count(outcome, n)` adds to the summary,
    `describe(item)` names an item in the log lines written to `logger`; a handler running
    past `handler_timeout` seconds is cancelled and settled as failed (`HandlerTimeout`);
    `timed(seconds)` hears how long each handler ran."""
    if items:
        batch = _Batch(holder, items, clock, lease, count, describe, logger, handler_timeout, timed)
        await batch.run()
