"""What a deployment decides for mongoq, and what mongoq decides for itself.

- Pinned concerns: every collection handle a primitive uses writes with majority write concern,
  reads majority-committed data from the primary, whatever the client's defaults (a URI's
  ``w=1`` would let a failover roll back an acknowledged claim: two holders).
- Topology: detected once per client with ``hello``; transactional features refuse a backend
  without transactions with an error naming the feature and the fix, before any write.

Runs on the embedded backend (a client whose defaults say secondaryPreferred) and, with
``MONGOQ_TEST_URI``, on the real server through a URI that says ``w=1&readPreference=
secondaryPreferred``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mongomock_motor import AsyncMongoMockClient
from pymongo import ReadPreference
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

import mongoq
from mongoq import AsyncGroupTransport, AsyncTaskQueue, MongoqError, NewMessage, NewTask, _driver
from mongoq._driver import Topology, topology_from_hello
from mongoq.outbox import AsyncOutbox, Event
from mongoq.testing import ManualClock, memory_database
from tests.conftest import SERVERS, TEST_URI
from tests.support.txengine import TxDatabase, transactional_database

LAX = "w=1&readPreference=secondaryPreferred"
TOPOLOGY_EXPECT = os.environ.get("MONGOQ_TEST_TOPOLOGY_EXPECT")


def _with_options(uri: str, options: str) -> str:
    base, _, query = uri.partition("?")
    if options in query:  # the CI job's URI says so already
        return uri
    return f"{base}?{query}&{options}" if query else f"{base.rstrip('/')}/?{options}"


@pytest.fixture(params=["memory", *SERVERS])
async def lax_db(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A database whose client defaults are single-node writes and secondary reads."""
    if request.param == "memory":
        client = AsyncMongoMockClient(read_preference=ReadPreference.SECONDARY_PREFERRED)
        yield client["lax"]
        return
    assert TEST_URI is not None
    name = f"mongoq_test_{uuid.uuid4().hex[:10]}"
    database = mongoq.connect(_with_options(TEST_URI, LAX), name, driver=request.param)
    assert database.client.write_concern == WriteConcern(w=1)  # the URI's default took effect
    try:
        yield database
    finally:
        await database.client.drop_database(name)
        await _driver.close(database)


def handles(primitive: Any) -> dict[str, Any]:
    """The collection handles a primitive keeps, by attribute name."""
    return {
        name: value
        for name, value in vars(primitive).items()
        if value is not primitive.db  # a database answers every attribute with a collection
        and hasattr(value, "write_concern")
        and hasattr(value, "find_one_and_update")
    }


async def test_every_collection_handle_pins_majority_writes_and_primary_reads(
    lax_db: Any,
) -> None:
    assert lax_db.read_preference == ReadPreference.SECONDARY_PREFERRED
    clock = ManualClock()
    queue = AsyncTaskQueue(lax_db, "tasks", clock=clock)
    transport = AsyncGroupTransport(lax_db, "groups", clock=clock)
    outbox = AsyncOutbox(lax_db, subscriptions={"order.placed": ["h"]}, clock=clock)
    found = {
        "queue": handles(queue),
        "transport": handles(transport),
        "outbox": handles(outbox),
    }
    assert set(found["queue"]) == {"collection"}
    assert set(found["transport"]) == {"messages", "locks", "counters", "dead"}
    assert set(found["outbox"]) == {"events", "deliveries", "sequences", "lanes", "history"}
    for primitive, collections in found.items():
        for name, collection in collections.items():
            where = f"{primitive}.{name}"
            assert collection.write_concern == WriteConcern(w="majority"), where
            assert collection.read_preference == ReadPreference.PRIMARY, where
            assert collection.read_concern == ReadConcern("majority"), where

    # And the pinned handles work end to end on that client.
    await queue.setup()
    await transport.setup()
    await outbox.setup()
    await queue.put_many([NewTask("t1", 1)])
    [task] = await queue.claim_many(5, "w")
    assert await queue.complete(task, "ok")
    await transport.publish_many([NewMessage("g", "e")])
    [lease] = await transport.claim_many(5, "w")
    assert await transport.ack(lease)
    await outbox.publish(Event(type="order.placed", payload={"n": 1}, id="e1"), session=None)
    [delivery] = await outbox.claim("w")
    assert await outbox.complete(delivery)
    stored = await lax_db["tasks"].find_one({"_id": "t1"})
    assert (stored["status"], stored["result"]) == ("done", "ok")
    assert await lax_db["groups_messages"].count_documents({}) == 0
    assert await lax_db["mongoq_outbox_deliveries"].count_documents({}) == 0


