"""Scenarios written once and driven twice: through the async core and through the generated
blocking facade (`mongoq_sync`), which must reach the same database states.

A scenario is an async function of an `Env`. `AsyncEnv` hands it the async classes directly;
`SyncEnv` hands it the blocking classes behind `AsyncView`, which runs every blocking call in a
worker thread (so the blocking facade is exercised exactly as a script would use it, while the
scenario itself stays one piece of async code). Assertions read the stored documents.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import anyio.to_thread

import mongoq_sync
from mongoq import AsyncGroupTransport, AsyncTaskQueue, NewMessage, NewTask, PermanentError
from mongoq.testing import ManualClock, settle
from tests.support.helpers import indexed, read_all, wait_for

LEASE = 30.0


class AsyncView:
    """A blocking facade object seen through async eyes: each call runs in a worker thread."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        if not callable(attribute):
            return attribute
        if name in PLAIN_METHODS:  # plain in the async API too (e.g. `leased` makes a manager)
            return lambda *args, **kwargs: _view(attribute(*args, **kwargs))

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = await anyio.to_thread.run_sync(functools.partial(attribute, *args, **kwargs))
            return _view(result)

        return call

    async def __aenter__(self) -> AsyncView:
        await anyio.to_thread.run_sync(self._target.__enter__)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await anyio.to_thread.run_sync(self._target.__exit__, *exc_info)


PLAIN_METHODS = {"leased", "backoff", "stop"}


def _view(value: Any) -> Any:
    return AsyncView(value) if isinstance(value, mongoq_sync.TaskLease) else value


class Env:
    """What a scenario sees."""

    kind: str
    clock: ManualClock

    async def task_queue(self, name: str, **options: Any) -> Any:
        raise NotImplementedError

    async def group_transport(self, prefix: str, **options: Any) -> Any:
        raise NotImplementedError

    async def documents(self, collection: str) -> dict[Any, dict[str, Any]]:
        raise NotImplementedError

    async def settle(self) -> None:
        """Let the event loop that runs the core catch up (heartbeats after a clock jump)."""
        raise NotImplementedError


class AsyncEnv(Env):
    kind = "async"

    def __init__(self, db: Any, clock: ManualClock) -> None:
        self.db = db
        self.clock = clock

    async def task_queue(self, name: str, **options: Any) -> Any:
        return await indexed(AsyncTaskQueue, self.db, name, self.clock, **options)

    async def group_transport(self, prefix: str, **options: Any) -> Any:
        return await indexed(AsyncGroupTransport, self.db, prefix, self.clock, **options)

    async def documents(self, collection: str) -> dict[Any, dict[str, Any]]:
        return await read_all(self.db, collection)

    async def settle(self) -> None:
        await settle()


class SyncEnv(Env):
    kind = "sync"

    def __init__(self, database: mongoq_sync.Database, clock: ManualClock) -> None:
        self.database = database
        self.clock = clock

    async def task_queue(self, name: str, **options: Any) -> Any:
        return await self._indexed(mongoq_sync.TaskQueue, name, options)

    async def group_transport(self, prefix: str, **options: Any) -> Any:
        return await self._indexed(mongoq_sync.GroupTransport, prefix, options)

    async def _indexed(self, kind: Callable[..., Any], name: str, options: dict[str, Any]) -> Any:
        """A blocking `kind` made, and its indexes created, in a worker thread as a script
        would, seen through `AsyncView`."""
        subject = await anyio.to_thread.run_sync(
            functools.partial(kind, self.database, name, clock=self.clock, **options)
        )
        await anyio.to_thread.run_sync(subject.setup)
        return AsyncView(subject)

    async def documents(self, collection: str) -> dict[Any, dict[str, Any]]:
        db = self.database.async_database
        return await anyio.to_thread.run_sync(self.database.call, read_all, db, collection)

    async def settle(self) -> None:
        await anyio.to_thread.run_sync(self.database.call, settle)


# ------------------------------------------------------------------------------- scenarios


async def task_lifecycle(env: Env) -> None:
    queue = await env.task_queue("tasks", lease_ttl=LEASE)
    assert await queue.put("a", {"n": 1}) == "inserted"
    assert await queue.put("a", {"n": 1}) == "unchanged"
    await queue.put_many([NewTask("b", {"n": 2}, priority=5), NewTask("c", {"n": 3})])
    claimed = []
    while (task := await queue.claim("w")) is not None:
        claimed.append(task.id)
        assert await queue.complete(task, {"double": task.payload["n"] * 2})
    assert claimed == ["b", "a", "c"]
    docs = await env.documents("tasks")
    assert {key: (doc["status"], doc["attempts"], doc["result"]) for key, doc in docs.items()} == {
        "a": ("done", 1, {"double": 2}),
        "b": ("done", 1, {"double": 4}),
        "c": ("done", 1, {"double": 6}),
    }
    stats = await queue.stats()
    assert stats.counts["done"] == 3 and stats.due == 0


