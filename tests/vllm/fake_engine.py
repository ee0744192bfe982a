"""A vLLM engine's configuration and a connector worker without an engine: the connector's own logic,
driven step by step with the metadata its scheduler side would send (vLLM's objects where it reads them,
a real store, vLLM's paged caches as plain tensors written through a probed layout)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

B, H, D, LAYERS = 128, 2, 64, 4  # the block, heads and layers ``configs`` describes


def configs(tmp_path: Path, **changes):
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
            prefill_context_parallel_size=changes.pop("pcp", 1),
        ),
        device_config=SimpleNamespace(device_type=changes.pop("device", "cpu")),
        load_config=SimpleNamespace(load_format=changes.pop("load_format", "auto")),
        scheduler_config=SimpleNamespace(async_scheduling=changes.pop("async_scheduling", False)),
    )
    return vllm_config, kv


def side_by_side(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """A GPU backend's cache write: [blocks, heads, tokens, 2 * head_dim], K then V in the last dim."""
    tokens, d = cache.shape[2], key.shape[-1]
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, tokens)
        cache[block, :, offset, :d] = key[t]
        cache[block, :, offset, d:] = value[t]


def worker(tmp_path: Path, *, num_blocks: int = 32, **changes: Any) -> Any:
    """A ``WorkerSide`` over ``num_blocks`` vLLM blocks per layer (its caches zeroed), on a store in
    ``tmp_path / "cache"``; ``changes`` as ``configs``'."""
    from tierkv.integrations.vllm.layout import PageShape, probe
    from tierkv.integrations.vllm.options import ConnectorOptions
    from tierkv.integrations.vllm.worker import WorkerSide

    vllm_config, kv = configs(tmp_path, **changes)
    options = ConnectorOptions(cache_dir=str(tmp_path / "cache"), host_bytes=0, sync=False)
    w = WorkerSide(vllm_config, kv, options)
    w.caches = [torch.zeros(num_blocks, H, B, 2 * D) for _ in range(LAYERS)]
    page = PageShape.of(w.caches[0], num_blocks)
    w.layout = probe(side_by_side, block_tokens=B, num_kv_heads=H, head_dim=D, page=page, dtype=torch.float32)
    return w


def scheduler(tmp_path: Path, **changes: Any) -> Any:
    """A ``SchedulerSide`` on a store in ``tmp_path / "cache"``; ``changes`` as ``configs``'."""
    from tierkv.integrations.vllm.options import ConnectorOptions
    from tierkv.integrations.vllm.scheduler import SchedulerSide

    vllm_config, kv = configs(tmp_path, **changes)
    options = ConnectorOptions(cache_dir=str(tmp_path / "cache"), host_bytes=0, sync=False, self_check_rate=0)
    return SchedulerSide(vllm_config, kv, options, load=True, save=True)


def request(req_id: str, tokens: list[int], **fields: Any) -> Any:
    """What the connector reads of a vLLM ``Request``; ``fields`` override (or, set to ``...``, remove)."""
    values = {
        "request_id": req_id,
        "prompt_token_ids": tokens,
        "num_tokens": len(tokens),
        "mm_features": [],
        "lora_request": None,
        "prompt_embeds": None,
        "cache_salt": None,
        **fields,
    }
    return SimpleNamespace(**{k: v for k, v in values.items() if v is not ...})
