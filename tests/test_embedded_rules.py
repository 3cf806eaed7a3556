"""The embedded backend refuses what a MongoDB server refuses, with the server's class and code.

mongomock stores an 18 MiB document, ignores hints and has no sessions; `mongoq._embedded` makes
the backend `mongoq.connect()` gives (and `memory_database()`) refuse as a server does: documents
over 16 MiB (17419 / 17420, DocumentTooLarge, "object to insert too large"), hints to indexes that
do not exist (2, BadValue), transactions (20, IllegalOperation), arithmetic on a field that holds
no number (14, TypeMismatch). Each test asserts the refusal and
then what is stored. Tests on the `db` fixture run on both embedded lanes and, with
MONGOQ_TEST_URI, on a real replica set; the transaction tests use `memory_database()` directly
(a replica set has transactions). Bulk updates use `UpdateMany` filtered on ``_id`` (mongomock
rejects `UpdateOne` under pymongo >= 4.11; see `mongoq._driver`).

Server texts and codes differ between versions (8.0 prefixes update errors; newer servers refuse
a document past 16 MiB with 10334): on a server, refusals are matched on their codes as the
library matches them and on part of their text, never on a whole message.
"""

from __future__ import annotations

import inspect
from datetime import datetime
from typing import Any

import bson
import pytest
from pymongo import DeleteMany, InsertOne, ReadPreference, ReturnDocument, UpdateMany
from pymongo.errors import (
    BulkWriteError,
    DocumentTooLarge,
    InvalidOperation,
    OperationFailure,
    WriteError,
)
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from mongoq import _driver
from mongoq.testing import instrument, memory_database

MAX = 16 * 1024 * 1024
NINE_MIB = "x" * (9 * 1024 * 1024)
MISSING_INDEX = "hint provided does not correspond to an existing index"
NO_TRANSACTIONS = "Transaction numbers are only allowed on a replica set member or mongos"


def sized(document: dict[str, Any], size: int, field: str = "pad") -> dict[str, Any]:
    """`document` with a string `field` making it encode to exactly `size` bytes of BSON: just
    over the limit, its update or insert command still fits what PyMongo sends (16 MiB + 16 KiB),
    so the server itself is the one to refuse it."""
    base = len(bson.encode({**document, field: ""}))
    padded = {**document, field: "x" * (size - base)}
    assert len(bson.encode(padded)) == size
    return padded


def is_memory(db: Any) -> bool:
    return _driver.backend_of(db) is _driver.Backend.MEMORY


async def stored(db: Any, name: str = "c") -> dict[Any, dict[str, Any]]:
    return {doc["_id"]: doc for doc in await db[name].find({}).to_list(None)}


async def aggregate(collection: Any, pipeline: list[Any], **options: Any) -> list[Any]:
    # Awaited in PyMongo async, a lazy cursor in Motor: the refusal may come from either step.
    cursor = collection.aggregate(pipeline, **options)
    if inspect.isawaitable(cursor):
        cursor = await cursor
    return list(await cursor.to_list(None))


# ------------------------------------------------------------------------------ document size

UPDATE_TOO_LARGE = "Resulting document after update is larger than 16777216"
UPSERT_TOO_LARGE = "Document to upsert is larger than 16777216"


def too_large_entry(
    code: Any, message: str, expected: int, *, embedded: bool, text: str | None = None
) -> None:
    """A write error's `code` and `message` are the 16 MiB refusal `expected` names (17419:
    an update's result, 17420: an upsert's insert).

    The embedded backend answers `expected` as MongoDB 6.0 to 8.0 do; a server may answer any
    code the library takes for this refusal (`_driver.TOO_LARGE_CODES`: newer servers say
    10334, in other words). The text is matched in part, and only beside its own code: 8.0
    prefixes update errors with "Plan executor error during update :: caused by :: "."""
    assert code in _driver.TOO_LARGE_CODES, (code, message)
    if embedded:
        assert code == expected, (code, message)
    if text is not None and code == expected:
        assert text in message, message


