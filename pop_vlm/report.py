"""Writing results: fixed-width text tables, markdown tables, the final one-line JSON summary and JSON files, shared
by the benchmarks and evaluations, so that each declares its columns once and prints them both ways."""
from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[dict], object]  # a row -> the cell's text
    width: int = 8
    left: bool = False

    def text(self, row: dict) -> str:
        return str(self.cell(row))


def ms(key: str) -> Callable[[dict], str]:
    """A cell: seconds in `key`, shown in milliseconds."""
    return lambda row: f"{row[key] * 1e3:.1f}"


def text_table(columns: Sequence[Column], rows: Sequence[dict]) -> list[str]:
    """Header, rule and one fixed-width line per row."""
    def line(cells):
        return " ".join(f"{c:<{col.width}}" if col.left else f"{c:>{col.width}}" for col, c in zip(columns, cells))

    head = line([col.header for col in columns])
    return [head, "-" * len(head)] + [line([col.text(row) for col in columns]) for row in rows]


def markdown_table(columns: Sequence[Column], rows: Sequence[dict]) -> list[str]:
    return (["| " + " | ".join(col.header for col in columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(col.text(row) for col in columns) + " |" for row in rows])


def rounded(row: dict, keys: Sequence[str] | None = None, digits: int = 6) -> dict:
    return {k: (round(row[k], digits) if isinstance(row[k], float) else row[k]) for k in (keys or row)}


def summary_line(report: dict, rows_key: str, keys: Sequence[str] | None = None) -> str:
    """The one JSON line a benchmark ends with: its meta and its rows, floats rounded."""
    return json.dumps({"meta": report["meta"], rows_key: [rounded(r, keys) for r in report[rows_key]]})


def write_json(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """How a script was run, for the record: `PYTHONPATH=. python <script> <arguments>`."""
    args = sys.argv[1:] if argv is None else argv
    return f"PYTHONPATH=. python {script} " + " ".join(shlex.quote(a) for a in args)
