"""The connector's metrics through vLLM's own stats path, on vLLM's ``/metrics``, under the names
``tierkv serve`` exports (one dashboard for both engines: ``dashboards/tierkv.json``).

Each side sends what changed: the scheduler the prompt tokens of each new request by where their KV
came from (vLLM's own prefix cache, a tierkv tier, computed), each worker its store's counters (bytes
read and written per tier, drops, errors) as deltas and its tiers' occupancy. vLLM adds the workers'
payloads and the scheduler's (``TierKVStats.aggregate``) and hands the sum to ``TierKVPromMetrics`` in
the API server's process. The payload is plain ``str -> number`` maps: it crosses vLLM's IPC as is.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from tierkv.metrics import EXPORTED_COUNTERS, EXPORTED_GAUGES

__all__ = ["PROMPT_SOURCES", "StoreDeltas", "TierKVPromMetrics", "TierKVStats", "log_totals"]

log = logging.getLogger("vllm.tierkv")

# where a prompt token's KV came from, in the scheduler's counts
PROMPT_SOURCES = ("vllm", "gpu", "host", "disk", "remote", "computed")

# the store's counters (summed over ranks: every rank's shard) and gauges (each rank's own tiers; a disk
# tier the ranks share reports the same), under the names tierkv serve exports
STORE_COUNTERS = EXPORTED_COUNTERS
STORE_GAUGES = EXPORTED_GAUGES
# the worker's own counters (WorkerSide.stats) and the store's own row -> (metric, its one label or None,
# that label's value, help); one metric may take several fields under different label values
WORKER_COUNTERS = {
    "load_blocks": (
        "tierkv_connector_loaded_blocks",
        None,
        "",
        "Blocks loaded into vLLM's pages (every rank)",
    ),
    "load_failed_blocks": (
        "tierkv_connector_load_failed_blocks",
        None,
        "",
        "Blocks reported to vLLM as failed loads (recomputed or failed, by its policy)",
    ),
    "save_blocks": ("tierkv_connector_saved_blocks", None, "", "Blocks handed to the store (every rank)"),
    "unsound_save_blocks": (
        "tierkv_connector_unsound_save_blocks",
        None,
        "",
        "Blocks not saved: computed from a block whose load failed on some rank, or by a forward that raised",
    ),
    "load_nbytes": (
        "tierkv_connector_loaded_bytes",
        None,
        "",
        "KV bytes loaded into vLLM's pages (every rank)",
    ),
    "load_s": (
        "tierkv_connector_load_seconds",
        None,
        "",
        "Time the workers spent loading, on the model's thread",
    ),
    "save_s": (
        "tierkv_connector_save_seconds",
        None,
        "",
        "Time the workers spent handing saves to the store",
    ),
    "check_blocks": (
        "tierkv_selfcheck_blocks",
        "outcome",
        "checked",
        "Restored blocks the sampled self-check also computed cold, by outcome (differed: purged)",
    ),
    "check_mismatch_blocks": ("tierkv_selfcheck_blocks", "outcome", "differed", ""),
    "recomputed_blocks": (
        "tierkv_recomputed_blocks",
        None,
        "",
        "Cached blocks computed instead of read: reading them was judged slower (measured speeds)",
    ),
}
_SEP = "|"  # payload keys: "metric|label,label"


@dataclasses.dataclass
class TierKVStats(KVConnectorStats):
    """``data``: ``{"counters": {key: delta}, "gauges": {key: value}}``, keys ``"name|labels"``. Counters
    add up (across steps and ranks); a gauge keeps its latest value (each rank has its own key)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {"counters": {}, "gauges": {}}

    def count(self, name: str, labels: tuple[str, ...], delta: float) -> None:
        """A zero delta is kept too: the series then exists on /metrics before its first event."""
        key = name + _SEP + ",".join(labels)
        self.data["counters"][key] = self.data["counters"].get(key, 0) + delta

    def gauge(self, name: str, labels: tuple[str, ...], value: float) -> None:
        self.data["gauges"][name + _SEP + ",".join(labels)] = value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, delta in other.data.get("counters", {}).items():
            self.data["counters"][key] = self.data["counters"].get(key, 0) + delta
        self.data["gauges"].update(other.data.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k.replace(_SEP, ":"): v for k, v in sorted(self.data["counters"].items())}

    def is_empty(self) -> bool:
        return not self.data["counters"] and not self.data["gauges"]


def split(key: str) -> tuple[str, tuple[str, ...]]:
    name, _, labels = key.partition(_SEP)
    return name, tuple(labels.split(",")) if labels else ()


