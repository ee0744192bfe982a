"""What ``tierkv stats`` reports: totals, ages, expiry and space, computed from a disk tier."""

from __future__ import annotations

import dataclasses
from typing import Any

from tierkv.telemetry import gpu_telemetry
from tierkv.tiers.disk import DiskTier, Entry
from tierkv.units import format_duration

# Last-access histogram buckets: upper bounds in seconds, named as a person reads them.
AGE_BUCKETS_S: tuple[tuple[str, float], ...] = (
    ("<1m", 60),
    ("<1h", 3600),
    ("<1d", 86400),
    ("<7d", 7 * 86400),
    ("<30d", 30 * 86400),
    (">=30d", float("inf")),
)


def store_stats(disk: DiskTier, now: float | None = None) -> dict[str, Any]:
    """A JSON-ready report. Totals come from the exact counters; ages from one pass over the index."""
    now = disk.clock() if now is None else now
    policy = disk.policy
    namespaces = disk.namespaces()
    quotas = disk.stored_quotas()
    per_ns: dict[bytes, dict[str, Any]] = {}
    for digest, (blocks, nbytes) in disk.totals().items():
        ns = namespaces.get(digest)
        per_ns[digest] = {
            "digest": digest.hex(),
            "model_id": ns.model_id if ns else None,
            "tenant": _tenant_name(ns.tenant_id, quotas) if ns and ns.tenant_id else None,
            "spec": ns.to_json() if ns else None,
            "blocks": blocks,
            "nbytes": nbytes,
            "oldest_created_s": None,
            "newest_created_s": None,
            "expired_unswept": 0,
            "last_access_histogram": {name: 0 for name, _ in AGE_BUCKETS_S},
        }
    retention = _RetentionUsage()
    for _, e in disk.iter_entries():
        retention.add(e, now)
        row = per_ns.get(e.ns_digest)
        if row is None:  # written after the totals were read
            continue
        row["oldest_created_s"] = min(e.created_s, row["oldest_created_s"] or e.created_s)
        row["newest_created_s"] = max(e.created_s, row["newest_created_s"] or e.created_s)
        idle = now - e.last_access_s
        row["last_access_histogram"][next(n for n, ub in AGE_BUCKETS_S if idle < ub)] += 1
        if disk.policy.expired(e, now):
            row["expired_unswept"] += 1
    usage = disk.usage()
    return {
        "cache_dir": str(disk.path),
        "format_version": disk.format_version(),  # older than STORE_FORMAT_VERSION: `gc --upgrade`
        "data_path": disk.read_path(),  # which reader and writer this machine uses: native or Python
        "policy": {
            "budget_nbytes": policy.budget_nbytes,
            "ttl_s": policy.ttl_s,
            "max_age_s": policy.max_age_s,
            "pin_budget_nbytes": policy.pin_limit_nbytes,
        },
        "retention": retention.report(),
        "blocks": sum(r["blocks"] for r in per_ns.values()),
        "live_nbytes": usage["live_nbytes"],
        "segment_allocated_nbytes": usage["segment_allocated_nbytes"],
        "segment_apparent_nbytes": usage["segment_apparent_nbytes"],
        "index_file_nbytes": usage["index_file_nbytes"],
        "budget_used": (usage["live_nbytes"] / policy.budget_nbytes) if policy.budget_nbytes else None,
        "namespaces": sorted(per_ns.values(), key=lambda r: -r["nbytes"]),
        "tenants": tenant_report(disk),
        "gpus": [dataclasses.asdict(g) for g in gpu_telemetry()],  # NVML, device-wide; [] without a GPU
    }


class _RetentionUsage:
    """Blocks and bytes by how they are kept: the store's own TTL, a request's longer retention (per
    retention asked), or a pin still running."""

    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {"default": [0, 0], "retained": [0, 0], "pinned": [0, 0]}
        self.by_ttl: dict[str, list[int]] = {}

    def add(self, e: Entry, now: float) -> None:
        kind = "pinned" if e.pin_until_s > now else "retained" if e.retain_s else "default"
        self.rows[kind][0] += 1
        self.rows[kind][1] += e.footprint
        if kind == "retained":
            row = self.by_ttl.setdefault(format_duration(e.retain_s), [0, 0])
            row[0] += 1
            row[1] += e.footprint

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: {"blocks": b, "nbytes": n} for k, (b, n) in self.rows.items()}
        out["retained"]["by_ttl"] = {
            k: {"blocks": b, "nbytes": n} for k, (b, n) in sorted(self.by_ttl.items())
        }
        return out


__all__ = ["AGE_BUCKETS_S", "store_stats"]


def tenant_report(disk: DiskTier) -> list[dict[str, Any]]:
    """Usage and quotas per tenant (of API keys), by name: never a salt."""
    rows = []
    for tid, ((blocks, nbytes, pinned_blocks, pinned_nbytes), q) in disk.tenants().items():
        rows.append(
            {
                "tenant": _tenant_name(tid, {tid: q} if q is not None else {}),
                "blocks": blocks,
                "nbytes": nbytes,
                "pinned_blocks": pinned_blocks,
                "pinned_nbytes": pinned_nbytes,
                "disk_quota_nbytes": q.disk_nbytes if q is not None else None,
                "host_quota_nbytes": q.host_nbytes if q is not None else None,
                "pin_quota_nbytes": q.pin_nbytes if q is not None else None,
            }
        )
    return sorted(rows, key=lambda r: (-r["nbytes"], r["tenant"]))


def _tenant_name(tid: bytes, quotas: dict[bytes, Any]) -> str:
    """A tenant's name as the keys file gives it; ``#<id>`` for one no keys file names now."""
    q = quotas.get(tid)
    return q.name if q is not None else f"#{tid.hex()[:12]}"
