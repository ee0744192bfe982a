"""Prometheus metrics: request counters and latency histograms, plus the store's counters read at scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tierkv.metrics import EXPORTED_COUNTERS, EXPORTED_GAUGES
from tierkv.telemetry import gpu_telemetry

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

_STORE_COUNTERS = {  # store counter -> (metric, help)
    "hit_tokens": ("tierkv_tier_hit_tokens", "Prompt tokens served from the tier"),
    **EXPORTED_COUNTERS,
}


class StoreCollector:
    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        store = self.server.store
        engine = self.server.engine
        queue = GaugeMetricFamily("tierkv_queue_depth", "Requests waiting for or running on the model")
        queue.add_metric([], engine.queued if engine else 0)
        yield queue
        if store is None:
            return
        stats = store.stats()
        tiers = store.tier_names
        for key, (name, help_) in _STORE_COUNTERS.items():
            fam = CounterMetricFamily(name, help_, labels=["tier"])
            for tier in tiers:
                fam.add_metric([tier], stats.get(tier, {}).get(key, 0))
            yield fam
        staged = CounterMetricFamily(
            "tierkv_staging_blocks", "Blocks through the GPU staging ring, by outcome", labels=["outcome"]
        )
        for outcome, key in (("copied", "blocks_written"), ("dropped", "dropped_saves")):
            staged.add_metric([outcome], stats.get("staging", {}).get(key, 0))
        yield staged
        recomputed = CounterMetricFamily(
            "tierkv_recomputed_blocks",
            "Cached blocks computed instead of read: reading them was judged slower (measured speeds)",
        )
        recomputed.add_metric([], stats.get("store", {}).get("recomputed_blocks", 0))
        yield recomputed
        checked = CounterMetricFamily(
            "tierkv_selfcheck_blocks",
            "Restored blocks the sampled self-check also computed cold, by outcome (differed: purged)",
            labels=["outcome"],
        )
        checked.add_metric(["checked"], stats.get("store", {}).get("checked_blocks", 0))
        checked.add_metric(["differed"], stats.get("store", {}).get("check_mismatch_blocks", 0))
        yield checked
        # Blocks served by each tier, as a share of every full block the store was asked for since start
        # (a dashboard's hit rate without a recording rule; rate() of the counters gives it per window).
        served = {t: stats.get(t, {}).get("hit_blocks", 0) for t in tiers}
        asked = sum(served.values()) + stats.get("store", {}).get("miss_blocks", 0)
        ratio = GaugeMetricFamily(
            "tierkv_hit_ratio",
            "Share of the prompts' full blocks served by the tier since start",
            labels=["tier"],
        )
        for tier in tiers:
            ratio.add_metric([tier], served[tier] / asked if asked else 0.0)
        yield ratio
        for field, (name, help_) in EXPORTED_GAUGES.items():  # the tiers with a size, a queue
            gauge = GaugeMetricFamily(name, help_, labels=["tier"])
            for tier in tiers:
                if field in stats.get(tier, {}):
                    gauge.add_metric([tier], stats[tier][field])
            yield gauge
        yield from self._tenants(store)
        yield from gpu_metrics()

    def _tenants(self, store: Any) -> Iterator[Any]:
        """Usage and quotas per tenant of the keys file (labels are configured names, never client-chosen)."""
        tenants = self.server.tenants
        if tenants is None:
            return
        quotas = tenants.quotas()  # (one reading: a reload may change them meanwhile)
        used = GaugeMetricFamily(
            "tierkv_tenant_bytes", "Bytes of the tenant's blocks in the tier", labels=["tenant", "tier"]
        )
        pinned = GaugeMetricFamily(
            "tierkv_tenant_pinned_bytes", "Bytes the tenant has pinned", labels=["tenant"]
        )
        quota = GaugeMetricFamily(
            "tierkv_tenant_quota_bytes",
            "The tenant's quota in the tier (absent: none)",
            labels=["tenant", "tier"],
        )
        usage = store.tenant_usage()
        for tid, q in sorted(quotas.items(), key=lambda kv: kv[1].name):
            name, row = q.name, usage.get(tid, {})
            for tier in ("host", "disk"):
                if tier in store.tier_names:
                    used.add_metric([name, tier], row.get(f"{tier}_nbytes", 0))
            pinned.add_metric([name], row.get("pinned_nbytes", 0))
            for tier, limit in (("disk", q.disk_nbytes), ("host", q.host_nbytes), ("pin", q.pin_nbytes)):
                if limit is not None:
                    quota.add_metric([name, tier], limit)
        yield used
        yield pinned
        yield quota


def gpu_metrics() -> Iterator[Any]:
    """NVML's device-wide figures (none without a GPU): memory, utilisation, PCIe throughput."""
    samples = gpu_telemetry()
    if not samples:
        return
    families = {
        "memory_used_nbytes": GaugeMetricFamily(
            "tierkv_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"]
        ),
        "memory_total_nbytes": GaugeMetricFamily(
            "tierkv_gpu_memory_total_bytes", "GPU memory", labels=["gpu"]
        ),
        "utilization_gpu_pct": GaugeMetricFamily(
            "tierkv_gpu_utilization_percent", "GPU busy share", labels=["gpu"]
        ),
        "pcie_tx_Bps": GaugeMetricFamily(
            "tierkv_gpu_pcie_tx_bytes_per_second", "PCIe device to host", labels=["gpu"]
        ),
        "pcie_rx_Bps": GaugeMetricFamily(
            "tierkv_gpu_pcie_rx_bytes_per_second", "PCIe host to device", labels=["gpu"]
        ),
    }
    for sample in samples:
        for field, fam in families.items():
            fam.add_metric([str(sample.index)], getattr(sample, field))
    yield from families.values()


class Metrics:
    def __init__(self, server: Any) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tierkv_requests",
            "HTTP requests by route template (unmatched: no route) and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tierkv_prompt_tokens",
            "Prompt tokens by where their KV came from",
            ["source"],
            registry=self.registry,
        )  # host, disk, computed
        self.completion_tokens = Counter(
            "tierkv_completion_tokens", "Generated tokens", registry=self.registry
        )
        self.ttft = Histogram(
            "tierkv_ttft_seconds",
            "Time to first token, queueing included",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.restore = Histogram(
            "tierkv_restore_seconds",
            "Time to restore a cached prefix",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(StoreCollector(server))
        self.static_routes: frozenset[str] = frozenset()  # the app's routes without parameters (create_app)

    def count_request(self, path: str, status: int) -> None:
        """A request answered before any route saw it (the body guard's 413, 408, 400 or 503)."""
        self.requests.labels(path if path in self.static_routes else "unmatched", str(status)).inc()


__all__ = ["Metrics", "StoreCollector", "gpu_metrics"]
