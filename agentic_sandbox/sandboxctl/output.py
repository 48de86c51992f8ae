"""Tables by default; `--output json|yaml` for programs.

Tables are rich tables: a list is a table with a header row; one object is a two-column list of
its fields; a nested object is its own two-column table inside the cell, and a nested list of
objects (an operation's `stages`) a table with its own header — never `key=value,key=value`
runs. Long multi-line text (a traceback) keeps its lines. On a terminal the tables fit its
width; piped, nothing is wrapped, so `grep` and `awk` see whole rows.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import yaml
from rich import box
from rich.console import Console, RenderableType
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from agentic_sandbox.sdk.models import ApiModel

PIPED_WIDTH = 4096  # no wrapping when the output is not a terminal


def _scalar(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return str(round(value, 3))
    text = str(value)
    if len(text) >= 19 and text[4:5] == "-" and text[10:11] == "T":  # ISO time → shorter
        text = text[:19].replace("T", " ")
    return text


def _header(key: str) -> str:
    return key.upper().replace("_", " ")


def _is_rows(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _cell(value: Any) -> RenderableType:
    if isinstance(value, dict):
        return _fields(value) if value else Text("-")
    if _is_rows(value):
        return _rows(value, _columns_of(value), nested=True)
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return _items(value)
    if isinstance(value, list):
        return Text(", ".join(_scalar(v) for v in value) or "-")
    return Text(_scalar(value))


def _items(values: Sequence[Any]) -> Table:
    """A list that mixes objects, lists and scalars: one item a line, each rendered as a cell."""
    t = Table.grid(padding=(0, 1))
    t.add_column(no_wrap=True)
    t.add_column()
    for v in values:
        t.add_row(Text("-"), _cell(v))
    return t


def _columns_of(rows: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def _rows(rows: Sequence[dict[str, Any]], columns: Sequence[str], *, nested: bool) -> Table:
    t = Table(
        box=box.SIMPLE_HEAD if nested else None,
        show_edge=False,
        pad_edge=False,
        header_style="bold" if nested else None,
    )
    for c in columns:
        t.add_column(_header(c))
    for r in rows:
        t.add_row(*(_cell(r.get(c)) for c in columns))
    return t


def _fields(data: dict[str, Any]) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(no_wrap=True)
    t.add_column()
    for k, v in data.items():
        t.add_row(Text(str(k)), _cell(v))
    return t


def _console(file: Any) -> Console:
    tty = bool(getattr(file, "isatty", lambda: False)())
    width = shutil.get_terminal_size((100, 24)).columns if tty else PIPED_WIDTH
    return Console(
        file=file, width=width, highlight=False, markup=False, emoji=False, soft_wrap=False
    )


def render(obj: RenderableType, *, tty: bool = False) -> str:
    """The text of a rich renderable, without trailing spaces."""
    buf = io.StringIO()
    width = shutil.get_terminal_size((100, 24)).columns if tty else PIPED_WIDTH
    Console(
        file=buf,
        width=width,
        color_system=None,
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=False,
    ).print(obj)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    return render(_rows(rows, columns, nested=False), tty=sys.stdout.isatty())


def fields(data: dict[str, Any]) -> str:
    return render(_fields(data), tty=sys.stdout.isatty())


def doc(value: Any) -> Any:
    """What the server sent: a model's document, a list of them as `{"items": [...]}`."""
    if isinstance(value, ApiModel):
        return value.to_dict()
    if isinstance(value, list):
        return {"items": [doc(v) for v in value]}
    return value


def emit(data: Any, fmt: str, columns: Sequence[str] | None = None) -> None:
    if fmt == "json":
        print(json.dumps(data, indent=2, sort_keys=False))
        return
    if fmt == "yaml":
        print(yaml.safe_dump(data, sort_keys=False), end="")
        return
    if columns is not None:
        rows = data.get("items", data) if isinstance(data, dict) else data
        if isinstance(rows, dict):
            rows = [rows]
        print(table(rows, columns))
        return
    if isinstance(data, dict):
        print(fields(data))
        return
    print(data)


def err(message: str) -> None:
    print(f"sandboxctl: {message}", file=sys.stderr)


@contextmanager
def progress(title: str) -> Iterator[Callable[[str, float], None]]:
    """A progress line on stderr while long work runs (`update(stage, fraction)`); nothing
    when stderr is not a terminal."""
    if not sys.stderr.isatty():
        yield lambda _stage, _fraction: None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=_console(sys.stderr),
    ) as bar:
        task = bar.add_task(title, total=1.0)

        def update(stage: str, fraction: float) -> None:
            bar.update(task, description=f"{title}: {stage}", completed=fraction)

        yield update
