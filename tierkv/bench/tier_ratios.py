"""The tiers benchmark's ratios (``tierkv bench --only tiers``): each of issue 24's measures divided by
the limit it is held to, from the rows measured in the same run."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["in_words", "paired", "ratios"]


def paired(bws: list[float], limits: list[float]) -> float:
    """The median of each run's ratio to the limit measured beside it."""
    return statistics.median(b / a for b, a in zip(bws, limits, strict=True))


def ratios(
    rows: dict[str, dict[str, float]],
    paths: tuple[str, ...],
    od: float,
    write_limit: float,
    bws: list[float],
    own: list[float],
    firsts: tuple[list[float], list[float]],
) -> dict[str, float]:
    """The issue's ratios, per data path (the first, native where built, is what a user gets)."""
    out = {
        f"restore cold one-prefix / raw read of its own files (median of each run's ratio) [{paths[0]}]": statistics.median(
            b / a for b, a in zip(bws, own)
        ),
        f"first restore, host tier on / raw read of its own files (median of each run's ratio) [{paths[0]}]": (
            statistics.median(b / a for b, a in zip(*firsts))
        ),
    }
    for path in paths:
        out[f"restore cold one-prefix / disk limit [{path}]"] = (
            rows[f"restore one-prefix, cold [{path}]"]["median"] / od
        )
    for path in paths:
        if f"first restore in a fresh process, cold, host tier on [{path}]" in rows:
            out[f"first restore, host tier on / disk limit [{path}]"] = (
                rows[f"first restore in a fresh process, cold, host tier on [{path}]"]["median"] / od
            )
        out[f"restore cold interleaved / disk limit [{path}]"] = (
            rows[f"restore interleaved prefixes, cold [{path}]"]["median"] / od
        )
        if f"restore one-prefix, warm page cache [{path}]" not in rows:
            continue
        warm_read = next((v for k, v in rows.items() if k.startswith("raw buffered warm read")), None)
        if warm_read:
            out[f"restore warm / the page cache's read [{path}]"] = (
                rows[f"restore one-prefix, warm page cache [{path}]"]["median"] / warm_read["median"]
            )
        verified = next((v for k, v in rows.items() if k.startswith("a warm read and its checksum")), None)
        if verified:
            out[f"restore warm / a warm read and its checksum [{path}]"] = (
                rows[f"restore one-prefix, warm page cache [{path}]"]["median"] / verified["median"]
            )
    for w in ("native", "native buffered", "python"):
        if f"persistence (save+flush, durable) [{w}]" in rows:
            out[f"persistence / disk write limit [{w}]"] = (
                rows[f"persistence (save+flush, durable) [{w}]"]["median"] / write_limit
            )
        if f"persistence (save+flush, durable), a store that has saved before [{w}]" in rows:
            out[f"persistence, a store that has saved before / disk write limit [{w}]"] = (
                rows[f"persistence (save+flush, durable), a store that has saved before [{w}]"]["median"]
                / write_limit
            )
        if f"persistence (save+flush, durable), host tier populated [{w}]" in rows:
            out[f"persistence, host tier populated / disk write limit [{w}]"] = (
                rows[f"persistence (save+flush, durable), host tier populated [{w}]"]["median"] / write_limit
            )
    # Against a raw write from distinct memory, as the store's own writes are (disk_limits._odirect_distinct):
    # this VM's disk writes a reused buffer faster, and the write limit above reuses one.
    distinct = rows.get("raw O_DIRECT sequential write, 1 MiB, QD 1, each request from memory of its own")
    if distinct and "persistence (save+flush, durable), host tier populated [native]" in rows:
        for what in ("", ", host tier populated", ", a store that has saved before"):
            out[f"persistence{what} / a raw write from memory of its own [native]"] = (
                rows[f"persistence (save+flush, durable){what} [native]"]["median"] / distinct["median"]
            )
    out["naive LMDB cold / disk limit"] = rows["naive LMDB get, cold, random order"]["median"] / od
    return out


def in_words(res: dict[str, Any]) -> str:
    """The few ratios a user asks first, in words (each one found in the tables below)."""
    rows, ratios = res["rows_Bps"], res["ratios"]

    def ratio(prefix: str) -> str:
        return next((f"{v:.2f}" for k, v in ratios.items() if k.startswith(prefix)), "-")

    def rate(name: str) -> str:
        return f"{rows[name]['median'] / 1e9:.2f} GB/s" if name in rows else "-"

    large = ratio("restore warm, 8 MiB records")
    large = f" ({large} with an 8B model's 8 MiB blocks)" if large != "-" else ""
    return (
        f"**In short.** A cold restore of one prefix: {rate('restore one-prefix, cold [native]')}, "
        f"{ratio('restore cold one-prefix / disk limit [native]')} of the disk's read limit (the best raw "
        "read pattern of this run; above 1 where the store's pattern beat every raw one). A fresh process's "
        f"first restore, host tier on: {ratio('first restore, host tier on / the best raw read beside it')} of "
        f"the best raw read measured beside it. Warm, from the page cache: "
        f"{ratio('restore warm / memcpy (median')} of memcpy{large}; from the host tier: "
        f"{ratio('host tier / memcpy')} of memcpy (above 1: its large copies stream past the CPU's cache, "
        f"torch's copy does not). A durable save (save, then flush): "
        f"{ratio('persistence / the best raw write beside it')} of the best raw write measured beside it. "
        "Whether a restore beats recomputing the prefix: the ttft part, and `tierkv bench --plan`."
    )
