"""The embedded in-memory backend: mongomock-motor, made to refuse what a MongoDB server refuses.

`embedded_database(name)` is what `mongoq.connect()` returns without a URI (and what
`mongoq.testing.memory_database()` calls). It is a plain mongomock-motor database, not a wrapper:
`_driver.backend_of` still says MEMORY, and `mongoq.testing.instrument` wraps it as any other.
What it owns is a set of per-instance patches on the synchronous mongomock collections behind it
(mongomock-motor awaits those), so that code developed on it meets a server's refusals, with the
server's error class and code, in development rather than in production:

1. Document size: no document over 16 MiB of BSON is ever stored (mongomock would).
   - an update (update_one/update_many/replace_one) whose result would pass it: WriteError 17419,
     the document left as it was (update_many: those updated before it stay updated, as on a
     server); an upsert that would insert one: WriteError 17420;
   - the same in find_one_and_update / find_one_and_replace: OperationFailure 17419 / 17420;
   - in bulk_write: BulkWriteError whose writeErrors carry {index, code, errmsg} (ordered stops at
     the first, unordered goes on);
   - insert_one of a document over 16 MiB + 16382 bytes: DocumentTooLarge, raised by PyMongo
     before sending; a smaller one still over 16 MiB is sent and refused by the server: WriteError
     2 ("object to insert too large"). insert_many and bulk InsertOne send such documents (PyMongo
     leaves acknowledged batches to the server), so each is a write error in a BulkWriteError.
   Not modelled: PyMongo's DocumentTooLarge for an update or replace whose *command* passes
   16 MiB + 16382 bytes (here the result is judged: 17419), and messages over 48 MB.
   An update whose result BSON cannot encode is refused with BSON's own error, unapplied, as
   PyMongo would refuse to send it.
2. Hints: a hint naming no existing index is refused with code 2 (BadValue), "hint provided does
   not correspond to an existing index": OperationFailure for find (``.hint()`` or ``hint=``,
   checked when the cursor is first read, as a server does), find_one, aggregate,
   count_documents and find_one_and_*; WriteError for update/replace/delete (a write error in
   bulk_write). A hint is an index name or a key pattern (a list of (field, direction) pairs or
   a dict); ``_id_`` and ``{"$natural": ±1}`` always exist. An existing hint is accepted and
   dropped before mongomock sees it (mongomock refuses update and delete hints). As on a server,
   a query on a collection that does not exist is not planned, so its hint is not looked up
   (except for an upsert, which creates the collection first).
3. Transactions: there are none, as on a standalone server. ``db.client.start_session()`` (plain
   or awaited) returns an `EmbeddedSession` whose ``start_transaction()`` and
   ``with_transaction()`` raise OperationFailure 20 (IllegalOperation), "Transaction numbers are
   only allowed on a replica set member or mongos". Passing a session to a command (``session=``)
   is not supported: mongomock refuses it on writes (NotImplementedError) and ignores it on some
   reads.
4. A ``$lookup`` with ``localField`` / ``foreignField`` *and* a ``pipeline`` (MongoDB 5.0's
   concise correlated form) runs: the equality, then the pipeline on the foreign collection, as
   a server does. mongomock refuses every ``pipeline`` (NotImplementedError); this adds that one
   form to mongomock's stage table, for the process (it only answers what mongomock refused).
   ``let``, and a pipeline without those two fields, stay refused; a dotted ``localField``
   through an array of documents is not modelled.
5. Type mismatches: ``$inc`` or ``$mul`` of a field that holds no number (a string, null, a bool,
   a document) is refused with code 14 (TypeMismatch), the document left as it was: WriteError
   for update/replace (a write error in bulk_write; update_many keeps the documents updated
   before it, as on a server), OperationFailure for find_one_and_update. So is an update
   pipeline whose arithmetic meets a non-number (mongomock fails with Python's TypeError; a
   server answers 14, or 16554/16556 on older versions for ``$add``/``$subtract``).
   ``$push`` or ``$addToSet`` to a field that holds no array is refused with code 2 (BadValue),
   the document left as it was. ``$max`` and ``$min`` across BSON types compare by the server's
   type order (a date is above every string, a string above every number) where mongomock
   fails with Python's TypeError.

Cost: one ``bson.encode`` per document an update changes (mongomock deep-copies it already) and
one per inserted document; hints are dictionary look-ups. No collection scan is added.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Generator, Mapping
from datetime import datetime
from typing import Any, NoReturn

import bson
import mongomock.aggregate as _mock_aggregate
from mongomock.collection import Collection as _MockCollection
from mongomock.collection import Cursor as _MockCursor
from mongomock_motor import AsyncMongoMockClient
from mongomock_motor.patches import _patch_collection_internals
from pymongo import ReturnDocument
from pymongo.errors import (
    BulkWriteError,
    DocumentTooLarge,
    DuplicateKeyError,
    InvalidOperation,
    OperationFailure,
    WriteError,
)

__all__ = ["MAX_BSON_SIZE", "EmbeddedSession", "embedded_database"]

#: The server's limit on a stored document (BSONObjMaxUserSize).
MAX_BSON_SIZE = 16 * 1024 * 1024
# What PyMongo allows a command beyond MAX_BSON_SIZE (pymongo.message._COMMAND_OVERHEAD).
_COMMAND_OVERHEAD = 16382
# An ``_id`` ObjectId field the insert will add: type byte + "_id\0" + 12 bytes.
_OBJECT_ID_FIELD = 17

_BAD_VALUE = 2
_TYPE_MISMATCH = 14
_ILLEGAL_OPERATION = 20
_UPDATE_TOO_LARGE = 17419
_UPSERT_TOO_LARGE = 17420
_MESSAGES = {
    _UPDATE_TOO_LARGE: f"Resulting document after update is larger than {MAX_BSON_SIZE}",
    _UPSERT_TOO_LARGE: f"Document to upsert is larger than {MAX_BSON_SIZE}",
}
_MISSING_INDEX = "hint provided does not correspond to an existing index"
_NO_TRANSACTIONS = "Transaction numbers are only allowed on a replica set member or mongos"
# The codes this module raises as write errors, whose bulk entries it tidies (see bulk_write).
_OWN_WRITE_CODES = frozenset({_BAD_VALUE, _TYPE_MISMATCH, _UPDATE_TOO_LARGE, _UPSERT_TOO_LARGE})
#: The update operators that need a number in the field they change.
_ARITHMETIC = ("$inc", "$mul")
#: The refusals of a document's content a findAndModify answers as command errors, by name.
_CODE_NAMES = {_TYPE_MISMATCH: "TypeMismatch", _BAD_VALUE: "BadValue"}
#: The update operators that need an array in the field they change.
_ARRAYS = ("$push", "$addToSet")

# The mongomock internals the rules hook into: fail at import, not with a silent rule-less
# backend, should a mongomock release rename them.
for _name in (
    "_insert", "_update", "_delete", "_ensure_uniques", "_store", "bulk_write",
    "_apply_update_document", "_apply_update_pipeline",
):  # fmt: skip
    if not hasattr(_MockCollection, _name):
        raise ImportError(f"mongoq's embedded backend needs mongomock 4.x (no Collection.{_name})")
if not hasattr(_MockCursor, "_compute_results"):
    raise ImportError("mongoq's embedded backend needs mongomock 4.x (no Cursor._compute_results)")
_found_lookup = getattr(_mock_aggregate, "_PIPELINE_HANDLERS", {}).get("$lookup")
if _found_lookup is None or not hasattr(_mock_aggregate, "process_pipeline"):
    raise ImportError("mongoq's embedded backend needs mongomock 4.x (no $lookup stage handler)")
_mock_lookup: Callable[..., Any] = _found_lookup
_process_pipeline: Callable[..., Any] = _mock_aggregate.process_pipeline


def _correlated_lookup(in_collection: list[Any], database: Any, options: Any) -> list[Any]:
    """Rule 4: ``$lookup`` {from, localField, foreignField, pipeline, as}, else mongomock's."""
    names = ("from", "localField", "foreignField", "as")
    correlated = isinstance(options, Mapping) and "pipeline" in options and "let" not in options
    if not correlated or not all(isinstance(options.get(name), str) for name in names):
        return list(_mock_lookup(in_collection, database, options))  # mongomock's, or refusal
    foreign = database.get_collection(options["from"])
    field, pipeline = options["foreignField"], list(options["pipeline"])
    # The foreign documents read once and bucketed by the field (mongomock's own $match would
    # scan the collection once per input document).
    buckets: dict[Any, list[Any]] | None = None
    for doc in in_collection:
        value: Any = doc
        for part in options["localField"].split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(value, (list, dict)) or "." in field:  # mongomock's matcher decides
            # an array matches by any element; an empty one as null (missing), as on a server
            equal = ({"$in": value} if value else None) if isinstance(value, list) else value
            doc[options["as"]] = list(foreign.aggregate([{"$match": {field: equal}}, *pipeline]))
            continue
        if buckets is None:
            buckets = _bucketed(foreign.find(), field)
        matches = copy.deepcopy(buckets.get(_bucket_key(value), []))
        doc[options["as"]] = list(_process_pipeline(matches, database, pipeline, None))
    return in_collection


