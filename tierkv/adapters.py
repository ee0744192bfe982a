"""KV layout adapters: the only code that knows how a transformers cache lays out its KV.

Canonical block layout: ``[layers, 2, tokens, kv_heads, head_dim]``. transformers' dynamic caches keep,
per layer, keys and values as ``[batch=1, kv_heads, tokens, head_dim]`` (here, on CPU, views of a
storage that appends in place: ``_append_layer``). Verified with the Llama, Qwen2,
Qwen3, Mistral and GPT-2 architectures (tests/test_worker.py builds each from a config).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tierkv.errors import ConfigError

if TYPE_CHECKING:
    from tierkv.cache_storage import CacheStorage, Lease

__all__ = [
    "CacheLayout",
    "GQA_SDPA",
    "cache_from_kv",
    "cache_layers",
    "layer_kv",
    "new_cache",
    "use_gqa_sdpa",
]


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


def new_cache(model: Any, storage: CacheStorage | None = None) -> Any:
    """A fresh dynamic cache whose full-attention layers append in place (``_append_layer``), in
    ``storage``'s kept buffer where it can lend it (``cache_storage``)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers 4.x before config-aware caches
        return DynamicCache()
    layers, kind = getattr(cache, "layers", None), _append_layer()
    if layers and kind is not None:
        from transformers.cache_utils import DynamicLayer

        lease = storage.lease() if storage is not None else None

        def appending() -> Any:
            layer = kind()
            layer._lease = lease
            return layer

        # only plain full-attention layers: a sliding window's layer keeps its own rules
        cache.layers = [appending() if type(layer) is DynamicLayer else layer for layer in layers]
    return cache


