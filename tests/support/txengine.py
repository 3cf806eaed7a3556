"""TEST-ONLY: an in-memory database with sessions and multi-document transactions.

`transactional_database()` adapts mongomock-ng (module `mongomock_ng`, a pure-Python MongoDB
emulator) to the shape of PyMongo's native async API (`pymongo.AsyncMongoClient`), so the test
suite can run mongoq's transactional code (``with_transaction``, commit, rollback) without a
server. It is not part of the library and it is not MongoDB: a test passing here says nothing
about isolation or concurrency on a real server.

What mongomock-ng's transactions model: writes made with ``session=`` inside a transaction are
undone when it aborts. How: the first write of a transaction to a collection snapshots (deep-
copies) that collection's documents and indexes; commit discards the snapshot, abort restores it.

What they do NOT model:
(a) isolation: uncommitted writes are visible at once to everyone (other sessions, other
    transactions, reads without a session), and a transaction sees others' writes as they land;
(b) other writers: an abort restores the whole collection, so it also discards the writes that
    others (without a transaction) made to that collection meanwhile;
(c) write conflicts: mongomock-ng never raises one (nor any TransientTransactionError), and a
    commit never fails; a write error leaves its transaction open, as if it had not happened;
(d) DDL: creating a collection is never undone; a drop inside a transaction is undone only as
    far as its documents and indexes go.
Reads (find, count, aggregate, ...) never take part in a transaction: given (a), they need not.

What this adapter adds on top (the workarounds):
- mongomock-ng keeps ONE snapshot slot per collection, shared by every session: a second
  transaction writing to a collection overwrites the first one's snapshot, and whichever ends
  first clears it, so the other's abort then silently restores the wrong state or nothing.
  Here the first open transaction to write to a collection holds it until it ends; a write from
  another transaction raises WriteConflict (code 112, label TransientTransactionError), which
  `TxSession.with_transaction` retries with backoff as PyMongo's does. Conflicts are therefore
  per collection (coarser than a server's per document), but never silent.
- As on a server, an error raised by a write inside a transaction (a duplicate key, a write
  conflict, any OperationFailure: BulkWriteError and DuplicateKeyError included) ABORTS that
  transaction at once, whether or not the caller catches the error: its writes are rolled back
  and its collections freed. The session still reports ``in_transaction`` until it is ended;
  every later command with it raises NoSuchTransaction (code 251, label
  TransientTransactionError), and so does the commit; an abort succeeds (PyMongo ignores
  abortTransaction errors). Swallowing a write error inside a transaction is therefore seen.
- `TxSession.with_transaction` retries as PyMongo's does (the whole transaction on a
  TransientTransactionError, from the callback or from the commit), but gives up after
  ``client.max_attempts`` attempts (default 10) as well as after ``client.retry_time_limit``
  seconds (default 120, PyMongo's): a callback that swallows a write error fails in well under
  a second instead of looping for two minutes. Giving up raises what PyMongo 4.20 raises,
  NetworkTimeout carrying the last error's labels, chained to that error.
- ``count_documents`` rejects a session (KeyError) and ``estimated_document_count`` too: reads
  run without one.
- TTL emulation ignores ``partialFilterExpression`` and would delete every document old
  enough: a partial TTL index is declared (``index_information`` shows it) but never expires.
- Type mismatches are refused as a server (and the embedded backend, `mongoq._embedded` rule 5)
  refuses them, where mongomock-ng fails with Python's TypeError or AttributeError: ``$inc`` or
  ``$mul`` of a field that holds no number with code 14 (TypeMismatch), ``$push`` or
  ``$addToSet`` to a field that holds no array with code 2 (BadValue), checked before the
  document is changed (it is left as it was): WriteError for update_one/update_many, a write
  error in bulk_write, OperationFailure (a command error) for find_one_and_update. Inside a
  transaction, that aborts it as any write error does.
- ``$inc`` of a Decimal128 (or by one) adds as a server does, in decimal (mongomock-ng fails
  with Python's TypeError): ``Decimal128("7")`` plus 1 is ``Decimal128("8")``, NaN stays NaN.
- As on a server, a bulk write (or insert_many) in a transaction stops at its first write error,
  ordered or not: the transaction is aborted then, and the reply lists that error only.
- `TxDatabase.command` answers "ping" and "hello" (with ``localTime``, the server clock);
  commands mongomock-ng lacks raise OperationFailure (CommandNotFound), not NotImplementedError.
Errors are PyMongo's own classes (mongomock-ng imports them from pymongo when it is installed).
Every call runs synchronously: awaiting one never yields to the event loop (as mongomock-motor).
"""

