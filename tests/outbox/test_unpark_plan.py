"""Unparking's plan on MongoDB 6.0, without a server (issue 25, item 8).

The plan test (test_plans.py) asks a server to explain the unparking aggregation and checks it
with `unpark_problems`: a DISTINCT_SCAN, and no FETCH stage that filters. No server runs here,
so these tests feed that same check an explain reply shaped as 6.0 returns it for the index
unparking had before (written from 6.0's explain format, not captured from a server), and a
plan derived by 6.0's rules from the schema as it stands:

- A ``$match`` predicate on a key of the hinted index becomes that key's index bounds; an
  equality or a string range is answered by the bounds exactly, so it leaves no filter.
- Every other predicate stays as the FETCH stage's filter, a predicate that the index's partial
  filter implies included. 7.0 drops those (``QueryPlannerAccess::processIndexScans``, in
  ``src/mongo/db/query/planner_access.cpp``; ``jstests/core/index/partial_index_optimization.js``
  is tagged ``requires_fcv_70``); 6.0 does not.
- A ``$group`` of one field with only ``$first`` accumulators, after a ``$sort`` the index
  gives (keys bounded to a single point drop out of the order), becomes a DISTINCT_SCAN when
  the FETCH has no filter and every key before the grouped one is bounded to a single point
  (``turnIxscanIntoDistinctIxscan`` in ``src/mongo/db/query/get_executor.cpp``, in
  ``distinct_access.cpp`` since 2024; ``jstests/aggregation/group_conversion_to_distinct_scan.js``
  groups on an index's second key behind an equality on its first).

The rules are checked against the reply first: derived for the index the reply names, they
give the plan it shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from mongoq.outbox import schema
from tests.outbox.test_plans import plan_nodes, unpark_problems

#: The unparking aggregation as a claim of every handler sends it (no range of keys).
PIPELINE = [
    {"$match": {"lane": "parked"}},
    {"$sort": {"parked_key": 1, "sequence": 1}},
    {"$group": {"_id": "$parked_key", "d": {"$first": "$_id"}, "s": {"$first": "$sequence"},
                "t": {"$first": "$due_at"}, "h": {"$first": "$handler"},
                "k": {"$first": "$key"}}},
    {"$sort": {"_id": 1}},
    {"$limit": 50},
]  # fmt: skip

#: The index ``(parked_key, sequence)``, partial ``{lane: "parked"}``, as a 6.0 explain shows
#: its scan: the partial filter's predicate kept in the FETCH stage, no DISTINCT_SCAN.
IXSCAN_60: dict[str, Any] = {
    "stage": "IXSCAN", "planNodeId": 1,
    "keyPattern": {"parked_key": 1, "sequence": 1}, "indexName": "parked_keys",
    "isMultiKey": False, "multiKeyPaths": {"parked_key": [], "sequence": []},
    "isUnique": False, "isSparse": False, "isPartial": True, "indexVersion": 2,
    "direction": "forward",
    "indexBounds": {"parked_key": ["[MinKey, MaxKey]"], "sequence": ["[MinKey, MaxKey]"]},
}  # fmt: skip
FETCH_60: dict[str, Any] = {
    "stage": "FETCH", "planNodeId": 2, "filter": {"lane": {"$eq": "parked"}},
    "inputStage": IXSCAN_60,
}  # fmt: skip
QUERY_PLANNER_60: dict[str, Any] = {
    "namespace": "mongoq_test.ob_deliveries", "indexFilterSet": False,
    "parsedQuery": {"lane": {"$eq": "parked"}},
    "queryHash": "5AF5FE2B", "planCacheKey": "D6F3C2A1",
    "maxIndexedOrSolutionsReached": False, "maxIndexedAndSolutionsReached": False,
    "maxScansToExplodeReached": False, "rejectedPlans": [],
}  # fmt: skip
COMMAND_60: dict[str, Any] = {
    "aggregate": "ob_deliveries", "pipeline": PIPELINE, "hint": "parked_keys", "cursor": {},
    "$db": "mongoq_test",
}  # fmt: skip
SERVER_60 = {"host": "rs0", "port": 27017, "version": "6.0.20", "gitVersion": "0"}
#: 6.0 may run a ``$group`` it cannot make a distinct scan in its slot-based engine (explain
#: version 2, the plan under ``queryPlan``)...
SBE_REPLY_60: dict[str, Any] = {
    "explainVersion": "2",
    "stages": [
        {"$cursor": {"queryPlanner": {
            **QUERY_PLANNER_60,
            "winningPlan": {
                "queryPlan": {"stage": "GROUP", "planNodeId": 3, "inputStage": FETCH_60},
                "slotBasedPlan": {"slots": "$$RESULT=s12 env: { }", "stages": "[3] group"},
            },
        }}},
        {"$sort": {"sortKey": {"_id": 1}, "limit": 50}},
    ],
    "serverInfo": SERVER_60, "command": COMMAND_60, "ok": 1.0,
}  # fmt: skip
#: ... or in its classic one (``internalQueryFrameworkControl``): the check reads both.
CLASSIC_REPLY_60: dict[str, Any] = {
    "explainVersion": "1",
    "stages": [
        {"$cursor": {"queryPlanner": {**QUERY_PLANNER_60, "winningPlan": FETCH_60}}},
        {"$group": PIPELINE[2]["$group"]},
        {"$sort": {"sortKey": {"_id": 1}, "limit": 50}},
    ],
    "serverInfo": SERVER_60, "command": COMMAND_60, "ok": 1.0,
}  # fmt: skip
REPLIES_60 = [pytest.param(SBE_REPLY_60, id="sbe"), pytest.param(CLASSIC_REPLY_60, id="classic")]


def _bound(condition: Any) -> str:
    """A key's bounds as an explain shows them, for the conditions unparking's ``$match`` has:
    an equality or a string range."""
    if not isinstance(condition, Mapping):
        return f'["{condition}", "{condition}"]'
    # A string range without one of its ends stops at the strings' end: "" below, {} above.
    lows = [(v, op) for op, v in condition.items() if op in ("$gt", "$gte")] or [("", "$gte")]
    highs = [(v, op) for op, v in condition.items() if op in ("$lt", "$lte")]
    low, low_op = max(lows)
    opening = "(" if low_op == "$gt" else "["
    if not highs:
        return f'{opening}"{low}", {{}})'
    high, high_op = min(highs)
    return f'{opening}"{low}", "{high}"{")" if high_op == "$lt" else "]"}'


def planned_on_60(keys: Sequence[tuple[str, int]], pipeline: Sequence[Any]) -> dict[str, Any]:
    """The classic plan MongoDB 6.0 makes of unparking's `pipeline` hinted to a partial index of
    `keys`, as its explain shows it, by the rules in the module docstring."""
    match: Mapping[str, Any] = pipeline[0]["$match"]
    grouped = pipeline[2]["$group"]["_id"].removeprefix("$")
    fields = [name for name, _ in keys]
    bounds = {name: [_bound(match[name])] if name in match else ["[MinKey, MaxKey]"]
              for name in fields}  # fmt: skip
    left = {name: {"$eq": value} for name, value in match.items() if name not in fields}
    before = fields[: fields.index(grouped)]
    points = all(name in match and not isinstance(match[name], Mapping) for name in before)
    order = list(pipeline[1]["$sort"].items())
    sorted_by_index = order == list(keys[len(before) : len(before) + len(order)])
    distinct = points and sorted_by_index and not left
    scan = {"stage": "DISTINCT_SCAN" if distinct else "IXSCAN", "keyPattern": dict(keys),
            "indexName": schema.PARKED_INDEX, "indexBounds": bounds}  # fmt: skip
    fetch = {"stage": "FETCH", **({"filter": left} if left else {}), "inputStage": scan}
    return {"stages": [{"$cursor": {"queryPlanner": {"winningPlan": fetch}}}]}


def _kind(bound: str) -> str:
    if bound == "[MinKey, MaxKey]":
        return "all"
    inner = bound[1:-1]
    half = (len(inner) - 2) // 2
    point = bound[0] + bound[-1] == "[]" and inner[:half] == inner[half + 2 :]
    return "point" if point else "range"


def shape(explain: Mapping[str, Any]) -> tuple[Any, ...]:
    """What the rules decide of a plan: its access stages, the fields its FETCH filters, and
    each key's kind of bounds."""
    nodes = [node for node in plan_nodes(explain) if node["stage"] != "GROUP"]
    scan = nodes[-1]
    return (
        [node["stage"] for node in nodes],
        sorted(field for node in nodes for field in node.get("filter", {})),
        scan["keyPattern"],
        {name: _kind(bounds[0]) for name, bounds in scan["indexBounds"].items()},
    )


