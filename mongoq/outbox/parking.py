"""Parking: blocked backlogs out of the claim index, and back in once they may be first.

A keyed delivery waits while an earlier one of its handler and key is unfinished. When a claim
sees many of them behind one head (or a head that is not due yet), `Parking.park` moves them
out of the claim index (``lane: "parked"``, with their ``parked_key``), so that later claims do
not scan them; `Parking.unpark` moves the lowest pending delivery of a key back once nothing
unfinished comes before it. It writes ``deliveries`` only (the filters, updates and the
``parked_keys`` index: `mongoq.outbox.schema`), and keeps, per `AsyncOutbox` instance, which
keys it knows to have parked deliveries and when unparking is due.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime
from logging import Logger
from typing import Any

from mongoq import _driver
from mongoq.clock import stored_instant
from mongoq.outbox import schema
from mongoq.outbox.faults import kind, whole
from mongoq.outbox.quarantine import Unusable

__all__ = ["PARK_THRESHOLD", "UNPARK_KEYS_PER_CLAIM", "Parking"]

#: Waiting deliveries of one key a claim must see behind an unfinished head before parking them.
PARK_THRESHOLD = 32
#: Parked keys one claim looks at for a delivery to move back (keep simultaneously backlogged
#: keys in the hundreds).
UNPARK_KEYS_PER_CLAIM = 500

HandlerKey = tuple[str, str]
#: The lowest pending delivery of each handler and key, given a pending one of each.
HeadsOf = Callable[
    [Mapping[HandlerKey, Mapping[str, Any]]], Awaitable[dict[HandlerKey, dict[str, Any] | None]]
]
#: Sets aside deliveries found unusable (`mongoq.outbox.quarantine.Quarantine.set_aside`).
Aside = Callable[[list[Unusable]], Awaitable[Any]]


def _handler_set(handlers: Iterable[str] | None) -> tuple[str, ...] | None:
    """The handlers of a claim as unparking keys its state by (None: every handler)."""
    return None if handlers is None else tuple(sorted(handlers))


class Parking:
    """Park and unpark for the claims of one `AsyncOutbox` instance."""

    def __init__(self, deliveries: Any, heads_of: HeadsOf, log: Logger, aside: Aside) -> None:
        self.deliveries = deliveries
        self.heads_of = heads_of
        self.log = log
        self.aside = aside
        # keys with parked deliveries, as far as this instance knows: a settle of one of them
        # makes unparking due for its handler
        self.parked_keys: set[HandlerKey] = set()
        self.due: set[str] = set()
        # handler set of a claim -> the last parked key its unparking looked at
        self.after: dict[tuple[str, ...] | None, HandlerKey] = {}
        # the handler sets whose parked keys a claim of this instance looked at at least once
        self.looked: set[tuple[str, ...] | None] = set()

    def settled(self, handler: str, key: str | None) -> None:
        """A delivery of `handler` and `key` settled: its key's parked followers may be first."""
        if (handler, key) in self.parked_keys:
            self.due.add(handler)

    def wanted(self, handlers: list[str] | None) -> bool:
        """Whether a claim of `handlers` should look at the parked keys although it did not
        read the lane view: its first, or one after a settle of a key of theirs with parked
        deliveries (or after a look that had more keys to look at)."""
        if _handler_set(handlers) not in self.looked:
            return True
        if handlers is None:
            return bool(self.due)
        return not self.due.isdisjoint(handlers)

    async def park(
        self,
        waiting: Mapping[HandlerKey, list[Any]],
        heads: Mapping[HandlerKey, dict[str, Any] | None],
        now: datetime,
    ) -> None:
        """Move blocked backlogs out of the claim index: the waiting deliveries of a key when
        there are `PARK_THRESHOLD` or more, or when its head is not due yet (they cannot run
        before it anyway). Best effort: a failure is logged, never fails the claim, and leaves
        them ready (scanned, but correct)."""
        parked: list[Any] = []
        for hk, ids in waiting.items():
            head = heads.get(hk)
            not_due = head is not None and (stored_instant(head.get("due_at")) or now) > now
            if len(ids) >= PARK_THRESHOLD or not_due:
                parked += ids
                self.parked_keys.add(hk)
                # A head that finished while its followers were being parked settled before
                # its key was known here: the next claim looks.
                self.due.add(hk[0])
        if not parked:
            return
        try:
            result = await self.deliveries.update_many(
                schema.delivery_parkable(parked), schema.delivery_parking()
            )
        except _driver.DRIVER_ERRORS as exc:
            self.log.warning("parking %d blocked deliveries failed (%s)", len(parked), exc)
            return
        self.log.debug("parked %d blocked deliveries", result.modified_count)

    async def unpark(self, handlers: list[str] | None) -> None:
        """Level-triggered: each parked key whose lowest pending delivery is parked (nothing
        unfinished before it) gets that delivery back in the claim index. It looks at the
        current state only, so a crash while parking, or a head finishing while its followers
        were being parked, delays a key until a later claim but never strands it."""
        cursor = _handler_set(handlers)
        # Each look goes on after the last key the previous one (for the same handlers) looked
        # at, wrapping around, so every parked key is looked at however many there are. The
        # aggregation is a distinct scan of the parked keys (one index seek a key), then one
        # query reads what comes before each key's lowest parked delivery.
        groups = await _driver.aggregate_list(
            self.deliveries,
            schema.delivery_parked_keys(handlers, self.after.get(cursor), UNPARK_KEYS_PER_CLAIM),
            hint=schema.PARKED_INDEX,
        )
        pairs = [(str(g["h"]), str(g["k"])) for g in groups]
        self._looked(handlers, pairs)
        if not pairs:
            return
        # A lowest parked delivery whose sequence is no number (a hand edit) has no place in
        # its key: set aside (the next look finds the key's next one).
        broken = [g for g in groups if not whole(g.get("s"), -(2**63))]
        if broken:
            await self.aside([
                Unusable({"_id": g["d"], "sequence": g.get("s"), "lane": schema.PARKED},
                         "sequence", kind(g.get("s")))
                for g in broken
            ])  # fmt: skip
        lowest = {
            (str(g["h"]), str(g["k"])):
                {"_id": g["d"], "sequence": g["s"], "due_at": g.get("t"), "lane": schema.PARKED}
            for g in groups if whole(g.get("s"), -(2**63))
        }  # fmt: skip
        if not lowest:
            return
        heads = await self.heads_of(lowest)
        ready = [
            h["_id"] for h in heads.values() if h is not None and h.get("lane") == schema.PARKED
        ]
        if ready:
            await self.deliveries.update_many(
                schema.delivery_unparkable(ready), schema.delivery_unparking()
            )

    def _looked(self, handlers: list[str] | None, pairs: list[HandlerKey]) -> None:
        """Remember a look at the parked keys of `handlers` that found `pairs`: where the next
        look goes on, whether it is due, and which keys have parked deliveries."""
        cursor = _handler_set(handlers)
        whole = cursor not in self.after and len(pairs) < UNPARK_KEYS_PER_CLAIM
        self.looked.add(cursor)
        if handlers is None:
            self.due.clear()
        else:
            self.due.difference_update(handlers)
        if len(pairs) == UNPARK_KEYS_PER_CLAIM:
            self.after[cursor] = pairs[-1]
            # more keys to look at: the next claim goes on
            self.due.update(handlers if handlers is not None else {h for h, _ in pairs})
        else:
            self.after.pop(cursor, None)
        # The keys with parked deliveries, which a settle makes worth unparking: all of them
        # (of these handlers) when this look saw every one.
        if whole:
            self.parked_keys = {
                hk for hk in self.parked_keys if handlers is not None and hk[0] not in handlers
            }
        self.parked_keys.update(pairs)
