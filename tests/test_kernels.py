import pytest
import torch

from tierkv import kernels


def _caches(L=3, H=2, T=80, D=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(H, T, D, generator=g).to(dtype) for _ in range(L)]
    values = [torch.randn(H, T, D, generator=g).to(dtype) for _ in range(L)]
    return keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_matches_a_loop_of_copies(dtype) -> None:
    keys, values = _caches(dtype=dtype)
    starts = torch.tensor([48, 0, 16])  # scattered, out of order
    out = kernels.gather_blocks(keys, values, starts, 16)
    assert out.shape == (3, 3, 2, 16, 2, 4)
    for n, s in enumerate(starts.tolist()):
        for layer in range(3):
            assert torch.equal(out[n, layer, 0], keys[layer][:, s : s + 16].transpose(0, 1))
            assert torch.equal(out[n, layer, 1], values[layer][:, s : s + 16].transpose(0, 1))


def test_scatter_inverts_gather() -> None:
    keys, values = _caches()
    starts = torch.tensor([32, 64])
    blocks = kernels.gather_blocks(keys, values, starts, 16)
    k2 = [torch.zeros_like(k) for k in keys]
    v2 = [torch.zeros_like(v) for v in values]
    kernels.scatter_blocks(blocks, k2, v2, starts)
    for layer in range(3):
        assert torch.equal(k2[layer][:, 32:48], keys[layer][:, 32:48])
        assert torch.equal(v2[layer][:, 64:80], values[layer][:, 64:80])
        assert not k2[layer][:, :32].any()  # nothing else touched


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.bfloat16, 128), (torch.float32, 64), (torch.bfloat16, 12)]
)
def test_cuda_gather_and_scatter_equal_the_torch_fallback_bit_for_bit(dtype, head_dim) -> None:
    """head_dim 12 in bf16: 24-byte rows, so the kernel moves 8-byte words instead of 16."""
    assert kernels._cuda_ext is not None, f"the CUDA extension is not built (backend {kernels.BACKEND})"
    keys, values = _caches(L=4, H=8, T=4096, D=head_dim, dtype=dtype)
    keys = [k.cuda() for k in keys]
    values = [v.cuda() for v in values]
    starts = (torch.randperm(4096 // 64)[:40] * 64).cuda()
    fast = kernels.gather_blocks(keys, values, starts, 64)
    k_fast, v_fast = [torch.zeros_like(k) for k in keys], [torch.zeros_like(v) for v in values]
    kernels.scatter_blocks(fast, k_fast, v_fast, starts)
    backend, kernels._cuda_ext = kernels._cuda_ext, None
    try:
        slow = kernels.gather_blocks(keys, values, starts, 64)
        k_slow, v_slow = [torch.zeros_like(k) for k in keys], [torch.zeros_like(v) for v in values]
        kernels.scatter_blocks(slow, k_slow, v_slow, starts)
    finally:
        kernels._cuda_ext = backend
    assert torch.equal(fast, slow)
    assert all(torch.equal(a, b) for a, b in zip(k_fast + v_fast, k_slow + v_slow))