from __future__ import annotations

import asyncio
import decimal
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import mongomock_ng
from bson import Decimal128
from bson.decimal128 import create_decimal128_context
from mongomock_ng.collection import Collection as _NgCollection
from pymongo.errors import (
    BulkWriteError,
    CollectionInvalid,
    InvalidOperation,
    NetworkTimeout,
    OperationFailure,
    PyMongoError,
    WriteError,
)
from pymongo.operations import IndexModel

from mongoq import _embedded

__all__ = [
    "TxClient",
    "TxCollection",
    "TxCursor",
    "TxDatabase",
    "TxSession",
    "transactional_database",
]

T = TypeVar("T")
_RETRY_TIME_LIMIT = 120.0  # seconds, as PyMongo's with_transaction
_MAX_ATTEMPTS = 10  # PyMongo has no such bound (see the module doc)
_BACKOFF_INITIAL, _BACKOFF_MAX = 0.005, 0.5
_WRITE_CONFLICT = (
    "WriteConflict error: this operation conflicted with another operation. "
    "Please retry your operation or multi-document transaction."
)


_TYPE_MISMATCH, _BAD_VALUE = 14, 2
#: The refusals of a document's content a findAndModify answers as command errors, by name.
_CODE_NAMES = {_TYPE_MISMATCH: "TypeMismatch", _BAD_VALUE: "BadValue"}
_ARITHMETIC = ("$inc", "$mul")  # need a number in the field they change
_ARRAYS = ("$push", "$addToSet")  # need an array
# The embedded backend's own readings of a document (the same server rules, another engine).
_MISSING, _field_at, _is_number = _embedded._MISSING, _embedded._field_at, _embedded._is_number


def _type_refusal(document: Mapping[str, Any], update: Mapping[str, Any]) -> WriteError | None:
    """What a server answers to `update` (operators) of `document`, when it refuses it for a
    field of the wrong type (see the module doc); None when it does not."""
    found: tuple[str, int] | None = None
    for operator in (*_ARITHMETIC, *_ARRAYS):
        for path in update.get(operator) or ():
            value = _field_at(document, path)
            if value is _MISSING:
                continue
            where = f"{{_id: {document.get('_id')!r}}}"
            if operator in _ARITHMETIC and not _is_number(value):
                found = (
                    f"Cannot apply {operator} to a value of non-numeric type. {where} has the "
                    f"field '{path}' of non-numeric type {type(value).__name__}",
                    _TYPE_MISMATCH,
                )
            elif operator in _ARRAYS and not isinstance(value, list):
                found = (
                    f"The field '{path}' must be an array but is of type "
                    f"{type(value).__name__} in document {where}",
                    _BAD_VALUE,
                )
            if found is not None:
                message, code = found
                return WriteError(message, code, {"index": 0, "code": code, "errmsg": message})
    return None


def _decimal(value: Any) -> decimal.Decimal:
    return value.to_decimal() if isinstance(value, Decimal128) else decimal.Decimal(value)


def _decimal_sums(document: Mapping[str, Any], update: Mapping[str, Any]) -> Mapping[str, Any]:
    """`update` with each ``$inc`` that meets a Decimal128 (in the field or as the increment)
    made a ``$set`` of the sum, computed as a server computes it."""
    increments = update.get("$inc") or {}
    sums: dict[str, Decimal128] = {}
    for path, by in increments.items():
        value = _field_at(document, path)
        if isinstance(value, Decimal128) or isinstance(by, Decimal128):
            with decimal.localcontext(create_decimal128_context()) as context:
                base = _decimal(0 if value is _MISSING else value)
                sums[path] = Decimal128(context.add(base, _decimal(by)))
    if not sums:
        return update
    changed = {name: spec for name, spec in update.items() if name != "$inc"}
    rest = {path: by for path, by in increments.items() if path not in sums}
    if rest:
        changed["$inc"] = rest
    changed["$set"] = {**changed.get("$set", {}), **sums}
    return changed


_apply_update_document: Callable[..., Any] = _NgCollection._apply_update_document


