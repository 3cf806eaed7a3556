"""The one place that knows how the supported drivers differ.

Supported databases: PyMongo's native async API (`pymongo.AsyncMongoClient`, recommended),
Motor (`motor.motor_asyncio.AsyncIOMotorClient`, which MongoDB supersedes with the former;
still supported), and the embedded in-memory backend (mongomock-motor). Classes that wrap a
database (the instrumentation in `mongoq.testing`) set ``mongoq_wrapper = True`` and expose the
wrapped database as ``mongoq_delegate``; they are seen through.

Differences absorbed here:
- ``aggregate`` is awaited in PyMongo async and returns a cursor directly in Motor/mongomock-motor;
- ``to_list(0)`` is invalid in PyMongo async, so lists are read with an explicit ``limit`` and
  ``to_list(None)``; mongomock-motor ignores ``to_list``'s length altogether;
- mongomock rejects ``bulk_write`` with ``UpdateOne`` under pymongo >= 4.11 (pymongo passes a
  ``sort`` argument it does not know); an ``UpdateMany`` filtered on ``_id`` is the same write,
  so the embedded backend gets that instead;
- the embedded backend has no ``hello`` command, hence no server clock;
- mongomock's TTL emulation ignores ``partialFilterExpression`` (it would delete every document
  older than the TTL, pending work included), so partial TTL indexes are not created there: the
  embedded backend keeps tombstones until the process ends. It also expires on the wall clock,
  not the primitive's: a bare TTL index is created there without its expiry.
What a deployment decides, also here: the topology (``hello``, once per client: standalone,
replica set, sharded) and so whether there are transactions; the concerns every mongoq
collection handle pins (majority writes and reads, the primary) and the options of the
transactions mongoq starts; the server's refusals mongoq turns into its own errors (a hint to
a missing index -> `IndexesMissing`; a document over 16 MiB, see `too_large`).
Owns no collections.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import os
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from pymongo import ReadPreference, UpdateMany, UpdateOne
from pymongo.errors import (
    BulkWriteError,
    CollectionInvalid,
    ConfigurationError,
    ConnectionFailure,
    DocumentTooLarge,
    ExecutionTimeout,
    OperationFailure,
    PyMongoError,
    ServerSelectionTimeoutError,
    WTimeoutError,
)
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from mongoq._unreachable import expect_first_contact, reach, server_unavailable
from mongoq._validation import check_timeout
from mongoq.errors import IndexesMissing, InvalidInput, MongoqError

__all__ = ["TRANSIENT_ERRORS", "Backend", "backend_of", "connect"]

#: Errors after which the outcome of the command is unknown (it may or may not have applied):
#: worth logging and trying again later, never a reason to give up on a lease.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionFailure,
    ExecutionTimeout,
    WTimeoutError,
)
#: Every driver error: what background loops (heartbeats, worker slots) survive and log.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (PyMongoError,)
#: A unique index refused a document.
DUPLICATE_KEY = 11000


def only_duplicates(error: BulkWriteError) -> bool:
    """Whether every write a bulk write refused was refused as a duplicate key (and only
    that): an insert of what may exist already, done."""
    errors = error.details.get("writeErrors", [])
    concern = error.details.get("writeConcernErrors", [])
    return bool(errors) and not concern and all(e.get("code") == DUPLICATE_KEY for e in errors)


#: The server's refusals of a document over 16 MiB: an update's result (17419), an upsert's
#: insert (17420), a document built otherwise (10334). Definite: nothing was written.
TOO_LARGE_CODES = frozenset({17419, 17420, 10334})
#: The server's refusals of an update whose arithmetic meets a field that holds no number:
#: TypeMismatch (14: ``$inc``, ``$mul``, pipeline arithmetic on current servers), and the older
#: codes of ``$add`` (16554) and ``$subtract`` (16556). Definite: nothing was written.
TYPE_MISMATCH_CODES = frozenset({14, 16554, 16556})
_BAD_VALUE = 2
_INDEX_OPTIONS_CONFLICT = 85
_NAMESPACE_EXISTS = 48
T = TypeVar("T")

MEMORY_SCHEME = "memory://"
#: Seconds the first call through a client `connect` made waits for its server (`connect`'s
#: `timeout`): a server that is not there is said within seconds. Later calls keep the driver's
#: server selection timeout (30 s), which rides out a replica set's election (about 12 s).
DEFAULT_TIMEOUT = 5.0


class Backend(enum.Enum):
    PYMONGO = "pymongo"
    MOTOR = "motor"
    MEMORY = "memory"


def too_large(error: BaseException) -> bool:
    """Whether `error` is a refusal of a document over the size limit (server or driver)."""
    if isinstance(error, DocumentTooLarge):
        return True
    return isinstance(error, OperationFailure) and error.code in TOO_LARGE_CODES


def type_mismatch(error: BaseException) -> bool:
    """Whether `error` is a refusal of an update for a field of the wrong type (a malformed
    document: `TYPE_MISMATCH_CODES`), in a single write or a findAndModify."""
    return isinstance(error, OperationFailure) and error.code in TYPE_MISMATCH_CODES


def missing_index(error: BaseException) -> bool:
    """Whether `error` is the server's refusal of a hint to an index that does not exist."""
    return (
        isinstance(error, OperationFailure)
        and error.code == _BAD_VALUE
        and "hint provided does not correspond to an existing index" in str(error)
    )


