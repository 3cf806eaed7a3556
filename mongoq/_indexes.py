"""Index declarations, as the primitives' schemas list them, and their creation.

Each primitive's ``schema.py`` declares its indexes as `IndexSpec` values beside the queries
they serve; ``setup()`` hands them to `create_indexes` (one collection's
list) or `create_schema_indexes` (a schema's lists by collection).
Owns no collections.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mongoq import _driver

__all__ = ["IndexSpec", "Keys", "create_indexes", "create_schema_indexes"]

Keys = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class IndexSpec:
    """One index of a collection."""

    name: str
    keys: Keys
    unique: bool = False
    #: the index holds only the documents this filter matches
    partial: Mapping[str, Any] | None = None
    #: a TTL index on its one key, expiring after the primitive's configured time; partial
    #: (a bare TTL index would empty a queue), created through
    #: `_driver.create_partial_ttl_index`, which skips it where the backend cannot honour
    #: `partial` (the embedded one)
    ttl: bool = False
    #: with `ttl`: over every document, no partial filter, said explicitly (only on a
    #: collection whose every document expires: the running workers' presences), created
    #: through `_driver.create_ttl_index`
    whole: bool = False

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``create_index`` (only those that differ from its defaults)."""
        options: dict[str, Any] = {"name": self.name}
        if self.unique:
            options["unique"] = True
        if self.partial is not None:
            options["partialFilterExpression"] = dict(self.partial)
        return options


async def create_indexes(
    db: Any,
    collection: Any,
    indexes: Iterable[IndexSpec],
    *,
    expiries: Mapping[str, int | None] | None = None,
) -> None:
    """Create `indexes` on `collection`, in order, idempotently. A TTL index expires after
    ``expiries[name]`` seconds; one whose expiry is None is a setting this process leaves off:
    not created, and not dropped either (another process may be the one that sets it)."""
    for index in indexes:
        if not index.ttl:
            await collection.create_index(list(index.keys), **index.options())
            continue
        if (index.partial is None) != index.whole or index.name not in (expiries or {}):
            raise ValueError(f"TTL index {index.name!r} needs an expiry, and a partial filter "
                             "unless it is said to cover the whole collection")  # fmt: skip
        expire_after = (expiries or {})[index.name]
        if expire_after is None:
            continue
        if index.whole:
            await _driver.create_ttl_index(
                db, collection, index.keys[0][0], name=index.name, expire_after=expire_after
            )
            continue
        await _driver.create_partial_ttl_index(
            db,
            collection,
            index.keys[0][0],
            name=index.name,
            expire_after=expire_after,
            partial=index.partial or {},  # set: checked above
        )


async def create_schema_indexes(
    db: Any, indexes: Mapping[str, Iterable[IndexSpec]], collection: Callable[[str], Any]
) -> None:
    """Create a schema's indexes, listed by collection name; `collection(name)` is the
    primitive's collection of that name (the primitive owns the naming: prefixes differ)."""
    for name, specs in indexes.items():
        await create_indexes(db, collection(name), specs)