def too_large(
    error: BaseException, expected: int, *, embedded: bool, text: str | None = None
) -> None:
    """`error` is the 16 MiB refusal `expected` names (see `too_large_entry`)."""
    assert isinstance(error, OperationFailure), error
    too_large_entry(error.code, str(error), expected, embedded=embedded, text=text)


#: An update past 16 MiB as servers refuse it, recorded: MongoDB 6.0 and 7.0; 8.0, which
#: prefixes its update errors; a newer server, which raises 10334 (the BSON object's size).
RECORDED_UPDATE_REFUSALS = [
    {"index": 0, "code": 17419, "errmsg": UPDATE_TOO_LARGE},
    {
        "index": 0, "code": 17419,
        "errmsg": f"Plan executor error during update :: caused by :: {UPDATE_TOO_LARGE}",
    },
    {
        "index": 0, "code": 10334,
        "errmsg": "BSONObj size: 16777229 (0x100000D) is invalid. Size must be between 0 and "
        "16793600(16MB) First element: _id: 1",
    },
]  # fmt: skip


@pytest.mark.parametrize("entry", RECORDED_UPDATE_REFUSALS, ids=["6.0-7.0", "8.0", "newer"])
def test_every_servers_refusal_of_an_update_past_16_mib_is_recognised(
    entry: dict[str, Any],
) -> None:
    too_large_entry(entry["code"], entry["errmsg"], 17419, embedded=False, text=UPDATE_TOO_LARGE)
    error = WriteError(entry["errmsg"], entry["code"], entry)
    too_large(error, 17419, embedded=False, text=UPDATE_TOO_LARGE)
    assert _driver.too_large(error)  # the library's own matcher, which these checks share


async def test_an_update_past_16_mib_is_refused_and_the_document_kept(db: Any) -> None:
    await db["c"].insert_one({"_id": 1, "a": NINE_MIB})
    with pytest.raises(WriteError) as refused:
        await db["c"].update_one({"_id": 1}, {"$set": {"b": NINE_MIB}})
    too_large(refused.value, 17419, embedded=is_memory(db), text=UPDATE_TOO_LARGE)
    assert (await stored(db)) == {1: {"_id": 1, "a": NINE_MIB}}


async def test_a_replacement_past_16_mib_is_refused_and_the_document_kept(db: Any) -> None:
    await db["c"].insert_one({"_id": 1, "a": "small"})
    replacement = sized({"b": 1}, MAX + 1)  # with its _id, the result passes the limit
    with pytest.raises(WriteError) as refused:
        await db["c"].replace_one({"_id": 1}, replacement)
    too_large(refused.value, 17419, embedded=is_memory(db))
    assert (await stored(db)) == {1: {"_id": 1, "a": "small"}}


async def test_a_document_of_exactly_16_mib_is_accepted(db: Any) -> None:
    await db["c"].insert_one({"_id": 1})
    result = sized({"_id": 1}, MAX)
    await db["c"].replace_one({"_id": 1}, {k: v for k, v in result.items() if k != "_id"})
    assert len(bson.encode((await stored(db))[1])) == MAX


async def test_update_many_stops_at_the_document_that_would_pass_16_mib(db: Any) -> None:
    await db["c"].insert_many(
        [{"_id": 1, "a": "small"}, {"_id": 2, "a": NINE_MIB}, {"_id": 3, "a": "small"}]
    )
    with pytest.raises(WriteError) as refused:
        await db["c"].update_many({}, {"$set": {"b": NINE_MIB}})
    too_large(refused.value, 17419, embedded=is_memory(db))
    after = await stored(db)
    assert after[2] == {"_id": 2, "a": NINE_MIB}  # the failing one is left as it was
    for doc_id in (1, 3):  # the others: wholly updated or not at all, as on a server
        assert after[doc_id] in (
            {"_id": doc_id, "a": "small"},
            {"_id": doc_id, "a": "small", "b": NINE_MIB},
        )
    if is_memory(db):  # natural order: the one before stays updated, the one after is not reached
        assert "b" in after[1] and "b" not in after[3]


