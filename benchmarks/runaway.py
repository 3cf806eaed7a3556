"""What a handler that swallows its cancellation costs, and how soon a cancel reaches a running
handler: ``python -m benchmarks.runaway`` (embedded backend, wall clock), under ``/usr/bin/time``
for the CPU. Prints one line per measurement.

1. swallow: a handler catches every cancellation for 4 s of wall time; ``handler_timeout=0.5``.
   It prints how many cancellations reached it, and the process's CPU seconds over the run.
2. cancel, same process: seconds from `cancel()` to the handler's cancellation.
3. cancel, another process (a direct update of the task, as another process's cancel is seen
   here): seconds until the handler's cancellation, with ``poll_interval=1``.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

import mongoq
from mongoq.clock import SystemClock

SWALLOW_FOR = 4.0


async def _queue(name: str) -> mongoq.AsyncTaskQueue:
    queue = mongoq.AsyncTaskQueue(mongoq.connect(), name, lease_ttl=30, clock=SystemClock())
    await queue.setup()
    await queue.put("t1")
    return queue


async def swallow() -> None:
    queue = await _queue("swallow")
    caught = 0

    async def handler(task: mongoq.Task) -> None:
        nonlocal caught
        end = time.monotonic() + SWALLOW_FOR
        while time.monotonic() < end:
            try:
                await anyio.sleep(end - time.monotonic())
            except BaseException:  # the careless handler measured
                caught += 1

    cpu = time.process_time()
    with anyio.move_on_after(SWALLOW_FOR + 2):
        await queue.run(handler, handler_timeout=0.5, stop_when_empty=True, poll_interval=0.5)
    print(f"swallow: {caught} cancellation(s) caught, {time.process_time() - cpu:.2f} s CPU")


async def cancel_latency(*, same_process: bool) -> None:
    queue = await _queue("cancel")
    started, ended = anyio.Event(), anyio.Event()

    async def handler(task: mongoq.Task) -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            ended.set()

    async with anyio.create_task_group() as group:

        async def run() -> Any:
            return await queue.run(handler, poll_interval=1.0)

        group.start_soon(run)
        await started.wait()
        await anyio.sleep(1.5)  # held past a poll: as a task that has run a while
        sent = time.monotonic()
        if same_process:
            await queue.cancel("t1")
        else:
            await queue.collection.update_one({"_id": "t1"}, {"$set": {"status": "cancelled"}})
        with anyio.move_on_after(15):
            await ended.wait()
        where = "same process" if same_process else "another process (poll 1 s)"
        print(f"cancel, {where}: handler cancelled {time.monotonic() - sent:.3f} s after")
        queue.stop()
        group.cancel_scope.cancel()


async def main() -> None:
    await swallow()
    await cancel_latency(same_process=True)
    await cancel_latency(same_process=False)


if __name__ == "__main__":
    anyio.run(main)
