"""The connector's options and namespace: what makes two engines share blocks, or not."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tierkv.errors import ConfigError
from tierkv.integrations.vllm.namespace import checkpoint_fingerprint, kv_namespace, unsupported
from tierkv.integrations.vllm.options import ConnectorOptions


def test_options_parse_sizes_and_durations_and_refuse_unknown_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    o = ConnectorOptions.from_extra(
        {
            "cache_dir": "/c",
            "host_bytes": "64MiB",
            "disk_bytes": 0,
            "ttl_s": "2h",
            "remote": "redis://h:1",
            "sweep_interval_s": 0,
        }
    )
    assert (o.host_bytes, o.disk_bytes, o.ttl_s, o.remote, o.sweep_interval_s) == (
        64 << 20,
        None,
        7200.0,
        "redis://h:1",
        0.0,
    )
    d = ConnectorOptions.from_extra(None)
    assert (d.host_bytes, d.disk_bytes, d.ttl_s) == (2 << 30, 20 << 30, 86400.0)  # tierkv serve's defaults
    monkeypatch.setenv("TIERKV_CACHE_DIR", "/somewhere")
    assert d.resolved_cache_dir == "/somewhere"
    with pytest.raises(ConfigError, match="unknown tierkv connector option"):
        ConnectorOptions.from_extra({"cache-dir": "/c"})


def _configs(tmp_path: Path, **changes):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    if not (model / "model.safetensors").exists():
        (model / "model.safetensors").write_bytes(b"weights v1")
    spec = FullAttentionSpec(
        block_size=changes.pop("block_size", 128),
        num_kv_heads=2,
        head_size=64,
        dtype=changes.pop("dtype", torch.float32),
        sliding_window=changes.pop("window", None),
    )
    kv = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layers.{i}.attn" for i in range(4)], spec)],
        kv_cache_layout=changes.pop("layout", "LBHNC"),
    )
    hf = SimpleNamespace(to_dict=lambda: {"hidden_size": 256, "rope_theta": changes.get("rope", 1e4)})
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(
            model=str(model), revision=None, hf_config=hf, served_model_name=None, quantization=None
        ),
        cache_config=SimpleNamespace(cache_dtype=changes.pop("cache_dtype", "auto")),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=changes.pop("tp", 1),
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
        ),
        device_config=SimpleNamespace(device_type=changes.pop("device", "cpu")),
    )
    return vllm_config, kv


def test_the_namespace_follows_the_engine(tmp_path: Path) -> None:
    ns = kv_namespace(*_configs(tmp_path))
    assert (ns.model_id, ns.dtype, ns.num_layers, ns.num_kv_heads, ns.head_dim, ns.block_tokens) == (
        "model",
        "float32",
        4,
        2,
        64,
        128,
    )
    assert ns.revision.startswith("w:") and "+vllm:cpu/LBHNC/FullAttentionSpec+tp0of1" in ns.revision
    assert kv_namespace(*_configs(tmp_path)) == ns  # the scheduler and the worker agree
    others = [
        kv_namespace(*_configs(tmp_path, block_size=64)),
        kv_namespace(*_configs(tmp_path, dtype=torch.bfloat16)),
        kv_namespace(*_configs(tmp_path, layout="LBNHC")),
        kv_namespace(*_configs(tmp_path, device="cuda")),
        kv_namespace(*_configs(tmp_path, rope=5e5)),
        kv_namespace(*_configs(tmp_path, tp=2)),
        kv_namespace(*_configs(tmp_path), tp_rank=0, revision="my-finetune-3"),
        ns.with_salt("tenant"),
    ]
    assert len({n.digest for n in [ns, *others]}) == len(others) + 1


def test_other_weights_are_another_namespace(tmp_path: Path) -> None:
    before = kv_namespace(*_configs(tmp_path))
    (tmp_path / "model" / "model.safetensors").write_bytes(b"other weights")
    after = kv_namespace(*_configs(tmp_path))
    assert before.digest != after.digest
    assert checkpoint_fingerprint(str(tmp_path / "nowhere")) is None


@pytest.mark.parametrize(
    ("change", "reason"), [({"window": 256}, "sliding"), ({"cache_dtype": "fp8"}, "unquantized")]
)
def test_what_cannot_be_kept_exactly_turns_the_connector_off(
    tmp_path: Path, change: dict, reason: str
) -> None:
    assert unsupported(*_configs(tmp_path)) is None
    assert reason in unsupported(*_configs(tmp_path, **change))


def test_a_hybrid_model_turns_the_connector_off(tmp_path: Path) -> None:
    vllm_config, kv = _configs(tmp_path)
    kv = dataclasses.replace(kv, kv_cache_groups=[*kv.kv_cache_groups, *kv.kv_cache_groups])
    assert "2 KV cache groups" in unsupported(vllm_config, kv)
