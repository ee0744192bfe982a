"""One gc pass over a disk tier: what ``tierkv gc`` and ``POST /admin/gc`` both run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from tierkv.errors import ConfigError
from tierkv.tiers.disk import DiskTier, SweepReport
from tierkv.tiers.disk.schema import DryCount

ProgressFactory = Callable[[str], AbstractContextManager[Callable[[int], None] | None]]


def resolve_namespace(disk: DiskTier, prefix: str, also: Iterable[bytes] = ()) -> bytes:
    """The one namespace digest starting with ``prefix`` (hex) among those on disk and ``also`` (a store's
    namespaces saved lately: their blocks may all be on their way still); ConfigError if none or several."""
    if len(prefix) < 4:
        raise ConfigError("give at least 4 hex digits of the namespace digest")
    known = set(disk.totals()) | set(disk.namespaces()) | set(also)
    matches = [d for d in known if d.hex().startswith(prefix.lower())]
    if len(matches) != 1:
        raise ConfigError(f"namespace {prefix}: {'no' if not matches else len(matches)} namespaces match")
    return matches[0]


def run_gc(
    disk: DiskTier,
    *,
    ttl_s: float | None = None,
    max_age_s: float | None = None,
    budget_nbytes: int | None = None,
    namespace: str | bytes | None = None,
    purge_all: bool = False,
    check: bool = False,
    compact: bool = False,
    dry_run: bool = False,
    progress: ProgressFactory | None = None,
) -> dict[str, Any]:
    """Purge (a namespace: a digest prefix, or the digest itself; or all), expire, hold the budget,
    verify, compact — in that order."""
    if namespace and purge_all:
        raise ConfigError("namespace and all exclude each other")
    step = progress or (lambda _label: nullcontext(None))
    report = SweepReport()
    counted = DryCount()  # a dry run's: a block the purge counted is not counted again by expiry or budget
    if namespace is not None:
        digest = namespace if isinstance(namespace, bytes) else resolve_namespace(disk, namespace)
        with step("purge") as tick:
            report += disk.purge_namespace(digest, dry_run=dry_run, progress=tick, counted=counted)
    if purge_all:
        with step("purge") as tick:
            report += disk.purge_namespace(None, dry_run=dry_run, progress=tick, counted=counted)
    with step("expire") as tick:
        report += disk.expire(
            ttl_s=ttl_s, max_age_s=max_age_s, dry_run=dry_run, progress=tick, counted=counted
        )
    with step("budget") as tick:
        report += disk.enforce_budget(budget_nbytes, dry_run=dry_run, progress=tick, counted=counted)
    if check:
        with step("check") as tick:
            report += disk.check(dry_run=dry_run, progress=tick)
    if compact:
        report += disk.compact(dry_run=dry_run)
    usage = disk.usage()
    return {
        **dataclasses.asdict(report),
        "dry_run": dry_run,
        "live_nbytes": usage["live_nbytes"],
        "pinned_nbytes": usage["pinned_nbytes"],
    }


def upgrade(disk: DiskTier) -> int:
    """Mark a store of format 1 or 2 format 3 (``upgrade.upgrade``), filling which stored blocks extend which from the
    records' own parent keys (read from each record's first page). Returns how many were filled."""
    from tierkv.archive.export import read_parents
    from tierkv.tiers.disk.upgrade import upgrade as upgrade_index

    return upgrade_index(disk.index, lambda entries: read_parents(disk, entries))


__all__ = ["ProgressFactory", "resolve_namespace", "run_gc", "upgrade"]
