"""Shared fixtures: every test runs on the embedded backend and, when ``MONGOQ_TEST_URI`` names
a replica set, on a real server through PyMongo async and through Motor (the real-server lane).
Without the variable those lanes are skipped with a visible reason: the report header says so
and `test_real_server_lane` is reported as skipped with it.

Shims for embedded-backend bugs belong here, commented; none is needed yet: the library itself
avoids what mongomock gets wrong (see `mongoq._driver`).
"""

from __future__ import annotations

import os
import uuid
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

import mongoq
from mongoq import _driver
from mongoq.testing import ManualClock, interleaving_database, memory_database
from tests.support.txengine import transactional_database

TEST_URI = os.environ.get("MONGOQ_TEST_URI")
REAL_SERVER_SKIP = "real-server lane: set MONGOQ_TEST_URI to a replica-set URI to run it"
#: Which drivers the real-server lane uses (a CI matrix runs one per job): "pymongo,motor".
TEST_DRIVERS = [
    d.strip() for d in os.environ.get("MONGOQ_TEST_DRIVERS", "pymongo,motor").split(",") if d
]
#: The topology the CI job set up ("replica_set" or "standalone"): the real-server lane fails
#: at once on another, so a misconfigured job cannot pass by skipping what it should run.
TOPOLOGY_EXPECT = os.environ.get("MONGOQ_TEST_TOPOLOGY_EXPECT")
NO_TRANSACTIONS_SKIP = "this server has no transactions (standalone); the replica-set jobs run it"


# Without a server the lanes are not generated at all (one skip line per test would bury the
# report); the header and tests/test_real_server_lane.py say so instead.
# "interleaved" is the embedded backend with every command yielding to the event loop, as over a
# network (`mongoq.testing.interleaving_database`): the second embedded lane.
EMBEDDED = ["memory", "interleaved"]
SERVERS = [d for d in ("pymongo", "motor") if d in TEST_DRIVERS] if TEST_URI else []
BACKENDS = [*EMBEDDED, *SERVERS]


def pytest_report_header() -> str:
    if TEST_URI:
        return "mongoq backends: memory, interleaved, and pymongo and motor on MONGOQ_TEST_URI"
    return f"mongoq backends: memory and interleaved only ({REAL_SERVER_SKIP})"


@pytest.fixture(params=BACKENDS)
async def db(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A fresh, empty database on each backend."""
    async for database in _database(request.param, request.node.nodeid):
        yield database


async def _database(kind: str, test_id: str) -> AsyncIterator[Any]:
    if kind == "memory":
        yield memory_database()
        return
    if kind == "interleaved":
        # Seeded by the test's id: a failing interleaving repeats on every run.
        yield interleaving_database(seed=zlib.crc32(test_id.encode()))
        return
    if kind == "tx":
        yield transactional_database()
        return
    assert TEST_URI is not None
    name = f"mongoq_test_{uuid.uuid4().hex[:10]}"
    database = mongoq.connect(TEST_URI, name, driver=kind)
    try:
        found = await _driver.topology(database)
        if TOPOLOGY_EXPECT and found.value != TOPOLOGY_EXPECT:
            pytest.fail(f"MONGOQ_TEST_URI is a {found.value}; the job expects {TOPOLOGY_EXPECT}")
        yield database
    finally:
        await database.client.drop_database(name)
        await _driver.close(database)


# The outbox runs with and without transactions: "tx" is the test-only transactional engine
# (tests/support/txengine.py, mongomock-ng), the embedded backend has none.
@pytest.fixture(params=[*EMBEDDED, "tx", *SERVERS])
async def odb(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A fresh database on every backend the outbox supports, transactional or not."""
    async for database in _database(request.param, request.node.nodeid):
        yield database


@pytest.fixture(params=["tx", *SERVERS])
async def txdb(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A fresh database with multi-document transactions."""
    async for database in _database(request.param, request.node.nodeid):
        if not await _driver.supports_transactions(database):
            pytest.skip(NO_TRANSACTIONS_SKIP)
        yield database


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