class _IndexRequired:
    """The context of `index_required` (a class, not a generator: it wraps every claim)."""

    __slots__ = ("collection", "index")

    def __init__(self, collection: Any, index: str | None) -> None:
        self.collection = collection
        self.index = index

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        if self.index is None or not isinstance(error, OperationFailure):
            return
        if not missing_index(error):
            return
        collection = self.collection
        name = getattr(collection, "full_name", None) or getattr(collection, "name", "?")
        raise IndexesMissing(
            f"{name} has no index {self.index!r}: mongoq's indexes were never created here; run "
            "the primitive's setup() once, at deploy time or when the service starts"
        ) from error


def index_required(collection: Any, index: str | None) -> _IndexRequired:
    """Turn a refused hint to `index` into `IndexesMissing`, naming the collection and the
    set-up call: the same clear error on the first call, never a failure logged every poll."""
    return _IndexRequired(collection, index)


def unwrap(db: Any) -> Any:
    """The innermost database behind any number of instrumentation wrappers."""
    # Look on the type: a database answers any attribute name with a collection of that name.
    while getattr(type(db), "mongoq_wrapper", False):
        db = db.mongoq_delegate
    return db


def backend_of(db: Any) -> Backend:
    """Which driver `db` belongs to; `InvalidInput` for anything else (e.g. a blocking client)."""
    kind = type(unwrap(db))
    module = kind.__module__
    # An adapter that behaves exactly like one driver says so (the test suite's transactional
    # engine declares itself PyMongo-shaped).
    declared = getattr(kind, "mongoq_backend", None)
    if isinstance(declared, str):
        return Backend(declared)
    # mongomock-motor masquerades as Motor (through `__class__`, and its wrapper classes copy
    # Motor's `__module__`); its own base classes in the MRO give it away.
    if any(base.__module__.startswith("mongomock_motor") for base in kind.__mro__):
        return Backend.MEMORY
    if module.startswith("motor"):
        return Backend.MOTOR
    if module.startswith("pymongo.asynchronous"):
        return Backend.PYMONGO
    raise InvalidInput(
        "db",
        "expected an async database (pymongo.AsyncMongoClient()[name], Motor, or "
        f"mongoq.connect()), got {type(db).__module__}.{type(db).__qualname__}",
    )