async def test_an_upsert_past_16_mib_is_refused_and_nothing_inserted(db: Any) -> None:
    document = sized({"_id": "new"}, MAX + 1)
    with pytest.raises(WriteError) as refused:
        await db["c"].update_one({"_id": "new"}, {"$set": {"pad": document["pad"]}}, upsert=True)
    too_large(refused.value, 17420, embedded=is_memory(db), text=UPSERT_TOO_LARGE)
    assert (await stored(db)) == {}


async def test_find_one_and_update_past_16_mib_is_a_command_error(db: Any) -> None:
    await db["c"].insert_one({"_id": 1, "a": NINE_MIB})
    with pytest.raises(OperationFailure) as refused:
        await db["c"].find_one_and_update(
            {"_id": 1}, {"$set": {"b": NINE_MIB}}, return_document=ReturnDocument.AFTER
        )
    too_large(refused.value, 17419, embedded=is_memory(db))
    assert not isinstance(refused.value, WriteError)  # findAndModify fails as a command
    with pytest.raises(OperationFailure) as replaced:
        await db["c"].find_one_and_replace({"_id": 1}, sized({"b": 1}, MAX + 1))
    too_large(replaced.value, 17419, embedded=is_memory(db))
    assert not isinstance(replaced.value, WriteError)
    assert (await stored(db)) == {1: {"_id": 1, "a": NINE_MIB}}


async def test_find_one_and_update_upserting_past_16_mib_is_refused(db: Any) -> None:
    pad = sized({"_id": "new"}, MAX + 1)["pad"]
    with pytest.raises(OperationFailure) as refused:
        await db["c"].find_one_and_update({"_id": "new"}, {"$set": {"pad": pad}}, upsert=True)
    too_large(refused.value, 17420, embedded=is_memory(db))
    assert not isinstance(refused.value, WriteError)
    assert (await stored(db)) == {}


@pytest.mark.parametrize("ordered", [True, False])
async def test_bulk_write_reports_the_oversized_update_at_its_index(db: Any, ordered: bool) -> None:
    await db["c"].insert_many([{"_id": 1, "a": NINE_MIB}, {"_id": 2, "n": 0}])
    pad = sized({"_id": "new"}, MAX + 1)["pad"]
    ops = [
        UpdateMany({"_id": 2}, {"$set": {"n": 1}}),
        UpdateMany({"_id": 1}, {"$set": {"b": NINE_MIB}}),  # refused: 17419
        UpdateMany({"_id": 2}, {"$inc": {"n": 1}}),
        UpdateMany({"_id": "new"}, {"$set": {"pad": pad}}, upsert=True),  # refused: 17420
    ]
    with pytest.raises(BulkWriteError) as refused:
        await db["c"].bulk_write(ops, ordered=ordered)
    errors = refused.value.details["writeErrors"]
    assert [error["index"] for error in errors] == ([1] if ordered else [1, 3])
    expected = [(17419, UPDATE_TOO_LARGE), (17420, UPSERT_TOO_LARGE)]
    for error, (code, text) in zip(errors, expected, strict=False):
        too_large_entry(error["code"], error["errmsg"], code, embedded=is_memory(db), text=text)
    after = await stored(db)
    assert after[1] == {"_id": 1, "a": NINE_MIB}
    assert after[2]["n"] == (1 if ordered else 2)  # ordered stops at the first error
    assert "new" not in after


async def test_insert_one_of_18_mib_is_refused_before_sending(db: Any) -> None:
    with pytest.raises(DocumentTooLarge):
        await db["c"].insert_one({"_id": 1, "a": NINE_MIB, "b": NINE_MIB})
    assert (await stored(db)) == {}


async def test_insert_one_just_over_16_mib_is_refused_by_the_server(db: Any) -> None:
    # Within PyMongo's 16 KiB of command overhead, the document is sent; the server refuses it.
    with pytest.raises(WriteError) as refused:
        await db["c"].insert_one(sized({"_id": 1}, MAX + 1))
    assert refused.value.code == 2
    assert "object to insert too large" in str(refused.value)
    assert (await stored(db)) == {}


