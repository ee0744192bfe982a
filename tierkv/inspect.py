"""What ``tierkv stats`` reports: totals, ages, expiry and space, computed from a disk tier."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tierkv.telemetry import gpu_telemetry
from tierkv.tiers.disk import DiskTier

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
    now = time.time() if now is None else now
    policy = disk.policy
    namespaces = disk.namespaces()
    per_ns: dict[bytes, dict[str, Any]] = {}
    for digest, (blocks, nbytes) in disk.totals().items():
        ns = namespaces.get(digest)
        per_ns[digest] = {
            "digest": digest.hex(),
            "model_id": ns.model_id if ns else None,
            "spec": ns.to_json() if ns else None,
            "blocks": blocks,
            "nbytes": nbytes,
            "oldest_created_s": None,
            "newest_created_s": None,
            "expired_unswept": 0,
            "last_access_histogram": {name: 0 for name, _ in AGE_BUCKETS_S},
        }
    for _, e in disk.iter_entries():
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
        "data_path": disk.read_path(),  # which reader and writer this machine uses: native or Python
        "policy": {
            "budget_nbytes": policy.budget_nbytes,
            "ttl_s": policy.ttl_s,
            "max_age_s": policy.max_age_s,
        },
        "blocks": sum(r["blocks"] for r in per_ns.values()),
        "live_nbytes": usage["live_nbytes"],
        "segment_allocated_nbytes": usage["segment_allocated_nbytes"],
        "segment_apparent_nbytes": usage["segment_apparent_nbytes"],
        "index_file_nbytes": usage["index_file_nbytes"],
        "budget_used": (usage["live_nbytes"] / policy.budget_nbytes) if policy.budget_nbytes else None,
        "namespaces": sorted(per_ns.values(), key=lambda r: -r["nbytes"]),
        "gpus": [dataclasses.asdict(g) for g in gpu_telemetry()],  # NVML, device-wide; [] without a GPU
    }


__all__ = ["AGE_BUCKETS_S", "store_stats"]