def _bucketed(docs: Any, field: str) -> dict[Any, list[Any]]:
    """`docs` by their `field`'s value (each element of an array; None when missing)."""
    buckets: dict[Any, list[Any]] = {}
    for doc in docs:
        value = doc.get(field)
        for key in value if isinstance(value, list) else [value]:
            if not isinstance(key, (list, dict)):
                buckets.setdefault(_bucket_key(key), []).append(doc)
    return buckets


def _bucket_key(value: Any) -> Any:
    """`value` as a bucket's key: a bool apart from the number it equals in Python (BSON
    compares them as different types)."""
    return ("bool", value) if isinstance(value, bool) else value


_mock_aggregate._PIPELINE_HANDLERS["$lookup"] = _correlated_lookup


def embedded_database(name: str) -> Any:
    """A fresh, empty embedded database named `name`, enforcing the rules above."""
    # Not tz_aware (PyMongo's default, as for the server clients), so dates inside payloads read
    # back alike on every backend; mongoq makes its own fields aware.
    database: Any = AsyncMongoMockClient()[name]
    sync_database = database.delegate
    _enforce_on_client(database.client, sync_database.client)
    _enforce_on_database(sync_database)
    return database


# ------------------------------------------------------------------------------------ errors


def _write_error(message: str, code: int) -> WriteError:
    """A WriteError as PyMongo raises it from a single-statement write's reply."""
    return WriteError(message, code, {"index": 0, "code": code, "errmsg": message})