@pytest.mark.parametrize("ordered", [True, False])
async def test_insert_many_refuses_the_oversized_document_only(db: Any, ordered: bool) -> None:
    # PyMongo sends an acknowledged batch whatever its documents' sizes: the server answers with
    # a write error for each document over the limit.
    documents = [{"_id": 1}, sized({"_id": 2}, MAX + 1), {"_id": 3}]
    with pytest.raises(BulkWriteError) as refused:
        await db["c"].insert_many(documents, ordered=ordered)
    [error] = refused.value.details["writeErrors"]
    assert (error["index"], error["code"]) == (1, 2)
    assert "object to insert too large" in error["errmsg"]
    assert refused.value.details["nInserted"] == (1 if ordered else 2)
    assert sorted(await stored(db)) == ([1] if ordered else [1, 3])


async def test_bulk_insert_one_over_the_limit_is_a_write_error(db: Any) -> None:
    ops = [InsertOne({"_id": 1}), InsertOne(sized({"_id": 2}, MAX + 1)), InsertOne({"_id": 3})]
    with pytest.raises(BulkWriteError) as refused:
        await db["c"].bulk_write(ops, ordered=False)
    [error] = refused.value.details["writeErrors"]
    assert (error["index"], error["code"]) == (1, 2)
    assert sorted(await stored(db)) == [1, 3]


async def test_a_write_that_fits_still_goes_through(db: Any) -> None:
    await db["c"].insert_one({"_id": 1, "a": NINE_MIB})
    await db["c"].update_one({"_id": 1}, {"$set": {"b": "x" * (6 * 1024 * 1024)}})
    await db["c"].update_one({"_id": 2}, {"$set": {"a": NINE_MIB}}, upsert=True)
    after = await stored(db)
    assert len(after[1]["b"]) == 6 * 1024 * 1024 and after[2]["a"] == NINE_MIB


# ------------------------------------------------------------------------------------- hints


async def indexed(db: Any) -> Any:
    """A collection with documents and one secondary index, ``by_a`` on ``{a: 1}``."""
    collection = db["c"]
    await collection.insert_many([{"_id": i, "a": i} for i in range(3)])
    await collection.create_index([("a", 1)], name="by_a")
    return collection


def refused_hint(error: BaseException) -> bool:
    return isinstance(error, OperationFailure) and error.code == 2 and MISSING_INDEX in str(error)


@pytest.mark.parametrize("hint", ["missing", [("b", 1)], [("a", -1)], {"a": 1, "b": 1}])
async def test_find_with_a_hint_to_a_missing_index_is_refused(db: Any, hint: Any) -> None:
    collection = await indexed(db)
    with pytest.raises(OperationFailure) as refused:
        await collection.find({"a": {"$gte": 0}}).hint(hint).to_list(None)
    assert refused_hint(refused.value) and not isinstance(refused.value, WriteError)
    with pytest.raises(OperationFailure) as kwarg:
        await collection.find({}, hint=hint).to_list(None)
    assert refused_hint(kwarg.value)
    with pytest.raises(OperationFailure) as one:
        await collection.find_one({}, hint=hint)
    assert refused_hint(one.value)


@pytest.mark.parametrize(
    "hint", ["by_a", [("a", 1)], {"a": 1}, "_id_", [("_id", 1)], [("$natural", 1)]]
)
async def test_find_with_a_hint_to_an_existing_index_runs(db: Any, hint: Any) -> None:
    collection = await indexed(db)
    found = await collection.find({"a": {"$gte": 1}}).hint(hint).to_list(None)
    assert sorted(doc["_id"] for doc in found) == [1, 2]
    assert len(await collection.find({}, hint=hint).to_list(None)) == 3


