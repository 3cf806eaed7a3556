"""The collections each primitive owns, by what follows its name (a task queue's ``name``, a
transport's or an outbox's ``prefix``): the one table both the primitives' schemas (which name
their collections beside their indexes) and the registry (which keeps two primitives off each
other's collections) read. Owns no collections.
"""

from __future__ import annotations

__all__ = [
    "COUNTERS",
    "DEAD",
    "DELIVERIES",
    "EVENTS",
    "HISTORY",
    "LANES",
    "LOCKS",
    "MESSAGES",
    "SCHEDULES_SUFFIX",
    "SEQUENCES",
    "SUFFIXES",
    "WORKERS_SUFFIX",
]

# A task queue: ``{name}`` (its tasks), ``{name}_schedules``, ``{name}_workers``.
SCHEDULES_SUFFIX = "_schedules"
WORKERS_SUFFIX = "_workers"
# A group transport: ``{prefix}_messages``, ``_locks``, ``_counters``, ``_dead``.
MESSAGES, LOCKS, COUNTERS, DEAD = "messages", "locks", "counters", "dead"
# An outbox: ``{prefix}events``, ``deliveries``, ``key_sequences``, ``lanes``,
# ``completed_deliveries``.
EVENTS = "events"
DELIVERIES = "deliveries"
SEQUENCES = "key_sequences"
LANES = "lanes"
HISTORY = "completed_deliveries"

#: What each primitive appends to its name to name each of its collections.
SUFFIXES: dict[str, tuple[str, ...]] = {
    "tasks": ("", SCHEDULES_SUFFIX, WORKERS_SUFFIX),
    "groups": tuple(f"_{part}" for part in (MESSAGES, LOCKS, COUNTERS, DEAD)),
    "outbox": (EVENTS, DELIVERIES, SEQUENCES, LANES, HISTORY),
}
