"""Markdown tables, for every part's report (a leaf: the parts and ``report`` import it, it imports none of them)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def md_table(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines: ``align`` has one letter per column, ``l`` (text) or ``r`` (numbers)."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


__all__ = ["md_table"]
