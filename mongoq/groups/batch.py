"""The group transport's side of a batch slot (`mongoq.runtime.batch`): how the heads of the
groups a slot leased are renewed, run and settled by ``AsyncGroupTransport.run``. Owns no
collections; every write goes through the transport's fenced calls.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from mongoq.errors import PermanentError
from mongoq.groups.models import GroupLease
from mongoq.runtime.loop import WORKER_STOPPED

if TYPE_CHECKING:
    from mongoq.groups.transport import AsyncGroupTransport

__all__ = ["GroupBatch"]


@dataclass(eq=False)
class GroupBatch:
    """`BatchHolder` for groups: `extend_many` renews (`extend` for one), `ack_many` acks
    (`ack` for one), `PermanentError` dead-letters the head, another failure nacks it."""

    transport: AsyncGroupTransport
    handler: Callable[[GroupLease], Awaitable[Any]]
    retry_delay: float
    done: str = "acked"

    def lease_end(self, item: GroupLease) -> datetime:
        return item.lease_until

    async def renew(self, items: Sequence[GroupLease]) -> list[bool]:
        if len(items) == 1:
            return [await self.transport.extend(items[0])]
        return await self.transport.extend_many(items)

    async def renew_one(self, item: GroupLease) -> bool:
        return await self.transport.extend(item)

    async def handle(self, item: GroupLease) -> Any:
        return await self.handler(item)

    async def settle_failure(self, item: GroupLease, error: Exception) -> str:
        if isinstance(error, PermanentError):
            return "dead" if await self.transport.dead_letter(item, error) else "lost"
        held = await self.transport.nack(item, self.retry_delay, error=error)
        return "retried" if held else "lost"

    async def complete(self, items: Sequence[GroupLease], results: Sequence[Any]) -> list[bool]:
        if len(items) == 1:
            return [await self.transport.ack(items[0])]
        return await self.transport.ack_many(items)

    async def settle_cut_short(self, item: GroupLease) -> str:
        held = await self.transport.nack(item, self.retry_delay, error=WORKER_STOPPED)
        return "retried" if held else "lost"

    async def give_back(self, item: GroupLease) -> str:
        # Never handed to the handler: not a delivery.
        return "released" if await self.transport._unclaim(item) else "lost"
