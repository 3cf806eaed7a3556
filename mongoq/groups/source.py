"""`GroupSource`: one group transport as a source of work for the shared run loop
(`mongoq.runtime.source`), as `AsyncGroupTransport.source` hands it out to
`AsyncGroupTransport.run`.

Each slot leases up to `batch_size` groups (one group: `claim`, more: `claim_many`) and runs
their heads in the shared batch slot (`mongoq.runtime.batch`, with `GroupBatch`). Its one
maintenance service is ``orphans``: messages whose group has no lock readied every
``lease_ttl``, and when a slot finds nothing to claim. Owns no collections: every command goes
through the transport.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from mongoq.clock import Clock
from mongoq.groups.batch import GroupBatch
from mongoq.groups.models import GroupLease, GroupRunSummary
from mongoq.runtime import changes, wakeups
from mongoq.runtime.batch import run_batch
from mongoq.runtime.events import Tally
from mongoq.runtime.services import Service
from mongoq.runtime.source import ChangeFeed

if TYPE_CHECKING:
    from mongoq.groups.transport import AsyncGroupTransport

__all__ = ["GroupSource"]

log = logging.getLogger("mongoq.groups")


class GroupSource:
    """One transport's groups for a run loop: leased by `worker_id` (heads of `min_priority`
    or more), their heads run with `handler`, counted into `summary`."""

    fills = False

    def __init__(
        self,
        transport: AsyncGroupTransport,
        handler: Callable[[GroupLease], Awaitable[Any]],
        *,
        worker_id: str,
        min_priority: int,
        retry_delay: float,
        batch_size: int,
        handler_timeout: float | None,
    ) -> None:
        self.transport = transport
        self.worker_id = worker_id
        self.min_priority = min_priority
        self.batch_size = batch_size
        self.handler_timeout = handler_timeout
        self.name = f"groups:{transport.prefix}"
        self.clock: Clock = transport.clock
        self.summary = GroupRunSummary()
        self.tally = Tally(self.summary, "groups", transport.prefix)
        self.wake_key: wakeups.Key = transport._wake_key
        self.changes = ChangeFeed(transport.locks, changes.GROUPS_READY)
        self.services = [
            Service("orphans", self._recover, interval=transport.lease_ttl, when_idle=True)
        ]
        self._holder = GroupBatch(transport, handler, retry_delay)

    async def claim(self, limit: int) -> list[list[GroupLease]]:
        """One batch of up to `batch_size` leases (the run loop gives each slot one)."""
        if self.batch_size == 1:
            lease = await self.transport.claim(self.worker_id, min_priority=self.min_priority)
            leases = [] if lease is None else [lease]
        else:
            leases = await self.transport.claim_many(
                self.batch_size, self.worker_id, min_priority=self.min_priority
            )
        self.tally("claimed", len(leases))
        return [leases] if leases else []

    async def process(self, item: list[GroupLease]) -> None:
        await run_batch(
            self._holder, item, clock=self.clock, lease=self.transport.lease_ttl,
            count=self.tally, describe=lambda lease: f"group {lease.group_id!r}", logger=log,
            handler_timeout=self.handler_timeout, timed=self.tally.handler_time,
        )  # fmt: skip

    async def next_due(self) -> datetime | None:
        return await self.transport._next_due(self.min_priority)

    async def _recover(self, interval: float) -> None:
        await self.transport.recover_orphans()