def _checked_update_document(
    self: Any, existing_document: Any, spec: Any, document: Any, was_insert: Any
) -> Any:
    """mongomock-ng's `_apply_update_document` (it changes the stored document in place),
    after the server's type checks: a refusal leaves the document as it was."""
    refusal = _type_refusal(existing_document, document)
    if refusal is not None:
        raise refusal
    document = _decimal_sums(existing_document, document)
    return _apply_update_document(self, existing_document, spec, document, was_insert)


# For the process: mongomock-ng serves only this engine in the test suite.
_NgCollection._apply_update_document = _checked_update_document  # type: ignore[method-assign]


def _failure(message: str, code: int, code_name: str, **extra: Any) -> OperationFailure:
    """An OperationFailure shaped like a server reply."""
    details = {"ok": 0.0, "errmsg": message, "code": code, "codeName": code_name, **extra}
    return OperationFailure(message, code, details)


def _no_such_transaction(number: int) -> OperationFailure:
    """What a server answers to a command in (or the commit of) a transaction it aborted."""
    message = f"Transaction with {{ txnNumber: {number} }} has been aborted."
    return _failure(message, 251, "NoSuchTransaction", errorLabels=["TransientTransactionError"])


def _transient(error: BaseException) -> bool:
    return isinstance(error, PyMongoError) and error.has_error_label("TransientTransactionError")


def _gave_up(error: BaseException) -> NetworkTimeout:
    """What PyMongo 4.20's with_transaction raises when its retries run out."""
    timeout = NetworkTimeout(str(error))
    if isinstance(error, PyMongoError):
        timeout._error_labels = error._error_labels.copy()
    return timeout


def _public(owner: object, name: str, noun: str) -> str:
    """`name`, to look up as a child of `owner` (``db.orders``, ``client.mongoq``, as in PyMongo).
    A private name raises AttributeError instead: probes such as copy's, or ``_inner`` read
    before it is set, must not make a collection or recurse."""
    if name.startswith("_"):
        kind = type(owner).__name__
        raise AttributeError(f"{kind} has no attribute {name!r}; use {noun}[{name!r}]")
    return name


def transactional_database(
    name: str = "mongoq",
    *,
    max_attempts: int = _MAX_ATTEMPTS,
    retry_time_limit: float = _RETRY_TIME_LIMIT,
) -> TxDatabase:
    """A fresh in-memory database (own client, not tz_aware) with working transactions;
    `max_attempts` and `retry_time_limit` bound the retries of ``with_transaction``."""
    client = TxClient(
        mongomock_ng.MongoClient(), max_attempts=max_attempts, retry_time_limit=retry_time_limit
    )
    return client[name]


