"""The kept buffer a CPU engine's caches keep their KV in (``cache_storage``): a restored cache's layers
take it with the same logits, bit for bit, as transformers' own cache; a cache still held keeps it from
the next one, whose KV then lives elsewhere; what does not fit leaves it, exactly."""

import copy

import pytest
import torch
from test_append_layer import _canonical, _concatenating, _model, greedy

from tierkv import TieredStore
from tierkv.adapters import cache_from_kv, cache_layers, new_cache
from tierkv.cache_storage import CacheStorage

from test_worker import prompt


def _storage(cm, tokens: int) -> CacheStorage:
    s = CacheStorage.of(cm.layout, cm.dtype)
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


@pytest.mark.parametrize(
    ("arch", "dtype", "attn"),
    [("llama", torch.float32, "sdpa"), ("qwen2", torch.float32, "sdpa"), ("qwen2", torch.bfloat16, "eager")],
)
def test_a_restored_cache_takes_the_kept_buffer_with_the_same_logits(arch, dtype, attn) -> None:
    cm = _model(arch, dtype, attn)
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


def test_a_held_storage_object_keeps_the_buffer_too() -> None:
    """``untyped_storage()`` of a cache's keys, held with no tensor view: the storage counts that object
    once however many hold it, and the next cache must still not take the buffer."""
    cm = _model("llama", torch.float32)
    storage = _storage(cm, 128)
    with torch.inference_mode():
        _, first = cm._forward(prompt(40, salt=30), new_cache(cm.model, storage))
        assert all(_in(storage, first))
        keys = first.layers[0].keys
        kept, at, want = (
            keys.untyped_storage(),
            (keys.storage_offset(), keys.shape, keys.stride()),
            keys.clone(),
        )
        del first, keys
        _, second = cm._forward(prompt(40, salt=31), new_cache(cm.model, storage))
        assert not any(_in(storage, second))
        again = torch.empty(0, dtype=want.dtype).set_(kept, *at)
        assert torch.equal(again, want)
        del kept, again, second
        _, third = cm._forward(prompt(40, salt=31), new_cache(cm.model, storage))
        assert all(_in(storage, third))


def test_a_lease_owns_the_buffer_until_its_views_are_gone_and_another_takes_it() -> None:
    storage = CacheStorage(torch.float32, num_layers=3, num_kv_heads=2, head_dim=8)
    assert storage.reserve(10) and storage.tokens == 64  # rounded up: slots start 64-byte aligned
    like = torch.empty(1, 2, 5, 8)
    a, b = storage.lease(), storage.lease()
    a0 = a.take(5, like, like)
    assert a0 is not None and b.take(5, like, like) is None  # b's first try took no slot of a's
    a1 = a.take(5, like, like)
    assert a1 is not None and a1[0].data_ptr() != a0[0].data_ptr()  # a's next layer: the next slot
    assert a.take(65, like, like) is None  # too long for the buffer
    del a0, a1
    b1 = b.take(5, like, like)
    assert b1 is not None  # a's views gone: b takes it, at its own next slot (1: its refused try had 0)
    assert b1[0].data_ptr() == storage._buf[1, 0].data_ptr()
    assert a.take(5, like, like) is None  # and a is refused from then on
    assert b.take(5, like, like) is not None
    assert b.take(5, like, like) is None  # 3 layers: no slot past the last
    bf16 = torch.empty(1, 2, 5, 8, dtype=torch.bfloat16)
    assert storage.lease().take(5, bf16, bf16) is None


def test_a_cache_with_a_lease_is_copied_without_it() -> None:
    cm = _model("llama", torch.float32)
    storage = _storage(cm, 128)
    fresh = new_cache(cm.model, storage)
    other = copy.deepcopy(fresh)
    assert all(layer._lease is None for layer in other.layers)
    with torch.inference_mode():
        a, other = cm._forward(prompt(30, salt=32), other)
        b, _ = cm._forward(prompt(30, salt=32), _concatenating(cm))
    assert torch.equal(a, b) and not any(_in(storage, other))


def test_a_buffer_reserved_in_inference_mode_serves_forwards_outside_it() -> None:
    cm = _model("llama", torch.float32)
    with torch.inference_mode():
        storage = _storage(cm, 128)
    assert not torch.is_inference(storage._buf)
    with torch.no_grad():
        a, cache = cm._forward(prompt(30, salt=33), new_cache(cm.model, storage))
        b, _ = cm._forward(prompt(30, salt=33), _concatenating(cm))
    assert torch.equal(a, b) and all(_in(storage, cache))


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
    storage = CacheStorage.of(cm.layout, cm.dtype)
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
        cm.warm_up()  # as a server starts: its warm-up's caches let the buffer go
        ids = prompt(150, salt=29)
        cm.prefill(ids)
        store.flush()
        pre = cm.prefill(ids)
        assert pre.hit.num_tokens == 144
        assert all(_in(cm._cache_storage, pre.cache))
        del pre
        out = cm.generate(ids, 40)
        assert out.prefill.cache is None  # a finished generation's result holds no cache
        pre = cm.prefill(ids)  # so the next request takes the buffer while ``out`` is still held
        assert all(_in(cm._cache_storage, pre.cache))
    assert out.token_ids == greedy(cm, ids, 40)
