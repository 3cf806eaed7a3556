"""The dashboard's HTML: the overview, one page per primitive (its counts, its chart, its
failed and waiting work, every id a link to its item's page), the confirmation page of an
action, the error page, and the pieces the item pages (`mongoq.dashboard.detail`) share.
Everything shown is escaped; the pages load only the dashboard's own stylesheet and script
(``/static``).

Owns no collections.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from mongoq._text import format_age, one_line
from mongoq.dashboard.readings import Summary

__all__ = [
    "TITLES", "ago", "confirm", "confirm_link", "deliveries_table", "delivery_link", "error",
    "error_cell", "find_form", "group_link", "groups_table", "id_cell", "id_fields", "link",
    "overview", "page", "primitive_page", "show", "table", "task_link", "unknown_functions",
    "waiting_age",
]  # fmt: skip

#: The widest an error is shown in a table (the whole text is in the cell's title).
ERROR_WIDTH = 120
TITLES = {"tasks": "task queue", "groups": "group transport", "outbox": "outbox"}


def show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return escape(str(value))


def ago(now: datetime, then: datetime | None) -> str:
    return format_age(None if then is None else max(0.0, (now - then).total_seconds()))


def error_cell(text: str | None) -> str:
    if not text:
        return "<td>-</td>"
    return f'<td class="error" title="{escape(text)}">{escape(one_line(text, ERROR_WIDTH))}</td>'


def link(primitive: str, name: str) -> str:
    return f"/{primitive}/{quote(name, safe='')}"


def confirm_link(primitive: str, name: str, verb: str, label: str, **fields: Any) -> str:
    query = urlencode({k: str(v) for k, v in fields.items()})
    href = f"/confirm/{primitive}/{quote(name, safe='')}/{verb}?{query}"
    return f'<a class="action" href="{escape(href)}">{escape(label)}</a>'


def id_fields(field: str, value: str | int) -> dict[str, Any]:
    """A stored 7 and "7" are different ids: the form says which."""
    return {field: value, f"{field}_type": "int" if isinstance(value, int) else "str"}


def table(headers: Sequence[str], rows: Iterable[str], empty: str, css: str = "") -> str:
    body = "".join(rows)
    if not body:
        return f'<p class="empty">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def page(
    title: str, body: str, *, database: str, actions: bool, note: str | None = None,
    refresh: float = 10.0,
) -> str:  # fmt: skip
    """A whole page; its script refreshes the charts and counts every `refresh` seconds."""
    mode = "actions enabled" if actions else "read-only"
    banner = f'<p class="note" role="status">{escape(note)}</p>' if note else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)} - mongoq</title>
<link rel="stylesheet" href="/static/dashboard.css"></head>
<body data-refresh="{refresh:g}"><header><a class="brand" href="/">mongoq</a>
<span class="database">database <b>{escape(database)}</b></span>
<span class="mode {"on" if actions else "off"}">{mode}</span></header>
<main>{banner}<h1>{escape(title)}</h1>{body}</main>
<script src="/static/dashboard.js"></script></body></html>"""


def _counts(summary: Summary) -> str:
    if summary.error is not None:
        return f'<span class="error">unreadable: {escape(summary.error)}</span>'
    return " ".join(
        f'<span class="count"><span class="label">{escape(label)}</span> '
        f'<b data-count="{escape(summary.key)}:{escape(label)}">{count}</b></span>'
        for label, count in summary.counts.items()
    )


def unknown_functions(summary: Summary, tag: str = "p") -> str:
    """A warning per task function that no running worker runs, with its due tasks, the most
    waiting first (`tag`: ``p`` on a primitive's page, ``span`` in the overview's cell)."""
    shown = []
    for name, count in sorted(summary.unknown_functions.items(), key=lambda i: (-i[1], i[0])):
        what = (f"waiting for unknown function <code>{escape(name)}</code>" if name else
                "waiting without a function (plain tasks: no Jobs worker runs them)")  # fmt: skip
        shown.append(f'<{tag} class="warning" role="status" title="{escape(UNKNOWN_HINT)}">'
                     f"{what}: <b>{count}</b></{tag}>")  # fmt: skip
    return "".join(shown)


#: What an unknown function's warning means, in its tooltip.
UNKNOWN_HINT = (
    "Due tasks of a task function that no running worker knows (a misspelt name, a deploy not "
    "finished): they wait, never run nor charged an attempt, until a worker that knows it starts."
)


def waiting_age(seconds: float | None) -> str:
    """How long the oldest due item has waited: ``-`` when nothing is due, ``<1s`` for under
    a second (due work never reads as ``0s``, which would say nothing waits)."""
    if seconds is None:
        return "-"
    return "<1s" if seconds < 1 else format_age(seconds)


