"""The registry of a database's primitives (`mongoq.registry`), which operators' tools read
(``mongoq list``; the dashboard of issue 16): every set-up records its primitive, once, and
what is listed is read back from the registry collection."""

from __future__ import annotations

from typing import Any

from mongoq import AsyncGroupTransport, AsyncTaskQueue
from mongoq.outbox import AsyncOutbox
from mongoq.registry import REGISTRY, registered, unregister
from mongoq.testing import ManualClock


async def test_every_set_up_records_its_primitive_once_and_keeps_when_it_was_first(
    db: Any, clock: ManualClock
) -> None:
    await AsyncTaskQueue(db, "emails", clock=clock).setup()
    await AsyncGroupTransport(db, "orders", clock=clock).setup()
    await AsyncOutbox(db, "shop_", subscriptions={"t": ["h"]}, clock=clock).setup()
    first = clock.now()
    clock.advance(60)
    await AsyncTaskQueue(db, "emails", clock=clock).setup()  # a worker restarting
    await AsyncTaskQueue(db, "audio", clock=clock).setup()

    found = await registered(db)

    assert [(r.primitive, r.name) for r in found] == [
        ("tasks", "audio"), ("tasks", "emails"), ("groups", "orders"), ("outbox", "shop_"),
    ]  # fmt: skip
    emails = found[1]
    assert (emails.registered_at, emails.set_up_at) == (first, clock.now())
    assert emails.version
    docs = await db[REGISTRY].find({}, sort=[("_id", 1)]).to_list(None)
    assert [doc["_id"] for doc in docs] == [
        "groups:orders", "outbox:shop_", "tasks:audio", "tasks:emails",
    ]  # fmt: skip


async def test_unregister_forgets_a_primitive_and_leaves_its_collections(
    db: Any, clock: ManualClock
) -> None:
    queue = AsyncTaskQueue(db, "emails", clock=clock)
    await queue.setup()
    await queue.put("t1")
    assert await unregister(db, "tasks", "emails") is True
    assert await unregister(db, "tasks", "emails") is False
    assert await registered(db) == []
    assert await queue.get("t1") is not None


def test_no_task_queue_may_take_the_registrys_name() -> None:
    import pytest

    from mongoq import InvalidInput
    from mongoq.testing import memory_database

    with pytest.raises(InvalidInput) as error:
        AsyncTaskQueue(memory_database(), REGISTRY)
    assert error.value.field == "name"


async def test_a_registry_the_server_refuses_to_write_never_stops_a_set_up(
    db: Any, clock: ManualClock, caplog: Any
) -> None:
    """A role without access to the registry: the set-up logs it and goes on (a worker's
    start-up does not depend on operators' tools)."""
    from mongoq.testing import FaultInjector, instrument

    faults = FaultInjector()
    faults.fail_before("update_one", collection=REGISTRY)
    queue = AsyncTaskQueue(instrument(db, faults), "emails", clock=clock)
    await queue.setup()
    assert len(faults.triggered) == 1
    assert await registered(db) == []
    assert any("could not record tasks 'emails'" in r.getMessage() for r in caplog.records)
    assert "claim" in await db["emails"].index_information()  # the set-up itself was done
