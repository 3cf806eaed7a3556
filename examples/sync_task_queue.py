"""The task queue from blocking code (a script, a cron job, a Django view): `mongoq_sync`.

Runs on the embedded in-memory backend: ``python examples/sync_task_queue.py``.
The heartbeat of ``with queue.leased(task)`` keeps running in the portal thread while the block
blocks; ``queue.run(handler)`` runs plain functions in worker threads.
"""

from __future__ import annotations

import logging
import time

import mongoq_sync
from mongoq import Task


def resize(task: Task) -> dict[str, int]:
    time.sleep(0.01)  # blocking work is fine: it runs in a worker thread
    return {"width": 320}


def main() -> None:
    with mongoq_sync.connect() as db:  # or mongoq_sync.connect("mongodb://...")
        queue = mongoq_sync.TaskQueue(db, "thumbnails", lease_ttl=60)
        queue.setup()
        for number in range(5):
            queue.put(f"img-{number}", {"path": f"/photos/{number}.jpg"})

        task = queue.claim()
        assert task is not None
        with queue.leased(task) as lease:  # heartbeats in the background while this blocks
            lease.complete(resize(task))

        print(queue.run(resize, concurrency=4, stop_when_empty=True))
        print({status: n for status, n in queue.stats().counts.items() if n})


if __name__ == "__main__":
    # mongoq logs (never prints): retries at INFO, failures given up at WARNING.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
