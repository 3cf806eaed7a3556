"""The task queue's side of a batch slot (`mongoq.runtime.batch`): how a batch of claimed tasks
is renewed, run and settled by ``AsyncTaskQueue.run(batch_size=N)``. Owns no collections; every
write goes through the queue's fenced calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from mongoq import _driver
from mongoq.errors import InvalidInput, PermanentError
from mongoq.runtime import wakeups
from mongoq.runtime.loop import WORKER_STOPPED
from mongoq.tasks.models import Task, check_result

if TYPE_CHECKING:
    from mongoq.tasks.queue import AsyncTaskQueue

__all__ = ["FAILS_AT_ONCE", "TaskBatch"]

#: The errors that fail a task at once, never retried: a handler's `PermanentError`, and a
#: result (or input) that cannot be stored.
FAILS_AT_ONCE = (PermanentError, InvalidInput)


@dataclass(eq=False)
class TaskBatch:
    """`BatchHolder` for tasks: `heartbeat_many` renews, `complete_many` completes, a failure
    fails (`PermanentError`, a result that cannot be stored) or releases for retry."""

    queue: AsyncTaskQueue
    handler: Callable[[Task], Awaitable[Any]]
    done: str = "completed"

    def lease_end(self, item: Task) -> datetime:
        return item.lease_until or self.queue.clock.now()

    async def renew(self, items: Sequence[Task]) -> list[bool]:
        if len(items) == 1:  # one command, never a read
            return [await self.queue.heartbeat(items[0])]
        return await self.queue.heartbeat_many(items)

    async def renew_one(self, item: Task) -> bool:
        return await self.queue.heartbeat(item)

    async def handle(self, item: Task) -> Any:
        result = await self.handler(item)
        check_result("result", item, result)
        return result

    async def settle_failure(self, item: Task, error: Exception) -> str:
        if isinstance(error, FAILS_AT_ONCE):
            return "failed" if await self.queue.fail(item, error) else "lost"
        return await self._retry(item, error)

    async def complete(self, items: Sequence[Task], results: Sequence[Any]) -> list[bool]:
        return await self.queue.complete_many(items, results)

    async def settle_cut_short(self, item: Task) -> str:
        return await self._retry(item, WORKER_STOPPED)

    async def lost_outcomes(self, items: Sequence[Task]) -> list[str]:
        """Per task no longer held: ``cancelled`` when it was (one read), else ``lost``."""
        cancelled = await self.queue._cancelled_of(items)
        return ["cancelled" if item.id in cancelled else "lost" for item in items]

    @contextlib.contextmanager
    def told(self, items: Sequence[Task], renew_now: Callable[[], None]) -> Iterator[None]:
        """While a batch of `items` runs: a cancel or removal of one of them, in this process
        or heard from elsewhere (`mongoq.tasks.cancels`), renews the batch at once, which
        finds it gone and stops its handler; the poll of long-held tasks sees them."""
        with contextlib.ExitStack() as stack:
            held = self.queue._held
            for item in items:
                stack.enter_context(wakeups.listen(held.stop_key(item.id), renew_now))
            stack.enter_context(held.batch(items, self.queue.clock.now()))
            yield

    async def give_back(self, item: Task) -> str:
        held = await self.queue.release_not_an_attempt(item, delay=0)
        return "released" if held else "lost"

    async def not_started(self, item: Task, *, lost: bool) -> str:
        """The outcome of a task whose handler never started because its lease could not be
        shown live: `lost` (a renewal found it taken over, or cancelled), else given back,
        fenced (``lost`` if another worker claimed it meanwhile); ``unknown`` when the
        database does not answer."""
        try:
            if lost:
                return (await self.lost_outcomes([item]))[0]
            return await self.give_back(item)
        except _driver.DRIVER_ERRORS:
            return "unknown"

    async def _retry(self, item: Task, error: Exception | str) -> str:
        # On its last attempt the release fails the task: count it so.
        last = item.attempts >= self.queue.max_attempts
        held = await self.queue.release_for_retry(item, error)
        return ("failed" if last else "retried") if held else "lost"