def test_transactions_mongoq_starts_are_snapshot_majority_primary_and_bounded() -> None:
    options = _driver.transaction_options()
    assert options["read_concern"] == ReadConcern("snapshot")
    assert options["write_concern"] == WriteConcern(w="majority")
    assert options["read_preference"] == ReadPreference.PRIMARY
    assert 0 < options["max_commit_time_ms"] <= 60_000


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ({"isWritablePrimary": True, "ok": 1.0}, Topology.STANDALONE),
        ({"isWritablePrimary": True, "setName": "rs0", "hosts": ["a:27017"]}, Topology.REPLICA_SET),
        ({"secondary": True, "setName": "rs0"}, Topology.REPLICA_SET),
        ({"isWritablePrimary": True, "msg": "isdbgrid"}, Topology.SHARDED),
    ],
)
def test_topology_is_read_from_hello(reply: dict[str, Any], expected: Topology) -> None:
    assert topology_from_hello(reply) is expected


async def test_the_embedded_backend_has_no_transactions() -> None:
    db = memory_database()
    assert await _driver.topology(db) is Topology.EMBEDDED
    assert await _driver.supports_transactions(db) is False
    with pytest.raises(MongoqError, match=r"purge.*replica set.*--replSet"):
        await _driver.require_transactions(db, "purge")


class _StartedTransaction:
    """Stands for a user's session with a transaction started (as PyMongo reports it before
    its first command reaches a server that has no transactions)."""

    in_transaction = True


async def test_a_transactional_publish_without_transactions_is_refused_before_any_write(
    db: Any,
) -> None:
    if await _driver.supports_transactions(db):
        pytest.skip("this backend has transactions; see the standalone job of the server CI")
    outbox = AsyncOutbox(db, subscriptions={"order.placed": ["h"]}, clock=ManualClock())
    await outbox.setup()
    with pytest.raises(MongoqError, match=r"publish\(session=\.\.\.\) needs multi-document"):
        await outbox.publish(Event(type="order.placed", id="e1"), session=_StartedTransaction())
    assert await db["mongoq_outbox_events"].count_documents({}) == 0
    assert await db["mongoq_outbox_deliveries"].count_documents({}) == 0
    assert await db["mongoq_outbox_key_sequences"].count_documents({}) == 0


async def test_the_topology_is_asked_once_per_client(db: Any) -> None:
    first = await _driver.topology(db)
    again = await _driver.topology(db)
    assert first is again
    if TOPOLOGY_EXPECT and first is not Topology.EMBEDDED:
        assert first.value == TOPOLOGY_EXPECT, f"the job expects {TOPOLOGY_EXPECT}, got {first}"


async def test_hello_is_sent_once_per_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the transactional test engine (which answers ``hello`` as a replica set): two
    questions, one command; a second client is asked again."""
    sent: list[Any] = []
    answer = TxDatabase.command

    async def counting(self: TxDatabase, command: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(command)
        return await answer(self, command, *args, **kwargs)

    monkeypatch.setattr(TxDatabase, "command", counting)
    db = transactional_database()
    assert await _driver.topology(db) is Topology.REPLICA_SET
    assert await _driver.supports_transactions(db) is True
    assert sent == ["hello"]
    assert await _driver.topology(transactional_database()) is Topology.REPLICA_SET
    assert sent == ["hello", "hello"]