class TxCursor:
    """`AsyncCursor` / `AsyncCommandCursor` over a mongomock-ng cursor or any iterator."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def sort(self, key_or_list: Any, direction: Any = None) -> TxCursor:
        self._inner.sort(key_or_list, direction)
        return self

    def limit(self, limit: int) -> TxCursor:
        self._inner.limit(limit)
        return self

    def skip(self, skip: int) -> TxCursor:
        self._inner.skip(skip)
        return self

    def hint(self, index: Any) -> TxCursor:
        self._inner.hint(index)  # accepted, ignored
        return self

    def max_time_ms(self, max_time_ms: int | None) -> TxCursor:
        self._inner.max_time_ms(max_time_ms)  # accepted, ignored
        return self

    def batch_size(self, batch_size: int) -> TxCursor:
        return self  # no batches in memory (mongomock-ng would warn)

    async def to_list(self, length: int | None = None) -> list[Any]:
        if isinstance(length, int) and length < 1:
            raise ValueError("to_list() length must be greater than 0")
        return list(itertools.islice(self._inner, length))

    def __aiter__(self) -> TxCursor:
        return self

    async def __anext__(self) -> Any:
        try:
            return next(self._inner)
        except StopIteration:
            raise StopAsyncIteration from None

    async def close(self) -> None:
        return None


class TxSession:
    """`AsyncClientSession`; pass it as ``session=`` to any `TxCollection` method."""

    def __init__(self, client: TxClient, inner: Any) -> None:
        self.client = client
        self._inner = inner
        self._held: set[tuple[str, str]] = set()
        self._txn_number = 0
        # Aborted "on the server" by a write error, still open for the client (see module doc).
        self._doomed = False

    @property
    def in_transaction(self) -> bool:
        return self._doomed or bool(self._inner.in_transaction)

    @property
    def has_ended(self) -> bool:
        return bool(self._inner.has_ended)

    async def start_transaction(self, **options: Any) -> _TransactionContext:
        if self._doomed:
            raise InvalidOperation("Transaction already in progress")
        self._inner.start_transaction(**options)  # raises InvalidOperation as PyMongo does
        self._txn_number += 1
        return _TransactionContext(self)

    async def commit_transaction(self) -> None:
        if self._doomed:
            self._doomed = False
            raise _no_such_transaction(self._txn_number)
        try:
            self._inner.commit_transaction()
        finally:
            self._release()

    async def abort_transaction(self) -> None:
        if self._doomed:  # aborted already; PyMongo ignores the server's error
            self._doomed = False
            return
        try:
            self._inner.abort_transaction()
        finally:
            self._release()

    async def with_transaction(
        self, callback: Callable[[TxSession], Awaitable[T]], **options: Any
    ) -> T:
        """Run ``await callback(self)`` in a transaction and commit it; abort and re-raise on an
        exception, retrying the whole transaction on TransientTransactionError from the callback
        or the commit (as PyMongo), within ``client.max_attempts`` and ``retry_time_limit``."""
        start, attempt = time.monotonic(), 0
        while True:
            if attempt:
                backoff = min(_BACKOFF_INITIAL * 1.5**attempt, _BACKOFF_MAX)
                await asyncio.sleep(random.random() * backoff)
            attempt += 1
            await self.start_transaction(**options)
            try:
                result = await callback(self)
            except BaseException as exc:
                if self.in_transaction:
                    await self.abort_transaction()
                if not _transient(exc):
                    raise
                if self._may_retry(start, attempt):
                    continue
                raise _gave_up(exc) from exc
            if not self.in_transaction:  # the callback ended the transaction itself
                return result
            try:
                await self.commit_transaction()
            except PyMongoError as exc:
                if not _transient(exc):
                    raise
                if self._may_retry(start, attempt):
                    continue
                raise _gave_up(exc) from exc
            return result

    def _may_retry(self, start: float, attempts: int) -> bool:
        elapsed = time.monotonic() - start
        return attempts < self.client.max_attempts and elapsed < self.client.retry_time_limit

    async def end_session(self) -> None:
        self._doomed = False
        try:
            self._inner.end_session()  # aborts an open transaction
        finally:
            self._release()

    async def __aenter__(self) -> TxSession:
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        await self.end_session()

    def _hold(self, key: tuple[str, str]) -> None:
        """Make this session's transaction the one writer of collection `key` (see module doc)."""
        if not self.in_transaction:
            return
        if self.client._holders.setdefault(key, self) is not self:
            raise _failure(
                _WRITE_CONFLICT, 112, "WriteConflict", errorLabels=["TransientTransactionError"]
            )
        self._held.add(key)

    def _check_alive(self) -> None:
        """A command with this session: NoSuchTransaction once a write error aborted it."""
        if self._doomed:
            raise _no_such_transaction(self._txn_number)

    def _abort_on_error(self) -> None:
        """A write in this transaction failed: the server aborts it at once (see module doc)."""
        if self._doomed or not self._inner.in_transaction:
            return
        try:
            self._inner.abort_transaction()
        finally:
            self._release()
            self._doomed = True

    def _release(self) -> None:
        for key in self._held:
            self.client._holders.pop(key, None)
        self._held.clear()


class _TransactionContext:
    """What ``await session.start_transaction()`` returns: commits on exit, aborts on error."""

    def __init__(self, session: TxSession) -> None:
        self._session = session

    async def __aenter__(self) -> _TransactionContext:
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._session.in_transaction:
            if exc is None:
                await self._session.commit_transaction()
            else:
                await self._session.abort_transaction()


def _method(name: str, *, write: bool) -> Callable[..., Coroutine[Any, Any, Any]]:
    async def method(self: TxCollection, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, args, kwargs, write=write)

    method.__name__ = name
    return method


