"""Shared fixtures: every test runs on the embedded backend and, when ``MONGOQ_TEST_URI`` names
a replica set, on a real server through PyMongo async and through Motor (the real-server lane).
Without the variable those lanes are skipped with a visible reason: the report header says so
and `test_real_server_lane` is reported as skipped with it.

Shims for embedded-backend bugs belong here, commented; none is needed yet: the library itself
avoids what mongomock gets wrong (see `mongoq._driver`).
"""

from __future__ import annotations

import inspect
import os
import random
import re
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import mongoq
import mongoq_sync
from mongoq import _driver
from mongoq.testing import ManualClock, interleaving_database, latency_database, memory_database
from tests.support.blocking import blocking_database
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
NO_CHANGE_STREAMS_SKIP = (
    "this server has no change streams (standalone: 40573); the replica-set jobs run it"
)


# Without a server the lanes are not generated at all (one skip line per test would bury the
# report); the header and tests/test_real_server_lane.py say so instead.
# "interleaved" is the embedded backend with every command yielding to the event loop, as over a
# network (`mongoq.testing.interleaving_database`): the second embedded lane. "latency" adds a
# real, seeded round trip of 0.2-2 ms before and after every command
# (`mongoq.testing.latency_database`): a test that waits for "nothing ready to run" instead of
# a condition fails there as against a server. It runs every test that waits for something
# (`_WAITING`) and a seeded sample of the rest (`LATENCY_SAMPLE`), which changes with each run
# (`MONGOQ_TEST_SEED` repeats one; the report header names it); `MONGOQ_TEST_LATENCY_MS`
# changes its longest delay.
EMBEDDED = ["memory", "interleaved", "latency"]
LATENCY_SAMPLE = 0.05
#: The latency lane's longest delay, before and after a command, in milliseconds.
LATENCY_MS = float(os.environ.get("MONGOQ_TEST_LATENCY_MS") or 2)
RUN_SEED = int(os.environ.get("MONGOQ_TEST_SEED") or random.randrange(1 << 30))
# Set for the processes pytest-xdist starts: each must draw the same sample of the latency lane,
# or their collections differ and the run stops.
os.environ["MONGOQ_TEST_SEED"] = str(RUN_SEED)
SERVERS = [d for d in ("pymongo", "motor") if d in TEST_DRIVERS] if TEST_URI else []
BACKENDS = [*EMBEDDED, *SERVERS]


def pytest_report_header() -> str:
    lanes = f"memory, interleaved, latency (a sample; MONGOQ_TEST_SEED={RUN_SEED})"
    if TEST_URI:
        return f"mongoq backends: {lanes}, and pymongo and motor on MONGOQ_TEST_URI"
    return f"mongoq backends: {lanes} only ({REAL_SERVER_SKIP})"


#: What a test that waits for something to happen through the event loop calls (rather than
#: awaiting the call that does it): it runs on the latency lane always.
_WAITING = (
    "settle(", "wait_for(", "until(", "in_background(", "napping(", "sleeping_until(", "asleep(",
    "scenario(env)",
)  # fmt: skip
#: What a test that forces the order of every command calls (`Interleaving`): the interleaved
#: and latency lanes only change when commands run, which the forced order decides there, so
#: such a test runs on the plain lane (and on a server) only.
_ORDERED = ("every_order(", "race(", "Interleaving(", "all_interleavings(", "lane_orders(")


def _calls(source: str, calls: tuple[str, ...]) -> bool:
    """Whether `source` calls one of `calls` (a whole name: ``trace(`` is no ``race(``)."""
    return any(re.search(rf"(?<![\w]){re.escape(call)}", source) for call in calls)


def _source(item: pytest.Item) -> str | None:
    function = getattr(item, "function", None)
    try:
        return inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return None


def _lane_wanted(item: pytest.Item, lane: str) -> bool:
    """Whether `item`'s instance on embedded `lane` runs (see `_WAITING`, `_ORDERED`)."""
    source = _source(item)
    if source is None or lane not in ("interleaved", "latency"):
        return True
    if _calls(source, _ORDERED):
        return False
    if lane == "interleaved" or _calls(source, _WAITING):
        return True
    return random.Random(f"{RUN_SEED}:{item.nodeid}").random() < LATENCY_SAMPLE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the latency lane's instances of the tests that wait, and a seeded sample of the
    others (by test id and `RUN_SEED`); run the tests that force every command's order on the
    plain lane only."""
    kept, dropped = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        lane = params.params.get("db", params.params.get("odb")) if params else None
        (kept if lane is None or _lane_wanted(item, lane) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


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
    if kind == "latency":
        yield latency_database(
            seed=zlib.crc32(test_id.encode()),
            min_delay=min(0.0002, LATENCY_MS / 1000),
            max_delay=LATENCY_MS / 1000,
        )
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


@pytest.fixture
def blocking_db() -> Iterator[mongoq_sync.Database]:
    """A blocking database (`mongoq_sync`) for tests that are plain (blocking) functions: the
    embedded backend, or a database of its own on ``MONGOQ_TEST_URI``'s server."""
    with blocking_database(TEST_URI) as database:
        yield database


async def skip_without_change_streams(db: Any) -> None:
    """Skip the calling test where `db` has no change streams: the embedded lanes, and a
    standalone server, which refuses ``$changeStream`` (40573), so that a test waiting for an
    event would wait out its time limit. A replica set or a sharded cluster has them."""
    found = await _driver.topology(db)
    if found is _driver.Topology.EMBEDDED:
        pytest.skip("change streams need a real replica set: set MONGOQ_TEST_URI")
    if found is _driver.Topology.STANDALONE:
        pytest.skip(NO_CHANGE_STREAMS_SKIP)