def _client(uri: str, driver: str, options: dict[str, Any]) -> Any:
    """The driver's client of `uri`; a URI the driver cannot read is `InvalidInput` naming
    ``uri`` (its password never quoted: the driver's message names only the part at fault)."""
    client_class: Any
    if driver == "motor":
        with extra_required("motor", 'driver="motor"'):
            from motor.motor_asyncio import AsyncIOMotorClient

        client_class = AsyncIOMotorClient
    elif driver == "pymongo":
        from pymongo import AsyncMongoClient

        client_class = AsyncMongoClient
    else:
        raise InvalidInput("driver", f"must be 'pymongo' or 'motor', got {driver!r}")
    try:
        return client_class(uri, **options)
    except (ValueError, ConfigurationError) as error:
        said = str(error)
        if "@" not in uri:  # the driver's hint is about escaping a password: none here
            said = said.split(" Hint:")[0]
        raise InvalidInput("uri", f"is not a MongoDB URI the driver can read: {said}") from None


def connect(
    uri: str | None = None,
    database: str = "mongoq",
    *,
    driver: str = "pymongo",
    timeout: float | None = DEFAULT_TIMEOUT,
    client_options: Mapping[str, Any] | None = None,
) -> Any:
    """Build an async database handle; see `mongoq.connect`. `client_options` go to a server
    client's constructor (e.g. ``event_listeners`` for command monitoring)."""
    if not isinstance(database, str) or not database:
        raise InvalidInput("database", "must be a non-empty string")
    check_timeout("timeout", timeout)
    if uri is None:
        uri = os.environ.get("MONGOQ_URI") or None
    if uri is None or uri == MEMORY_SCHEME:
        # mongomock-motor, refusing what a server refuses (16 MiB, hints, transactions): see
        # mongoq._embedded. Imported here: the embedded backend is an extra.
        with extra_required("embedded", "the embedded backend (connect() with no URI)"):
            from mongoq._embedded import embedded_database

        return embedded_database(database)
    if not isinstance(uri, str) or not uri.startswith(("mongodb://", "mongodb+srv://")):
        raise InvalidInput("uri", "must start with mongodb://, mongodb+srv:// or memory://")
    client = _client(uri, driver, dict(client_options or {}))
    if timeout is not None:
        expect_first_contact(client, float(timeout))
    return client[database]


@contextlib.contextmanager
def extra_required(extra: str, feature: str) -> Iterator[None]:
    """An import of an optional dependency: missing, it is a `MongoqError` naming the extra."""
    try:
        yield
    except ImportError as error:
        raise MongoqError(
            f"{feature} needs the {extra!r} extra: pip install 'mongoq-queue[{extra}]' "
            f"(missing: {error.name or error})"
        ) from error


#: Documents a server returns in a cursor's first batch when the command names no batch size.
FIRST_BATCH = 101


async def find_list(
    collection: Any,
    filter: Mapping[str, Any],
    *,
    sort: Sequence[tuple[str, int]] | None = None,
    limit: int = 0,
    projection: Mapping[str, Any] | None = None,
    hint: str | None = None,
    batch_size: int | None = None,
) -> list[dict[str, Any]]:
    """Run a find and read all of it; `limit=0` means no limit. A read of more than a server's
    first batch (101 documents) asks for `batch_size` (default: `limit`) in its first, so that
    it takes one round trip, not a find and a getMore."""
    cursor = collection.find(filter, projection, sort=sort, limit=limit)
    if hint is not None:  # chained: mongomock's `find` rejects a `hint` argument
        cursor = cursor.hint(hint)
    size = batch_size or limit
    if size > FIRST_BATCH:
        cursor = cursor.batch_size(size)
    with index_required(collection, hint):
        return list(await cursor.to_list(None))


def ids_after(last: str | int) -> dict[str, Any]:
    """The documents whose ``_id`` (a string or an int) sorts after `last` in BSON order. A
    server compares an id only with ids of its own type and sorts numbers before strings: after
    an int, every string id follows too."""
    later: dict[str, Any] = {"_id": {"$gt": last}}
    if isinstance(last, int):
        return {"$or": [later, {"_id": {"$type": "string"}}]}
    return later


