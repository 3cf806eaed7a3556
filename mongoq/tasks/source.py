"""`TaskSource`: one task queue as a source of work for the shared run loop
(`mongoq.runtime.source`), as `AsyncTaskQueue.source` hands it out to `AsyncTaskQueue.run` and
to the task functions' worker (`mongoq.jobs.worker`).

It claims one task a slot (the handler runs inside `leased`, started only under a lease known
to be live: `mongoq.runtime.lease`), or a batch a slot (`mongoq.runtime.batch`, with
`TaskBatch`), and names the maintenance services the queue needs while it runs: ``reclaim``
(expired leases, every ``lease_ttl / 3`` and when idle), ``schedules`` (the queue's ticker,
`mongoq.tasks.schedules`), ``holders`` (telling the holders of cancelled tasks,
`mongoq.tasks.cancels`) and, for a worker that names the task functions it runs,
``presence`` (its document in ``{name}_workers``, `mongoq.tasks.presence`) and ``unserved``
(a warning for due tasks of functions it does not run). Owns no collections: every command
goes through the queue.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from pymongo.errors import ConnectionFailure

from mongoq import _driver
from mongoq.clock import Clock
from mongoq.errors import InvalidInput, LeaseLost
from mongoq.runtime import changes, wakeups
from mongoq.runtime import lease as leases
from mongoq.runtime.batch import run_batch
from mongoq.runtime.events import Tally
from mongoq.runtime.handler import call_handler
from mongoq.runtime.services import Service
from mongoq.runtime.source import ChangeFeed
from mongoq.tasks import cancels
from mongoq.tasks.batch import TaskBatch
from mongoq.tasks.models import Task, TaskRunSummary
from mongoq.tasks.schedules import RECHECK

if TYPE_CHECKING:
    from mongoq.tasks.queue import AsyncTaskQueue

__all__ = ["PRESENCE_WAIT", "TaskSource"]

log = logging.getLogger("mongoq.tasks")

#: Seconds a worker waits, at most, to announce itself when it starts and to withdraw when it
#: stops: a server that does not answer must not hold a stop up (a presence expires anyway).
PRESENCE_WAIT = 5.0


class TaskSource:
    """One queue's tasks for a run loop: claimed by `worker_id` (of `functions` only, when
    given), run with `handler` one at a time or `batch_size` at once, counted into `summary`."""

    fills = False

    def __init__(
        self,
        queue: AsyncTaskQueue,
        handler: Callable[[Task], Awaitable[Any]],
        *,
        worker_id: str,
        batch_size: int,
        handler_timeout: float | None,
        schedules: bool,
        functions: Sequence[str] | None,
    ) -> None:
        self.queue = queue
        self.worker_id = worker_id
        self.batch_size = batch_size
        self.handler_timeout = handler_timeout
        self.functions = None if functions is None else list(functions)
        self.name = f"tasks:{queue.name}"
        self.clock: Clock = queue.clock
        self.summary = TaskRunSummary()
        self.tally = Tally(self.summary, "tasks", queue.name)
        self.wake_key: wakeups.Key = queue._wake_key
        self.changes = ChangeFeed(queue.collection, changes.TASKS_DUE_OR_STOPPED, self._heard)
        self.services = self._services(schedules)
        self._holder = TaskBatch(queue, handler)

    def _services(self, schedules: bool) -> list[Service]:
        third = self.queue.lease_ttl / 3
        services = [Service("reclaim", self._reclaim, interval=third, when_idle=True)]
        if schedules:
            services.append(Service(
                "schedules", self._tick, interval=RECHECK, at_once=True,
                wake_key=self.queue._scheduler.wake_key,
            ))  # fmt: skip
        held = self.queue._held
        told = partial(cancels.tell_cancelled, held, self.clock, self.queue._cancelled_of)
        services.append(Service("holders", told, proves_server=False))
        if self.functions is not None:
            services += [
                Service("presence", self._announce, interval=third, at_start=True,
                        close=self._withdraw),
                Service("unserved", self._say_unserved, interval=third, when_idle=True),
            ]  # fmt: skip
        return services

    # ------------------------------------------------------------------------------ claims

    async def claim(self, limit: int) -> list[Any]:
        """One task, or one batch of up to `batch_size` (the run loop gives each slot one)."""
        if self.batch_size == 1:
            task = await self.queue.claim(self.worker_id, functions=self.functions)
            if task is None:
                return []
            self.tally("claimed")
            return [task]
        batch = await self.queue.claim_many(
            self.batch_size, self.worker_id, functions=self.functions
        )
        self.tally("claimed", len(batch))
        return [batch] if batch else []

    async def next_due(self) -> datetime | None:
        return await self.queue._next_due(self.functions)

    def _heard(self, event: Mapping[str, Any]) -> bool:
        """A change event of `changes.TASKS_DUE_OR_STOPPED`: a task cancelled or removed tells
        its holders in this process (False: nothing to claim); any other, True (claim)."""
        stopped = changes.stopped_task(event)
        if stopped is None:
            return True
        self.queue._held.tell([stopped])
        return False

    # -------------------------------------------------------------------------- processing

    async def process(self, item: Any) -> None:
        if self.batch_size == 1:
            await self._process_one(item)
            return
        await run_batch(
            self._holder, item, clock=self.clock, lease=self.queue.lease_ttl, count=self.tally,
            describe=lambda task: repr(task.id), logger=log,
            handler_timeout=self.handler_timeout, timed=self.tally.handler_time,
        )  # fmt: skip

    async def _process_one(self, task: Task) -> None:
        """`task` run inside `leased`, started only under a lease known to be live."""
        queue, tally = self.queue, self.tally
        liveness = await leases.confirm(
            task.lease_until or self.clock.now(), clock=self.clock, lease=queue.lease_ttl,
            renew=partial(queue.heartbeat, task), name=f"task {task.id!r}",
        )  # fmt: skip
        if liveness is not leases.Liveness.LIVE:
            tally(await self._holder.not_started(task, lost=liveness is leases.Liveness.LOST))
            return
        lease = queue.leased(task)
        try:
            async with lease:
                result = await call_handler(
                    partial(self._holder.handler, task), clock=self.clock,
                    limit=self.handler_timeout, guard=lease._guard(),
                    timed=tally.handler_time, name=f"task {task.id!r}",
                )  # fmt: skip
                # Finished: a hard stop from here on still records it (as a batch does),
                # bounded like a batch's final settle.
                with anyio.move_on_after(queue.lease_ttl, shield=True) as bound:
                    try:
                        await lease.complete(result)
                    except InvalidInput as exc:  # a result that cannot be stored: a bug
                        await lease.fail(exc)
                if bound.cancelled_caught:  # no answer: the lease expires, result untold
                    lease._abandon()
        except LeaseLost:
            pass
        except _driver.DRIVER_ERRORS:
            log.warning("settling %r failed; its lease will expire", task.id, exc_info=True)
        except Exception:
            pass  # settled (and logged) by the lease's exit
        finally:  # a cancellation (a second signal) is counted too
            tally(lease.outcome or "unknown")

    # ---------------------------------------------------------------------------- services

    async def _reclaim(self, interval: float) -> None:
        await self.queue.reclaim_expired()

    async def _tick(self, interval: float) -> datetime | None:
        return await self.queue._scheduler.tick()

    async def _announce(self, interval: float) -> None:
        """This worker's presence (its task functions), counted live for a lease: three
        rounds, so that one delayed by a slow server does not make the worker look gone.
        Shielded and bounded: one cancelled in flight could land after the withdrawal. Best
        effort: a write that fails (no server, no right to write ``_workers``) is logged and
        tried again next round."""
        assert self.functions is not None
        with anyio.move_on_after(PRESENCE_WAIT, shield=True):
            try:
                await self.queue._presence.announce(
                    self.worker_id, self.functions, self.queue.lease_ttl
                )
            except Exception as exc:
                self._presence_failed("announce", exc)

    async def _withdraw(self) -> None:
        """This worker's presence removed once its run has ended (nothing announces any
        more). Best effort: one left behind expires by itself."""
        with anyio.move_on_after(PRESENCE_WAIT, shield=True):
            try:
                await self.queue._presence.withdraw(self.worker_id)
            except Exception as exc:
                self._presence_failed("withdraw", exc)

    def _presence_failed(self, step: str, exc: Exception) -> None:
        # A lost server is said once, by the run loop; anything else (a missing right) here.
        level = logging.DEBUG if isinstance(exc, ConnectionFailure) else logging.WARNING
        log.log(
            level,
            "%s: could not %s the presence of worker %s (%s: %s); readers count it by its "
            "expiry, %g s after its last announcement", self.queue.name, step, self.worker_id,
            type(exc).__name__, exc, self.queue.lease_ttl,
            extra={"mongoq_queue": self.queue.name, "mongoq_worker": self.worker_id,
                   "mongoq_event": f"presence_{step}_failed"},
        )  # fmt: skip

    async def _say_unserved(self, interval: float) -> None:
        """Log the due tasks this worker does not run (a function it does not know, or none):
        they wait, uncharged, for a worker that knows them."""
        assert self.functions is not None
        queue = self.queue
        counts, cut = await queue._due_not_of(queue.clock.now(), self.functions)
        bound = "at least " if cut else ""
        for function, waiting in counts.items():
            log.warning(
                "%s: %s%d due task(s) of %s wait: no task function of this worker runs them",
                queue.name, bound, waiting,
                f"task function {function!r}" if function else "no task function (plain tasks)",
                extra={"mongoq_queue": queue.name, "mongoq_function": function or None,
                       "mongoq_waiting": waiting},
            )  # fmt: skip