async def test_aggregate_and_count_check_their_hint(db: Any) -> None:
    collection = await indexed(db)
    pipeline = [{"$match": {"a": {"$gte": 1}}}, {"$sort": {"a": 1}}]
    with pytest.raises(OperationFailure) as refused:
        await aggregate(collection, pipeline, hint="missing")
    assert refused_hint(refused.value)
    assert [doc["_id"] for doc in await aggregate(collection, pipeline, hint="by_a")] == [1, 2]
    with pytest.raises(OperationFailure) as counted:
        await collection.count_documents({"a": 1}, hint="missing")
    assert refused_hint(counted.value)
    assert await collection.count_documents({"a": {"$gte": 1}}, hint="by_a") == 2
    assert await collection.count_documents({}, hint=[("a", 1)]) == 3


async def test_find_one_and_modify_check_their_hint(db: Any) -> None:
    collection = await indexed(db)
    calls = [
        lambda hint: collection.find_one_and_update({"a": 1}, {"$set": {"x": 1}}, hint=hint),
        lambda hint: collection.find_one_and_replace({"a": 1}, {"a": 1, "x": 1}, hint=hint),
        lambda hint: collection.find_one_and_delete({"a": 1}, hint=hint),
    ]
    for call in calls:
        with pytest.raises(OperationFailure) as refused:
            await call("missing")
        assert refused_hint(refused.value) and not isinstance(refused.value, WriteError)
    assert (await stored(db))[1] == {"_id": 1, "a": 1}  # nothing changed
    updated = await collection.find_one_and_update(
        {"a": 1}, {"$set": {"x": 1}}, hint="by_a", return_document=ReturnDocument.AFTER
    )
    assert updated == {"_id": 1, "a": 1, "x": 1}
    assert await collection.find_one_and_delete({"a": 1}, hint=[("a", 1)]) is not None


async def test_updates_and_deletes_check_their_hint(db: Any) -> None:
    collection = await indexed(db)
    writes = [
        lambda hint: collection.update_one({"a": 1}, {"$set": {"x": 1}}, hint=hint),
        lambda hint: collection.update_many({}, {"$set": {"x": 1}}, hint=hint),
        lambda hint: collection.replace_one({"a": 1}, {"a": 1, "x": 1}, hint=hint),
        lambda hint: collection.update_one({"_id": 9}, {"$set": {"a": 9}}, upsert=True, hint=hint),
        lambda hint: collection.delete_one({"a": 1}, hint=hint),
        lambda hint: collection.delete_many({}, hint=hint),
    ]
    before = await stored(db)
    for write in writes:
        with pytest.raises(WriteError) as refused:  # a write error in the server's reply
            await write("missing")
        assert refused_hint(refused.value)
    assert (await stored(db)) == before
    # Existing hints are accepted (mongomock itself refuses any hint on updates and deletes).
    assert (
        await collection.update_one({"a": 1}, {"$set": {"x": 1}}, hint="by_a")
    ).modified_count == 1
    assert (
        await collection.update_many({}, {"$set": {"y": 1}}, hint=[("a", 1)])
    ).modified_count == 3
    assert (await collection.replace_one({"a": 2}, {"a": 2}, hint="_id_")).matched_count == 1
    assert (await collection.delete_one({"a": 0}, hint={"a": 1})).deleted_count == 1
    assert (await collection.delete_many({}, hint="by_a")).deleted_count == 2


async def test_bulk_write_reports_refused_hints_as_write_errors(db: Any) -> None:
    collection = await indexed(db)
    ops = [
        UpdateMany({"_id": 0}, {"$set": {"x": 1}}, hint="missing"),
        UpdateMany({"_id": 1}, {"$set": {"x": 1}}, hint="by_a"),
        DeleteMany({"_id": 2}, hint="missing"),
    ]
    with pytest.raises(BulkWriteError) as refused:
        await collection.bulk_write(ops, ordered=False)
    errors = refused.value.details["writeErrors"]
    assert [(error["index"], error["code"]) for error in errors] == [(0, 2), (2, 2)]
    assert all(MISSING_INDEX in error["errmsg"] for error in errors)
    after = await stored(db)
    assert "x" not in after[0] and after[1]["x"] == 1 and 2 in after


