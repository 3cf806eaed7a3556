"""A run loop without its server: one warning when the server is lost, retries with a growing
backoff (on the primitive's clock), one warning when it is back, and the work done then; with
`give_up_after`, `ServerUnavailable` once the server has been gone that long."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import anyio
import pytest
from pymongo.errors import ServerSelectionTimeoutError

from mongoq import OutboxDispatcher, ServerUnavailable
from mongoq.runtime.outage import MAX_BACKOFF, Outage
from mongoq.testing import ManualClock, Operation, instrument
from tests.support.group_helpers import new_transport
from tests.support.helpers import napping, new_queue, rejects, wait_for
from tests.support.outbox_helpers import event, new_outbox

NO_SERVER = (
    "db.example:27017: [Errno 111] Connection refused (configured timeouts: socketTimeoutMS: "
    "5000.0ms, connectTimeoutMS: 5000.0ms), Timeout: 5.0s, Topology Description: "
    "<TopologyDescription id: 1, topology_type: Unknown, servers: [<ServerDescription "
    "('db.example', 27017) server_type: Unknown, rtt: None>]>"
)


class Unreachable:
    """A hook: while `down`, every command fails as the driver fails with no server at all."""

    def __init__(self) -> None:
        self.down = False
        self.refused = 0

    async def before(self, op: Operation) -> None:
        if self.down:
            self.refused += 1
            raise ServerSelectionTimeoutError(NO_SERVER)

    async def after(self, op: Operation, error: BaseException | None) -> None:
        return None


@dataclass
class Subject:
    """A primitive with two items of work, through an `Unreachable` hook."""

    host: Any  # what runs the loop: napping() reads it, stop() stops it
    run: Callable[..., Awaitable[Any]]
    left: Callable[[], Awaitable[int]]  # unfinished items, read from the database


async def subject(kind: str, db: Any, clock: ManualClock, hook: Unreachable) -> Subject:
    down = instrument(db, hook)

    async def nothing(*_: Any) -> None:
        return None

    if kind == "tasks":
        queue = await new_queue(down, clock)
        await queue.put_many([])  # no-op: the index set-up above already reached the server
        for n in (1, 2):
            await queue.put(f"t{n}", n)

        async def tasks_left() -> int:
            counts = (await queue.stats()).counts
            return sum(counts.values()) - counts.get("done", 0)

        return Subject(queue, lambda **o: queue.run(nothing, schedules=False, **o), tasks_left)
    if kind == "groups":
        transport = await new_transport(down, clock)
        for n in (1, 2):
            await transport.publish("g", n)

        async def messages_left() -> int:
            return (await transport.stats()).messages

        return Subject(transport, lambda **o: transport.run(nothing, **o), messages_left)
    outbox = await new_outbox(down, clock, subscriptions={"t": ["h"]})
    await outbox.publish([event(1), event(2)], session=None)
    dispatcher = OutboxDispatcher(outbox, {"h": nothing})

    async def deliveries_left() -> int:
        stats = await outbox.stats()
        return stats.pending + stats.running + stats.parked

    return Subject(dispatcher, lambda **o: dispatcher.run(**o), deliveries_left)


KINDS = ["tasks", "groups", "outbox"]


def said(caplog: pytest.LogCaptureFixture, event_name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "mongoq_event", None) == event_name]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_lost_server_is_said_once_retried_with_backoff_and_said_back_once(
    kind: str, db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    hook = Unreachable()
    work = await subject(kind, db, clock, hook)
    caplog.set_level(logging.DEBUG, logger="mongoq")
    hook.down = True
    # The poll interval, then as long as the server has been lost so far (so doubling), capped.
    waits = [1, 1, 2, 4, 8, 16, MAX_BACKOFF]
    async with anyio.create_task_group() as group:
        group.start_soon(work.run)
        for wait in waits:
            before = hook.refused
            await wait_for(
                lambda before=before: hook.refused > before and napping(work.host), "a failed try"
            )
            assert clock.sleeping_until(clock.now() + timedelta(seconds=wait)) >= 1
            clock.advance(wait)
        hook.down = False
        while await work.left():
            await wait_for(lambda: napping(work.host), "the run to wait on the clock")
            clock.advance(1)
        work.host.stop()

    lost, back = said(caplog, "server_lost"), said(caplog, "server_back")
    assert len(lost) == 1 and len(back) == 1
    assert lost[0].levelno == logging.WARNING
    assert "cannot reach the MongoDB server at db.example:27017 (connection refused" in (
        lost[0].getMessage()
    )
    assert len(lost[0].getMessage()) < 250
    assert back[0].mongoq_seconds == sum(waits)  # type: ignore[attr-defined]
    assert await work.left() == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_give_up_after_raises_server_unavailable_once_the_server_was_gone_that_long(
    kind: str, db: Any, clock: ManualClock
) -> None:
    hook = Unreachable()
    work = await subject(kind, db, clock, hook)
    hook.down = True
    start = clock.now()

    async def drive() -> None:
        while True:
            await wait_for(lambda: napping(work.host), "the run to back off")
            clock.advance(1)

    async with anyio.create_task_group() as group:
        group.start_soon(drive)
        with pytest.raises(ServerUnavailable) as raised:
            await work.run(give_up_after=10)
        group.cancel_scope.cancel()

    error = raised.value
    assert error.hosts == ("db.example:27017",)
    assert "gave up (give_up_after=10)" in str(error)
    assert clock.now() - start >= timedelta(seconds=10)
    hook.down = False
    assert await work.left() == 2  # nothing was claimed, nothing lost


async def test_give_up_after_is_checked_before_anything_runs(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)

    async def handler(task: Any) -> None:
        return None

    with rejects("give_up_after"):
        await queue.run(handler, give_up_after=0)


def test_a_success_sent_before_the_loss_does_not_end_it(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outage = Outage("loop", clock, poll_interval=1, give_up_after=None)
    before = clock.now()
    clock.advance(5)
    assert outage.failed(ServerSelectionTimeoutError(NO_SERVER), "claim", clock.now()) == 1
    outage.succeeded(before)  # a claim sent before the failure answered late: proves nothing
    assert outage.lost and said(caplog, "server_back") == []
    outage.succeeded(clock.now())
    assert not outage.lost and len(said(caplog, "server_back")) == 1


def test_every_slot_backs_off_by_the_outages_length_not_by_its_own_count(
    clock: ManualClock,
) -> None:
    outage = Outage("loop", clock, poll_interval=1, give_up_after=None)
    error = ServerSelectionTimeoutError(NO_SERVER)
    start = clock.now()
    assert [outage.failed(error, "claim", start) for _ in range(8)] == [1] * 8  # eight slots
    clock.advance(6)
    assert outage.failed(error, "claim", clock.now()) == 6
    clock.advance(50)  # lost 56 s so far: the cap
    assert outage.failed(error, "claim", clock.now()) == MAX_BACKOFF


def test_giving_up_never_counts_across_a_stretch_when_nothing_was_tried(
    clock: ManualClock,
) -> None:
    """Every slot busy with its handler, the loop tries nothing for minutes: two failures that
    far apart are not one outage, and `give_up_after` counts from the later one."""
    outage = Outage("loop", clock, poll_interval=1, give_up_after=30)
    error = ServerSelectionTimeoutError(NO_SERVER)
    outage.failed(error, "housekeeping", clock.now())
    clock.advance(2 * MAX_BACKOFF + 1)
    outage.failed(error, "housekeeping", clock.now())  # no give-up: a new stretch
    clock.advance(29)
    outage.failed(error, "claim", clock.now())
    clock.advance(1)
    with pytest.raises(ServerUnavailable, match=r"no server for 30 s, gave up"):
        outage.failed(error, "claim", clock.now())
