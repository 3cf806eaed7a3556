"""`AsyncGroupTransport` (seed 000): per-group FIFO messages, one consumer per group. The
layout of its collections is in `mongoq.groups.transport`'s docstring."""

from mongoq.groups.transport import (
    AsyncGroupTransport,
    DeadLetter,
    GroupLease,
    GroupRunSummary,
    GroupStats,
    NewMessage,
)

__all__ = [
    "AsyncGroupTransport",
    "DeadLetter",
    "GroupLease",
    "GroupRunSummary",
    "GroupStats",
    "NewMessage",
]
