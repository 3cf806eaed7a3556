"""`ServerClock`: follows the server's clock through ``hello``'s ``localTime``.

No server runs here, so a stand-in answers ``hello``; it presents itself as a PyMongo async
database (the driver layer reads the class's module), which is all `ServerClock` looks at.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
from pymongo.errors import AutoReconnect, ServerSelectionTimeoutError

from mongoq import ServerClock, ServerUnavailable
from mongoq.testing import memory_database, settle


class FakeServer:
    """Answers ``hello`` with a clock `skew` seconds ahead of this machine's."""

    __module__ = "pymongo.asynchronous.database"

    def __init__(self, skew: float) -> None:
        self.skew = skew
        self.hellos = 0
        self.fail_next = False

    async def command(self, name: str) -> dict[str, Any]:
        assert name == "hello"
        self.hellos += 1
        if self.fail_next:
            self.fail_next = False
            raise AutoReconnect("injected: no reply")
        local = datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=self.skew)
        return {"isWritablePrimary": True, "localTime": local}


async def test_the_offset_is_measured_once_then_reused_until_stale() -> None:
    server = FakeServer(skew=120.0)
    clock = ServerClock(server, resync_interval=300)
    await clock.refresh()
    await clock.refresh()
    assert server.hellos == 1  # not re-measured before resync_interval
    assert abs(clock.offset.total_seconds() - 120.0) < 1.0
    assert abs((clock.now() - datetime.now(UTC)).total_seconds() - 120.0) < 1.0
    assert clock.now().microsecond % 1000 == 0  # BSON precision


async def test_a_failed_measurement_keeps_the_last_offset() -> None:
    server = FakeServer(skew=-30.0)
    clock = ServerClock(server, resync_interval=0)  # every refresh re-measures
    await clock.refresh()
    server.skew = 500.0
    server.fail_next = True
    await clock.refresh()
    assert abs(clock.offset.total_seconds() + 30.0) < 1.0
    await clock.refresh()
    assert abs(clock.offset.total_seconds() - 500.0) < 1.0


async def test_the_embedded_backend_falls_back_to_the_system_clock() -> None:
    clock = ServerClock(memory_database())
    await clock.refresh()
    assert clock.offset == timedelta(0)
    assert abs((clock.now() - datetime.now(UTC)).total_seconds()) < 1.0


class _NoServer:
    """A database whose ``hello`` waits until released, then finds no server."""

    mongoq_backend = "pymongo"

    def __init__(self) -> None:
        self.hellos = 0
        self.release = anyio.Event()

    async def command(self, name: str) -> Any:
        self.hellos += 1
        await self.release.wait()
        raise ServerSelectionTimeoutError("No servers found yet, Timeout: 5.0s, Topology ...")


async def test_callers_waiting_on_a_measurement_that_found_no_server_are_told_at_once() -> None:
    """Five calls refresh the clock at once: one measures, and when it finds no server the
    other four are told so too, rather than each waiting out the timeout in turn."""
    db = _NoServer()
    clock = ServerClock(db)
    outcomes: list[BaseException] = []

    async def refresh() -> None:
        try:
            await clock.refresh()
        except ServerUnavailable as error:
            outcomes.append(error)

    async with anyio.create_task_group() as group:
        for _ in range(5):
            group.start_soon(refresh)
        await settle()
        db.release.set()
    assert (db.hellos, len(outcomes)) == (1, 5)