def _command_error(message: str, code: int, code_name: str) -> OperationFailure:
    """An OperationFailure as PyMongo raises it from a failed command's reply."""
    details = {"ok": 0.0, "errmsg": message, "code": code, "codeName": code_name}
    return OperationFailure(message, code, details)


def _missing_index(namespace: str) -> str:
    # The server's wording, prefixed as its planner prefixes it.
    return f"error processing query: ns={namespace} planner returned error :: caused by :: " + (
        _MISSING_INDEX
    )


class _TooLargeToInsert(WriteError):
    """Internal: a document over the limit stopped on its way into the store (nothing stored).

    A WriteError without details, so that mongomock's insert_many and bulk loops record it as
    the server's write error (its text is the errmsg); single-document paths convert it."""

    def __init__(self, size: int) -> None:
        message = f"object to insert too large. size in bytes: {size}, max size: {MAX_BSON_SIZE}"
        super().__init__(message, _BAD_VALUE)
        self.size = size


class _RollBack(DuplicateKeyError):
    """Internal: raised where mongomock checks a changed document, so that it restores its own
    snapshot of the document (it does so on DuplicateKeyError only); `error` is what the caller
    gets instead."""

    def __init__(self, error: BaseException) -> None:
        super().__init__("rolled back by mongoq's embedded rules", 11000)
        self.error = error


# ------------------------------------------------------------------------------------ types

_MISSING = object()


