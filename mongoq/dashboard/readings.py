"""What the dashboard reads: the primitives of a database, found through the registry
(`mongoq.registry`), opened as their owners open them, and summarised for the overview.

Owns no collections: every read goes through a primitive's own operator calls (``stats``,
``list_tasks``, ``dead_letters``, ``list_groups``, ``list_deliveries``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar, cast

import anyio

from mongoq import registry
from mongoq.clock import Clock
from mongoq.groups import AsyncGroupTransport
from mongoq.outbox import AsyncOutbox
from mongoq.registry import Primitive, Registration
from mongoq.tasks import AsyncTaskQueue

log = logging.getLogger("mongoq.dashboard")

__all__ = ["Catalog", "Summary"]

_P = TypeVar("_P", AsyncTaskQueue, AsyncGroupTransport, AsyncOutbox)
#: How far behind its read a throughput window ends: a worker whose clock lags, or whose write
#: was still on its way, stamps a finish before the read; the next window still counts it.
WINDOW_LAG = timedelta(seconds=5)
#: How long one primitive's stats may take before the overview shows it as unreadable.
READ_TIMEOUT = 10.0


@dataclass(frozen=True)
class Summary:
    """One primitive on the overview: its counts by label, how much waits (`backlog`), how
    long the oldest due item has waited in seconds (None when nothing is due: a task queue's
    oldest due task, a group transport's oldest message, an outbox's oldest due delivery; the
    same read as the counts, so a due count above 0 always comes with an age), and when it
    was read on the primitive's clock (`read_at`). `finished` is how many items finished
    from the instant the read was asked about up to `counted_until` (the throughput chart's
    source; None when not asked, when that instant is not before `counted_until`, or where
    the primitive keeps no record of finished items: a group transport, an outbox without
    ``completion_history``). `error` says why the read failed (the counts are
    then empty). `unknown_functions` are a task queue's due tasks by task function that no
    running worker runs (`TaskStats.unknown_functions`)."""

    primitive: Primitive
    name: str
    counts: dict[str, int]
    backlog: int
    oldest_age: float | None
    read_at: datetime | None = None
    finished: int | None = None
    error: str | None = None
    #: where the window `finished` counted ended (`WINDOW_LAG` before `read_at`): where the
    #: next one starts
    counted_until: datetime | None = None
    unknown_functions: dict[str, int] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.primitive}:{self.name}"


class Catalog:
    """The registered primitives of `db`, each opened once and kept (with `clock`, or each
    its default clock: the server's)."""

    def __init__(self, db: Any, clock: Clock | None = None) -> None:
        self.db = db
        self.clock = clock
        self._open: dict[tuple[str, str, bool], Any] = {}  # each kept: its clock, its indexes

    async def registrations(self) -> list[Registration]:
        return await registry.registered(self.db)

    async def find(self, primitive: str, name: str) -> Registration | None:
        """The registration of `primitive` `name`, or None: pages and actions serve only
        what is registered."""
        for found in await self.registrations():
            if (found.primitive, found.name) == (primitive, name):
                return found
        return None

    def tasks(self, name: str) -> AsyncTaskQueue:
        return self._opened(("tasks", name, False), lambda: AsyncTaskQueue(
            self.db, name, clock=self.clock))  # fmt: skip

    def groups(self, prefix: str) -> AsyncGroupTransport:
        return self._opened(("groups", prefix, False), lambda: AsyncGroupTransport(
            self.db, prefix, clock=self.clock))  # fmt: skip

    def outbox(self, prefix: str, completion_history: bool = False) -> AsyncOutbox:
        # Subscriptions matter to publishing only, which the dashboard never does.
        return self._opened(("outbox", prefix, completion_history), lambda: AsyncOutbox(
            self.db, prefix, subscriptions={}, completion_history=completion_history,
            clock=self.clock))  # fmt: skip

    def open(self, found: Registration) -> AsyncTaskQueue | AsyncGroupTransport | AsyncOutbox:
        if found.primitive == "tasks":
            return self.tasks(found.name)
        if found.primitive == "groups":
            return self.groups(found.name)
        return self.outbox(found.name, bool(found.options.get("completion_history", False)))

    def _opened(self, key: tuple[str, str, bool], make: Callable[[], _P]) -> _P:
        opened = self._open.get(key)
        if opened is None:
            opened = self._open[key] = make()
        return cast(_P, opened)

    async def summaries(self, since: Mapping[str, datetime] | None = None) -> list[Summary]:
        """A summary of every registered primitive, read concurrently, with the items finished
        after ``since[key]`` where given; one that cannot be read (a timeout, a refused
        command) is shown with its error, never hiding the rest."""
        found = await self.registrations()
        results: list[Summary | None] = [None] * len(found)
        after = since or {}

        async def read(index: int, registration: Registration) -> None:
            key = f"{registration.primitive}:{registration.name}"
            results[index] = await self.summary(registration, after.get(key))

        async with anyio.create_task_group() as group:
            for index, registration in enumerate(found):
                group.start_soon(read, index, registration)
        return [summary for summary in results if summary is not None]

    async def summary(self, found: Registration, since: datetime | None = None) -> Summary:
        try:
            with anyio.fail_after(READ_TIMEOUT):
                return await self._summary(found, since)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.warning(
                "could not read %s %r: %s", found.primitive, found.name, text,
                extra={"mongoq_primitive": found.primitive, "mongoq_queue": found.name},
            )  # fmt: skip
            return Summary(found.primitive, found.name, {}, 0, None, error=text)

    async def _summary(self, found: Registration, since: datetime | None) -> Summary:
        primitive = self.open(found)
        finished: int | None = None
        if isinstance(primitive, AsyncTaskQueue):
            tasks = await primitive.stats()
            now = primitive.clock.now()
            until = now - WINDOW_LAG
            if since is not None and since < until:
                finished = await primitive.count_finished(since, until)
            counts = {**tasks.counts, "due": tasks.due, "expired": tasks.expired}
            return Summary("tasks", found.name, counts, tasks.counts.get("pending", 0),
                           tasks.oldest_due_age, now, finished, counted_until=until,
                           unknown_functions=tasks.unknown_functions)  # fmt: skip
        if isinstance(primitive, AsyncGroupTransport):
            groups = await primitive.stats()
            counts = {"ready": groups.ready, "in_flight": groups.in_flight,
                      "parked": groups.parked, "messages": groups.messages,
                      "dead": groups.dead}  # fmt: skip
            return Summary("groups", found.name, counts, groups.messages,
                           groups.oldest_message_age, primitive.clock.now())  # fmt: skip
        outbox = await primitive.stats()
        now = primitive.clock.now()
        until = now - WINDOW_LAG
        if since is not None and since < until:
            finished = await primitive.count_finished(since, until)
        counts = {"pending": outbox.pending, "parked": outbox.parked, "running": outbox.running,
                  "dead": outbox.dead, "completed": outbox.completed}  # fmt: skip
        return Summary("outbox", found.name, counts, outbox.pending,
                       _due_age(now, outbox.oldest_due_at), now, finished,
                       counted_until=until)  # fmt: skip


def _due_age(now: datetime, due_at: datetime | None) -> float | None:
    """Seconds the oldest unfinished delivery has been due; None when nothing is due yet (its
    due time is still ahead: a retry's delay), as when nothing waits at all."""
    if due_at is None or due_at > now:
        return None
    return (now - due_at).total_seconds()
