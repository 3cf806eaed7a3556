"""How operators' tools (the ``mongoq`` command, the dashboard) write values for people and
read the ones people type: ages (``15m``), one-line errors, JSON-ready values. Owns no
collections."""

from __future__ import annotations

import re
from dataclasses import fields, is_dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = ["for_log", "format_age", "mask_uri_credentials", "one_line", "parse_age", "plain"]

_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


_URI_USERINFO = re.compile(r"(mongodb(?:\+srv)?://)[^@/\s]+@")


def mask_uri_credentials(text: str) -> str:
    """`text` with the user and password of every ``mongodb://`` URI in it made ``***``."""
    return _URI_USERINFO.sub(r"\1***@", text)


def for_log(value: Any) -> str:
    """`value` as a log message's ``%s`` shows it: printable text as it is, text with a line
    break, a carriage return or a terminal escape escaped as `repr` does (``a\\nb``), so that
    an id, a name or a URL path cannot forge a line of a text log. The raw value belongs in
    the record's ``extra`` fields."""
    text = value if isinstance(value, str) else str(value)
    return text if text.isprintable() else repr(text)[1:-1]


def parse_age(text: str) -> float | None:
    """Seconds from ``90``, ``30s``, ``15m``, ``12h`` or ``7d``; None for anything else."""
    match = _AGE.fullmatch(text.strip())
    return None if match is None else float(match.group(1)) * _UNITS[match.group(2)]


def format_age(seconds: float | None) -> str:
    """``3d4h``, ``12m5s``, ``7s``: the two largest units; ``-`` for None."""
    if seconds is None:
        return "-"
    left, parts = int(seconds), list[str]()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if left >= size or parts:
            parts.append(f"{left // size}{unit}")
            left %= size
    return "".join([*parts, f"{left}s"][:2])


def one_line(text: str, width: int) -> str:
    """Free text in one line: a stored traceback becomes its last line (the exception)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [""]
    summary = lines[-1] if lines[0].startswith("Traceback") else lines[0]
    if len(summary) > width:
        return summary[: width - 3] + "..."
    return summary + (" ..." if len(lines) > 1 and summary is lines[0] else "")


def plain(value: Any) -> Any:
    """`value` as JSON: dataclasses as objects, datetimes in ISO 8601, the rest as text."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, datetime):
        return (value.replace(tzinfo=UTC) if value.tzinfo is None else value).isoformat()
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
