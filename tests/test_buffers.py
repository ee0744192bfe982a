"""The engine's reused buffers (``tierkv/buffers.py``) and a server's restore buffer reserved at start-up."""

import sys

import pytest
import torch

from tierkv import TieredStore
from tierkv.buffers import ReusedBuffers
from tierkv.worker import CachedModel

from helpers import resident_nbytes


def test_a_cpu_buffer_is_kept_and_grown_at_least_twofold() -> None:
    bufs = ReusedBuffers(torch.float32, torch.device("cpu"))
    a = bufs.get("restore", (2, 100, 3), grow_dim=1)
    assert a.shape == (2, 100, 3)
    b = bufs.get("restore", (2, 60, 3), grow_dim=1)
    assert b.shape == (2, 60, 3) and b.data_ptr() == a.data_ptr()  # the same memory, not a new allocation
    c = bufs.get("restore", (2, 130, 3), grow_dim=1)
    assert c.shape == (2, 130, 3) and c.data_ptr() != a.data_ptr()
    d = bufs.get("restore", (2, 200, 3), grow_dim=1)
    assert d.data_ptr() == c.data_ptr()  # grown to twice 100, not to 130: a growing prompt reallocates rarely
    assert bufs.get("save", (4, 5), grow_dim=0).data_ptr() != d.data_ptr()  # each name its own


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only (mincore)")
def test_a_reserved_buffer_is_resident_before_reserve_returns() -> None:
    bufs = ReusedBuffers(torch.float32, torch.device("cpu"))
    assert bufs.reserve("restore", (4, 2, 8192, 64), grow_dim=2)  # 16 MiB
    buf = bufs.get("restore", (4, 2, 8192, 64), grow_dim=2)
    assert resident_nbytes(buf) >= (16 << 20) - (8 << 10)  # all but its partial first and last pages


def test_a_server_reserves_the_restore_buffer_its_restores_then_use(tmp_path) -> None:
    """``reserve_restore`` sizes the buffer for the model's context, within the byte cap, in whole blocks;
    a prefill's restore then lands in that memory (no fresh pages on the request's path)."""
    with TieredStore.open(tmp_path, host_bytes=64 << 20) as store:
        cm = CachedModel.default(store)
        ns = cm.base_namespace
        token_nbytes = 2 * ns.num_layers * ns.num_kv_heads * ns.head_dim * 4
        tokens = cm.reserve_restore(max_nbytes=300 * token_nbytes)
        assert tokens == 300 // ns.block_tokens * ns.block_tokens
        reserved = cm._buffers.get("restore", (ns.num_layers, 2, tokens, ns.num_kv_heads, ns.head_dim), 2)
        if sys.platform == "linux":  # faulted in already, by reserve_restore
            assert resident_nbytes(reserved) >= reserved.numel() * 4 - (8 << 10)
        prompt = list(range(1, 3 * ns.block_tokens + 5))
        cm.prefill(prompt)
        store.flush()
        seen = []
        real = store.restore

        def spying(*args, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(kwargs["out"].data_ptr())
            return real(*args, **kwargs)

        store.restore = spying  # type: ignore[method-assign]
        pre = cm.prefill(prompt)
        assert pre.hit.num_tokens == 3 * ns.block_tokens
        assert seen == [reserved.data_ptr()]
        cap = cm.model.config.max_position_embeddings
        assert cm.reserve_restore(max_nbytes=1 << 40) == cap // ns.block_tokens * ns.block_tokens
    assert CachedModel.default(None).reserve_restore() == 0  # no store: nothing to restore into