def _field_at(document: Mapping[str, Any], path: str) -> Any:
    """The value at the dotted `path` of `document`, `_MISSING` where there is none."""
    value: Any = document
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _is_number(value: Any) -> bool:
    """A BSON number (double, int32, int64, decimal): never a bool, which BSON keeps apart."""
    return isinstance(value, (int, float, bson.Int64, bson.Decimal128)) and not isinstance(
        value, bool
    )


def _type_order(value: Any) -> int:
    """Where `value`'s BSON type sorts among the others, as a server compares them (null,
    numbers, strings, documents, arrays, binary, ObjectId, bools, dates, ...)."""
    if value is None:
        return 1
    if _is_number(value):
        return 2
    order: tuple[tuple[type | tuple[type, ...], int], ...] = (
        (str, 3), (dict, 4), (list, 5), (bytes, 6), (bson.ObjectId, 7), (bool, 8),
        (datetime, 9), (bson.Timestamp, 10), (bson.Regex, 11),
    )  # fmt: skip
    return next((rank for kind, rank in order if isinstance(value, kind)), 12)


def _across_types(document: Mapping[str, Any], update: Any) -> Any:
    """`update` with each ``$max`` / ``$min`` between values of two BSON types settled by the
    server's type order (a ``$set`` where the new value wins, nothing where it does not), which
    mongomock cannot compare."""
    if not isinstance(update, Mapping) or not ({"$max", "$min"} & set(update)):
        return update
    settled = dict(update)
    won: dict[str, Any] = dict(settled.get("$set") or {})
    for operator, above in (("$max", True), ("$min", False)):
        fields = dict(settled.get(operator) or {})
        for path, value in list(fields.items()):
            current = _field_at(document, path)
            if current is _MISSING or _type_order(current) == _type_order(value):
                continue
            del fields[path]
            if (_type_order(value) > _type_order(current)) == above:
                won[path] = value
        settled[operator] = fields
    if won:
        settled["$set"] = won
    return settled  # (an operator left empty changes nothing, as on a server)


def _bson_type(value: Any) -> str:
    """The server's name for `value`'s BSON type, as its error texts give it."""
    names: dict[type, str] = {
        str: "string", type(None): "null", bool: "bool", dict: "object", list: "array",
        datetime: "date",
    }  # fmt: skip
    return next((name for kind, name in names.items() if isinstance(value, kind)), "unknown")


# ------------------------------------------------------------------------------------ hints


def _key_pattern(hint: Any) -> list[tuple[Any, Any]]:
    """A key-pattern hint as (field, direction) pairs, accepting what PyMongo accepts."""
    if isinstance(hint, Mapping):
        return list(hint.items())
    if not isinstance(hint, (list, tuple)):
        raise TypeError(f"must use a dictionary or a list of (key, direction) pairs, not: {hint!r}")
    return [(item, 1) if isinstance(item, str) else tuple(item) for item in hint]


def _hint_exists(collection: Any, hint: Any, *, upsert: bool) -> bool:
    store = collection._store
    # A server plans no query on a collection that does not exist (an empty plan), so it never
    # looks the hint up; an upsert creates the collection first, then plans.
    if not store.is_created and not upsert:
        return True
    if isinstance(hint, str):
        return hint == "_id_" or hint in store.indexes
    keys = _key_pattern(hint)
    if keys == [("_id", 1)] or (len(keys) == 1 and keys[0][0] == "$natural"):
        return True  # the _id index always exists; $natural asks for a collection scan
    # mongomock keeps an index's key as it was given: a list of pairs, or dict items.
    return any(_key_pattern(list(index["key"])) == keys for index in store.indexes.values())


# --------------------------------------------------------------------------------- patching


def _enforce_on_client(client: Any, sync_client: Any) -> None:
    """Sessions without transactions on `client`; rules on every database `client` opens."""

    def start_session(*args: Any, **kwargs: Any) -> EmbeddedSession:
        return EmbeddedSession(client)

    client.start_session = start_session
    get_database = sync_client.get_database

    def get_ruled_database(*args: Any, **kwargs: Any) -> Any:
        database = get_database(*args, **kwargs)
        _enforce_on_database(database)
        return database

    sync_client.get_database = get_ruled_database


