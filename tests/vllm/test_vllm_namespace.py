"""The connector's options and namespace: what makes two engines share blocks, or not."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from fake_engine import configs as _configs

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
        kv_namespace(*_configs(tmp_path, load_format="gguf")),
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
    ("change", "reason"),
    [
        ({"window": 256}, "sliding"),
        ({"cache_dtype": "fp8"}, "unquantized"),
        ({"pcp": 2}, "prefill context parallelism"),
        ({"load_format": "dummy"}, "random weights"),
    ],
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


def test_an_unknown_tensor_parallel_rank_turns_the_worker_off(tmp_path: Path) -> None:
    """Without vLLM's distributed state, rank 0 is certain only for one rank: with two, every rank would
    take rank 0's keys (it returned 0 on any exception), so the worker must refuse to run."""
    from tierkv.integrations.vllm.guard import tp_group
    from tierkv.integrations.vllm.options import ConnectorOptions
    from tierkv.integrations.vllm.worker import WorkerSide

    assert tp_group(1).size == 1
    with pytest.raises(RuntimeError, match="tensor-parallel rank"):
        tp_group(2)
    vllm_config, kv = _configs(tmp_path, tp=2)
    worker = WorkerSide(vllm_config, kv, ConnectorOptions(cache_dir=str(tmp_path / "cache")))
    assert worker.store is None and "tensor-parallel rank" in str(worker.off)
    assert not (tmp_path / "cache").exists()  # it never opened a store under a guessed rank