async def test_a_dropped_index_is_no_longer_hintable(db: Any) -> None:
    collection = await indexed(db)
    await collection.drop_index("by_a")
    with pytest.raises(OperationFailure) as refused:
        await collection.find({}).hint("by_a").to_list(None)
    assert refused_hint(refused.value)


async def test_a_collection_that_does_not_exist_answers_empty_whatever_the_hint(db: Any) -> None:
    # A server plans nothing on a missing collection (an empty plan), so it never looks up the
    # hint: reads and non-upsert writes there find nothing rather than fail.
    collection = db["never_created"]
    assert await collection.find({}).hint("missing").to_list(None) == []
    assert (await collection.update_many({}, {"$set": {"x": 1}}, hint="missing")).matched_count == 0
    assert (await collection.delete_many({}, hint="missing")).deleted_count == 0


async def test_collection_options_stay_visible_and_ruled(db: Any) -> None:
    collection = db.get_collection(
        "c",
        write_concern=WriteConcern(w="majority"),
        read_preference=ReadPreference.PRIMARY,
        read_concern=ReadConcern("majority"),
    )
    assert collection.write_concern == WriteConcern(w="majority")
    assert collection.read_preference == ReadPreference.PRIMARY
    assert collection.read_concern == ReadConcern("majority")
    await collection.insert_one({"_id": 1, "a": NINE_MIB})
    with pytest.raises(WriteError) as refused_update:
        await collection.update_one({"_id": 1}, {"$set": {"b": NINE_MIB}})
    too_large(refused_update.value, 17419, embedded=is_memory(db))
    with pytest.raises(OperationFailure) as refused:
        await collection.find({}).hint("missing").to_list(None)
    assert refused_hint(refused.value)


# ------------------------------------------------------------------------------ transactions


@pytest.mark.parametrize("lane", ["plain", "instrumented"])
async def test_the_embedded_backend_refuses_transactions(lane: str) -> None:
    db = memory_database() if lane == "plain" else instrument(memory_database())
    assert _driver.backend_of(db) is _driver.Backend.MEMORY
    ran: list[Any] = []

    async def work(session: Any) -> None:
        ran.append(session)

    session = db.client.start_session()  # PyMongo async: a plain call
    async with session:
        assert not session.in_transaction
        with pytest.raises(OperationFailure) as refused:
            await session.with_transaction(work)
        assert (refused.value.code, refused.value.details["codeName"]) == (20, "IllegalOperation")
        assert NO_TRANSACTIONS in str(refused.value)
        with pytest.raises(OperationFailure) as started:
            session.start_transaction()
        assert started.value.code == 20
        with pytest.raises(InvalidOperation):
            await session.commit_transaction()
    assert session.has_ended
    motor_style = await db.client.start_session()  # Motor: awaited
    with pytest.raises(OperationFailure) as awaited:
        motor_style.start_transaction()
    assert awaited.value.code == 20
    await motor_style.end_session()
    with pytest.raises(OperationFailure) as through_driver:
        await _driver.run_in_transaction(db, work)
    assert through_driver.value.code == 20
    assert ran == []  # the work never ran, so nothing of it was written


async def test_a_database_opened_from_the_same_client_is_ruled_too() -> None:
    db = memory_database()
    other = db.client["other"]
    await other["c"].insert_one({"_id": 1, "a": NINE_MIB})
    with pytest.raises(WriteError) as refused:
        await other["c"].update_one({"_id": 1}, {"$set": {"b": NINE_MIB}})
    assert refused.value.code == 17419
    assert _driver.backend_of(other) is _driver.Backend.MEMORY


# ------------------------------------------------------------------- the correlated $lookup


