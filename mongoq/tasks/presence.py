"""The running `Jobs` workers of a queue, as each announces itself: `Presence`, one per
`AsyncTaskQueue`. A worker upserts its document when it starts and at each housekeeping round
(`mongoq.jobs.worker`), and deletes it when its run ends; `stats` reads which task functions
the live ones run, to tell the due tasks that wait for a function no running worker knows.

"Live" is decided by each document's ``expires``, never by its presence in the collection: a
killed worker's document stays until the TTL index deletes it, an hour past its ``expires``
(`schema.WORKER_EXPIRY_SLACK`; the embedded backend never does).

Owns the collection ``{name}_workers`` (documents and queries: `mongoq.tasks.schema`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from mongoq import _driver
from mongoq.tasks import schema

if TYPE_CHECKING:
    from mongoq.tasks.queue import AsyncTaskQueue

__all__ = ["Presence"]


class Presence:
    """The presences of the workers running one `AsyncTaskQueue`'s task functions."""

    def __init__(self, queue: AsyncTaskQueue) -> None:
        self.queue = queue
        self.collection = _driver.collection(queue.db, f"{queue.name}{schema.WORKERS_SUFFIX}")

    async def announce(self, worker_id: str, functions: Sequence[str], ttl: float) -> None:
        """`worker_id` runs `functions` of this queue, and counts as running for `ttl` seconds
        unless it announces again (one upsert)."""
        now = await self.queue._now()
        await self.collection.update_one(
            schema.worker_by_id(worker_id),
            schema.worker_announcing(functions, now, now + timedelta(seconds=ttl)),
            upsert=True,
        )

    async def withdraw(self, worker_id: str) -> None:
        """`worker_id` runs nothing here any more (one delete)."""
        await self.collection.delete_one(schema.worker_by_id(worker_id))

    async def functions(self, now: datetime) -> set[str] | None:
        """The task functions the workers live at `now` run, together; None when no worker is
        live (one command, whatever the number of workers)."""
        names = await self.collection.distinct("functions", schema.workers_live(now))
        # A worker always runs at least one function: no name, no live worker.
        return set(names) if names else None
