"""What only a real server can tell the benchmarks: the commands it received (PyMongo's command
monitoring, beside the counting wrapper every backend has) and, from ``explain``, how many
documents a claim examined. Nothing here runs on the embedded backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pymongo import monitoring

from mongoq.testing import Operation

#: Commands a client sends for itself (handshakes, heartbeats on a pooled socket, session
#: clean-up, authentication): not the library's work.
CLIENT_OWN = frozenset(
    {"hello", "ismaster", "isMaster", "ping", "endSessions", "saslStart", "saslContinue",
     "buildInfo", "getnonce", "authenticate"}
)  # fmt: skip


class ServerCommandCounter(monitoring.CommandListener):
    """Counts the commands the server received for one database (PyMongo command monitoring),
    leaving out the client's own (`CLIENT_OWN`)."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.total = 0

    def reset(self) -> None:
        self.total = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.database_name == self.database and event.command_name not in CLIENT_OWN:
            self.total += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        return None

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        return None


def explain_command(op: Operation) -> dict[str, Any] | None:
    """The server command a recorded read (or the read half of a findAndModify) sends, ready to
    explain; None for what is not a query (inserts, bulk writes)."""
    filter = op.filter or {}
    chained = dict(op.chain)
    if op.name in ("find", "find_one"):
        command: dict[str, Any] = {"find": op.collection, "filter": filter}
        sort = op.kwargs.get("sort") or (chained.get("sort") or (None,))[0]
        if sort:
            command["sort"] = dict(sort)
        limit = 1 if op.name == "find_one" else op.kwargs.get("limit")
        if limit:
            command["limit"] = limit
        if "hint" in chained:
            command["hint"] = chained["hint"][0]
        return command
    if op.name == "find_one_and_update":
        command = {"findAndModify": op.collection, "query": filter, "update": op.args[1]}
        if op.kwargs.get("sort"):
            command["sort"] = dict(op.kwargs["sort"])
        if op.kwargs.get("hint") is not None:
            command["hint"] = op.kwargs["hint"]
        return command
    if op.name in ("update_one", "update_many", "delete_one", "delete_many"):
        if op.name.startswith("update"):
            update = {"q": filter, "u": op.args[1], "multi": op.name == "update_many"}
            return {"update": op.collection, "updates": [update]}
        limit = 1 if op.name == "delete_one" else 0
        return {"delete": op.collection, "deletes": [{"q": filter, "limit": limit}]}
    if op.name == "aggregate":
        command = {"aggregate": op.collection, "pipeline": list(op.args[0]), "cursor": {}}
        if op.kwargs.get("hint") is not None:
            command["hint"] = op.kwargs["hint"]
        return command
    if op.name == "count_documents":
        return {"count": op.collection, "query": filter}
    return None


def docs_examined(explained: Mapping[str, Any]) -> int:
    """``totalDocsExamined`` of an ``executionStats`` explain (summed over shards)."""
    stats = explained.get("executionStats")
    if isinstance(stats, Mapping):
        if "totalDocsExamined" in stats:
            return int(stats["totalDocsExamined"])
        return sum(docs_examined({"executionStats": s}) for s in stats.get("shards", ()))
    # Aggregations report per stage: add up their cursor stages.
    return sum(
        docs_examined(stage.get("$cursor", {}))
        for stage in explained.get("stages", ())
        if isinstance(stage, Mapping)
    )


async def examined_by(db: Any, operations: Iterable[Operation]) -> int:
    """Documents the server examines to run `operations` again, from ``explain``."""
    total = 0
    for op in operations:
        command = explain_command(op)
        if command is not None:
            explained = await db.command({"explain": command, "verbosity": "executionStats"})
            total += docs_examined(explained)
    return total
