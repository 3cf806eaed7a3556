"""The candidate claim shared by the batched claims of the task queue and the group transport.

A batched claim is two commands: read the `n` most urgent due documents, then take those
still due with one conditional ``update_many``; when it took all of them, the caller knows what
it holds without reading them back. On a server other claimers' commands run
between the two, so the slots of one worker read the same candidates at once and all but one
find them taken. A claimer that lost every candidate moves past them: they are no longer due,
so reading again returns the next ones. It reports "nothing" only when nothing is due, so a run
loop never naps while due work waits. The first round takes the most urgent candidates in
order; later rounds, only reached under contention, take a random part of a wider window.
Owns no collections.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mongoq import _driver

__all__ = ["Candidates", "take_candidates"]

log = logging.getLogger("mongoq.claims")

#: Rounds of "every candidate was taken first" before a claim gives up for now. Each lost round
#: means another claimer took a whole batch, so rounds beyond the number of concurrent claimers
#: are rare; the bound keeps a claim finite under producers that never stop.
MAX_ROUNDS = 32
#: The widest candidate window a claim reads after lost rounds.
MAX_WINDOW = 1000
_random = random.Random()


@dataclass(frozen=True)
class Candidates:
    """What a batched claim's update was applied to."""

    #: as read before the update, in claim order
    docs: list[dict[str, Any]]
    #: they were read whole and the update took every one: none needs reading back
    all_taken: bool


async def take_candidates(
    collection: Any,
    due: Mapping[str, Any],
    update: Mapping[str, Any],
    *,
    sort: Sequence[tuple[str, int]],
    n: int,
    hint: str,
    fields: Sequence[str] = (),
    whole_first: bool = False,
    joined: Sequence[Mapping[str, Any]] = (),
) -> Candidates:
    """Mark up to `n` due documents with `update` (which must make them no longer `due`);
    returns the candidates of the round that took some, in claim order, each ``{_id}`` plus
    `fields` as read before the update (the whole document in the first round, with
    `whole_first`), and whether the update took every one of those whole documents (else the
    caller reads back which it took); no candidates when nothing is due.

    `joined` (stages such as a ``$lookup``, implying `whole_first`) makes the first round's
    read an aggregation that brings, with each whole candidate, what the caller reads next."""
    if "_id" in due:  # the candidates' `$in` would replace it and take every due document
        raise ValueError("take_candidates: `due` must not filter on _id")
    for lost in range(MAX_ROUNDS):
        # After a lost round the other losers read the same next candidates: each reads a
        # wider window and tries a random `n` of it (in claim order), so that they split the
        # window instead of colliding again, all but one, round after round.
        window = min(n * (lost + 1), MAX_WINDOW)
        # Whole documents only for the first round's `n`: a wider window after lost rounds
        # would read payloads it mostly does not take.
        whole = (whole_first or bool(joined)) and lost == 0
        if whole and joined:
            candidates = await _driver.aggregate_list(
                collection,
                [{"$match": dict(due)}, {"$sort": dict(sort)}, {"$limit": window}, *joined],
                hint=hint,
            )
        else:
            projection = None if whole else {"_id": 1, **dict.fromkeys(fields, 1)}
            candidates = await _driver.find_list(
                collection, due, sort=sort, limit=window, projection=projection, hint=hint
            )
        if not candidates:
            return Candidates([], all_taken=False)
        if len(candidates) > n:
            chosen = sorted(_random.sample(range(len(candidates)), n))
            candidates = [candidates[index] for index in chosen]
        ids = [doc["_id"] for doc in candidates]
        taken = await collection.update_many({"_id": {"$in": ids}, **due}, dict(update))
        if taken.modified_count:
            return Candidates(candidates, all_taken=whole and taken.modified_count == len(ids))
    log.debug(
        "claim lost every candidate %d times in a row; trying again later",
        MAX_ROUNDS,
        extra={"collection": getattr(collection, "name", None)},
    )
    return Candidates([], all_taken=False)
