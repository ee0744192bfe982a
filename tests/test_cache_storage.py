"""The kept buffer a CPU engine's caches keep their KV in (``cache_storage``): a restored cache's layers
take it with the same logits, bit for bit, as transformers' own cache; a cache still held keeps it from
the next one, whose KV then lives elsewhere; what does not fit leaves it, exactly."""

import pytest
import torch
from test_append_layer import _canonical, _concatenating, _model

from tierkv import TieredStore
from tierkv.adapters import cache_from_kv, cache_layers, new_cache
from tierkv.cache_storage import CacheStorage

from test_worker import prompt


def _storage(cm, tokens: int) -> CacheStorage:
    s = CacheStorage(cm.dtype, cm.layout.num_layers, cm.layout.num_kv_heads, cm.layout.head_dim)
    assert s.reserve(tokens) and s.tokens == tokens
    return s


def _in(storage: CacheStorage, cache) -> list[bool]:
    """For each layer, whether its keys and values are views of the kept buffer."""
    buf = storage._buf
    assert buf is not None
    lo, hi = buf.data_ptr(), buf.data_ptr() + storage.nbytes
    pairs = [(layer.keys, layer.values) for layer in cache.layers]
    return [lo <= k.data_ptr() < hi and lo <= v.data_ptr() < hi for k, v in pairs]


def _decode(cm, ours, theirs, logits, steps: int) -> None:
    for step in range(steps):
        tok = int(logits.argmax())
        logits, ours = cm._forward([tok], ours)
        want, theirs = cm._forward([tok], theirs)
        assert torch.equal(logits, want), step


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_restored_cache_takes_the_kept_buffer_with_the_same_logits(arch) -> None:
    cm = _model(arch, torch.float32)
    storage = _storage(cm, 256)
    ids = prompt(120, salt=21)
    with torch.inference_mode():
        _, prefix = cm._forward(ids[:96], new_cache(cm.model))
        kv = _canonical(cm, prefix, room=40)
        ours, theirs = cache_from_kv(cm.model, kv, storage), _concatenating(cm, kv)
        a, ours = cm._forward(ids[96:], ours)
        b, theirs = cm._forward(ids[96:], theirs)
        assert torch.equal(a, b)
        assert all(_in(storage, ours))
        kv.fill_(0)  # the restore buffer is free after the first forward: the prefix is in the kept buffer
        _decode(cm, ours, theirs, a, 40)
        assert all(_in(storage, ours))  # decoded in place, within it


def test_a_cache_still_held_keeps_the_buffer_from_the_next_one() -> None:
    """The second cache's KV must not land where the first one's still is: it allocates its own, and the
    first is unchanged. Once the first is gone, the next cache takes the buffer again."""
    cm = _model("llama", torch.float32)
    storage = _storage(cm, 256)
    with torch.inference_mode():
        a_logits, first = cm._forward(prompt(80, salt=22), new_cache(cm.model, storage))
        assert all(_in(storage, first))
        before = [t.clone() for pair in cache_layers(first, cm.layout) for t in pair]
        b, second = cm._forward(prompt(90, salt=23), new_cache(cm.model, storage))
        want, _ = cm._forward(prompt(90, salt=23), _concatenating(cm))
        assert torch.equal(b, want)
        assert not any(_in(storage, second))
        after = [t for pair in cache_layers(first, cm.layout) for t in pair]
        assert all(torch.equal(x, y) for x, y in zip(before, after))
        # a view a caller kept of the first cache's keys holds the buffer too
        held = first.layers[0].keys[:, :, :10]
        del first, after
        _, third = cm._forward(prompt(70, salt=24), new_cache(cm.model, storage))
        assert not any(_in(storage, third))
        del held, third, second
        c, fourth = cm._forward(prompt(70, salt=24), new_cache(cm.model, storage))
        assert all(_in(storage, fourth))
        want, _ = cm._forward(prompt(70, salt=24), _concatenating(cm))
        assert torch.equal(c, want)


def test_what_does_not_fit_the_buffer_leaves_it_exactly() -> None:
    """A prompt longer than the buffer allocates its own storage; one that fits, decoded past the buffer's
    end, moves out of it at that step; both with transformers' own logits throughout."""
    cm = _model("qwen3", torch.float32)
    storage = _storage(cm, 64)
    ids = prompt(100, salt=25)
    with torch.inference_mode():
        a, ours = cm._forward(ids, new_cache(cm.model, storage))
        b, theirs = cm._forward(ids, _concatenating(cm))
        assert torch.equal(a, b) and not any(_in(storage, ours))
        del ours
        a, ours = cm._forward(ids[:50], new_cache(cm.model, storage))
        b, theirs = cm._forward(ids[:50], _concatenating(cm))
        assert torch.equal(a, b) and all(_in(storage, ours))
        _decode(cm, ours, theirs, a, 20)  # 70 tokens: past the buffer's 64
        assert not any(_in(storage, ours)) and ours.get_seq_length() == 70


def test_a_layer_reset_does_not_take_a_slot_again() -> None:
    """A slot is handed out once: a reset layer's new tokens go elsewhere, and a view taken before the
    reset is left as it was (transformers' own rule)."""
    cm = _model("llama", torch.float32)
    storage = _storage(cm, 128)
    with torch.inference_mode():
        _, cache = cm._forward(prompt(50, salt=26), new_cache(cm.model, storage))
        assert all(_in(storage, cache))
        held = cache.layers[0].keys.clone(), cache.layers[0].keys
        cache.reset()
        a, cache = cm._forward(prompt(40, salt=27), cache)
        b, _ = cm._forward(prompt(40, salt=27), _concatenating(cm))
        assert torch.equal(a, b)
        assert not any(_in(storage, cache))
        assert torch.equal(held[1], held[0])


def test_without_a_storage_use_count_the_buffer_is_never_kept(monkeypatch) -> None:
    cm = _model("llama", torch.float32)
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    storage = CacheStorage(cm.dtype, cm.layout.num_layers, cm.layout.num_kv_heads, cm.layout.head_dim)
    assert not storage.reserve(128) and storage.tokens == 0
    with torch.inference_mode():
        a, cache = cm._forward(prompt(40, salt=28), new_cache(cm.model, storage))
        b, _ = cm._forward(prompt(40, salt=28), _concatenating(cm))
    assert torch.equal(a, b)


def test_the_engine_restores_into_its_reserved_cache_storage(tmp_path) -> None:
    """Through the engine: a restore's prefill keeps its KV in the buffer reserved at start-up, and greedy
    generation after it gives transformers' own tokens."""
    with TieredStore.open(tmp_path, host_bytes=16 << 20) as store:
        cm = _model("qwen2", torch.float32)
        cm.store = store
        assert cm.reserve_cache_storage(512) == 512
        ids = prompt(150, salt=29)
        cm.prefill(ids)
        store.flush()
        pre = cm.prefill(ids)
        assert pre.hit.num_tokens == 144
        assert all(_in(cm._cache_storage, pre.cache))
        del pre
        out = cm.generate(ids, 40)
    with torch.inference_mode():
        logits, cache = cm._forward(ids, _concatenating(cm))
        want = []
        for _ in range(40):
            want.append(int(logits.argmax()))
            logits, cache = cm._forward(want[-1:], cache)
    assert out.token_ids == want