def overview(summaries: Sequence[Summary], charts: Mapping[str, str]) -> str:
    """Every primitive: its counts, its oldest waiting item and its chart (`charts` by key)."""
    rows = [
        f'<tr><td>{TITLES[s.primitive]}</td><td><a href="{link(s.primitive, s.name)}">'
        f"{escape(s.name)}</a></td><td>{_counts(s)}{unknown_functions(s, 'span')}</td>"
        f'<td data-age="{escape(s.key)}">{escape(waiting_age(s.oldest_age))}</td>'
        f"<td>{charts.get(s.key, '')}</td></tr>"
        for s in summaries
    ]
    return LEGEND + table(
        ["primitive", "name", "counts", "oldest waiting", "backlog and throughput"],
        rows, "No mongoq primitive is set up in this database: a primitive's setup() "
        "registers it.", "overview",
    )  # fmt: skip


#: What the charts draw, said once above them.
LEGEND = (
    '<p class="legend"><span class="backlog">backlog</span> (left axis) '
    '<span class="rate">finished per minute</span> (right axis), sampled while this '
    "dashboard runs; times in UTC</p>"
)


def _summary_block(summary: Summary) -> str:
    age = escape(waiting_age(summary.oldest_age))
    oldest = (f'<span class="count"><span class="label">oldest waiting</span> '
              f'<b data-age="{escape(summary.key)}">{age}</b></span>')  # fmt: skip
    return f'<p class="counts">{_counts(summary)} {oldest}</p>{unknown_functions(summary)}'


def primitive_page(summary: Summary, chart: str, sections: Sequence[tuple[str, str]]) -> str:
    """A primitive's page: its counts, its `chart`, then `sections` of (heading, HTML)."""
    parts = [_summary_block(summary), LEGEND, f'<div class="chart-large">{chart}</div>']
    parts += [f"<section><h2>{escape(title)}</h2>{html}</section>" for title, html in sections]
    return "".join(parts)


# ---------------------------------------------------------------------------------- links


def _query(fields: Mapping[str, Any]) -> str:
    return urlencode({k: str(v) for k, v in fields.items()})


def task_link(queue: str, task_id: str | int) -> str:
    return f"/task/{quote(queue, safe='')}?{_query(id_fields('id', task_id))}"


def group_link(prefix: str, group_id: str | int) -> str:
    return f"/group/{quote(prefix, safe='')}?{_query(id_fields('id', group_id))}"


def delivery_link(prefix: str, event_id: str, handler: str) -> str:
    query = _query({"event_id": event_id, "handler": handler})
    return f"/delivery/{quote(prefix, safe='')}?{query}"


def unreadable_mark(fault: str | None) -> str:
    """What marks an item whose stored document has a field of the wrong type."""
    return "" if fault is None else f' <span class="error">unreadable: {escape(fault)}</span>'


def id_cell(href: str, value: Any) -> str:
    """A table cell holding an id as a link to its page."""
    return f'<td><a class="id" href="{escape(href)}">{show(value)}</a></td>'


# ------------------------------------------------------------------------------ sections


def _task_rows(
    name: str, tasks: Sequence[Any], actions: bool, verb: str, label: str,
    cells: Callable[[Any], str], marked: bool = False,
) -> list[str]:  # fmt: skip
    """One row a task: its id (a link to its page), its `cells`, then the link to `verb` it
    (with actions); `marked` rows carry the task's id (``data-task``)."""
    rows = []
    for task in tasks:
        act = confirm_link("tasks", name, verb, label, **id_fields("id", task.id))
        mark = f' data-task="{escape(str(task.id))}"' if marked else ""
        last = f"{act if actions else ''}{unreadable_mark(task.unreadable)}"
        rows.append(f"<tr{mark}>{id_cell(task_link(name, task.id), task.id)}{cells(task)}"
                    f"<td>{last}</td></tr>")  # fmt: skip
    return rows


def failed_tasks(name: str, tasks: Sequence[Any], now: datetime, actions: bool) -> str:
    rows = _task_rows(name, tasks, actions, "requeue", "Requeue", lambda task: (
        f"<td>{task.attempts}</td><td>{ago(now, task.updated_at)}</td>{error_cell(task.error)}"
    ), marked=True)  # fmt: skip
    shown = table(["task", "attempts", "failed ago", "error", ""], rows, "No failed task.")
    if actions and tasks:
        shown += confirm_link("tasks", name, "requeue", "Requeue every failed task", all=1)
    return shown


def open_tasks(name: str, tasks: Sequence[Any], now: datetime, actions: bool) -> str:
    rows = _task_rows(name, tasks, actions, "cancel", "Cancel", lambda task: (
        f"<td>{escape(task.status)}</td><td>{task.attempts}</td>"
        f"<td>{ago(now, task.updated_at)}</td><td>{show(task.worker_id)}</td>"
    ))  # fmt: skip
    return table(["task", "status", "attempts", "changed ago", "worker", ""], rows,
                 "No pending or running task.")  # fmt: skip


