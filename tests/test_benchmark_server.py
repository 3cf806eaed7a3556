"""The real-server parts of the benchmarks, checked on what they are given: the command
monitoring counter on synthetic events, and the explain commands and their reading on recorded
operations and canned explain output (no server runs here; see benchmarks/server.py)."""

from __future__ import annotations

from typing import Any

from pymongo import monitoring

from benchmarks.server import ServerCommandCounter, docs_examined, explain_command
from mongoq.testing import Operation


def started(command: dict[str, Any], database: str = "bench") -> monitoring.CommandStartedEvent:
    return monitoring.CommandStartedEvent(command, database, 1, ("localhost", 27017), 1)


def test_the_server_counter_counts_the_databases_commands_not_the_clients_own() -> None:
    counter = ServerCommandCounter("bench")
    for event in (
        started({"find": "tasks"}),
        started({"getMore": 1, "collection": "tasks"}),
        started({"hello": 1}),  # a handshake
        started({"endSessions": []}),
        started({"find": "tasks"}, database="other"),
    ):
        counter.started(event)
    assert counter.total == 2
    counter.reset()
    assert counter.total == 0


def test_explain_commands_repeat_what_was_sent() -> None:
    find = Operation(
        "deliveries", "find", ({"lane": "ready"},), {"sort": [("due_at", 1)], "limit": 5}, None,
        (("hint", ("claim",)),),
    )  # fmt: skip
    assert explain_command(find) == {
        "find": "deliveries", "filter": {"lane": "ready"}, "sort": {"due_at": 1}, "limit": 5,
        "hint": "claim",
    }  # fmt: skip
    claim = Operation(
        "tasks", "find_one_and_update", ({"lease_until": {"$lte": 1}}, {"$set": {"s": 1}}),
        {"sort": [("priority", -1)], "hint": "claim"}, None,
    )  # fmt: skip
    assert explain_command(claim) == {
        "findAndModify": "tasks", "query": {"lease_until": {"$lte": 1}},
        "update": {"$set": {"s": 1}}, "sort": {"priority": -1}, "hint": "claim",
    }  # fmt: skip
    pipeline = [{"$match": {"lane": "parked"}}]
    aggregate = Operation("deliveries", "aggregate", (pipeline,), {"hint": "parked"}, None)
    assert explain_command(aggregate) == {
        "aggregate": "deliveries",
        "pipeline": pipeline,
        "cursor": {},
        "hint": "parked",
    }
    assert explain_command(Operation("tasks", "insert_many", ([{}],), {}, None)) is None


def test_documents_examined_are_read_from_every_shape_of_explain() -> None:
    assert docs_examined({"executionStats": {"totalDocsExamined": 3}}) == 3
    sharded = {"executionStats": {"shards": [{"totalDocsExamined": 2}, {"totalDocsExamined": 5}]}}
    assert docs_examined(sharded) == 7
    stages = {"stages": [{"$cursor": {"executionStats": {"totalDocsExamined": 4}}}, {"$group": {}}]}
    assert docs_examined(stages) == 4
    assert docs_examined({}) == 0
