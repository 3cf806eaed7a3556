"""`JobsWorker`: one `WorkerLoop` over several task queues, running the tasks of the task
functions a `Jobs` declares. Claims rotate over the queues (each starts at the queue after the
last one claimed from), and name the functions the worker knows; processing is each queue's
own (`AsyncTaskQueue.run`'s lease, heartbeat and settle steps). Each queue's
``{name}_workers`` (which the queue owns: `mongoq.tasks.presence`) holds the worker's presence
while it runs: the task functions it runs there, renewed at each housekeeping round, deleted
when the run ends; `AsyncTaskQueue.stats` reads them. Owns no collections.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from pymongo.errors import ConnectionFailure

from mongoq._validation import MAX_BATCH, check_int, check_interval, check_timeout
from mongoq.errors import HandlerTimeout, PermanentError
from mongoq.runtime import changes, wakeups
from mongoq.runtime.events import Tally
from mongoq.runtime.handler import call_handler
from mongoq.runtime.loop import WorkerLoop
from mongoq.tasks import AsyncTaskQueue, Task, TaskRunSummary
from mongoq.tasks.batch import TaskBatch

if TYPE_CHECKING:
    from mongoq.clock import Clock
    from mongoq.jobs.functions import TaskFunction
    from mongoq.jobs.registry import Jobs

__all__ = ["JobsWorker"]

log = logging.getLogger("mongoq.jobs")

Claimed = tuple[int, Any]  # (queue index, a task or a batch of them)
#: Seconds a worker waits, at most, to announce itself when it starts and to withdraw when it
#: stops: a server that does not answer must not hold a stop up (a presence expires anyway).
PRESENCE_WAIT = 5.0


class JobsWorker:
    """One run of a `Jobs`' task functions over the queues `names`."""

    def __init__(
        self,
        jobs: Jobs,
        names: list[str],
        *,
        concurrency: int,
        batch_size: int,
        poll_interval: float,
        worker_id: str,
    ) -> None:
        self.jobs = jobs
        self.concurrency = check_int("concurrency", concurrency, low=1)
        self.batch_size = check_int("batch_size", batch_size, low=1, high=MAX_BATCH)
        self.poll_interval = check_interval("poll_interval", poll_interval)
        self.worker_id = worker_id
        self.queues = [jobs.queue(name) for name in names]
        self.functions = [jobs.functions_of(name) for name in names]
        # The shortest lease: a housekeeping round every third of it, and how long an
        # announcement holds (three rounds: one delayed by a slow server does not make the
        # worker look gone).
        self._presence_ttl = min(queue.lease_ttl for queue in self.queues)
        self.summary = TaskRunSummary()
        self._tallies = [Tally(self.summary, "tasks", queue.name) for queue in self.queues]
        self._process = [self._steps(index) for index in range(len(self.queues))]
        self._turn = 0  # the queue the next claim starts at
        # Until when a queue is taken for empty: its claim found nothing, and neither a wake-up
        # of it nor a poll interval came since. Tried last, so a busy queue's tasks are not
        # each charged a claim of an empty one.
        self._empty_until: list[datetime | None] = [None] * len(self.queues)
        self._loop: WorkerLoop[Claimed] | None = None

    def loop(
        self, *, stop_when_empty: bool, stop_when_drained: bool, give_up_after: float | None
    ) -> WorkerLoop[Claimed]:
        """The run loop: claims over every queue, each queue's housekeeping, wake-ups from its
        puts (this process) and its change stream (a replica set)."""
        self._loop = WorkerLoop(
            claim=self._claim,
            process=self._run,
            clock=self.queues[0].clock,
            concurrency=self.concurrency,
            poll_interval=self.poll_interval,
            stop_when_empty=stop_when_empty,
            housekeeping=self._housekeep,
            housekeeping_interval=self._presence_ttl / 3,
            name=f"jobs:{','.join(queue.name for queue in self.queues)}",
            next_due=self._next_due if stop_when_drained else None,
            background=self._listeners(),
            give_up_after=check_timeout("give_up_after", give_up_after),
        )
        return self._loop

    def _steps(self, index: int) -> Callable[[Any], Awaitable[None]]:
        queue, tally = self.queues[index], self._tallies[index]
        holder = TaskBatch(queue, self._call)
        if self.batch_size == 1:
            return queue._single_steps(holder, tally, self.worker_id, None)[1]
        steps = queue._batch_steps(holder, tally, self.worker_id, self.batch_size, None)
        return steps[1]

    async def _claim(self) -> Claimed | None:
        count = len(self.queues)
        now = self.queues[0].clock.now()
        rotation = [(self._turn + offset) % count for offset in range(count)]
        self._turn = (rotation[0] + 1) % count  # a slot claiming meanwhile starts at the next
        fresh = [i for i in rotation if (self._empty_until[i] or now) <= now]
        for index in fresh + [i for i in rotation if i not in fresh]:
            queue, names = self.queues[index], self.functions[index]
            if self.batch_size == 1:
                got: Any = await queue.claim(self.worker_id, functions=names)
                taken = int(got is not None)
            else:
                got = await queue.claim_many(self.batch_size, self.worker_id, functions=names)
                taken = len(got)
            if taken:
                self._turn = (index + 1) % count
                self._empty_until[index] = None
                self._tallies[index]("claimed", taken)
                return index, got
            self._empty_until[index] = now + timedelta(seconds=self.poll_interval)
        return None

    async def _run(self, claimed: Claimed) -> None:
        index, got = claimed
        await self._process[index](got)

    async def _call(self, task: Task) -> Any:
        """Run `task` with its task function, under the function's own time limit, in a span
        of the call when tracing (`mongoq.jobs.tracing`)."""
        function = self.jobs.functions.get(task.function or "")
        if function is None:  # claimed by name: only a function removed since the claim
            raise PermanentError(f"no task function {task.function!r} in this worker")
        queue = self.jobs.queue(function.queue)
        return await self.jobs.tracing.process(
            task, function.name, queue.name, max_attempts=queue.max_attempts,
            worker=self.worker_id, call=partial(self._limited, function, task, queue.clock),
        )  # fmt: skip

    @staticmethod
    async def _limited(function: TaskFunction[Any, Any], task: Task, clock: Clock) -> Any:
        """`function`'s run of `task` under its time limit; a timeout goes through the
        function's retry policy as any failure does."""
        try:
            return await call_handler(partial(function.run, task), clock=clock,
                                      limit=function.timeout,
                                      name=f"task {task.id!r} ({function.name})")  # fmt: skip
        except HandlerTimeout as timeout:  # raised outside the call: the policy applies here
            final = function.final(timeout, task)
            if final is timeout:
                raise
            raise final from timeout

    async def _housekeep(self) -> None:
        await self.announce()
        for queue, names in zip(self.queues, self.functions, strict=True):
            await queue.reclaim_expired()
            await _say_unknown(queue, names)

    async def announce(self) -> None:
        """This worker's presence in each of its queues: at the start of a run, then at each
        housekeeping round. Shielded and bounded: one cancelled in flight could land after the
        withdrawal. Best effort: a queue whose write fails (no server, no right to write its
        ``_workers``) is logged and announced again next round, the rest of the round goes on."""
        with anyio.move_on_after(PRESENCE_WAIT, shield=True):
            for queue, names in zip(self.queues, self.functions, strict=True):
                try:
                    await queue._presence.announce(self.worker_id, names, self._presence_ttl)
                except Exception as exc:
                    self._presence_failed("announce", queue, exc)

    async def withdraw(self) -> None:
        """This worker's presence removed from each of its queues, once its run has ended
        (nothing announces any more). Best effort: one left behind expires by itself."""
        with anyio.move_on_after(PRESENCE_WAIT, shield=True):
            for queue in self.queues:
                try:
                    await queue._presence.withdraw(self.worker_id)
                except Exception as exc:
                    self._presence_failed("withdraw", queue, exc)

    def _presence_failed(self, step: str, queue: AsyncTaskQueue, exc: Exception) -> None:
        # A lost server is said once, by the run loop; anything else (a missing right) here.
        level = logging.DEBUG if isinstance(exc, ConnectionFailure) else logging.WARNING
        log.log(
            level,
            "%s: could not %s the presence of worker %s (%s: %s); readers count it by its "
            "expiry, %g s after its last announcement", queue.name, step, self.worker_id,
            type(exc).__name__, exc, self._presence_ttl,
            extra={"mongoq_queue": queue.name, "mongoq_worker": self.worker_id,
                   "mongoq_event": f"presence_{step}_failed"},
        )  # fmt: skip

    async def _next_due(self) -> datetime | None:
        dues = [
            await queue._next_due(names)
            for queue, names in zip(self.queues, self.functions, strict=True)
        ]
        return min((due for due in dues if due is not None), default=None)

    @staticmethod
    def _heard(
        queue: AsyncTaskQueue, index: int, wake: Callable[[int, Any], None],
        event: Mapping[str, Any],
    ) -> None:  # fmt: skip
        """A change event of `queue`'s tasks: its holders told of a cancel, else a wake-up."""
        if queue._heard(event):
            wake(index, event)

    def _listeners(self) -> list[Callable[[], Coroutine[Any, Any, Any]]]:
        """Beside the slots: each queue's wake-ups and change stream, waking the loop."""

        def wake(index: int, _: Any = None) -> None:
            self._empty_until[index] = None
            if self._loop is not None:
                self._loop.wake()

        async def listen(key: wakeups.Key, index: int) -> None:
            with wakeups.listen(key, partial(wake, index)):
                await anyio.sleep_forever()

        listeners: list[Callable[[], Coroutine[Any, Any, Any]]] = []
        for index, queue in enumerate(self.queues):
            # The queue's schedules (the periodic functions'): one read at each next tick.
            listeners.append(partial(queue._scheduler.run, self.poll_interval))
            listeners.append(partial(listen, queue._wake_key, index))
            listeners.extend(queue._holders_told(self.poll_interval))
            listeners.append(partial(
                changes.watch, queue.collection, changes.TASKS_DUE_OR_STOPPED,
                partial(self._heard, queue, index, wake), clock=queue.clock,
                retry=self.poll_interval, name=f"jobs:{queue.name}",
            ))  # fmt: skip
        return listeners


async def _say_unknown(queue: AsyncTaskQueue, names: list[str]) -> None:
    """Log the due tasks of `queue` this worker does not run (a function it does not know, or
    none): they wait, uncharged, for a worker that knows them."""
    counts, cut = await queue._due_not_of(queue.clock.now(), names)
    bound = "at least " if cut else ""
    for function, waiting in counts.items():
        log.warning(
            "%s: %s%d due task(s) of %s wait: no task function of this worker runs them",
            queue.name, bound, waiting,
            f"task function {function!r}" if function else "no task function (plain tasks)",
            extra={"mongoq_queue": queue.name, "mongoq_function": function or None,
                   "mongoq_waiting": waiting},
        )  # fmt: skip