@pytest.mark.parametrize("reply", REPLIES_60)
def test_the_plan_check_refuses_the_plan_6_0_gives_to_an_index_without_the_lane(
    reply: dict[str, Any],
) -> None:
    # the reply answers the aggregation unparking sends today
    assert schema.delivery_parked_keys(None, None, 50) == reply["command"]["pipeline"]
    assert unpark_problems(list(plan_nodes(reply))) == [
        "no DISTINCT_SCAN",
        "FETCH filters ['lane']",
    ]
    # The rules, for the index the reply names, give the plan it shows.
    recorded = [node for node in plan_nodes(reply) if node["stage"] == "IXSCAN"]
    keys = list(recorded[0]["keyPattern"].items())
    assert shape(planned_on_60(keys, reply["command"]["pipeline"])) == shape(reply)


@pytest.mark.parametrize(
    ("handlers", "after"),
    [(None, None), (["mail", "stats"], None), (["mail"], ("mail", "k7")), (None, ("m", "k"))],
    ids=["every handler", "some handlers", "some handlers, past a key", "past a key"],
)
def test_unparking_is_a_distinct_scan_on_6_0(
    handlers: list[str] | None, after: tuple[str, str] | None
) -> None:
    """The aggregation unparking sends, on the index `setup` declares for it: no FETCH filter
    (every predicate of the ``$match`` is on a key), so 6.0 makes it a DISTINCT_SCAN as 7.0 and
    8.0 do."""
    pipeline = schema.delivery_parked_keys(handlers, after, 50)
    match = pipeline[0]["$match"]
    assert schema.PARKED_DELIVERIES.partial is not None
    # the match implies the partial filter, or no server would use the index at all
    assert all(match.get(name) == value for name, value in schema.PARKED_DELIVERIES.partial.items())
    nodes = list(plan_nodes(planned_on_60(schema.PARKED_DELIVERIES.keys, pipeline)))
    assert not unpark_problems(nodes), (unpark_problems(nodes), nodes)
