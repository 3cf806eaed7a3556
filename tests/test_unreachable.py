"""Without a server: `connect()` takes a timeout, and the first call that needs the server
raises one `ServerUnavailable` line naming the hosts and the wait, after one wait, never two."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest
from pymongo.errors import PyMongoError, ServerSelectionTimeoutError

import mongoq
from mongoq import AsyncTaskQueue, MongoqError, ServerUnavailable
from mongoq._unreachable import server_unavailable
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


def test_the_timeout_becomes_the_clients_selection_and_connect_timeouts() -> None:
    db = mongoq.connect("mongodb://127.0.0.1:1/", timeout=2.5)
    options = db.client.options
    assert options.server_selection_timeout == 2.5
    assert options.pool_options.connect_timeout == 2.5


def test_the_uris_own_timeouts_win_and_none_keeps_the_drivers() -> None:
    own = mongoq.connect("mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=9000", timeout=2)
    assert own.client.options.server_selection_timeout == 9
    assert own.client.options.pool_options.connect_timeout == 2
    default = mongoq.connect("mongodb://127.0.0.1:1/", timeout=None)
    assert default.client.options.server_selection_timeout == 30


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


def test_a_reachable_set_without_a_primary_says_so() -> None:
    text = (
        "No primary available for writes, Timeout: 5.0s, Topology Description: "
        "<TopologyDescription id: 1, topology_type: ReplicaSetNoPrimary, servers: "
        "[<ServerDescription ('db1.example', 27017) server_type: RSSecondary, rtt: 0.1>]>"
    )
    error = server_unavailable(ServerSelectionTimeoutError(text))
    assert str(error) == (
        "cannot reach the MongoDB server at db1.example:27017 "
        "(no primary available for writes; gave up after 5 s)"
    )
