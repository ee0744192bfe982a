"""The connector's metrics payload and its Prometheus side, on a real store (the end-to-end check through
vLLM's own /metrics is in test_vllm_serve.py)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tierkv import Namespace, TieredStore

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # conftest.py skips the directory's tests; nothing to import
    pytest.skip("needs vLLM", allow_module_level=True)

from tierkv.integrations.vllm.metrics import StoreDeltas, TierKVPromMetrics, TierKVStats  # noqa: E402

NS = Namespace(
    model_id="m", revision="r", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4
)


def test_counters_add_up_across_ranks_and_gauges_keep_each_ranks_latest() -> None:
    a, b = TierKVStats(), TierKVStats()
    a.count("tierkv_tier_read_bytes", ("disk",), 100)
    b.count("tierkv_tier_read_bytes", ("disk",), 50)
    a.gauge("tierkv_tier_used_bytes", ("host", "0"), 7)
    b.gauge("tierkv_tier_used_bytes", ("host", "1"), 9)
    total = a.aggregate(b)
    assert total.data["counters"] == {"tierkv_tier_read_bytes|disk": 150}
    assert total.data["gauges"] == {"tierkv_tier_used_bytes|host,0": 7, "tierkv_tier_used_bytes|host,1": 9}
    assert total.reduce() == {"tierkv_tier_read_bytes:disk": 150}
    assert TierKVStats().is_empty() and not total.is_empty()
    # the payload crosses vLLM's IPC as plain data and comes back as the same stats
    assert TierKVStats(data=dict(total.data)).data == total.data


def test_a_worker_reports_what_its_store_did_since_the_last_payload(tmp_path: Path) -> None:
    with TieredStore.open(tmp_path, host_bytes=1 << 20) as store:
        deltas = StoreDeltas(rank=1, interval_s=3600)
        first = deltas.take(store, {"load_blocks": 0}, moved=True)
        assert first is not None
        store.save(NS, list(range(8)), torch.ones(2, 2, 8, 2, 8))
        store.flush()
        assert (
            deltas.take(store, {"load_blocks": 0}, moved=False) is None
        )  # nothing moved, within the interval
        after = deltas.take(store, {"load_blocks": 3}, moved=True)
        assert after is not None
        counters, gauges = after.data["counters"], after.data["gauges"]
        assert counters["tierkv_tier_written_bytes|disk"] > 0
        assert counters["tierkv_connector_loaded_blocks|"] == 3
        assert gauges["tierkv_tier_used_bytes|host,1"] > 0 and "tierkv_tier_capacity_bytes|disk,1" in gauges
        again = deltas.take(store, {"load_blocks": 3}, moved=True)
        assert again is not None and again.data["counters"]["tierkv_tier_written_bytes|disk"] == 0


def test_the_prometheus_side_counts_prompt_tokens_by_source_and_the_hit_ratio() -> None:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = TierKVPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    step = TierKVStats()
    for source, n in (("vllm", 100), ("host", 300), ("disk", 200), ("computed", 400)):
        step.count("tierkv_prompt_tokens", (source,), n)
    step.count("tierkv_tier_read_bytes", ("disk",), 4096)
    step.gauge("tierkv_tier_used_bytes", ("host", "0"), 123)
    prom.observe(step.data, 0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    assert value("tierkv_prompt_tokens_total", source="host") == 300
    assert value("tierkv_tier_hit_tokens_total", tier="disk") == 200
    assert value("tierkv_tier_hit_tokens_total", tier="vllm") is None  # vLLM's own hits are not a tier's
    assert value("tierkv_hit_ratio", tier="host") == 0.3
    assert value("tierkv_tier_read_bytes_total", tier="disk") == 4096
    assert value("tierkv_tier_used_bytes", tier="host", rank="0") == 123