def within(since: Any, until: Any | None) -> dict[str, Any]:
    """A field's condition for the window ``[since, until)`` (`until` None: open-ended):
    consecutive windows hold each value once."""
    return {"$gte": since} if until is None else {"$gte": since, "$lt": until}


def owned_by(pairs: Sequence[tuple[Any, Any]], token_field: str = "token") -> dict[str, Any]:
    """A filter matching the documents ``(_id, token)`` of `pairs`: one ``_id $in`` per distinct
    token (a batch shares one), rather than an ``$or`` branch per document."""
    by_token: dict[Any, list[Any]] = {}
    for doc_id, token in pairs:
        by_token.setdefault(token, []).append(doc_id)
    branches = [{"_id": {"$in": ids}, token_field: token} for token, ids in by_token.items()]
    return branches[0] if len(branches) == 1 else {"$or": branches}


async def aggregate_list(
    collection: Any, pipeline: Sequence[Mapping[str, Any]], *, hint: str | None = None
) -> list[Any]:
    """Run an aggregation and read all of it, whichever driver."""
    options = {} if hint is None else {"hint": hint}
    with index_required(collection, hint):
        cursor = collection.aggregate(list(pipeline), **options)
        if inspect.isawaitable(cursor):
            cursor = await cursor
        return list(await cursor.to_list(None))


def update_by_id(
    db: Any, filter: Mapping[str, Any], update: Any, *, upsert: bool = False
) -> UpdateOne | UpdateMany:
    """A bulk-write operation updating the one document `filter` selects by ``_id``."""
    if "_id" not in filter:
        raise ValueError("update_by_id needs an _id in the filter")
    return update_single(db, filter, update, upsert=upsert)


def update_single(
    db: Any, filter: Mapping[str, Any], update: Any, *, upsert: bool = False
) -> UpdateOne | UpdateMany:
    """A bulk-write operation updating the one document `filter` selects (by ``_id`` or by the
    fields of a unique index: it can match no more than one)."""
    if backend_of(db) is Backend.MEMORY:
        return UpdateMany(dict(filter), update, upsert=upsert)
    return UpdateOne(dict(filter), update, upsert=upsert)


async def create_partial_ttl_index(
    db: Any,
    collection: Any,
    field: str,
    *,
    name: str,
    expire_after: int,
    partial: Mapping[str, Any],
) -> bool:
    """Create a TTL index limited to `partial`; False where the backend cannot honour the limit."""
    if backend_of(db) is Backend.MEMORY:
        return False
    try:
        await collection.create_index(
            [(field, 1)],
            name=name,
            expireAfterSeconds=expire_after,
            partialFilterExpression=dict(partial),
        )
    except OperationFailure as exc:
        if exc.code != _INDEX_OPTIONS_CONFLICT:
            raise
        existing = (await collection.index_information()).get(name, {})
        same_index = list(existing.get("key", [])) == [(field, 1)] and dict(
            existing.get("partialFilterExpression", {})
        ) == dict(partial)
        if not same_index:  # not an expiry change: another index in the way (say so)
            raise
        # The index exists with another expiry: change it in place rather than fail.
        await db.command(
            "collMod", collection.name, index={"name": name, "expireAfterSeconds": expire_after}
        )
    return True


async def create_ttl_index(
    db: Any, collection: Any, field: str, *, name: str, expire_after: int
) -> bool:
    """Create a TTL index over every document of `collection` (one whose documents all expire:
    the running workers' presences). The embedded backend expires documents on the wall clock,
    not on the primitive's clock (a test's `ManualClock`): there the index is created without
    its expiry, still serving the reads that filter on `field`, and this returns False."""
    if backend_of(db) is Backend.MEMORY:
        await collection.create_index([(field, 1)], name=name)
        return False
    await collection.create_index([(field, 1)], name=name, expireAfterSeconds=expire_after)
    return True