class StoreDeltas:
    """A worker's payload: what its store's counters and its own did since the last one. Built when the
    step moved blocks, else at most once a second (for the writer's work and the gauges), so an idle
    decode step costs a clock read."""

    def __init__(self, rank: int, interval_s: float = 1.0) -> None:
        self.rank = str(rank)
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}
        self._at = 0.0

    def take(self, store: Any, worker: dict[str, float], moved: bool) -> TierKVStats | None:
        now = time.monotonic()
        if store is None or (not moved and now - self._at < self.interval_s):
            return None
        self._at = now
        out = TierKVStats()
        stats = store.stats()
        for tier in store.tier_names:
            row = stats.get(tier, {})
            for field, (name, _) in STORE_COUNTERS.items():
                out.count(name, (tier,), self._delta((tier, field), row.get(field, 0)))
            for field, (name, _) in STORE_GAUGES.items():
                if field in row:
                    out.gauge(name, (tier, self.rank), row[field])
        own = {**worker, "recomputed_blocks": stats.get("store", {}).get("recomputed_blocks", 0)}
        for field, (name, label, value, _) in WORKER_COUNTERS.items():
            out.count(name, (value,) if label else (), self._delta(("worker", field), own.get(field, 0)))
        return out

    def _delta(self, key: tuple[str, str], value: float) -> float:
        before = self._last.get(key, 0)
        self._last[key] = value
        return value - before if value >= before else value  # a counter that restarted: count it anew


class TierKVPromMetrics(KVConnectorPromMetrics):
    """vLLM's ``build_prom_metrics`` product: the metrics registered once in the API server's process,
    fed with each step's aggregated payload."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        base = list(labelnames)
        self._counters: dict[str, Any] = {}
        for name, help_ in STORE_COUNTERS.values():
            self._counters[name] = self._counter_cls(
                name=name, documentation=help_, labelnames=base + ["tier"]
            )
        for name, label, _, help_ in WORKER_COUNTERS.values():
            if name not in self._counters:
                labels = base + [label] if label else base
                self._counters[name] = self._counter_cls(name=name, documentation=help_, labelnames=labels)
        self._counters["tierkv_prompt_tokens"] = self._counter_cls(
            name="tierkv_prompt_tokens",
            documentation="Prompt tokens by where their KV came from (vllm: vLLM's own prefix cache)",
            labelnames=base + ["source"],
        )
        self._counters["tierkv_connector_lookups"] = self._counter_cls(
            name="tierkv_connector_lookups",
            documentation="Lookups not answered within lookup_wait_s: deferred to a later step, or given up",
            labelnames=base + ["outcome"],
        )
        self._counters["tierkv_tier_hit_tokens"] = self._counter_cls(
            name="tierkv_tier_hit_tokens",
            documentation="Prompt tokens served from the tier",
            labelnames=base + ["tier"],
        )
        self._gauges: dict[str, Any] = {
            name: self._gauge_cls(
                name=name,
                documentation=help_,
                labelnames=base + ["tier", "rank"],
                multiprocess_mode="mostrecent",
            )
            for name, help_ in STORE_GAUGES.values()
        }
        self._hit_ratio = self._gauge_cls(
            name="tierkv_hit_ratio",
            documentation="Share of the prompts' tokens served by the tier since start",
            labelnames=base + ["tier"],
            multiprocess_mode="mostrecent",
        )
        self._prompt_totals: dict[int, dict[str, float]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        totals = self._prompt_totals.setdefault(engine_idx, dict.fromkeys(PROMPT_SOURCES, 0.0))
        for key, delta in transfer_stats_data.get("counters", {}).items():
            name, labels = split(key)
            if name in self._counters:
                child = self._counters[name].labels(*engine, *labels)
                if delta > 0:
                    child.inc(delta)
            if name == "tierkv_prompt_tokens" and labels and labels[0] in totals:
                totals[labels[0]] += delta
                if labels[0] not in ("vllm", "computed") and delta > 0:
                    self._counters["tierkv_tier_hit_tokens"].labels(*engine, labels[0]).inc(delta)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            name, labels = split(key)
            if name in self._gauges:
                self._gauges[name].labels(*engine, *labels).set(value)
        asked = sum(totals.values())
        for tier in PROMPT_SOURCES:
            if tier not in ("vllm", "computed") and asked:
                self._hit_ratio.labels(*engine, tier).set(totals[tier] / asked)


def log_totals(stats: dict[str, Any], load_rates: dict[str, list[float]]) -> None:
    """A worker's totals as it closes: its loads, saves and self-checks, and each tier's load rate (the
    loads that tier served alone)."""
    log.info(
        "tierkv connector (worker): loaded %d blocks (%d read, %d failed) in %.2f s, saved %d in "
        "%.2f s, %d not saved after failed loads, self-check %d blocks (%d differed)",
        stats["load_blocks"],
        stats["read_blocks"],
        stats["load_failed_blocks"],
        stats["load_s"],
        stats["save_blocks"],
        stats["save_s"],
        stats["unsound_save_blocks"],
        stats["check_blocks"],
        stats["check_mismatch_blocks"],
    )
    for tier, (nbytes, seconds) in sorted(load_rates.items()):
        log.info(
            "tierkv connector (worker): loads from %s alone: %.1f MiB into vLLM's pages in %.3f s "
            "(%.2f GB/s, lookup and verification included)",
            tier,
            nbytes / 2**20,
            seconds,
            nbytes / seconds / 1e9 if seconds else 0.0,
        )
