"""The outbox claim's query plans on a real server (``explain``): what the embedded backend
cannot tell. Each runs on the server lanes only (``MONGOQ_TEST_URI``) and is skipped elsewhere.

- the scan of every lane uses ``ready`` and sorts nothing in memory;
- the scan of some lanes (one held by another owner) merges the ``claim`` ranges of at most 200
  lanes (``SORT_MERGE``), and its next page, two ranges a lane, stays within the same limit;
- what comes before the heads of several keys is one ``$or`` of ``ordering`` ranges;
- unparking is a distinct scan of ``parked_keys`` (one seek a key), with no FETCH filter (6.0
  keeps one for a predicate that is not on an index key), no in-memory sort;
- a claim of some handlers reads their lanes by ``_id`` ranges, never the whole collection.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from mongoq.outbox import AsyncOutbox, Event
from mongoq.testing import CommandCounter, ManualClock, Operation, instrument
from tests.conftest import SERVERS
from tests.support.outbox_helpers import PREFIX, SUBSCRIPTIONS, key_in_lane
from tests.support.test_index_audit import ChainRecorder, _explain_command, plan_mappings


def plan_nodes(explain: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every stage of the winning plan of an explain output, as its mapping (``stage``,
    ``indexName``...): never a rejected plan's, nor anything of the echoed command."""
    return (node for node in plan_mappings(explain) if isinstance(node.get("stage"), str))


async def explained(db: Any, recorder: ChainRecorder, op: Operation) -> list[Mapping[str, Any]]:
    command = _explain_command(op, recorder)
    winning = await db.command({"explain": command, "verbosity": "queryPlanner"})
    return list(plan_nodes(winning))


def stages(nodes: list[Mapping[str, Any]]) -> set[str]:
    return {str(node["stage"]) for node in nodes}


def indexes(nodes: list[Mapping[str, Any]]) -> set[str]:
    return {str(node["indexName"]) for node in nodes if "indexName" in node}


def unpark_problems(nodes: list[Mapping[str, Any]]) -> list[str]:
    """What keeps unparking's plan from being one index seek a key: no DISTINCT_SCAN, or a
    FETCH that filters what it fetched (a server never makes such a scan a distinct scan: a
    key it skipped might be the one whose document passes)."""
    problems = [] if "DISTINCT_SCAN" in stages(nodes) else ["no DISTINCT_SCAN"]
    problems += [
        f"FETCH filters {sorted(node['filter'])}"
        for node in nodes
        if node["stage"] == "FETCH" and node.get("filter")
    ]
    return problems


async def explainable(
    odb: Any, request: pytest.FixtureRequest, clock: ManualClock
) -> tuple[ChainRecorder, CommandCounter, AsyncOutbox]:
    """An outbox set up on a real server whose commands are recorded for `explained` (the test
    is skipped elsewhere)."""
    if request.node.callspec.params["odb"] not in SERVERS:
        pytest.skip("explain needs a real server: set MONGOQ_TEST_URI")
    recorder = ChainRecorder(odb)
    counter = CommandCounter()
    outbox = AsyncOutbox(instrument(recorder, counter), PREFIX, subscriptions=SUBSCRIPTIONS,
                         clock=clock)  # fmt: skip
    await outbox.setup()
    return recorder, counter, outbox


def deliveries_finds(counter: CommandCounter) -> list[Operation]:
    return [op for op in counter.operations if op.collection == f"{PREFIX}deliveries"]


async def test_the_claim_scans_unpark_and_heads_use_their_indexes_on_a_real_server(
    odb: Any, request: pytest.FixtureRequest, clock: ManualClock
) -> None:
    recorder, counter, outbox = await explainable(odb, request, clock)
    # Three keys with 40 waiting each behind their heads, then a backlog over every lane.
    keys = [key_in_lane(lane, "hot") for lane in (5, 6, 7)]
    await outbox.publish(
        [Event(f"{k}-{n}", "order.paid", key=k) for k in keys for n in range(41)], session=None
    )
    await outbox.publish([Event(f"u{n}", "order.paid") for n in range(300)], session=None)
    counter.record = True
    # Every lane free: the `ready` scan, pages past each blocked backlog, the heads looked up.
    heads = await outbox.claim("A", limit=3)
    assert sorted(d.event.key or "" for d in heads) == sorted(keys)
    # B holds a lane: A's scans merge the ranges of the other lanes.
    other = AsyncOutbox(instrument(recorder, counter), PREFIX, subscriptions=SUBSCRIPTIONS,
                        clock=clock)  # fmt: skip
    assert await other.claim("B", limit=1)
    assert await outbox.claim("A", limit=5)
    clock.advance(2)  # the view is read again: unparking looks at the parked keys
    assert await outbox.claim("A", limit=5)
    counter.record = False

    seen: set[str] = set()
    for op in deliveries_finds(counter):
        spec = op.filter or {}
        if op.name == "aggregate":
            kind, index = "unpark", "parked_keys"
        elif op.name != "find" or ("lane" not in spec and "$or" not in spec):
            continue
        elif "lane_id" in spec:
            kind, index = "merge", "claim"
        elif spec.get("lane") == "ready":
            kind, index = "ready", "ready"
        else:
            kind, index = "ahead", "ordering"
        if "$or" in spec and kind in ("merge", "ready"):
            kind += " page"
        nodes = await explained(odb, recorder, op)
        assert "COLLSCAN" not in stages(nodes) and "SORT" not in stages(nodes), (kind, spec)
        assert index in indexes(nodes), (kind, indexes(nodes))
        if kind == "unpark":  # one index seek a key, not a walk of every parked delivery
            assert not unpark_problems(nodes), (unpark_problems(nodes), nodes)
        seen.add(kind)
    assert {"ready", "ready page", "merge", "ahead", "unpark"} <= seen, seen


async def test_a_claim_of_some_handlers_reads_their_lanes_by_id_on_a_real_server(
    odb: Any, request: pytest.FixtureRequest, clock: ManualClock
) -> None:
    """A claim for one handler reads that handler's ``_id`` range of the lanes (and the slots,
    and the lanes it holds of others) through the ``_id`` index: not a scan of every
    handler's lanes."""
    recorder, counter, outbox = await explainable(odb, request, clock)
    await outbox.publish([Event(f"u{n}", "order.created") for n in range(10)], session=None)
    assert await outbox.claim("A", ["mail"], limit=1)
    counter.record = True
    clock.advance(2)  # the view is read again
    assert await outbox.claim("A", ["stats"], limit=1)  # and A's lane of mail by _id
    counter.record = False
    reads = [
        op for op in counter.operations
        if op.collection == f"{PREFIX}lanes" and op.name == "find" and "$or" in (op.filter or {})
    ]  # fmt: skip
    assert reads, "no lane view read of some handlers"
    for op in reads:
        nodes = await explained(odb, recorder, op)
        assert "COLLSCAN" not in stages(nodes), (op.filter, stages(nodes))
        assert indexes(nodes) == {"_id_"}, indexes(nodes)
