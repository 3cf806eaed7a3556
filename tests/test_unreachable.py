"""Without a server: `connect()` takes a timeout, and the first call that needs the server
raises one `ServerUnavailable` line naming the hosts and the wait, after one wait, never two."""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Iterator

import anyio
import pytest
from pymongo.errors import PyMongoError, ServerSelectionTimeoutError

import mongoq
from mongoq import AsyncTaskQueue, MongoqError, ServerUnavailable
from mongoq._unreachable import names_unreachable_server, server_unavailable
from tests.support.helpers import rejects


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port bound but not listening: a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


async def test_the_first_call_says_the_server_is_unreachable_after_one_wait(
    closed_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    db = mongoq.connect(f"mongodb://alice:s3cr3tpw@127.0.0.1:{closed_port}/", timeout=0.3)
    queue = AsyncTaskQueue(db, "emails")
    caplog.set_level(logging.DEBUG, logger="pymongo.serverSelection")
    try:
        with pytest.raises(ServerUnavailable) as raised:
            await queue.put("t1", {"to": "a@example.com"})
    finally:
        await mongoq.close(db)

    error = raised.value
    assert str(error) == (
        f"cannot reach the MongoDB server at 127.0.0.1:{closed_port} "
        "(connection refused; gave up after 0.3 s)"
    )
    assert (error.hosts, error.waited) == ((f"127.0.0.1:{closed_port}",), 0.3)
    assert isinstance(error, MongoqError) and isinstance(error, ServerSelectionTimeoutError)
    assert error.__cause__ is None and error.__suppress_context__
    # One server selection waited out its timeout: the server clock's read, which comes first,
    # raised rather than let the put wait a second time.
    failed = [r for r in caplog.records if "Server selection failed" in r.getMessage()]
    assert len(failed) == 1


async def test_each_first_call_waits_the_timeout_until_one_reaches_the_server(
    closed_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The timeout bounds the first contact only: the client keeps the driver's selection
    timeout (30 s) for later calls, which rides out a replica set's election. Until a call
    reached the server, each call is a first contact, bounded again."""
    db = mongoq.connect(f"mongodb://127.0.0.1:{closed_port}/", timeout=0.2)
    assert db.client.options.server_selection_timeout == 30
    queue = AsyncTaskQueue(db, "emails")
    caplog.set_level(logging.DEBUG, logger="pymongo.serverSelection")
    try:
        for _ in range(2):
            with pytest.raises(ServerUnavailable, match=r"gave up after 0\.2 s"):
                await queue.stats()
    finally:
        await mongoq.close(db)
    failed = [r for r in caplog.records if "Server selection failed" in r.getMessage()]
    assert len(failed) == 2


async def test_without_a_timeout_the_first_call_waits_as_the_driver_does(
    closed_port: int,
) -> None:
    db = mongoq.connect(f"mongodb://127.0.0.1:{closed_port}/?serverSelectionTimeoutMS=300",
                        timeout=None)  # fmt: skip
    try:
        with pytest.raises(ServerUnavailable, match=r"gave up after 0\.3 s"):
            await AsyncTaskQueue(db, "emails").get("t1")
    finally:
        await mongoq.close(db)


def test_a_transactions_labels_are_kept() -> None:
    error = ServerSelectionTimeoutError(REPLICA_SET_DOWN)
    error._add_error_label("TransientTransactionError")
    assert server_unavailable(error).has_error_label("TransientTransactionError")


class _Session:
    in_transaction = True


@names_unreachable_server
class _Publisher:
    db = None

    async def publish(self, *, session: object) -> None:
        raise ServerSelectionTimeoutError(REPLICA_SET_DOWN)

    async def in_a_task_group(self) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(functools.partial(self.publish, session=None))


async def test_in_a_transaction_no_server_is_transient_as_the_driver_says() -> None:
    """``with_transaction`` retries the callback on an error labelled transient: PyMongo
    labels a failed server selection inside a transaction so, and the wrapped one keeps it,
    also when it is raised before the driver saw the session (the server clock's read)."""
    with pytest.raises(ServerUnavailable) as raised:
        await _Publisher().publish(session=_Session())
    assert raised.value.has_error_label("TransientTransactionError")
    with pytest.raises(ServerUnavailable) as outside:
        await _Publisher().publish(session=None)
    assert not outside.value.has_error_label("TransientTransactionError")


async def test_an_exception_group_of_selection_errors_is_one_server_unavailable() -> None:
    with pytest.raises(ServerUnavailable, match=r"^cannot reach the MongoDB server at db1"):
        await _Publisher().in_a_task_group()


@pytest.mark.parametrize("timeout", [0, -1, "5", True])
def test_a_bad_timeout_is_refused_naming_it(timeout: object) -> None:
    with rejects("timeout"):
        mongoq.connect("mongodb://127.0.0.1:1/", timeout=timeout)  # type: ignore[arg-type]
    with rejects("timeout"):
        mongoq.connect(timeout=timeout)  # type: ignore[arg-type]


REPLICA_SET_DOWN = (
    "db1.example:27017: [Errno 111] Connection refused (configured timeouts: socketTimeoutMS: "
    "5000.0ms, connectTimeoutMS: 5000.0ms),db2.example:27017: timed out (configured timeouts: "
    "socketTimeoutMS: 5000.0ms, connectTimeoutMS: 5000.0ms), Timeout: 5.0s, Topology "
    "Description: <TopologyDescription id: 1, topology_type: ReplicaSetNoPrimary, servers: "
    "[<ServerDescription ('db1.example', 27017) server_type: Unknown, rtt: None>, "
    "<ServerDescription ('db2.example', 27017) server_type: Unknown, rtt: None>]>"
)


def test_every_host_and_each_distinct_reason_is_named() -> None:
    error = server_unavailable(ServerSelectionTimeoutError(REPLICA_SET_DOWN))
    assert str(error) == (
        "cannot reach the MongoDB server at db1.example:27017, db2.example:27017 "
        "(connection refused, timed out; gave up after 5 s)"
    )
    assert isinstance(error, PyMongoError)  # what code retrying on driver errors catches


def test_an_ipv6_host_is_bracketed() -> None:
    text = REPLICA_SET_DOWN.replace("('db1.example', 27017)", "('::1', 27017)")
    assert server_unavailable(ServerSelectionTimeoutError(text)).hosts[0] == "[::1]:27017"


def test_a_reachable_set_without_a_primary_says_so() -> None:
    text = (
        "No primary available for writes, Timeout: 5.0s, Topology Description: "
        "<TopologyDescription id: 1, topology_type: ReplicaSetNoPrimary, servers: "
        "[<ServerDescription ('db1.example', 27017) server_type: RSSecondary, rtt: 0.1>]>"
    )
    error = server_unavailable(ServerSelectionTimeoutError(text))
    assert str(error) == (
        "no suitable MongoDB server at db1.example:27017 "
        "(no primary available for writes; gave up after 5 s)"
    )


@pytest.mark.parametrize(
    ("uri", "said"),
    [
        ("mongodb://localhost:notaport", "Port contains non-digit characters."),
        ("mongodb://", "Must provide at least one hostname or IP"),
        ("mongodb://user:p@ss@host", "escaped"),  # a password with an '@': the hint stays
    ],
)
@pytest.mark.parametrize("driver", ["pymongo", "motor"])
def test_a_uri_the_driver_cannot_read_is_invalid_input_naming_it(
    uri: str, said: str, driver: str
) -> None:
    with pytest.raises(mongoq.InvalidInput, match=r"^uri: is not a MongoDB URI") as raised:
        mongoq.connect(uri, driver=driver)
    assert said in str(raised.value)
    if "@" not in uri:
        assert "password" not in str(raised.value)  # the driver's hint is for a password