class Topology(enum.Enum):
    """What kind of deployment a database handle talks to."""

    EMBEDDED = "embedded"
    STANDALONE = "standalone"
    REPLICA_SET = "replica_set"
    SHARDED = "sharded"


# Keyed by the client object's id, holding the client weakly so that a new client reusing the
# address of a dead one is asked again. Clients are not hashable by identity (PyMongo's compare
# equal by their seeds), hence not a WeakKeyDictionary.
_TOPOLOGIES: dict[int, tuple[weakref.ref[Any], Topology]] = {}


def topology_from_hello(reply: Mapping[str, Any]) -> Topology:
    """Read the deployment kind from a ``hello`` reply: a mongos says ``msg: "isdbgrid"``, a
    replica-set member names its set, anything else is a standalone."""
    if reply.get("msg") == "isdbgrid":
        return Topology.SHARDED
    if reply.get("setName"):
        return Topology.REPLICA_SET
    return Topology.STANDALONE


async def topology(db: Any) -> Topology:
    """The deployment behind `db`, asked once per client with ``hello`` and remembered."""
    if backend_of(db) is Backend.MEMORY:
        return Topology.EMBEDDED
    client = unwrap(db).client
    known = _TOPOLOGIES.get(id(client))
    if known is not None and known[0]() is client:
        return known[1]
    found = topology_from_hello(await unwrap(db).command("hello"))
    with contextlib.suppress(TypeError):  # a client without weak references: asked again
        _TOPOLOGIES[id(client)] = (weakref.ref(client), found)
    return found


async def supports_transactions(db: Any) -> bool:
    """Whether `db` can run multi-document transactions: a replica set or a sharded cluster
    can; a standalone server and the embedded backend cannot."""
    return await topology(db) in (Topology.REPLICA_SET, Topology.SHARDED)


async def require_transactions(db: Any, feature: str) -> None:
    """Raise `MongoqError` naming `feature` and the fix when `db` has no transactions (checked
    before anything is written)."""
    kind = await topology(db)
    if kind in (Topology.REPLICA_SET, Topology.SHARDED):
        return
    where = "the embedded backend" if kind is Topology.EMBEDDED else "a standalone server"
    raise MongoqError(
        f"{feature} needs multi-document transactions, which {where} does not have: run "
        "MongoDB as a replica set (a single node is enough: start mongod with --replSet rs0 "
        "and run rs.initiate() once)"
    )


def in_transaction(session: Any) -> bool:
    """Whether `session` (any driver's) has a transaction started."""
    return bool(getattr(session, "in_transaction", False))


#: Writes wait for a majority: an acknowledged claim, settle or publish survives a failover
#: (with ``w=1`` a new primary can roll back a claim and hand the work to a second holder).
WRITE_CONCERN = WriteConcern(w="majority")
#: Reads see only majority-committed data and, with majority writes on the primary, this
#: worker's own writes: never a claim that a failover could roll back.
READ_CONCERN = ReadConcern("majority")
#: Reads from the primary: a secondary lags, and the read-backs after claims must see them.
READ_PREFERENCE = ReadPreference.PRIMARY
#: How long a commit may wait for its write concern before the driver reports it.
MAX_COMMIT_TIME_MS = 10_000


def collection(db: Any, name: str) -> Any:
    """The handle mongoq uses for collection `name`: majority writes and reads on the primary,
    whatever the client's defaults (a URI's ``w=1`` or ``readPreference=secondary``)."""
    return db.get_collection(
        name,
        write_concern=WRITE_CONCERN,
        read_concern=READ_CONCERN,
        read_preference=READ_PREFERENCE,
    )


def transaction_options() -> dict[str, Any]:
    """Options of the transactions mongoq starts: snapshot reads, majority writes, the
    primary, and a bound on the commit."""
    return {
        "read_concern": ReadConcern("snapshot"),
        "write_concern": WRITE_CONCERN,
        "read_preference": READ_PREFERENCE,
        "max_commit_time_ms": MAX_COMMIT_TIME_MS,
    }