def _room(tokens: int) -> int:
    """The tokens a layer's storage is allocated for when it grows: a quarter more, at least 64 and at most
    1,024, so that the tokens decoded next are appended in place, a long generation reallocates rarely, and
    a long prompt's cache is not a quarter larger than its KV."""
    return tokens + min(max(64, tokens // 4), 1024)


@functools.cache
def _layers_take_kv() -> bool:
    """Whether transformers' ``DynamicLayer`` is the one this module is written for: its
    ``lazy_initialization`` takes the keys and the values, and it says whether it is initialized
    (transformers 5; 4.56's takes the keys alone, and 4.55's layers have no such flag)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # transformers 4.x before cache layers
        return False
    try:
        params = inspect.signature(DynamicLayer.lazy_initialization).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return "value_states" in params and "is_initialized" in vars(DynamicLayer())


@functools.cache
def _append_layer() -> type | None:
    """transformers' ``DynamicLayer``, but appending in place; None where transformers has no such layer (or
    another one than this is written for)."""
    if not _layers_take_kv():
        return None
    from transformers.cache_utils import DynamicLayer

    class AppendLayer(DynamicLayer):
        """Keys and values (batch 1, CPU) are views of a storage ``[1, kv_heads, capacity, head_dim]`` with
        room for the tokens to come. ``DynamicLayer`` concatenates instead: it copies the whole layer at
        every forward. SmolLM2 in float32 with 2,873 tokens cached, a decoding step: 56.8-58.5 ->
        49.1-49.6 ms (two runs, medians of 36 interleaved). The first forward after a restore copies the
        restored prefix as the concatenation did (98.5 against 99.6 ms for 9 tokens). The views have the
        concatenated tensors' layout but for the heads' stride, and the logits are the same bits
        (tested); a token-major storage, which the restored prefix would fill at memcpy speed, made the
        attention slower by as much (102.0 ms, and 53.5 ms a step)."""

        _layer_type = None  # never registered as transformers' layer of any type
        _k: torch.Tensor | None = None
        _v: torch.Tensor | None = None
        _lease: Lease | None = None  # its cache's claim on a kept buffer (``new_cache``), tried once

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            grads = torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)
            if key_states.shape[0] != 1 or key_states.device.type != "cpu" or grads:
                self._k = self._v = None
                return super().update(key_states, value_states, *args, **kwargs)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, m = self.get_seq_length(), key_states.shape[-2]
            if not self._holds(n, m, key_states, value_states):
                self._grow(n, m, key_states, value_states)
            assert self._k is not None and self._v is not None
            self._k[:, :, n : n + m].copy_(key_states)
            self._v[:, :, n : n + m].copy_(value_states)
            self.keys, self.values = self._k[:, :, : n + m], self._v[:, :, : n + m]
            return self.keys, self.values

        def reset(self) -> None:
            """Dropped, as ``DynamicLayer`` drops its tensors: views of the old storage stay as they were."""
            self._k = self._v = None
            super().reset()

        def _holds(self, n: int, m: int, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
            """Whether the storage takes ``m`` more tokens like these in place: room for them, their heads,
            head size and dtype, writable here (an inference tensor is written to in inference mode only),
            and the layer's tensors still its own views (a reorder or an offload replaces them; a crop
            keeps a shorter one)."""
            k, v = self._k, self._v
            if k is None or v is None or n + m > k.shape[2]:
                return False
            if torch.is_inference(k) and not torch.is_inference_mode_enabled():
                return False
            for store, new, held in ((k, key_states, self.keys), (v, value_states, self.values)):
                if (
                    store.dtype != new.dtype
                    or store.shape[1] != new.shape[1]
                    or store.shape[3] != new.shape[3]
                ):
                    return False
                if n and (
                    held is None
                    or held.data_ptr() != store.data_ptr()
                    or held.stride() != store.stride()
                    or held.shape[:2] != store.shape[:2]
                    or held.shape[3] != store.shape[3]
                ):
                    return False
            return True

        def _grow(self, n: int, m: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            """A new storage with room for ``n + m`` and more (the kept buffer's slot, the first time, where
            its cache's lease gets one); the ``n`` tokens held so far copied into it."""
            lease, self._lease = self._lease, None
            kept = lease.take(n + m, key_states, value_states) if lease is not None else None
            if kept is not None:
                k, v = kept
            else:
                cap = _room(n + m)
                k = key_states.new_empty((1, key_states.shape[1], cap, key_states.shape[3]))
                v = value_states.new_empty((1, value_states.shape[1], cap, value_states.shape[3]))
            if n:
                assert self.keys is not None and self.values is not None
                k[:, :, :n].copy_(self.keys)
                v[:, :, :n].copy_(self.values)
            self._k, self._v = k, v

    return AppendLayer


def cache_from_kv(model: Any, kv: torch.Tensor, storage: CacheStorage | None = None) -> Any:
    """A fresh dynamic cache holding ``kv`` (canonical ``[L, 2, T, H, D]``) for every layer.

    The layers get views of ``kv`` (``[1, H, T, D]``, no copy): the next forward copies them into the
    cache's own tensors with its new tokens (``AppendLayer``'s storage, ``storage``'s kept buffer where it
    lends it, or ``DynamicLayer``'s concatenation). ``kv`` must stay untouched until then.
    """
    cache = new_cache(model, storage)
    layers = getattr(cache, "layers", None)
    kinds = {"DynamicLayer", "AppendLayer"}
    direct = (
        _layers_take_kv()
        and layers is not None
        and len(layers) == kv.shape[0]
        and all(type(layer).__name__ in kinds and hasattr(layer, "lazy_initialization") for layer in layers)
    )
    for i in range(kv.shape[0]):
        k, v = kv[i, 0].transpose(0, 1).unsqueeze(0), kv[i, 1].transpose(0, 1).unsqueeze(0)
        if direct:
            assert layers is not None
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


# ---------------------------------------------------------------- attention for a suffix over a restored cache

GQA_SDPA = "tierkv_sdpa_gqa"


def _sdpa_gqa_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except for several query tokens over a masked, longer key range on CPU
    with grouped KV heads: the suffix prefilled after a restore. transformers then repeats every KV head
    to the query heads (``repeat_kv``: a copy of the whole cache, three times its size for SmolLM2, in
    every layer) because CUDA's kernels need it; PyTorch's CPU flash kernel takes the mask with
    ``enable_gqa`` directly, as the cold prefill already does (no mask there), with the same results.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (
        query.device.type == "cpu"
        and getattr(module, "num_key_value_groups", 1) > 1
        and query.shape[2] > 1
        and attention_mask is not None
        and not dropout
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions")
    ):
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def use_gqa_sdpa(model: Any) -> bool:
    """Switch a CPU model with grouped KV heads from ``sdpa`` to ``tierkv_sdpa_gqa`` (above); True if it did.

    SmolLM2 (9 query heads over 3 KV heads) in float32 after restoring ~2,850 tokens, one thread, medians
    on a shared 2-core CPU: 9 tokens' forward 440 -> 281 ms, 57 tokens' 740 -> 567 ms (``repeat_kv``'s
    copies were ~120 ms of either, and the attention reads a third of the bytes). The logits are the same
    bits (tested). Anything else keeps its attention:
    eager (reduced precision on CPU), GPUs (masked GQA falls back to the math kernel there), transformers
    without registrable attention and mask functions, PyTorch before ``enable_gqa`` (2.5). The namespace
    does not change: the config hash leaves out the attention implementation.
    """
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    layout = CacheLayout.of(model)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = _first(text, "num_attention_heads", "n_head")
    if layout.num_kv_heads >= heads or next(model.parameters()).device.type != "cpu":
        return False
    if "enable_gqa" not in (F.scaled_dot_product_attention.__doc__ or ""):
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        return False
    AttentionInterface.register(GQA_SDPA, _sdpa_gqa_attention)
    AttentionMaskInterface.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # the same masks as sdpa
    model.set_attn_implementation(GQA_SDPA)
    return getattr(model.config, "_attn_implementation", None) == GQA_SDPA
