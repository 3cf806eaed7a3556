"""The registry of the primitives in a database: what `setup` records, so
that operators' tools (``mongoq list``) find every task queue, group transport and outbox of
a database by reading it, never by guessing from collection names.

Collection ``mongoq_registry``, one document per primitive::

    {_id: "<primitive>:<name>", primitive: "tasks" | "groups" | "outbox", name,
     registered_at (its first set-up), set_up_at (its last), version (of mongoq, at the last),
     options (what a reader needs to open it as its owner does: an outbox's
     ``completion_history``)}

Every write is one upsert by ``_id`` (no secondary index). A primitive whose collections were
dropped stays listed until `unregister` removes it; one set up before this registry existed
appears at its next `setup`. No task queue may be named ``mongoq_registry``.

It also keeps primitives apart: `check_collections` (one read by ``_id``, which `register`
does too, and a set-up before it writes anything) refuses a primitive any of whose collections
(`collections_of`) is one of another registered primitive's, e.g. a task queue ``g_messages``
beside a group transport ``g``: the two would read each other's documents.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from mongoq import _driver
from mongoq._collections import SUFFIXES
from mongoq._version import __version__
from mongoq.clock import stored_instant
from mongoq.errors import InvalidInput

log = logging.getLogger("mongoq.registry")

__all__ = [
    "REGISTRY",
    "Primitive",
    "Registration",
    "check_collections",
    "collections_of",
    "register",
    "registered",
    "unregister",
]

#: The registry's collection, the same in every database.
REGISTRY = "mongoq_registry"
Primitive = Literal["tasks", "groups", "outbox"]
#: The order `registered` lists them in.
_KINDS: tuple[Primitive, ...] = ("tasks", "groups", "outbox")
#: What each calls itself in a refusal, and the argument its name is given as.
_TITLES = {"tasks": ("task queue", "name"), "groups": ("group transport", "prefix"),
           "outbox": ("outbox", "prefix")}  # fmt: skip


@dataclass(frozen=True)
class Registration:
    """One primitive of the database: what it is and where (its queue name or prefix)."""

    primitive: Primitive
    name: str
    registered_at: datetime | None
    set_up_at: datetime | None
    version: str | None
    #: what its last set-up recorded to open it as its owner does (an outbox's
    #: ``completion_history``); empty for a task queue or group transport
    options: dict[str, Any] = field(default_factory=dict, hash=False)


def _id(primitive: Primitive, name: str) -> str:
    return f"{primitive}:{name}"


def _suffixes(primitive: Primitive) -> tuple[str, ...]:
    """What `primitive` appends to its name to name each of its collections."""
    return SUFFIXES[primitive]


def collections_of(primitive: Primitive, name: str) -> tuple[str, ...]:
    """The collections `primitive` `name` owns, as its face names them."""
    return tuple(f"{name}{suffix}" for suffix in _suffixes(primitive))


def _owners(collections: set[str]) -> set[tuple[Primitive, str]]:
    """Every primitive that would own one of `collections`, whether it exists or not."""
    return {
        (kind, collection.removesuffix(suffix))
        for kind in _KINDS
        for suffix in _suffixes(kind)
        for collection in collections
        if collection.endswith(suffix) and len(collection) > len(suffix)
    }


async def check_collections(db: Any, primitive: Primitive, name: str) -> None:
    """`InvalidInput` naming both if a collection of `primitive` `name` is one of another
    registered primitive's: one read of the registry by ``_id``, of the few primitives that
    could own one of them. A registry that cannot be read checks nothing (`register` says
    so)."""
    title, field_name = _TITLES[primitive]
    mine = set(collections_of(primitive, name))
    if REGISTRY in mine:
        raise InvalidInput(field_name, f"{title} {name!r} would use {REGISTRY!r}, mongoq's "
                                       "registry of queues")  # fmt: skip
    others = sorted(_id(kind, owner) for kind, owner in _owners(mine) - {(primitive, name)})
    try:
        docs = await _driver.find_list(
            _driver.collection(db, REGISTRY), {"_id": {"$in": others}},
            projection={"primitive": 1, "name": 1},
        )  # fmt: skip
    except _driver.DRIVER_ERRORS:
        return
    for doc in sorted(docs, key=lambda doc: str(doc["_id"])):
        other, other_name = doc.get("primitive"), doc.get("name")
        if other not in _KINDS or not isinstance(other_name, str):
            continue  # unreadable: `registered` skips it too
        shared = mine.intersection(collections_of(other, other_name))
        if shared:
            raise InvalidInput(
                field_name, f"{title} {name!r} would share the collection {min(shared)!r} with "
                f"{_TITLES[other][0]} {other_name!r}, set up in this database (choose another "
                "name, or `mongoq.registry.unregister` the other if it is gone)",
            )  # fmt: skip


async def register(
    db: Any, primitive: Primitive, name: str, now: datetime, options: dict[str, Any] | None = None
) -> None:
    """Record that `primitive` `name` was set up now, with `options` (one upsert; idempotent),
    after `check_collections` (one read): `InvalidInput` if its collections are another's.
    A read or write the server refuses (a role without access to the registry) is logged,
    never raised: the registry serves operators' tools, and a worker's start-up must not
    depend on it."""
    await check_collections(db, primitive, name)
    try:
        await _write(db, primitive, name, now, __version__, options or {})
    except _driver.DRIVER_ERRORS as exc:
        log.warning(
            "could not record %s %r in %s (%s); `mongoq list` will not show it", primitive,
            name, REGISTRY, exc, extra={"mongoq_primitive": primitive, "mongoq_queue": name},
        )  # fmt: skip


async def _write(
    db: Any, primitive: Primitive, name: str, now: datetime, version: str, options: dict[str, Any]
) -> None:
    await _driver.collection(db, REGISTRY).update_one(
        {"_id": _id(primitive, name)},
        {
            "$set": {"primitive": primitive, "name": name, "set_up_at": now,
                     "version": version, "options": options},
            "$setOnInsert": {"registered_at": now},
        },
        upsert=True,
    )  # fmt: skip


async def unregister(db: Any, primitive: Primitive, name: str) -> bool:
    """Forget `primitive` `name` (its collections are left alone); False if not registered."""
    result = await _driver.collection(db, REGISTRY).delete_one({"_id": _id(primitive, name)})
    return bool(result.deleted_count)


async def registered(db: Any) -> list[Registration]:
    """Every registered primitive: task queues, then group transports, then outboxes, each
    by name (one read)."""
    docs = await _driver.find_list(_driver.collection(db, REGISTRY), {})
    found = [
        Registration(
            primitive=doc["primitive"],
            name=doc["name"],
            registered_at=stored_instant(doc.get("registered_at")),
            set_up_at=stored_instant(doc.get("set_up_at")),
            version=doc.get("version"),
            options=dict(doc["options"]) if isinstance(doc.get("options"), dict) else {},
        )
        for doc in docs
        if doc.get("primitive") in _KINDS and isinstance(doc.get("name"), str)
    ]
    return sorted(found, key=lambda r: (_KINDS.index(r.primitive), r.name))
