"""The candidate claim shared by the batched claims of the task queue and the group transport.

A batched claim is two commands: read the ids of the `n` most urgent due documents, then take
those still due with one conditional ``update_many``. On a server other claimers' commands run
between the two, so the slots of one worker read the same candidates at once and all but one
find them taken. A claimer that lost every candidate moves past them: they are no longer due,
so reading again returns the next ones. It reports "nothing" only when nothing is due, so a run
loop never naps while due work waits. Owns no collections.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from mongoq import _driver

log = logging.getLogger("mongoq.claims")

#: Rounds of "every candidate was taken first" before a claim gives up for now. Each lost round
#: means another claimer took a whole batch, so rounds beyond the number of concurrent claimers
#: are rare; the bound keeps a claim finite under producers that never stop.
MAX_ROUNDS = 32


async def take_candidates(
    collection: Any,
    due: Mapping[str, Any],
    update: Mapping[str, Any],
    *,
    sort: Sequence[tuple[str, int]],
    n: int,
    hint: str,
) -> list[Any]:
    """Mark up to `n` due documents with `update` (which must make them no longer `due`);
    returns the candidate ids of the round that took some, in claim order (the caller reads
    back which of them its update took), or ``[]`` when nothing is due."""
    for _ in range(MAX_ROUNDS):
        candidates = await _driver.find_list(
            collection, due, sort=sort, limit=n, projection={"_id": 1}, hint=hint
        )
        if not candidates:
            return []
        ids = [doc["_id"] for doc in candidates]
        taken = await collection.update_many({"_id": {"$in": ids}, **due}, dict(update))
        if taken.modified_count:
            return ids
    log.debug(
        "claim lost every candidate %d times in a row; trying again later",
        MAX_ROUNDS,
        extra={"collection": getattr(collection, "name", None)},
    )
    return []
