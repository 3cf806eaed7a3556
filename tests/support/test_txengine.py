"""The test-only transactional engine (tests/support/txengine.py): PyMongo-async shaped, rolls
back."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pymongo import ASCENDING, DESCENDING, IndexModel, InsertOne, UpdateOne
from pymongo.errors import (
    BulkWriteError,
    CollectionInvalid,
    DuplicateKeyError,
    InvalidOperation,
    NetworkTimeout,
    OperationFailure,
)

from mongoq import _driver
from tests.support.txengine import TxDatabase, TxSession, transactional_database


class Boom(Exception):
    pass


@pytest.fixture
def db() -> TxDatabase:
    return transactional_database()


async def ids(db: TxDatabase, name: str) -> list[Any]:
    return [doc["_id"] for doc in await db[name].find({}, sort=[("_id", 1)]).to_list()]


async def test_shape(db: TxDatabase) -> None:
    assert db.name == "mongoq"
    assert transactional_database("other").name == "other"
    assert db.client["mongoq"] is db
    assert db.orders == db["orders"] == db.get_collection("orders")
    assert db["orders"].full_name == "mongoq.orders"
    assert db["orders"].database is db
    with pytest.raises(AttributeError):
        _ = db._private
    assert _driver.backend_of(db) is _driver.Backend.PYMONGO
    assert await _driver.supports_transactions(db)


async def test_committed_transaction_keeps_writes_in_two_collections(db: TxDatabase) -> None:
    async def work(session: TxSession) -> str:
        await db.orders.insert_one({"_id": 1}, session=session)
        await db.stock.update_one({"_id": "x"}, {"$inc": {"n": -1}}, upsert=True, session=session)
        return "done"

    async with db.client.start_session() as session:
        assert await session.with_transaction(work) == "done"
        assert not session.in_transaction
    assert session.has_ended
    assert await ids(db, "orders") == [1]
    assert await db.stock.find_one({"_id": "x"}) == {"_id": "x", "n": -1}


async def test_exception_in_with_transaction_rolls_back_two_collections(db: TxDatabase) -> None:
    await db.orders.insert_one({"_id": 0})
    await db.stock.insert_one({"_id": "x", "n": 5})

    async def work(session: TxSession) -> None:
        await db.orders.insert_many([{"_id": 1}, {"_id": 2}], session=session)
        await db.orders.delete_one({"_id": 0}, session=session)
        await db.stock.find_one_and_update({"_id": "x"}, {"$inc": {"n": -1}}, session=session)
        assert await ids(db, "orders") == [1, 2]  # no isolation: visible before the commit
        raise Boom

    session = db.client.start_session()
    with pytest.raises(Boom):
        await session.with_transaction(work)
    assert not session.in_transaction
    assert await ids(db, "orders") == [0]
    assert await db.stock.find_one({"_id": "x"}) == {"_id": "x", "n": 5}
    await session.end_session()


async def test_start_transaction_context_commits_and_aborts(db: TxDatabase) -> None:
    async with db.client.start_session() as session:
        assert not session.in_transaction
        async with await session.start_transaction():
            assert session.in_transaction
            await db.a.insert_one({"_id": 1}, session=session)
        assert not session.in_transaction

        with pytest.raises(Boom):
            async with await session.start_transaction():
                await db.a.insert_one({"_id": 2}, session=session)
                await db.b.insert_one({"_id": 2}, session=session)
                raise Boom
        assert not session.in_transaction

        await session.start_transaction()
        with pytest.raises(InvalidOperation):
            await session.start_transaction()
        await db.a.insert_one({"_id": 3}, session=session)
        await session.abort_transaction()
        await session.start_transaction()
        await db.a.insert_one({"_id": 4}, session=session)
        await session.commit_transaction()
        with pytest.raises(InvalidOperation):
            await session.commit_transaction()
    assert await ids(db, "a") == [1, 4]
    assert await ids(db, "b") == []


async def test_leaving_a_session_aborts_its_open_transaction(db: TxDatabase) -> None:
    async with db.client.start_session() as session:
        await session.start_transaction()
        await db.a.insert_one({"_id": 1}, session=session)
    assert session.has_ended and not session.in_transaction
    assert await ids(db, "a") == []
    with pytest.raises(InvalidOperation):
        await db.a.insert_one({"_id": 2}, session=session)


async def test_reads_accept_a_session(db: TxDatabase) -> None:
    await db.a.insert_many([{"_id": 1, "k": "x"}, {"_id": 2, "k": "y"}])
    async with db.client.start_session() as session, await session.start_transaction():
        assert await db.a.count_documents({}, session=session) == 2
        assert await db.a.estimated_document_count(session=session) == 2
        assert sorted(await db.a.distinct("k", session=session)) == ["x", "y"]
        assert await db.a.find_one({"_id": 2}, session=session) == {"_id": 2, "k": "y"}
        assert len(await db.a.find({}, session=session).to_list()) == 2


async def test_errors_are_pymongo_classes(db: TxDatabase) -> None:
    await db.a.insert_one({"_id": 1})
    with pytest.raises(DuplicateKeyError) as dup:
        await db.a.insert_one({"_id": 1})
    assert type(dup.value) is DuplicateKeyError and dup.value.code == 11000
    with pytest.raises(BulkWriteError) as bulk:
        await db.a.bulk_write([InsertOne({"_id": 2}), InsertOne({"_id": 1})])
    assert type(bulk.value) is BulkWriteError
    assert bulk.value.details["writeErrors"][0]["code"] == 11000
    assert bulk.value.details["nInserted"] == 1


async def test_duplicate_key_inside_a_transaction_rolls_back(db: TxDatabase) -> None:
    await db.a.create_index("k", unique=True)
    await db.a.insert_one({"_id": 1, "k": 1})

    async def work(session: TxSession) -> None:
        await db.a.insert_one({"_id": 2, "k": 2}, session=session)
        await db.a.insert_one({"_id": 3, "k": 1}, session=session)

    session = db.client.start_session()
    with pytest.raises(DuplicateKeyError):
        await session.with_transaction(work)
    assert await ids(db, "a") == [1]


def assert_no_such_transaction(error: BaseException) -> None:
    assert type(error) is OperationFailure
    assert error.code == 251 and (error.details or {}).get("codeName") == "NoSuchTransaction"
    assert error.has_error_label("TransientTransactionError")


async def transaction_over_one(db: TxDatabase) -> TxSession:
    """A session with a transaction started, once _id 1 is stored in ``a`` for a write in it
    to collide with. Leaving the session (``async with``) ends it."""
    await db.a.insert_one({"_id": 1})
    session = db.client.start_session()
    await session.start_transaction()
    return session


async def test_a_swallowed_duplicate_key_aborts_the_transaction_as_on_a_server(
    db: TxDatabase,
) -> None:
    async with await transaction_over_one(db) as session:
        await db.a.insert_one({"_id": 2}, session=session)
        await db.b.insert_one({"_id": 2}, session=session)
        with pytest.raises(DuplicateKeyError) as dup:
            await db.a.insert_one({"_id": 1}, session=session)
        assert not dup.value.has_error_label("TransientTransactionError")  # as a server's
        # Aborted at once: its writes are undone, its collections free for other writers.
        assert (await ids(db, "a"), await ids(db, "b")) == ([1], [])
        await db.a.insert_one({"_id": 3})
        async with db.client.start_session() as other, await other.start_transaction():
            await db.b.insert_one({"_id": "other"}, session=other)
        # The client still thinks it is open; every later command in it fails.
        assert session.in_transaction
        for command in (
            db.a.insert_one({"_id": 4}, session=session),
            db.a.find_one({"_id": 1}, session=session),
            db.b.delete_many({}, session=session),
            db.command("ping", session=session),
        ):
            with pytest.raises(OperationFailure) as later:
                await command
            assert_no_such_transaction(later.value)
        with pytest.raises(InvalidOperation):
            await session.start_transaction()
        with pytest.raises(OperationFailure) as commit:
            await session.commit_transaction()
        assert_no_such_transaction(commit.value)
        assert not session.in_transaction
        # The session works again for the next transaction.
        async with await session.start_transaction():
            await db.a.insert_one({"_id": 5}, session=session)
    assert (await ids(db, "a"), await ids(db, "b")) == ([1, 3, 5], ["other"])


async def test_a_swallowed_bulk_write_error_aborts_and_an_abort_then_succeeds(
    db: TxDatabase,
) -> None:
    async with await transaction_over_one(db) as session:
        with pytest.raises(BulkWriteError):
            await db.a.insert_many(
                [{"_id": 2}, {"_id": 1}, {"_id": 3}], ordered=False, session=session
            )
        assert await ids(db, "a") == [1]  # 2 and 3 were inserted, then rolled back
        await session.abort_transaction()  # PyMongo ignores the server's NoSuchTransaction
        assert not session.in_transaction
        await session.start_transaction()
        with pytest.raises(DuplicateKeyError):
            await db.a.update_one({"_id": 9}, {"$set": {"_id": 1}}, upsert=True, session=session)
    assert not session.in_transaction and await ids(db, "a") == [1]  # ending it cleared it


async def test_a_write_error_outside_a_transaction_leaves_the_session_usable(
    db: TxDatabase,
) -> None:
    await db.a.insert_one({"_id": 1})
    async with db.client.start_session() as session:
        with pytest.raises(DuplicateKeyError):
            await db.a.insert_one({"_id": 1}, session=session)
        await db.a.insert_one({"_id": 2}, session=session)
        assert await db.a.find_one({"_id": 2}, session=session) == {"_id": 2}
    assert await ids(db, "a") == [1, 2]


class Swallowing:
    """A transaction callback that inserts ``try{n}`` on its n-th attempt, then, on the attempts
    up to `swallows` (all when None), inserts the existing _id 1 and catches the
    DuplicateKeyError without re-raising it. Expects _id 1 in collection ``a``."""

    def __init__(self, db: TxDatabase, swallows: int | None = None) -> None:
        self.db = db
        self.swallows = swallows
        self.attempts = 0

    async def __call__(self, session: TxSession) -> str:
        self.attempts += 1
        await self.db.a.insert_one({"_id": f"try{self.attempts}"}, session=session)
        if self.swallows is None or self.attempts <= self.swallows:
            with pytest.raises(DuplicateKeyError):  # caught, not re-raised
                await self.db.a.insert_one({"_id": 1}, session=session)
        return "committed"


async def test_with_transaction_swallowing_a_write_error_gives_up_after_max_attempts() -> None:
    """The commit fails with NoSuchTransaction, which with_transaction retries: on a server
    until its 120 s run out; here after `max_attempts`, raising what PyMongo raises then."""
    db = transactional_database(max_attempts=3)
    await db.a.insert_one({"_id": 1})
    swallowing = Swallowing(db)

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(NetworkTimeout) as gave_up:
        await _driver.run_in_transaction(db, swallowing)
    assert loop.time() - started < 5
    assert swallowing.attempts == 3
    assert gave_up.value.has_error_label("TransientTransactionError")
    assert gave_up.value.__cause__ is not None
    assert_no_such_transaction(gave_up.value.__cause__)
    assert await ids(db, "a") == [1]

    db.client.retry_time_limit = 0  # the time limit binds too
    swallowing.attempts = 0
    with pytest.raises(NetworkTimeout):
        await _driver.run_in_transaction(db, swallowing)
    assert swallowing.attempts == 1


async def test_with_transaction_retries_a_transient_commit_failure(db: TxDatabase) -> None:
    await db.a.insert_one({"_id": 1})
    first_swallows = Swallowing(db, swallows=1)

    assert await _driver.run_in_transaction(db, first_swallows) == "committed"
    assert first_swallows.attempts == 2
    assert await ids(db, "a") == [1, "try2"]


async def test_bulk_write_with_update_one(db: TxDatabase) -> None:
    await db.a.insert_many([{"_id": 1, "n": 0}, {"_id": 2, "n": 0}])
    result = await db.a.bulk_write(
        [
            UpdateOne({"_id": 1}, {"$inc": {"n": 1}}),
            UpdateOne({"_id": 3}, {"$set": {"n": 7}}, upsert=True),
        ],
        ordered=False,
    )
    assert (result.matched_count, result.modified_count, result.upserted_count) == (1, 1, 1)
    assert await db.a.find({}, sort=[("_id", 1)]).to_list() == [
        {"_id": 1, "n": 1},
        {"_id": 2, "n": 0},
        {"_id": 3, "n": 7},
    ]


async def test_find_sort_limit_hint_and_to_list(db: TxDatabase) -> None:
    await db.a.insert_many([{"_id": i, "p": i % 3} for i in range(10)])
    await db.a.create_index([("p", DESCENDING), ("_id", ASCENDING)], name="p_id")
    cursor = db.a.find({"p": {"$gt": 0}}, {"_id": 1}).sort([("p", -1), ("_id", 1)])
    cursor = cursor.skip(1).limit(4).hint("p_id").batch_size(2).max_time_ms(1000)
    assert await cursor.to_list(None) == [{"_id": 5}, {"_id": 8}, {"_id": 1}, {"_id": 4}]

    cursor = db.a.find({}, sort=[("_id", -1)], limit=6)
    assert await cursor.to_list(2) == [{"_id": 9, "p": 0}, {"_id": 8, "p": 2}]
    assert [doc["_id"] async for doc in cursor] == [7, 6, 5, 4]
    assert await cursor.to_list() == []
    with pytest.raises(ValueError):
        await db.a.find({}).to_list(0)
    assert await _driver.find_list(db.a, {"p": 0}, sort=[("_id", -1)], limit=2, hint="p_id") == [
        {"_id": 9, "p": 0},
        {"_id": 6, "p": 0},
    ]


async def test_aggregate(db: TxDatabase) -> None:
    await db.a.insert_many([{"_id": i, "p": i % 3} for i in range(10)])
    pipeline: list[dict[str, Any]] = [
        {"$group": {"_id": "$p", "n": {"$sum": 1}}},
        {"$sort": {"_id": 1}},
    ]
    cursor = await db.a.aggregate(pipeline)
    assert await cursor.to_list() == [{"_id": 0, "n": 4}, {"_id": 1, "n": 3}, {"_id": 2, "n": 3}]
    cursor = await db.a.aggregate(pipeline)
    assert [doc["_id"] async for doc in cursor] == [0, 1, 2]
    assert await _driver.aggregate_list(db.a, [{"$count": "n"}]) == [{"n": 10}]


async def test_indexes(db: TxDatabase) -> None:
    # mongomock-ng: a collection without documents, indexes or create_collection is not listed
    await db.a.insert_one({})
    await db.a.create_indexes([IndexModel([("k", 1)], name="k"), IndexModel([("j", -1)])])
    assert set(await db.a.index_information()) == {"_id_", "k", "j_-1"}
    assert [spec["name"] async for spec in await db.a.list_indexes()] == ["_id_", "k", "j_-1"]
    await db.a.drop_index("k")
    assert set(await db.a.index_information()) == {"_id_", "j_-1"}
    await db.a.drop_indexes()
    assert set(await db.a.index_information()) == {"_id_"}


async def test_partial_ttl_index_is_declared_but_never_expires(db: TxDatabase) -> None:
    old = datetime(2000, 1, 1)
    await db.a.insert_many([{"_id": 1, "s": "live", "at": old}, {"_id": 2, "s": "dead", "at": old}])
    assert await _driver.create_partial_ttl_index(
        db, db.a, "at", name="ttl", expire_after=60, partial={"s": "dead"}
    )
    info = await db.a.index_information()
    assert info["ttl"]["expireAfterSeconds"] == 60
    assert info["ttl"]["partialFilterExpression"] == {"s": "dead"}
    assert await ids(db, "a") == [1, 2]  # mongomock-ng would delete both


async def test_commands(db: TxDatabase) -> None:
    for name in ("ping", "hello"):
        reply = await db.command(name)
        assert reply["ok"] == 1.0 and reply["isWritablePrimary"] is True
        assert reply["localTime"].tzinfo is None
        assert abs(reply["localTime"] - datetime.now(UTC).replace(tzinfo=None)) < timedelta(
            seconds=5
        )
    assert (await db.command({"ping": 1}))["ok"] == 1.0
    assert isinstance(await _driver.server_local_time(db), datetime)
    with pytest.raises(OperationFailure) as failure:
        await db.command("buildInfo")
    assert failure.value.code == 59


async def test_collections_and_databases(db: TxDatabase) -> None:
    await db.create_collection("a")
    with pytest.raises(CollectionInvalid):
        await db.create_collection("a")
    with pytest.raises(OperationFailure) as exists:
        await db.create_collection("a", check_exists=False)
    assert exists.value.code == 48
    await db.b.insert_one({})
    assert sorted(await db.list_collection_names()) == ["a", "b"]
    await db.drop_collection("a")
    await db.b.drop()
    assert await db.list_collection_names() == []
    await db.c.insert_one({})
    await db.client.drop_database(db.name)
    assert await db.list_collection_names() == []
    await db.client.close()


async def test_driver_create_collections_is_idempotent(db: TxDatabase) -> None:
    await _driver.create_collections(db, ["a", "b"])
    await _driver.create_collections(db, ["a", "b"])
    assert sorted(await db.list_collection_names()) == ["a", "b"]


async def test_driver_run_in_transaction(db: TxDatabase) -> None:
    async def work(session: TxSession) -> int:
        assert session.in_transaction
        await db.a.insert_one({"_id": 1}, session=session)
        await db.b.insert_one({"_id": 1}, session=session)
        return 7

    assert await _driver.run_in_transaction(db, work) == 7
    assert (await ids(db, "a"), await ids(db, "b")) == ([1], [1])

    async def failing(session: TxSession) -> int:
        await db.a.insert_one({"_id": 2}, session=session)
        await db.b.delete_one({"_id": 1}, session=session)
        raise Boom

    with pytest.raises(Boom):
        await _driver.run_in_transaction(db, failing)
    assert (await ids(db, "a"), await ids(db, "b")) == ([1], [1])


async def test_second_transaction_on_a_collection_gets_a_write_conflict(db: TxDatabase) -> None:
    # mongomock-ng shares one snapshot per collection between sessions: without the conflict,
    # `second` would overwrite `first`'s snapshot and an abort would restore the wrong state.
    first, second = db.client.start_session(), db.client.start_session()
    await first.start_transaction()
    await second.start_transaction()
    await db.a.insert_one({"_id": 1}, session=first)
    await db.b.insert_one({"_id": 2}, session=second)  # another collection: no conflict
    with pytest.raises(OperationFailure) as conflict:
        await db.a.insert_one({"_id": 2}, session=second)
    assert conflict.value.code == 112
    assert conflict.value.has_error_label("TransientTransactionError")
    await second.abort_transaction()
    await first.abort_transaction()
    assert (await ids(db, "a"), await ids(db, "b")) == ([], [])
    # once `first` ended, the collection is free again
    async with await second.start_transaction():
        await db.a.insert_one({"_id": 3}, session=second)
    assert await ids(db, "a") == [3]


async def test_with_transaction_retries_write_conflicts(db: TxDatabase) -> None:
    entered = asyncio.Event()
    release = asyncio.Event()
    attempts: list[str] = []

    async def slow(session: TxSession) -> None:
        attempts.append("slow")
        await db.a.insert_one({"_id": "slow"}, session=session)
        entered.set()
        await release.wait()

    async def fast(session: TxSession) -> None:
        attempts.append("fast")
        release.set()  # `slow` commits while this attempt backs off after its conflict
        await db.a.insert_one({"_id": "fast"}, session=session)

    slow_task = asyncio.create_task(_driver.run_in_transaction(db, slow))
    await entered.wait()
    await asyncio.wait_for(_driver.run_in_transaction(db, fast), 10)
    await slow_task
    assert attempts.count("slow") == 1 and attempts.count("fast") >= 2
    assert await ids(db, "a") == ["fast", "slow"]


async def test_with_transaction_lets_the_callback_end_the_transaction(db: TxDatabase) -> None:
    async def work(session: TxSession) -> str:
        await db.a.insert_one({"_id": 1}, session=session)
        await session.abort_transaction()
        return "aborted"

    async with db.client.start_session() as session:
        assert await session.with_transaction(work) == "aborted"
    assert await ids(db, "a") == []