class TxCollection:
    """`AsyncCollection` over a mongomock-ng collection."""

    def __init__(self, database: TxDatabase, inner: Any) -> None:
        self.database = database
        self._inner = inner

    @property
    def name(self) -> str:
        return str(self._inner.name)

    @property
    def full_name(self) -> str:
        return f"{self.database.name}.{self.name}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TxCollection):
            return NotImplemented
        return (self.database, self.name) == (other.database, other.name)

    def __hash__(self) -> int:
        return hash((self.database.name, self.name))

    def __repr__(self) -> str:
        return f"TxCollection({self.full_name!r})"

    def _call(
        self, method: str, args: Sequence[Any], kwargs: dict[str, Any], *, write: bool
    ) -> Any:
        session = kwargs.pop("session", None)
        if session is not None:
            if not isinstance(session, TxSession):
                raise TypeError(f"session must be a TxSession, got {type(session).__name__}")
            if session.has_ended:
                raise InvalidOperation("Cannot use ended session")
            session._check_alive()
            if write and session.in_transaction:
                try:
                    session._hold((self.database.name, self.name))
                    if method in ("bulk_write", "insert_many") and len(args) < 2:
                        kwargs["ordered"] = True  # its first error ends it (see module doc)
                    return self._run(method, args, {**kwargs, "session": session._inner})
                except OperationFailure:  # BulkWriteError and DuplicateKeyError included
                    session._abort_on_error()
                    raise
            # Reads run without it (see the module doc), and so do writes outside a
            # transaction (mongomock-ng would do nothing else with it).
        if not write:
            kwargs.pop("hint", None)  # mongomock-ng ignores hints, with a warning each time
        return self._run(method, args, kwargs)

    def _run(self, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        try:
            return getattr(self._inner, method)(*args, **kwargs)
        except BulkWriteError as error:
            # mongomock-ng records a write error by its str(), which PyMongo suffixes with the
            # full error: keep the server's errmsg for the refusals raised here.
            for entry in error.details.get("writeErrors", ()):
                if entry.get("code") in _CODE_NAMES and isinstance(entry.get("errmsg"), str):
                    entry["errmsg"] = entry["errmsg"].split(", full error: ", 1)[0]
            raise
        except WriteError as error:
            # A findAndModify's refusal of a document's content is a command error.
            if not method.startswith("find_one_and_") or error.code not in _CODE_NAMES:
                raise
            message = (error.details or {}).get("errmsg", str(error))
            raise _failure(message, error.code, _CODE_NAMES[error.code]) from None

    find_one = _method("find_one", write=False)
    count_documents = _method("count_documents", write=False)
    estimated_document_count = _method("estimated_document_count", write=False)
    distinct = _method("distinct", write=False)
    index_information = _method("index_information", write=False)
    insert_one = _method("insert_one", write=True)
    insert_many = _method("insert_many", write=True)
    update_one = _method("update_one", write=True)
    update_many = _method("update_many", write=True)
    replace_one = _method("replace_one", write=True)
    delete_one = _method("delete_one", write=True)
    delete_many = _method("delete_many", write=True)
    find_one_and_update = _method("find_one_and_update", write=True)
    find_one_and_delete = _method("find_one_and_delete", write=True)
    find_one_and_replace = _method("find_one_and_replace", write=True)
    bulk_write = _method("bulk_write", write=True)
    drop_index = _method("drop_index", write=True)
    drop_indexes = _method("drop_indexes", write=True)
    drop = _method("drop", write=True)

    def find(self, *args: Any, **kwargs: Any) -> TxCursor:
        return TxCursor(self._call("find", args, kwargs, write=False))

    async def aggregate(self, pipeline: Sequence[Mapping[str, Any]], **kwargs: Any) -> TxCursor:
        kwargs.pop("hint", None)  # mongomock-ng ignores it anyway, with a warning each time
        return TxCursor(self._call("aggregate", (list(pipeline),), kwargs, write=False))

    async def list_indexes(self, **kwargs: Any) -> TxCursor:
        return TxCursor(iter(self._call("list_indexes", (), kwargs, write=False)))

    async def create_index(self, keys: Any, **kwargs: Any) -> str:
        name = str(self._call("create_index", (keys,), dict(kwargs), write=True))
        self._never_expire_if_partial({**kwargs, "name": name})
        return name

    async def create_indexes(self, indexes: Sequence[IndexModel], **kwargs: Any) -> list[str]:
        names = list(self._call("create_indexes", (indexes,), kwargs, write=True))
        for model in indexes:
            self._never_expire_if_partial(model.document)
        return names

    def _never_expire_if_partial(self, spec: Mapping[str, Any]) -> None:
        # mongomock-ng's TTL emulation ignores the partial filter (see the module doc).
        if spec.get("expireAfterSeconds") is not None and spec.get("partialFilterExpression"):
            self._inner._store._ttl_indexes.pop(spec["name"], None)


class TxDatabase:
    """`AsyncDatabase` over a mongomock-ng database; mongoq treats it as PyMongo async."""

    mongoq_backend = "pymongo"  # read by mongoq._driver.backend_of

    def __init__(self, client: TxClient, inner: Any) -> None:
        self.client = client
        self._inner = inner
        self.name: str = inner.name

    def __getitem__(self, name: str) -> TxCollection:
        return self.get_collection(name)

    def __getattr__(self, name: str) -> TxCollection:
        return self.get_collection(_public(self, name, "database"))

    def __repr__(self) -> str:
        return f"TxDatabase({self.name!r})"

    def get_collection(self, name: str, **kwargs: Any) -> TxCollection:
        return TxCollection(self, self._inner.get_collection(name, **kwargs))

    async def command(
        self,
        command: str | Mapping[str, Any],
        value: Any = 1,
        check: bool = True,
        allowable_errors: Sequence[str | int] | None = None,
        read_preference: Any = None,
        codec_options: Any = None,
        session: TxSession | None = None,
        comment: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        if session is not None:
            session._check_alive()
        name = command if isinstance(command, str) else next(iter(command))
        if name in ("ping", "hello"):
            now = datetime.now(UTC).replace(tzinfo=None)
            now = now.replace(microsecond=now.microsecond // 1000 * 1000)  # BSON: milliseconds
            # A replica set's answer: the engine has transactions.
            return {"ok": 1.0, "localTime": now, "isWritablePrimary": True, "setName": "tx"}
        spec = {command: value} if isinstance(command, str) else dict(command)
        try:
            return dict(self._inner.command(spec, **kwargs))
        except NotImplementedError as exc:
            message = f"no such command: '{name}' (mongomock_ng: {exc})"
            raise _failure(message, 59, "CommandNotFound") from exc

    async def list_collection_names(self, **kwargs: Any) -> list[str]:
        return list(self._inner.list_collection_names(filter=kwargs.get("filter")))

    async def create_collection(
        self, name: str, *, session: Any = None, check_exists: bool = True, **kwargs: Any
    ) -> TxCollection:
        if name in self._inner.list_collection_names():
            if check_exists:
                raise CollectionInvalid(f"collection {name} already exists")
            message = f"Collection {self.name}.{name} already exists."
            raise _failure(message, 48, "NamespaceExists")
        self._inner.create_collection(name, **kwargs)
        return self.get_collection(name)

    async def drop_collection(self, name_or_collection: str | TxCollection, **kwargs: Any) -> None:
        name = getattr(name_or_collection, "name", name_or_collection)
        self._inner.drop_collection(name)


class TxClient:
    """`AsyncMongoClient` over a mongomock-ng client."""

    def __init__(
        self,
        inner: Any,
        *,
        max_attempts: int = _MAX_ATTEMPTS,
        retry_time_limit: float = _RETRY_TIME_LIMIT,
    ) -> None:
        self._inner = inner
        # bounds of TxSession.with_transaction's retries (see the module doc)
        self.max_attempts = max_attempts
        self.retry_time_limit = retry_time_limit
        self._databases: dict[str, TxDatabase] = {}
        # (database, collection) -> the session whose open transaction writes to it
        self._holders: dict[tuple[str, str], TxSession] = {}

    def __getitem__(self, name: str) -> TxDatabase:
        return self.get_database(name)

    def __getattr__(self, name: str) -> TxDatabase:
        return self.get_database(_public(self, name, "client"))

    def get_database(self, name: str) -> TxDatabase:
        if name not in self._databases:
            self._databases[name] = TxDatabase(self, self._inner[name])
        return self._databases[name]

    def start_session(self, **kwargs: Any) -> TxSession:
        return TxSession(self, self._inner.start_session(**kwargs))

    async def drop_database(self, name_or_database: str | TxDatabase, **kwargs: Any) -> None:
        self._inner.drop_database(getattr(name_or_database, "name", name_or_database))

    async def close(self) -> None:
        self._inner.close()