async def run_in_transaction(db: Any, work: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``work(session)`` in a transaction of its own (`transaction_options`), retried by
    the driver on transient errors (`with_transaction`), and return what it returned."""
    session = unwrap(db).client.start_session()
    if inspect.isawaitable(session):  # Motor awaits it, PyMongo async does not
        session = await session
    async with session:
        result: T = await session.with_transaction(work, **transaction_options())
        return result


async def create_collections(db: Any, names: Sequence[str]) -> None:
    """Create the collections in `names` that do not exist yet: collections created implicitly
    inside concurrent transactions conflict with each other."""
    listed = db.list_collection_names()
    existing = set(await listed if inspect.isawaitable(listed) else listed)
    for name in names:
        if name in existing:
            continue
        try:
            await db.create_collection(name)
        except CollectionInvalid:  # created meanwhile by another process
            pass
        except OperationFailure as exc:
            if exc.code != _NAMESPACE_EXISTS:
                raise


async def close(db: Any) -> None:
    """Close the client behind `db` (awaited in PyMongo async, a plain call in Motor)."""
    outcome = unwrap(db).client.close()
    if inspect.isawaitable(outcome):
        await outcome


async def ping(db: Any) -> None:
    """Ask the server to answer (``ping``, within `connect`'s timeout on a client it made);
    `ServerUnavailable` when none does in time."""
    if await reach(db):
        return  # the first contact's ping answered: no second one
    try:
        await db.command("ping")
    except ServerSelectionTimeoutError as error:
        raise server_unavailable(error) from None


async def server_local_time(db: Any) -> datetime | None:
    """The server's clock from ``hello``, or None where the backend cannot tell."""
    if backend_of(db) is Backend.MEMORY:
        return None
    reply = await db.command("hello")
    local_time = reply.get("localTime")
    return local_time if isinstance(local_time, datetime) else None


# ---------------------------------------------------------------------------- change streams

#: The definite refusals of ``$changeStream``: this deployment has no change streams, and
#: asking again will not change that. A standalone server says 40573 ("only supported on replica
#: sets"); MongoDB-compatible services without streams say CommandNotSupported (115) or
#: NotImplemented (238) (codes from the server's src/mongo/base/error_codes.yml). Any other
#: failure (a network error, a step-down, CappedPositionLost 136, ...) may pass: it is retried.
NO_CHANGE_STREAMS_CODES = frozenset({40573, 115, 238})


class NoChangeStreams(Exception):
    """The backend has no change streams (the embedded backend, a standalone server, a
    compatible service without them)."""


async def open_change_stream(collection: Any, pipeline: Sequence[Mapping[str, Any]]) -> Any:
    """`collection.watch(pipeline)`, opened (awaited in PyMongo async, at once in Motor): an
    async iterator of change events with an awaitable ``close()``. `NoChangeStreams` where
    there are none; a driver error otherwise."""
    watch = getattr(collection, "watch", None)
    # mongomock hands out a sub-collection named "watch" for the attribute: not a method.
    if not callable(watch) or type(watch).__module__.startswith("mongomock"):
        raise NoChangeStreams("this backend has no change streams")
    try:
        stream = watch(list(pipeline))
        if inspect.isawaitable(stream):
            stream = await stream
    except OperationFailure as error:
        if error.code in NO_CHANGE_STREAMS_CODES:
            raise NoChangeStreams(str(error)) from error
        raise
    return stream


def no_change_streams(error: BaseException) -> bool:
    """Whether `error` is a definite refusal of change streams (`NO_CHANGE_STREAMS_CODES`)."""
    return isinstance(error, OperationFailure) and error.code in NO_CHANGE_STREAMS_CODES


async def close_change_stream(stream: Any) -> None:
    """Close a stream `open_change_stream` opened, whichever driver."""
    outcome = stream.close()
    if inspect.isawaitable(outcome):
        await outcome