async def test_a_lookup_with_local_and_foreign_fields_and_a_pipeline_runs_it_per_document(
    db: Any,
) -> None:
    # MongoDB 5.0's concise correlated form: the equality, then the pipeline on its matches.
    await db["lk_groups"].insert_many([{"_id": "a"}, {"_id": "b"}, {"_id": "c"}])
    await db["lk_items"].insert_many(
        [{"_id": n, "group": g} for n, g in [(5, "a"), (2, "a"), (9, "a"), (4, "b"), (7, "b")]]
    )
    rows = await _driver.aggregate_list(
        db["lk_groups"],
        [
            {"$sort": {"_id": 1}},
            {
                "$lookup": {
                    "from": "lk_items", "localField": "_id", "foreignField": "group",
                    "pipeline": [{"$sort": {"_id": 1}}, {"$limit": 1}], "as": "first",
                }
            },
        ],
    )  # fmt: skip
    assert [(row["_id"], [item["_id"] for item in row["first"]]) for row in rows] == [
        ("a", [2]), ("b", [4]), ("c", []),
    ]  # fmt: skip


async def test_a_correlated_lookup_matches_as_a_server_does_missing_fields_and_arrays(
    db: Any,
) -> None:
    # A missing local field equals null (and a missing foreign one); an array local field
    # matches any of its elements; an array foreign field matches by any element.
    await db["lk_left"].insert_many(
        [{"_id": 1, "k": "x"}, {"_id": 2}, {"_id": 3, "k": ["y", "z"]}, {"_id": 4, "k": "w"}]
    )
    await db["lk_right"].insert_many(
        [
            {"_id": 10, "k": "x"},
            {"_id": 11},
            {"_id": 12, "k": None},
            {"_id": 13, "k": "z"},
            {"_id": 14, "k": ["w", "q"]},
            {"_id": 15, "k": "y"},
        ]
    )
    rows = await _driver.aggregate_list(
        db["lk_left"],
        [
            {"$sort": {"_id": 1}},
            {
                "$lookup": {
                    "from": "lk_right", "localField": "k", "foreignField": "k",
                    "pipeline": [{"$sort": {"_id": 1}}, {"$project": {"_id": 1}}], "as": "m",
                }
            },
        ],
    )  # fmt: skip
    assert {row["_id"]: [m["_id"] for m in row["m"]] for row in rows} == {
        1: [10], 2: [11, 12], 3: [13, 15], 4: [14],
    }  # fmt: skip


async def test_a_correlated_lookup_tells_a_bool_from_a_number_and_an_empty_array_from_a_value(
    db: Any,
) -> None:
    # BSON compares true and 1 as different types; an empty local array matches as null.
    await db["lk_l2"].insert_many([{"_id": 1, "k": True}, {"_id": 2, "k": 1}, {"_id": 3, "k": []}])
    await db["lk_r2"].insert_many([{"_id": 10, "k": True}, {"_id": 11, "k": 1}, {"_id": 12}])
    rows = await _driver.aggregate_list(
        db["lk_l2"],
        [
            {"$sort": {"_id": 1}},
            {
                "$lookup": {
                    "from": "lk_r2", "localField": "k", "foreignField": "k",
                    "pipeline": [{"$project": {"_id": 1}}], "as": "m",
                }
            },
        ],
    )  # fmt: skip
    assert {row["_id"]: [m["_id"] for m in row["m"]] for row in rows} == {1: [10], 2: [11], 3: [12]}


# ----------------------------------------------------------------------------- type mismatch


@pytest.mark.parametrize(
    "value", ["x", None, True, {"n": 1}], ids=["string", "null", "bool", "doc"]
)
async def test_an_inc_of_a_field_that_holds_no_number_is_refused_and_nothing_changes(
    db: Any, value: Any
) -> None:
    await db.c.insert_one({"_id": 1, "a": value, "s": 1})
    with pytest.raises(WriteError) as refused:
        await db.c.update_one({"_id": 1}, {"$set": {"s": 2}, "$inc": {"a": 1}})
    assert refused.value.code == 14 and _driver.type_mismatch(refused.value)
    assert "non-numeric" in str(refused.value)
    assert await db.c.find_one({"_id": 1}) == {"_id": 1, "a": value, "s": 1}
    await db.c.update_one({"_id": 1}, {"$inc": {"missing": 1}})  # a missing field is a 0
    assert (await db.c.find_one({"_id": 1}))["missing"] == 1


