"""The group transport's batched claim on a real server (``explain``): what the embedded
backend cannot tell. Runs on the server lanes only (``MONGOQ_TEST_URI``), skipped elsewhere.

claim_many's one read brings each candidate lock with its head through a ``$lookup``; the
server runs that sub-pipeline once per lock, and it must walk ``group_head`` (one key a lock),
never scan ``messages``, however long each group's backlog.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from mongoq import AsyncGroupTransport, NewMessage
from mongoq.testing import CommandCounter, ManualClock, instrument
from tests.conftest import SERVERS
from tests.support.group_helpers import PREFIX
from tests.support.test_index_audit import ChainRecorder, _explain_command, plan_mappings


def lookup_stages(explain: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The ``$lookup`` stages of the pipeline an aggregation's explain output says ran, with
    their statistics (not the ``$lookup`` of the command it echoes back)."""
    return (node for node in plan_mappings(explain) if "$lookup" in node)


#: What a server answers to ``explain`` of claim_many's read (``executionStats``), as MongoDB 6.0
#: to 8.0 shape it, abridged: the pipeline as run under ``stages`` (the ``$cursor`` with its
#: ``queryPlanner.winningPlan``, then the ``$lookup`` with its statistics), and the explained
#: command echoed back under ``command``, its pipeline and ``$lookup`` included.
RECORDED_EXPLAIN: dict[str, Any] = {
    "explainVersion": "1",
    "stages": [
        {
            "$cursor": {
                "queryPlanner": {
                    "namespace": "mongoq_test.g_locks",
                    "winningPlan": {
                        "stage": "FETCH",
                        "inputStage": {"stage": "IXSCAN", "indexName": "claim"},
                    },
                    "rejectedPlans": [
                        {"stage": "FETCH", "inputStage": {"stage": "IXSCAN", "indexName": "x"}}
                    ],
                },
                "executionStats": {"nReturned": 20, "totalDocsExamined": 20},
            },
            "nReturned": 20,
        },
        {
            "$lookup": {
                "from": "g_messages", "as": "head", "localField": "_id",
                "foreignField": "group_id", "let": {},
                "pipeline": [{"$sort": {"_id": 1}}, {"$limit": 1}],
            },
            "totalDocsExamined": 20, "totalKeysExamined": 20, "collectionScans": 0,
            "indexesUsed": ["group_head"], "nReturned": 20,
        },
    ],
    "serverInfo": {"host": "localhost", "port": 27017, "version": "7.0.40"},
    "command": {
        "aggregate": "g_locks",
        "pipeline": [
            {"$match": {"priority": {"$in": [0]}}},
            {"$sort": {"priority": -1, "available_at": 1}},
            {"$limit": 20},
            {
                "$lookup": {
                    "from": "g_messages", "localField": "_id", "foreignField": "group_id",
                    "pipeline": [{"$sort": {"_id": 1}}, {"$limit": 1}], "as": "head",
                }
            },
        ],
        "cursor": {},
        "$db": "mongoq_test",
    },
    "ok": 1.0,
}  # fmt: skip


def test_the_plan_is_read_from_the_stages_a_server_ran_never_from_the_echoed_command() -> None:
    (lookup,) = list(lookup_stages(RECORDED_EXPLAIN))
    assert lookup["indexesUsed"] == ["group_head"] and lookup["collectionScans"] == 0


async def test_claim_many_reads_each_head_from_the_group_head_index_on_a_real_server(
    db: Any, request: pytest.FixtureRequest
) -> None:
    if request.node.callspec.params["db"] not in SERVERS:
        pytest.skip("explain needs a real server: set MONGOQ_TEST_URI")
    recorder = ChainRecorder(db)
    counter = CommandCounter()
    transport = AsyncGroupTransport(instrument(recorder, counter), PREFIX, clock=ManualClock())
    await transport.setup()
    # 40 groups with 15 messages each: a scan would examine 600 messages, the index a key a
    # group. The claim takes 20; explained afterwards, the same read finds the other 20.
    await transport.publish_many(NewMessage(f"g{n % 40}", n) for n in range(600))
    counter.record = True
    leases = await transport.claim_many(20, "A")
    counter.record = False
    assert sorted(lease.event for lease in leases) == list(range(20))

    (read,) = [op for op in counter.operations if op.name == "aggregate"]
    explain = await db.command(
        {"explain": _explain_command(read, recorder), "verbosity": "executionStats"}
    )
    (lookup,) = list(lookup_stages(explain))
    assert lookup.get("collectionScans") == 0, lookup
    assert lookup.get("indexesUsed") == ["group_head"], lookup
    # The lookups ran for the 20 candidates left, a key and a message each (a few more at most).
    assert 20 <= int(lookup.get("totalDocsExamined", 0)) <= 40, lookup
