"""Claim tasks by hand and hold each inside ``async with queue.leased(task)``.

Runs on the embedded in-memory backend: ``python examples/task_queue_leased.py``
(set ``MONGOQ_URI`` to use a real server).
"""

from __future__ import annotations

import asyncio
import logging

import mongoq


async def main() -> None:
    db = mongoq.connect()
    queue = mongoq.AsyncTaskQueue(db, "thumbnails", lease_ttl=60, max_attempts=3)
    await queue.setup()

    await queue.put("img-1", {"path": "/photos/1.jpg"})
    await queue.put("img-2", {"path": "/photos/2.jpg"}, priority=5)  # claimed first
    await queue.put("img-1", {"path": "/photos/1.jpg"})  # a replay: changes nothing

    while (task := await queue.claim()) is not None:
        async with queue.leased(task) as lease:  # heartbeats every lease_ttl / 3
            print(f"resizing {task.payload['path']} (attempt {task.attempts})")
            await lease.complete({"width": 320})  # or leave the block cleanly: completes

    for task_id in ("img-1", "img-2"):
        task = await queue.get(task_id)
        assert task is not None
        print(task.id, task.status, task.result)


if __name__ == "__main__":
    # mongoq logs (never prints): retries at INFO, failures given up at WARNING.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main())