async def test_find_one_and_update_of_a_non_number_is_a_command_error(db: Any) -> None:
    await db.c.insert_one({"_id": 1, "a": "x"})
    with pytest.raises(OperationFailure) as refused:
        await db.c.find_one_and_update({"_id": 1}, {"$set": {"b": 1}, "$inc": {"a": 1}})
    assert not isinstance(refused.value, WriteError)
    assert refused.value.code == 14 and _driver.type_mismatch(refused.value)
    assert await db.c.find_one({"_id": 1}) == {"_id": 1, "a": "x"}


async def test_update_many_stops_at_the_document_that_holds_no_number(db: Any) -> None:
    await db.c.insert_many([{"_id": 1, "a": 1}, {"_id": 2, "a": "x"}, {"_id": 3, "a": 3}])
    with pytest.raises(WriteError) as refused:
        await db.c.update_many({}, {"$inc": {"a": 1}})
    assert refused.value.code == 14
    stored = {doc["_id"]: doc["a"] for doc in await db.c.find({}).to_list(None)}
    assert stored[2] == "x"  # (which others were updated is the server's order: not asserted)


async def test_pipeline_arithmetic_on_a_non_number_is_refused_and_nothing_changes(db: Any) -> None:
    await db.c.insert_one({"_id": 1, "a": "x"})
    with pytest.raises(WriteError) as refused:
        await db.c.update_one({"_id": 1}, [{"$set": {"b": {"$subtract": ["$a", 1]}}}])
    assert _driver.type_mismatch(refused.value)
    assert await db.c.find_one({"_id": 1}) == {"_id": 1, "a": "x"}


async def test_bulk_write_reports_the_type_mismatch_at_its_index(db: Any) -> None:
    await db.c.insert_many([{"_id": 1, "a": 1}, {"_id": 2, "a": "x"}])
    ops = [UpdateMany({"_id": 1}, {"$inc": {"a": 1}}), UpdateMany({"_id": 2}, {"$inc": {"a": 1}})]
    with pytest.raises(BulkWriteError) as refused:
        await db.c.bulk_write(ops, ordered=False)
    (entry,) = refused.value.details["writeErrors"]
    assert (entry["index"], entry["code"]) == (1, 14)
    assert (await db.c.find_one({"_id": 1}))["a"] == 2


@pytest.mark.parametrize("operator", ["$push", "$addToSet"])
async def test_an_array_operator_on_a_field_that_holds_no_array_is_refused(
    db: Any, operator: str
) -> None:
    await db.c.insert_one({"_id": 1, "a": "x"})
    with pytest.raises(WriteError) as refused:
        await db.c.update_one({"_id": 1}, {operator: {"a": 1}})
    assert refused.value.code == 2 and "must be an array" in str(refused.value)
    with pytest.raises(OperationFailure) as command:
        await db.c.find_one_and_update({"_id": 1}, {operator: {"a": 1}})
    assert not isinstance(command.value, WriteError) and command.value.code == 2
    assert await db.c.find_one({"_id": 1}) == {"_id": 1, "a": "x"}


async def test_max_and_min_across_types_follow_the_servers_type_order(db: Any) -> None:
    when = datetime(2026, 1, 1)
    await db.c.insert_one({"_id": 1, "s": "x", "d": when, "n": 3})
    await db.c.update_one({"_id": 1}, {"$max": {"s": 5, "d": "y", "n": 7}})
    assert await db.c.find_one({"_id": 1}, {"_id": 0}) == {"s": "x", "d": when, "n": 7}
    await db.c.update_one({"_id": 1}, {"$min": {"s": 5, "d": "y"}})
    assert await db.c.find_one({"_id": 1}, {"_id": 0}) == {"s": 5, "d": "y", "n": 7}
