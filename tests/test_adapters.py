"""KV layout adapters (tierkv/adapters.py) on real transformers models with random weights: a model's
cache to the canonical ``[layers, 2, tokens, kv_heads, head_dim]`` layout and back."""

from __future__ import annotations

import types

import pytest
import torch

from tierkv.adapters import CacheLayout, cache_from_kv, cache_layers, layer_kv, new_cache
from tierkv.default_model import build_default_model
from tierkv.errors import ConfigError

from test_worker import TINY  # the small random model the worker tests use


@pytest.fixture(scope="module")
def model():
    return build_default_model(torch.float32, seed=4, attn_implementation="sdpa", **TINY)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (1, n), generator=g)


def _forward(model, ids: torch.Tensor, cache):
    layout = CacheLayout.of(model)
    out = model(input_ids=ids, use_cache=True, **{layout.cache_kwarg: cache})
    return out.logits[0].float(), getattr(out, layout.cache_kwarg, cache)


def _canonical(cache, layout: CacheLayout) -> torch.Tensor:
    """The cache's KV as ``[L, 2, T, H, D]``."""
    keys, values = cache_layers(cache, layout)
    return torch.stack([torch.stack([k.transpose(0, 1), v.transpose(0, 1)]) for k, v in zip(keys, values)])


def test_layout_of_a_grouped_query_model(model) -> None:
    layout = CacheLayout.of(model)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 32)
    assert layout.cache_kwarg in ("cache", "past_key_values")


def test_layout_of_a_model_without_grouped_heads_or_head_dim() -> None:
    import transformers

    config = transformers.GPT2Config(n_embd=96, n_layer=3, n_head=4, vocab_size=259, n_positions=64)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    layout = CacheLayout.of(gpt2)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (3, 4, 24)  # heads = kv heads, 96 / 4


def test_a_config_without_the_sizes_is_a_config_error() -> None:
    shapeless = types.SimpleNamespace(
        config=types.SimpleNamespace(hidden_size=64), forward=lambda input_ids: None
    )
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        CacheLayout.of(shapeless)


@torch.inference_mode()
def test_new_cache_is_empty_and_fills_to_the_layout(model) -> None:
    layout = CacheLayout.of(model)
    cache = new_cache(model)
    assert cache.get_seq_length() == 0
    _, cache = _forward(model, _ids(20), cache)
    keys, values = cache_layers(cache, layout)
    assert len(keys) == len(values) == layout.num_layers
    for k, v in zip(keys, values):
        assert k.shape == v.shape == (layout.num_kv_heads, 20, layout.head_dim)
    k0, v0 = layer_kv(cache, 0)
    assert k0.shape == (1, layout.num_kv_heads, 20, layout.head_dim) and torch.equal(k0[0], keys[0])


@torch.inference_mode()
def test_kv_round_trips_through_cache_from_kv(model) -> None:
    layout = CacheLayout.of(model)
    _, cache = _forward(model, _ids(40), new_cache(model))
    kv = _canonical(cache, layout)
    assert kv.shape == (layout.num_layers, 2, 40, layout.num_kv_heads, layout.head_dim)
    rebuilt = cache_from_kv(model, kv)
    assert rebuilt.get_seq_length() == 40
    for layer in range(layout.num_layers):
        k, v = layer_kv(rebuilt, layer)
        k_ref, v_ref = layer_kv(cache, layer)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.equal(_canonical(rebuilt, layout), kv)


@torch.inference_mode()
def test_a_cache_rebuilt_from_a_prefix_continues_like_a_full_forward(model) -> None:
    layout = CacheLayout.of(model)
    ids = _ids(48, seed=2)
    full_logits, _ = _forward(model, ids, new_cache(model))
    _, prefix_cache = _forward(model, ids[:, :32], new_cache(model))
    kv = _canonical(prefix_cache, layout).clone()
    kept = kv.clone()
    logits, cache = _forward(model, ids[:, 32:], cache_from_kv(model, kv))
    assert (logits - full_logits[32:]).abs().max().item() <= 1e-4
    assert cache.get_seq_length() == 48
    assert torch.equal(kv, kept)  # the forward made the cache's own tensors; the restored KV is untouched
    assert torch.equal(_canonical(cache, layout)[:, :, :32], kept)


@torch.inference_mode()
def test_cache_from_kv_views_the_kv_without_a_copy_where_the_cache_allows(model) -> None:
    kv = torch.randn(2, 2, 16, 2, 32)
    cache = cache_from_kv(model, kv)
    layers = getattr(cache, "layers", None)
    if (
        not layers
        or type(layers[0]).__name__ != "DynamicLayer"
        or not hasattr(layers[0], "lazy_initialization")
    ):
        pytest.skip("this transformers' cache takes KV through update() (one copy)")
    k, v = layer_kv(cache, 1)
    assert k.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    assert torch.equal(k[0], kv[1, 0].transpose(0, 1)) and torch.equal(v[0], kv[1, 1].transpose(0, 1))
