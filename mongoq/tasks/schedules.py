"""Periodic tasks of a queue: `Scheduler`, one per `AsyncTaskQueue`, behind its `schedule`,
`schedules` and `unschedule` (`TaskSchedules`, mixed into the queue), and its `tick`, which a
run loop's ``schedules`` service calls (`mongoq.tasks.source`).

A schedule's tick puts one task, ``"<name>@<tick>"`` (`tick_task_id`): the id is the same in
every process, so any number of workers tick without a leader and the put, idempotent by id,
makes one task a tick. The ticker puts the task, then moves the schedule's ``next_at`` on,
fenced on the ``next_at`` it read: a ticker that stops between the two puts the same task again
(no change), one that lost the race changes nothing. Ticks missed while no worker ran follow
the schedule's `missed` policy: ``"once"`` puts the latest of them, ``"skip"`` only one not
older than `grace`. Cron expressions are `croniter`'s (the ``cron`` extra), read in the
schedule's time zone (an IANA name); `every` counts seconds from the first tick.

Owns the collection ``{name}_schedules`` (documents and queries: `mongoq.tasks.schema`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pymongo.errors import DuplicateKeyError

from mongoq import _driver
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import (
    check_function_name,
    check_int,
    check_name,
    check_payload,
    check_seconds,
)
from mongoq.clock import stored_instant, to_millis
from mongoq.errors import InvalidInput, MongoqError
from mongoq.runtime import wakeups
from mongoq.tasks import schema
from mongoq.tasks.models import MissedTicks, Schedule, tick_task_id

if TYPE_CHECKING:
    from mongoq.tasks.queue import AsyncTaskQueue

__all__ = ["Scheduler", "TaskSchedules", "check_timing"]

log = logging.getLogger("mongoq.tasks")

#: Seconds between two reads of the schedules when none is due sooner: how late a schedule
#: defined in another process is first seen (one defined in this process is seen at once).
RECHECK = 60.0
#: Due schedules one tick handles; more wait for the next (at once: one is still due).
TICK_BATCH = 100
#: The shortest `every` a schedule takes, in seconds (`_checked_every`).
MIN_EVERY = 1.0


def _croniter() -> Any:
    try:
        from croniter import croniter
    except ImportError:  # pragma: no cover - the test extra has it
        raise MongoqError(
            "cron schedules need croniter: pip install 'mongoq-queue[cron]'"
        ) from None
    return croniter


class _Rule:
    """When a schedule ticks: `latest` tick at or before an instant, `first` one after it."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.cron: str | None = doc.get("cron")
        self.every = float(doc["every"]) if doc.get("every") is not None else None
        self.zone = ZoneInfo(doc.get("timezone") or "UTC")
        anchor = stored_instant(doc.get("anchor"))
        assert anchor is not None, "a schedule always has its anchor"
        self.anchor = anchor

    def latest(self, now: datetime) -> datetime:
        if self.every is not None:
            # In whole milliseconds, as stored: `first` must land on a tick `latest` finds.
            step = round(self.every * 1000)
            elapsed = (to_millis(now) - self.anchor) // timedelta(milliseconds=1)
            return self.anchor + timedelta(milliseconds=max(elapsed // step, 0) * step)
        local = now.astimezone(self.zone) + timedelta(milliseconds=1)  # at `now` counts
        return to_millis(_croniter()(self.cron, local).get_prev(datetime).astimezone(UTC))

    def first(self, after: datetime) -> datetime:
        if self.every is not None:
            if after < self.anchor:
                return self.anchor
            return self.latest(after) + timedelta(milliseconds=round(self.every * 1000))
        local = after.astimezone(self.zone)
        return to_millis(_croniter()(self.cron, local).get_next(datetime).astimezone(UTC))


@names_unreachable_server
class TaskSchedules:
    """`schedule`, `schedules` and `unschedule` of `AsyncTaskQueue`, which it mixes in."""

    _scheduler: Scheduler  # set by the queue's constructor

    async def schedule(
        self,
        name: str,
        *,
        cron: str | None = None,
        every: float | None = None,
        payload: Any = None,
        priority: int = 0,
        timezone: str = "UTC",
        missed: MissedTicks = "once",
        grace: float = 60.0,
        function: str | None = None,
    ) -> Schedule:
        """Define (or redefine) the periodic task `name`: a task ``"<name>@<tick>"`` with
        `payload` and `priority` at every tick of `cron` (read in `timezone`, an IANA name;
        needs the ``cron`` extra) or every `every` seconds from now: at least 1 second, in
        whole milliseconds (else `InvalidInput`). Any number of workers (`run`) tick it, one
        task a tick. Ticks missed while no worker ran: ``missed="once"`` puts the latest of
        them once, ``"skip"`` none older than `grace` seconds (at least 1 second).

        Idempotent: the same definition again keeps its next tick (call it at every start);
        a changed one starts from the next tick after now. Two commands, three when new.
        `function` names the task function its tasks call (`mongoq.Jobs.periodic`)."""
        return await self._scheduler.define(
            name, cron=cron, every=every, payload=payload, priority=priority,
            timezone=timezone, missed=missed, grace=grace, function=function,
        )  # fmt: skip

    async def schedules(self) -> list[Schedule]:
        """Every schedule of the queue, by name (one command)."""
        return await self._scheduler.list()

    async def unschedule(self, name: str) -> bool:
        """Remove the schedule `name` (its tasks already put stay); False if there was none."""
        return await self._scheduler.remove(name)


class Scheduler:
    """The schedules of one `AsyncTaskQueue` and the ticker that puts their tasks."""

    def __init__(self, queue: AsyncTaskQueue) -> None:
        self.queue = queue
        self.collection = _driver.collection(queue.db, f"{queue.name}{schema.SCHEDULES_SUFFIX}")
        self.wake_key = wakeups.key_of("tasks.schedules", queue.db, queue.name)

    # ------------------------------------------------------------------------ definitions

    async def define(
        self,
        name: str,
        *,
        cron: str | None,
        every: float | None,
        payload: Any,
        priority: int,
        timezone: str,
        missed: MissedTicks,
        grace: float,
        function: str | None = None,
    ) -> Schedule:
        """`AsyncTaskQueue.schedule`."""
        name = _checked_name(name)
        fields = _checked(name, cron, every, payload, priority, timezone, missed, grace)
        if function is not None:  # absent from a plain schedule: its spec digest stays as it was
            fields["function"] = check_function_name("function", function)
        spec = hashlib.sha256(json.dumps(fields, sort_keys=True, default=repr).encode()).hexdigest()
        fields["spec"] = spec
        now = await self.queue._now()
        # The first tick after now: a definition changed or new never puts a past tick.
        first = (
            _Rule({**fields, "anchor": now}).first(now)
            if fields["cron"] is not None
            else to_millis(now + timedelta(seconds=fields["every"]))
        )
        with contextlib.suppress(DuplicateKeyError):  # defined so already: its tick stands
            await self.collection.update_one(
                schema.schedule_redefined(name, spec),
                schema.schedule_defining(fields, first, now),
                upsert=True,
            )
        wakeups.notify(self.wake_key)
        doc = await self.collection.find_one(schema.schedule_by_name(name))
        assert doc is not None
        return Schedule.from_document(doc)

    async def list(self) -> list[Schedule]:
        """`AsyncTaskQueue.schedules`."""
        docs = await _driver.find_list(
            self.collection, schema.schedules_by_next(), sort=[("_id", 1)]
        )
        return [Schedule.from_document(doc) for doc in docs]

    async def remove(self, name: str) -> bool:
        """`AsyncTaskQueue.unschedule`."""
        name = _checked_name(name)
        result = await self.collection.delete_one(schema.schedule_by_name(name))
        return bool(result.deleted_count)

    # ----------------------------------------------------------------------------- ticking

    async def tick(self) -> datetime | None:
        """Put the tasks of the due schedules' ticks and move each on (`missed` decides for
        ticks long past); returns when the next schedule is due (None: there is none)."""
        now = await self.queue._now()
        docs = await _driver.find_list(
            self.collection, schema.schedules_by_next(), sort=schema.SCHEDULE_ORDER,
            limit=TICK_BATCH + 1, hint=schema.SCHEDULE_DUE.name,
        )  # fmt: skip
        upcoming: list[datetime] = []
        for doc in docs[:TICK_BATCH]:
            schedule = Schedule.from_document(doc)
            if schedule.next_at > now:
                upcoming.append(schedule.next_at)
                break
            try:
                upcoming.append(await self._tick(doc, schedule, now))
            except _driver.DRIVER_ERRORS:
                raise  # the ticker's retry
            except Exception as exc:
                # (a time zone this host lacks, a cron this croniter refuses, no croniter):
                # said, and tried again at the next recheck, the other schedules ticking on.
                log.error(
                    "schedule %r cannot tick here: %s", schedule.name, exc,
                    extra={"mongoq_primitive": "tasks", "mongoq_queue": self.queue.name,
                           "mongoq_item": schedule.name},
                )  # fmt: skip
        else:
            if len(docs) > TICK_BATCH:
                upcoming.append(now)  # more are due: tick again at once
        return min(upcoming, default=None)

    async def _tick(self, doc: dict[str, Any], schedule: Schedule, now: datetime) -> datetime:
        """Put the task of `schedule`'s due tick (unless `missed` skips it), move the schedule
        on; returns its next tick."""
        rule = _Rule(doc)
        latest = max(rule.latest(now), schedule.next_at)
        run: datetime | None = latest
        if schedule.missed == "skip" and (now - latest).total_seconds() > schedule.grace:
            run = None
        if run is not None:
            await self.queue.put(
                tick_task_id(schedule.name, run), schedule.payload, priority=schedule.priority,
                function=schedule.function,
            )  # fmt: skip
        following = rule.first(now)
        advanced = await self.collection.update_one(
            schema.schedule_at(schedule.name, schedule.next_at),
            schema.schedule_advancing(following, run, now),
        )
        skipped = run is None or latest > schedule.next_at
        if advanced.modified_count and skipped:
            log.info(
                "schedule %r: missed ticks since %s (%s)", schedule.name,
                schedule.next_at.isoformat(), "ran the latest once" if run else "skipped",
                extra={"mongoq_primitive": "tasks", "mongoq_queue": self.queue.name,
                       "mongoq_item": schedule.name},
            )  # fmt: skip
        return following


def _checked_name(name: Any) -> str:
    """A schedule's name, checked as a queue's is (at most 128 bytes, printable): its ticks'
    task ids (``name@<tick>``) then stay well within an id's limit."""
    checked: str = check_name("name", name)
    return checked


def _checked_every(every: Any) -> float:
    """`every`, at least `MIN_EVERY` seconds and in whole milliseconds: ticks are computed in
    integer milliseconds, so that none drifts, doubles or spins the ticker."""
    if isinstance(every, int | float) and not isinstance(every, bool) and every < MIN_EVERY:
        raise InvalidInput("every", f"must be at least {MIN_EVERY:g} second, got {every!r}")
    seconds = check_seconds("every", every)
    if abs(seconds * 1000 - round(seconds * 1000)) > 1e-6:
        raise InvalidInput("every", f"must be whole milliseconds, got {every!r}")
    return seconds


def _checked(
    name: Any, cron: Any, every: Any, payload: Any, priority: Any, timezone: Any, missed: Any,
    grace: Any,
) -> dict[str, Any]:  # fmt: skip
    """The stored definition of a schedule, every argument checked (`InvalidInput` naming it)."""
    _checked_name(name)
    every, grace = check_timing(cron, every, timezone, missed, grace)
    check_payload("payload", payload)
    check_int("priority", priority, low=-(2**31), high=2**31 - 1)
    return {
        "cron": cron, "every": every, "timezone": timezone, "payload": payload,
        "priority": priority, "missed": missed, "grace": grace,
    }  # fmt: skip


def check_timing(
    cron: Any, every: Any, timezone: Any, missed: Any, grace: Any
) -> tuple[float | None, float]:
    """When a schedule ticks, checked (`InvalidInput` naming the option; a `cron` without the
    ``cron`` extra installed is refused naming it): `every` and `grace` in seconds."""
    if (cron is None) == (every is None):
        raise InvalidInput("cron", "give a cron expression or `every` seconds, one of the two")
    if cron is not None:
        if not isinstance(cron, str) or not _croniter().is_valid(cron):
            raise InvalidInput("cron", f"is not a cron expression: {cron!r}")
    else:
        every = _checked_every(every)
    if not isinstance(timezone, str):
        raise InvalidInput("timezone", "must be an IANA time zone name such as 'Europe/Paris'")
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidInput("timezone", f"is not a known time zone: {timezone!r}") from None
    if missed not in ("once", "skip"):
        raise InvalidInput("missed", "must be 'once' (run the latest missed tick) or 'skip'")
    grace = check_seconds("grace", grace)
    if grace < 1:  # a ticker wakes a little after the tick: a shorter grace skips them all
        raise InvalidInput("grace", "must be at least 1 second")
    return every, grace
