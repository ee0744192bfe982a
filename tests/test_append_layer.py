"""Cache layers that append in place (``adapters._append_layer``): the same logits, bit for bit, as
transformers' own concatenating layer, after a restore, through decoding, a growth and a crop."""

import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tierkv.adapters import cache_from_kv, cache_layers, new_cache
from tierkv.default_model import ByteTokenizer
from tierkv.worker import CachedModel

from test_worker import ARCHS, prompt


def _model(arch: str, dtype: torch.dtype, attn: str = "sdpa", **more) -> CachedModel:
    cfg_name, model_name, kwargs = ARCHS[arch]
    config = getattr(transformers, cfg_name)(**(kwargs | more), attn_implementation=attn)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    return CachedModel(model, ByteTokenizer(), None, model_id=arch, block_tokens=16)


def _concatenating(cm: CachedModel, kv: torch.Tensor | None = None, sliding: bool = False) -> DynamicCache:
    """transformers' own cache, its layers concatenating; ``kv`` (canonical) put in through its API."""
    cache = DynamicCache(config=cm.model.config)
    assert sliding or all(type(layer) is DynamicLayer for layer in cache.layers)
    if kv is not None:
        for i in range(kv.shape[0]):
            cache.update(kv[i, 0].transpose(0, 1).unsqueeze(0), kv[i, 1].transpose(0, 1).unsqueeze(0), i)
    return cache


def _canonical(cm: CachedModel, cache, room: int) -> torch.Tensor:
    """The cache's KV as a restore leaves it: ``[layers, 2, tokens, heads, dim]``, a view of a larger buffer
    (the engine's reused restore buffer)."""
    keys, values = cache_layers(cache, cm.layout)
    n = keys[0].shape[1]
    buf = torch.full((len(keys), 2, n + room, *keys[0].shape[::2]), float("nan"), dtype=keys[0].dtype)
    for i, (k, v) in enumerate(zip(keys, values)):
        buf[i, 0, :n], buf[i, 1, :n] = k.transpose(0, 1), v.transpose(0, 1)
    return buf[:, :, :n]


@pytest.mark.parametrize(
    ("dtype", "attn"), [(torch.float32, "sdpa"), (torch.bfloat16, "sdpa"), (torch.bfloat16, "eager")]
)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_restored_cache_appends_in_place_with_the_same_logits(arch, dtype, attn) -> None:
    """(Eager attention is what CPU half precision loads with: its matmuls read the stored views too.)"""
    cm = _model(arch, dtype, attn)
    ids = prompt(120, salt=3)
    with torch.inference_mode():
        _, prefix = cm._forward(ids[:96], new_cache(cm.model))
        kv = _canonical(cm, prefix, room=40)  # the buffer's tokens after the prefix are NaN
        ours, theirs = cache_from_kv(cm.model, kv), _concatenating(cm, kv)
        assert {type(layer).__name__ for layer in ours.layers} == {"AppendLayer"}
        a, ours = cm._forward(ids[96:], ours)
        b, theirs = cm._forward(ids[96:], theirs)
        assert torch.equal(a, b)
        kv.fill_(0)  # the restore buffer is free after the first forward: the layers copied the prefix
        ptrs, moved = {ours.layers[0].keys.data_ptr()}, 0
        for step in range(70):  # past the room the first update left (120 + 64): one growth
            tok = int(a.argmax())
            a, ours = cm._forward([tok], ours)
            b, theirs = cm._forward([tok], theirs)
            assert torch.equal(a, b), step
            ptr = ours.layers[0].keys.data_ptr()
            moved += ptr not in ptrs
            ptrs.add(ptr)
        assert moved == 1  # decoded in place, but for the one growth
        for got, want in zip(cache_layers(ours, cm.layout), cache_layers(theirs, cm.layout)):
            assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_cropped_cache_and_one_used_outside_inference_mode_stay_exact() -> None:
    """A crop leaves the layer's tensors views of its storage, shorter: the next tokens overwrite the
    cropped ones. A storage made in inference mode is not written outside it: the layer moves to a new
    one."""
    cm = _model("llama", torch.float32)
    ids = prompt(100, salt=4)
    with torch.inference_mode():
        _, ours = cm._forward(ids[:80], new_cache(cm.model))
        _, theirs = cm._forward(ids[:80], _concatenating(cm))
        ours.crop(-10)
        theirs.crop(-10)
        a, ours = cm._forward(ids[70:90], ours)
        b, theirs = cm._forward(ids[70:90], theirs)
        assert torch.equal(a, b)
    with torch.no_grad():
        a, ours = cm._forward(ids[90:], ours)
        b, theirs = cm._forward(ids[90:], theirs)
    assert torch.equal(a, b)
    assert not torch.is_inference(ours.layers[0].keys)


def test_greedy_generation_after_a_restore_matches_transformers_own_cache(tmp_path) -> None:
    """Through the engine (restore, prefill, decoding): the tokens a plain transformers cache gives."""
    from tierkv import TieredStore

    with TieredStore.open(tmp_path, host_bytes=16 << 20) as store:
        cm = _model("qwen2", torch.float32)
        cm.store = store
        ids = prompt(150, salt=5)
        cm.prefill(ids)
        store.flush()
        out = cm.generate(ids, 60)
        assert out.prefill.hit.num_tokens == 144
    assert out.token_ids == greedy(cm, ids, 60)


def greedy(cm: CachedModel, ids: list[int], n: int) -> list[int]:
    """``n`` tokens of greedy generation after ``ids`` through transformers' own cache: the reference."""
    with torch.inference_mode():
        logits, cache = cm._forward(ids, _concatenating(cm))
        want: list[int] = []
        for _ in range(n):
            want.append(int(logits.argmax()))
            logits, cache = cm._forward(want[-1:], cache)
    return want


def test_sliding_window_layers_and_batches_keep_transformers_own_rules() -> None:
    """Only plain full-attention layers append in place: a sliding window's layers stay transformers' own
    (and exact), and a batch of two falls back to concatenating, with the same logits."""
    cm = _model("mistral", torch.float32, sliding_window=24)
    ids = prompt(60, salt=6)
    with torch.inference_mode():
        cache = new_cache(cm.model)
        assert {type(layer).__name__ for layer in cache.layers} == {"DynamicSlidingWindowLayer"}
        a, _ = cm._forward(ids, cache)
        b, _ = cm._forward(ids, _concatenating(cm, sliding=True))
        assert torch.equal(a, b)
    cm = _model("llama", torch.float32)
    batch = torch.tensor([prompt(30, salt=7), prompt(30, salt=8)])
    with torch.inference_mode():
        ours = cm.model(input_ids=batch, use_cache=True, cache=new_cache(cm.model)).logits
        theirs = cm.model(input_ids=batch, use_cache=True, cache=_concatenating(cm)).logits
    assert torch.equal(ours, theirs)


def test_a_reset_cache_starts_again_from_its_first_token() -> None:
    cm = _model("qwen3", torch.float32)
    first, second = prompt(50, salt=9), prompt(40, salt=10)
    with torch.inference_mode():
        _, cache = cm._forward(first, new_cache(cm.model))
        held = cache.layers[0].keys.clone(), cache.layers[0].keys
        cache.reset()
        a, cache = cm._forward(second, cache)
        b, _ = cm._forward(second, _concatenating(cm))
        assert torch.equal(a, b) and cache.get_seq_length() == 40
        assert torch.equal(held[1], held[0])  # a view taken before the reset is left as it was