def _enforce_on_database(sync_database: Any) -> None:
    """Rules on every collection `sync_database` hands out (mongomock-motor asks it for each)."""
    if sync_database.__dict__.get("_mongoq_rules"):
        return
    get_collection = sync_database.get_collection

    def get_ruled_collection(*args: Any, **kwargs: Any) -> Any:
        collection = get_collection(*args, **kwargs)
        if not collection.__dict__.get("_mongoq_rules"):
            _Rules(collection)
        return collection

    sync_database.get_collection = get_ruled_collection
    sync_database._mongoq_rules = True


class _Rules:
    """The server rules of one mongomock collection: its methods replace the collection's own
    (as instance attributes, which mongomock's internal calls and mongomock-motor both look up
    first), and each calls the replaced one."""

    _REPLACED = (
        "_insert", "_ensure_uniques", "_update", "_delete", "insert_one", "bulk_write", "find",
        "aggregate", "count_documents", "find_one_and_update", "find_one_and_replace",
        "find_one_and_delete", "_apply_update_document", "_apply_update_pipeline",
    )  # fmt: skip

    def __init__(self, collection: Any) -> None:
        # mongomock-motor patches `_insert` and `_ensure_uniques` itself (to enrich duplicate-key
        # errors, scanning the collection) when it first wraps a collection: let it do so now, so
        # that these rules sit outside its patches and their internal errors never pass through.
        _patch_collection_internals(collection)
        self._collection = collection
        self._original: dict[str, Callable[..., Any]] = {
            name: getattr(collection, name) for name in self._REPLACED
        }
        self._inserting = 0  # > 0 while a document is on its way in (already measured)
        self._batched = 0  # > 0 inside bulk_write, whose ops report write errors, not raise
        for name in self._REPLACED:
            setattr(collection, name, getattr(self, name))
        collection._mongoq_rules = True

    # -- size ------------------------------------------------------------------------------

    def _insert(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        """Every insert, upserts included, passes here one document at a time: measure it before
        mongomock stores it."""
        if isinstance(data, Mapping):
            try:
                size = len(bson.encode(data))
            except Exception:  # mongomock validates the document itself, with its own errors
                size = 0
            if "_id" not in data:
                size += _OBJECT_ID_FIELD
            if size > MAX_BSON_SIZE:
                raise _TooLargeToInsert(size)
        self._inserting += 1
        try:
            return self._original["_insert"](data, *args, **kwargs)
        finally:
            self._inserting -= 1

    def _ensure_uniques(self, document: Any) -> Any:
        """mongomock calls this on a document an update has just changed in place (and restores
        its snapshot on DuplicateKeyError): the one moment the result can be measured."""
        if not self._inserting:
            try:
                size = len(bson.encode(document))
            except Exception as error:  # PyMongo could not have sent this update at all
                raise _RollBack(error) from error
            if size > MAX_BSON_SIZE:
                message = _MESSAGES[_UPDATE_TOO_LARGE]
                raise _RollBack(_write_error(message, _UPDATE_TOO_LARGE))
        return self._original["_ensure_uniques"](document)

    def _update(self, *args: Any, hint: Any = None, **kwargs: Any) -> Any:
        """update_one, update_many, replace_one, bulk updates and find_one_and_* all land here."""
        if hint is not None:
            upsert = kwargs.get("upsert", args[2] if len(args) > 2 else False)
            self._check_write_hint(hint, upsert=bool(upsert))
        try:
            return self._original["_update"](*args, **kwargs)
        except _RollBack as refused:
            raise refused.error from None
        except _TooLargeToInsert:
            message = _MESSAGES[_UPSERT_TOO_LARGE]
            raise _write_error(message, _UPSERT_TOO_LARGE) from None

    # -- types -----------------------------------------------------------------------------

    def _apply_update_document(self, document: Any, spec: Any, update: Any, *args: Any) -> Any:
        """Checked before mongomock changes the stored document in place: a refusal leaves it
        as it was (mongomock would have applied the operators before the failing one)."""
        for operator in _ARITHMETIC:
            for path in update.get(operator) or ():
                value = _field_at(document, path)
                if value is not _MISSING and not _is_number(value):
                    message = (
                        f"Cannot apply {operator} to a value of non-numeric type. "
                        f"{{_id: {document.get('_id')!r}}} has the field '{path}' of non-numeric "
                        f"type {_bson_type(value)}"
                    )
                    raise _write_error(message, _TYPE_MISMATCH)
        for operator in _ARRAYS:
            for path in update.get(operator) or ():
                value = _field_at(document, path)
                if value is not _MISSING and not isinstance(value, list):
                    message = (
                        f"The field '{path}' must be an array but is of type "
                        f"{_bson_type(value)} in document {{_id: {document.get('_id')!r}}}"
                    )
                    raise _write_error(message, _BAD_VALUE)
        update = _across_types(document, update)
        return self._original["_apply_update_document"](document, spec, update, *args)

    def _apply_update_pipeline(self, document: Any, *args: Any) -> Any:
        # mongomock computes the new document apart, then swaps it in: a failure changed nothing.
        try:
            return self._original["_apply_update_pipeline"](document, *args)
        except (TypeError, AssertionError) as error:
            message = f"PlanExecutor error during update :: caused by :: TypeMismatch: {error}"
            raise _write_error(message, _TYPE_MISMATCH) from None

    def insert_one(self, document: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._original["insert_one"](document, *args, **kwargs)
        except _TooLargeToInsert as refused:
            if self._batched:  # bulk_write's InsertOne: a write error in its reply
                raise
            # PyMongo's own check, before sending (it measures the whole command, a few hundred
            # bytes more than the document: the threshold here is that much more lenient).
            if refused.size > MAX_BSON_SIZE + _COMMAND_OVERHEAD:
                raise DocumentTooLarge(
                    f"BSON document too large ({refused.size} bytes) - the connected server "
                    f"supports BSON document sizes up to {MAX_BSON_SIZE + _COMMAND_OVERHEAD} bytes."
                ) from None
            raise _write_error(str(refused), _BAD_VALUE) from None

    def bulk_write(self, requests: Any, *args: Any, **kwargs: Any) -> Any:
        self._batched += 1
        try:
            return self._original["bulk_write"](requests, *args, **kwargs)
        except BulkWriteError as error:
            # mongomock records a write error's text, which PyMongo suffixes with its details:
            # keep the server's errmsg for the errors raised here.
            for entry in error.details.get("writeErrors", ()):
                if entry.get("code") in _OWN_WRITE_CODES and isinstance(entry.get("errmsg"), str):
                    entry["errmsg"] = entry["errmsg"].split(", full error: ", 1)[0]
            raise
        finally:
            self._batched -= 1

    # -- hints -----------------------------------------------------------------------------

    def _check_read_hint(self, hint: Any, *, upsert: bool = False) -> None:
        if not _hint_exists(self._collection, hint, upsert=upsert):
            message = _missing_index(self._collection.full_name)
            raise _command_error(message, _BAD_VALUE, "BadValue")

    def _check_write_hint(self, hint: Any, *, upsert: bool) -> None:
        # An update or delete statement's failure is a write error in the server's reply.
        if not _hint_exists(self._collection, hint, upsert=upsert):
            raise _write_error(_missing_index(self._collection.full_name), _BAD_VALUE)

    def _delete(self, *args: Any, hint: Any = None, **kwargs: Any) -> Any:
        if hint is not None:
            self._check_write_hint(hint, upsert=False)
        return self._original["_delete"](*args, **kwargs)

    def find(self, *args: Any, hint: Any = None, **kwargs: Any) -> Any:
        cursor = self._original["find"](*args, **kwargs)
        set_hint = cursor.hint  # mongomock's: refuses options once the cursor has been read

        def hint_cursor(index: Any) -> Any:
            set_hint(index)
            cursor.__dict__.pop("_compute_results", None)
            if index is None:  # PyMongo: clears the hint
                return cursor
            compute = cursor._compute_results

            # A server plans the query when the cursor is first read: check then, once.
            def compute_checked(*args: Any, **kwargs: Any) -> Any:
                self._check_read_hint(index)
                del cursor._compute_results
                return compute(*args, **kwargs)

            cursor._compute_results = compute_checked
            return cursor

        cursor.hint = hint_cursor
        if hint is not None:  # find(hint=...): mongomock's find has no such argument
            hint_cursor(hint)
        return cursor

    def aggregate(self, pipeline: Any, *args: Any, hint: Any = None, **kwargs: Any) -> Any:
        if hint is not None:
            self._check_read_hint(hint)
        return self._original["aggregate"](pipeline, *args, **kwargs)

    def count_documents(self, filter: Any, *args: Any, hint: Any = None, **kwargs: Any) -> Any:
        if hint is not None:
            self._check_read_hint(hint)
        return self._original["count_documents"](filter, *args, **kwargs)

    def _find_one_and_modify(name: str) -> Any:  # type: ignore[misc]  # builds two methods
        """`find_one_and_update` / `find_one_and_replace`, with PyMongo's signature."""

        def method(
            self: _Rules, filter: Any, document: Any, projection: Any = None, sort: Any = None,
            upsert: bool = False, return_document: Any = ReturnDocument.BEFORE, *,
            hint: Any = None, **kwargs: Any,
        ) -> Any:  # fmt: skip
            return self._checked_find_and_modify(
                name, hint, upsert, filter, document, projection, sort, upsert, return_document,
                **kwargs,
            )  # fmt: skip

        method.__name__ = method.__qualname__ = name
        return method

    find_one_and_update = _find_one_and_modify("find_one_and_update")
    find_one_and_replace = _find_one_and_modify("find_one_and_replace")
    del _find_one_and_modify

    def find_one_and_delete(
        self, filter: Any, projection: Any = None, sort: Any = None, *, hint: Any = None,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        return self._checked_find_and_modify(
            "find_one_and_delete", hint, False, filter, projection, sort, **kwargs
        )

    def _checked_find_and_modify(
        self, name: str, hint: Any, upsert: bool, *args: Any, **kwargs: Any
    ) -> Any:
        """findAndModify is one command: its refusals are command errors, not write errors."""
        if hint is not None:
            self._check_read_hint(hint, upsert=upsert)
        try:
            return self._original[name](*args, **kwargs)
        except WriteError as error:
            if error.code in _CODE_NAMES:
                message = (error.details or {}).get("errmsg", str(error))
                raise _command_error(message, error.code, _CODE_NAMES[error.code]) from None
            if error.code not in _MESSAGES:
                raise
            raise _command_error(
                _MESSAGES[error.code], error.code, f"Location{error.code}"
            ) from None


# --------------------------------------------------------------------------------- sessions


def _no_transactions() -> OperationFailure:
    return _command_error(_NO_TRANSACTIONS, _ILLEGAL_OPERATION, "IllegalOperation")


class EmbeddedSession:
    """A client session of the embedded backend, which has no transactions (like a standalone
    server): starting one raises OperationFailure 20 (IllegalOperation).

    ``client.start_session()`` returns it directly, as PyMongo async does, and awaiting it gives
    it back, as Motor does. It works as an async context manager. Passing it to a command
    (``session=``) is not supported: mongomock refuses sessions on writes (NotImplementedError)
    and ignores them on some reads.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self._ended = False

    @property
    def has_ended(self) -> bool:
        return self._ended

    @property
    def in_transaction(self) -> bool:
        return False

    def start_transaction(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Raises: a server without transactions refuses the transaction's first command."""
        raise _no_transactions()

    async def with_transaction(self, callback: Any, *args: Any, **kwargs: Any) -> NoReturn:
        """Raises, before running `callback`: its first command would be refused."""
        raise _no_transactions()

    async def commit_transaction(self) -> NoReturn:
        raise InvalidOperation("No transaction started")

    async def abort_transaction(self) -> NoReturn:
        raise InvalidOperation("No transaction started")

    async def end_session(self) -> None:
        self._ended = True

    async def __aenter__(self) -> EmbeddedSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.end_session()

    def __await__(self) -> Generator[Any, None, EmbeddedSession]:
        # Motor awaits start_session(): an awaited session is itself.
        return self
        yield  # unreachable: makes this a generator
