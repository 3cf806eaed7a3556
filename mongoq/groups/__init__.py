"""`AsyncGroupTransport`: per-group FIFO messages, one consumer per group. The layout
of its collections, their indexes, and every filter and update are in `mongoq.groups.schema`."""

from mongoq.groups.models import (
    DeadLetter,
    GroupId,
    GroupInfo,
    GroupLease,
    GroupPage,
    GroupRunSummary,
    GroupStats,
    NewMessage,
)
from mongoq.groups.transport import AsyncGroupTransport

__all__ = [
    "AsyncGroupTransport",
    "DeadLetter",
    "GroupId",
    "GroupInfo",
    "GroupLease",
    "GroupPage",
    "GroupRunSummary",
    "GroupStats",
    "NewMessage",
]
