"""KV layout adapters: the only code that knows how a transformers cache lays out its KV.

Canonical block layout: ``[layers, 2, tokens, kv_heads, head_dim]``. transformers' dynamic caches keep,
per layer, keys and values as ``[batch=1, kv_heads, tokens, head_dim]``. Verified with the Llama, Qwen2,
Qwen3, Mistral and GPT-2 architectures (tests/test_worker.py builds each from a config).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from tierkv.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_kwarg: str  # "cache" (transformers 5) or "past_key_values" (4.x)

    @classmethod
    def of(cls, model: Any) -> CacheLayout:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
        heads = _first(cfg, "num_attention_heads", "n_head")
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or _first(cfg, "hidden_size", "n_embd") // heads
        params = inspect.signature(model.forward).parameters
        kwarg = "cache" if "cache" in params else "past_key_values"
        return cls(layers, kv_heads, head_dim, kwarg)


def _first(cfg: Any, *names: str) -> int:
    for n in names:
        v = getattr(cfg, n, None)
        if v:
            return int(v)
    raise ConfigError(f"model config has none of {names}: cannot infer its KV layout")


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers 4.x before config-aware caches
        return DynamicCache()


def cache_from_kv(model: Any, kv: torch.Tensor) -> Any:
    """A fresh dynamic cache holding ``kv`` (canonical ``[L, 2, T, H, D]``) for every layer.

    The layers get views of ``kv`` (``[1, H, T, D]``, no copy): the next forward concatenates its new
    tokens onto them, which makes the cache's own tensors. ``kv`` must stay untouched until then.
    """
    cache = new_cache(model)
    layers = getattr(cache, "layers", None)
    direct = layers is not None and len(layers) == kv.shape[0] and all(
        type(layer).__name__ == "DynamicLayer" and hasattr(layer, "lazy_initialization") for layer in layers)
    for i in range(kv.shape[0]):
        k, v = kv[i, 0].transpose(0, 1).unsqueeze(0), kv[i, 1].transpose(0, 1).unsqueeze(0)
        if direct:
            layers[i].lazy_initialization(k, v)
            layers[i].keys, layers[i].values = k, v
        else:  # other cache classes and transformers 4.x: through the public API (one copy)
            cache.update(k, v, i)
    return cache


def layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers 4.x


def cache_layers(cache: Any, layout: CacheLayout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's keys and values as ``[kv_heads, tokens, head_dim]`` views (what ``kernels`` gathers from)."""
    pairs = [layer_kv(cache, layer) for layer in range(layout.num_layers)]
    return [k[0] for k, _ in pairs], [v[0] for _, v in pairs]