def find_form(kind: str, name: str, fields: Sequence[tuple[str, str]], typed: bool) -> str:
    """A form that opens one item's page by its id (`fields`: name and label of each box;
    `typed`: the first is an id stored as text or as an integer)."""
    href = f"/{kind}/{quote(name, safe='')}"
    boxes = "".join(
        f'<label>{escape(label)} <input name="{escape(field)}" required size="24"></label> '
        for field, label in fields
    )
    if typed:
        boxes += ('<label>stored as <select name="id_type"><option value="str">text</option>'
                  '<option value="int">integer</option></select></label> ')  # fmt: skip
    return (f'<form class="find" method="get" action="{escape(href)}">{boxes}'
            '<button type="submit">Open</button></form>')  # fmt: skip


def purge_form(primitive: str, name: str, statuses: Sequence[str]) -> str:
    """A form that leads to the purge's confirmation page (nothing is deleted from here)."""
    href = f"/confirm/{primitive}/{quote(name, safe='')}/purge"
    select = ""
    if statuses:
        options = "".join(f"<option>{escape(s)}</option>" for s in statuses)
        select = f'<label>status <select name="status">{options}</select></label> '
    return (
        f'<form class="purge" method="get" action="{escape(href)}">{select}'
        '<label>older than <input name="older_than" value="7d" size="6"></label> '
        '<button type="submit">Purge...</button></form>'
    )


def dead_letters(name: str, letters: Sequence[Any], now: datetime, actions: bool) -> str:
    rows = []
    for letter in letters:
        act = confirm_link("groups", name, "redrive", "Redrive", seq=letter.seq)
        href = group_link(name, letter.group_id)
        rows.append(
            f"<tr>{id_cell(f'{href}#seq-{letter.seq}', letter.seq)}"
            f"{id_cell(href, letter.group_id)}"
            f"<td>{letter.deliveries}</td><td>{ago(now, letter.dead_at)}</td>"
            f"{error_cell(letter.error)}<td>{act if actions else ''}</td></tr>"
        )
    shown = table(["seq", "group", "deliveries", "dead for", "error", ""], rows,
                  "No dead letter.")  # fmt: skip
    if actions and letters:
        shown += confirm_link("groups", name, "redrive", "Redrive every dead letter", all=1)
    return shown


def groups_table(name: str, groups: Sequence[Any], empty: str, when: str) -> str:
    """Groups as `list_groups` shows them; `when` heads the column of `available_at`."""
    rows = [
        f"<tr>{id_cell(group_link(name, g.group_id), g.group_id)}<td>{escape(g.state)}</td>"
        f"<td>{show(g.available_at)}</td><td>{show(g.head_seq)}</td>"
        f"<td>{format_age(g.head_age)}</td><td>{show(g.head_deliveries)}</td>"
        f"{error_cell(g.head_error)}</tr>"
        for g in groups
    ]
    return table(["group", "state", when, "head", "head age", "deliveries", "error"], rows,
                 empty)  # fmt: skip


def deliveries_table(
    name: str, deliveries: Sequence[Any], now: datetime, actions: bool, empty: str,
    changed: str = "changed ago",
) -> str:  # fmt: skip
    """Deliveries, each event id a link to the delivery's page; a dead one can be requeued."""
    rows = []
    for d in deliveries:
        act = ""
        if actions and d.status == "dead":
            act = confirm_link("outbox", name, "requeue", "Requeue", event_id=d.event_id,
                               handler=d.handler)  # fmt: skip
        rows.append(
            f"<tr>{id_cell(delivery_link(name, d.event_id, d.handler), d.event_id)}"
            f"<td>{show(d.event_type)}</td><td>{show(d.handler)}</td>"
            f"<td>{escape(d.status)}</td><td>{d.attempts}</td><td>{show(d.key)}</td>"
            f"<td>{ago(now, d.updated_at)}</td>{error_cell(d.last_error)}<td>{act}</td></tr>"
        )
    return table(["event", "type", "handler", "status", "attempts", "key", changed, "error", ""],
                 rows, empty)  # fmt: skip


# ---------------------------------------------------------------------- confirm, error


def confirm(primitive: str, name: str, verb: str, sentence: str, form: Mapping[str, str]) -> str:
    hidden = "".join(
        f'<input type="hidden" name="{escape(k)}" value="{escape(v)}">'
        for k, v in form.items()
        if k != "token"
    )
    action = f"/actions/{primitive}/{quote(name, safe='')}/{verb}"
    return f"""<p class="confirm">{escape(sentence)}</p>
<form method="post" action="{escape(action)}">{hidden}
<label>token <input type="password" name="token" autocomplete="off" required
 placeholder="printed when the dashboard started"></label>
<button type="submit" class="danger">Confirm</button>
<a href="{link(primitive, name)}">Back</a></form>"""


def error(message: str) -> str:
    return f'<p class="error">{escape(message)}</p><p><a href="/">Back to the overview</a></p>'