async def task_takeover_fences_the_stale_holder(env: Env) -> None:
    queue = await env.task_queue("tasks", lease_ttl=LEASE)
    await queue.put("a")
    stale = await queue.claim("old")
    env.clock.advance(LEASE + 1)
    fresh = await queue.claim("new")
    assert fresh is not None and fresh.id == "a" and fresh.attempts == 2
    before = await env.documents("tasks")
    assert not await queue.complete(stale)
    assert not await queue.heartbeat(stale)
    assert not await queue.fail(stale, "late")
    assert await env.documents("tasks") == before
    assert await queue.complete(fresh)
    assert (await env.documents("tasks"))["a"]["status"] == "done"


async def task_lease_heartbeats_while_the_block_runs(env: Env) -> None:
    queue = await env.task_queue("tasks", lease_ttl=LEASE)
    await queue.put("a")
    task = await queue.claim("w")
    first_end = (await env.documents("tasks"))["a"]["lease_until"]
    async with queue.leased(task) as lease:
        for beat in range(1, 5):  # 44 s: longer than the lease
            env.clock.advance(LEASE / 3 + 1)
            await wait_for(lambda n=beat: lease.heartbeats >= n, f"heartbeat {beat}")
        assert (await env.documents("tasks"))["a"]["lease_until"] > first_end
        assert await queue.claim("other") is None
        assert not lease.lost
    docs = await env.documents("tasks")
    assert (docs["a"]["status"], docs["a"]["worker_id"]) == ("done", "w")


async def task_failures_end_failed(env: Env) -> None:
    queue = await env.task_queue("tasks", lease_ttl=LEASE, max_attempts=2, backoff_base=1)
    await queue.put("a")
    for attempt in (1, 2):
        task = await queue.claim("w")
        assert task is not None and task.attempts == attempt
        try:
            async with queue.leased(task):
                raise ValueError(f"boom {attempt}")
        except ValueError:
            pass
        env.clock.advance(10)
    doc = (await env.documents("tasks"))["a"]
    assert (doc["status"], doc["attempts"]) == ("failed", 2)
    assert doc["error"].endswith("ValueError: boom 2")


async def group_fifo_round_robin(env: Env) -> None:
    transport = await env.group_transport("grp", lease_ttl=LEASE)
    await transport.publish_many(
        [NewMessage("g1", {"i": i}) for i in range(3)] + [NewMessage("g2", {"i": 0})]
    )
    order = []
    while (lease := await transport.claim("w")) is not None:
        order.append((lease.group_id, lease.event["i"]))
        assert await transport.ack(lease)
        env.clock.advance(0.01)
    assert order == [("g1", 0), ("g2", 0), ("g1", 1), ("g1", 2)]
    assert await env.documents("grp_messages") == {}
    assert await env.documents("grp_locks") == {}


async def group_poison_to_dead_letters(env: Env) -> None:
    transport = await env.group_transport("grp", lease_ttl=LEASE, max_deliveries=2)
    await transport.publish("g", "poison")
    await transport.publish("g", "fine")
    for _ in range(2):
        lease = await transport.claim("w")
        assert lease.event == "poison"
        assert await transport.nack(lease, error=ValueError("bad"))
    lease = await transport.claim("w")
    assert lease.event == "fine"
    assert await transport.ack(lease)
    dead = await env.documents("grp_dead")
    assert [(doc["event"], doc["error"]) for doc in dead.values()] == [
        ("poison", "ValueError: bad")
    ]
    assert await env.documents("grp_messages") == {}


async def group_run_handles_outcomes(env: Env) -> None:
    transport = await env.group_transport("grp", lease_ttl=LEASE)
    await transport.publish("g", {"kind": "ok"})
    await transport.publish("g", {"kind": "permanent"})
    seen: list[str] = []

    def handle(lease: Any) -> None:
        seen.append(lease.event["kind"])
        if lease.event["kind"] == "permanent":
            raise PermanentError("cannot")

    handler: Callable[[Any], Any] = handle
    if env.kind == "async":
        blocking = handle

        async def handler(lease: Any) -> None:
            blocking(lease)

    summary = await transport.run(handler, stop_when_empty=True)
    assert (summary.acked, summary.dead) == (1, 1)
    assert seen == ["ok", "permanent"]
    dead = await env.documents("grp_dead")
    assert [doc["event"] for doc in dead.values()] == [{"kind": "permanent"}]


SCENARIOS: list[Callable[[Env], Awaitable[None]]] = [
    task_lifecycle,
    task_takeover_fences_the_stale_holder,
    task_lease_heartbeats_while_the_block_runs,
    task_failures_end_failed,
    group_fifo_round_robin,
    group_poison_to_dead_letters,
    group_run_handles_outcomes,
]
