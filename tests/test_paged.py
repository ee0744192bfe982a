"""Native copies into and out of an engine's paged KV cache (``integrations.vllm.paged``), against
``PagedLayout``'s torch copies (the reference), and restores that land straight in the pages (a ``Sink``).

The layouts are learned by ``probe`` from writers that stand for vLLM's backends: K and V side by side
(the GPU backends), split into kernel blocks, and K stored head_dim-major inside a (block, head) page
(vLLM-CPU's "vec" kernel, probed for real in tests/vllm/test_vllm_layout.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierkv import Namespace, TieredStore, native
from tierkv.integrations.vllm.layout import PagedLayout, PageShape, probe
from tierkv.integrations.vllm.paged import PagedCaches, PagedSink
from tierkv.keys import BlockChain
from tierkv.layout import KVSpec
from tierkv.tiers.disk import DiskTier

from helpers import make_kv

pytestmark = pytest.mark.skipif(native.reason() is not None, reason=f"native module: {native.reason()}")


def side_by_side(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    D = key.shape[-1]
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, cache.shape[2])
        cache[block, :, offset, :D] = key[t]
        cache[block, :, offset, D:] = value[t]


def k_transposed(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """vLLM-CPU's placement: each (block, head) page is [2, tokens, D] with K stored [D, tokens]."""
    blocks, heads, tokens, _ = cache.shape
    D = key.shape[-1]
    pages = cache.view(blocks, heads, 2 * tokens * D)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, tokens)
        pages[block, :, offset + tokens * torch.arange(D)] = key[t]
        pages[block, :, tokens * D + offset * D : tokens * D + (offset + 1) * D] = value[t]


WRITERS = {
    "side_by_side": (side_by_side, 1),
    "kernel_blocks": (side_by_side, 2),
    "k_transposed": (k_transposed, 1),
}
L, H, D, B = 3, 2, 8, 16


def layout_for(writer: str, dtype: torch.dtype) -> tuple[PagedLayout, PageShape]:
    write, kb = WRITERS[writer]
    page = PageShape(kb, H, B // kb, 2 * D)
    return probe(write, block_tokens=B, num_kv_heads=H, head_dim=D, page=page, dtype=dtype), page


def caches_for(page: PageShape, num_pages: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.zeros(num_pages * page.kernel_blocks, *page.dims[1:], dtype=dtype) for _ in range(L)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_native_paged_copies_match_the_torch_reference(writer: str, dtype: torch.dtype) -> None:
    layout, page = layout_for(writer, dtype)
    ref, got = caches_for(page, 12, dtype), caches_for(page, 12, dtype)
    paged = PagedCaches(layout, got)
    assert paged.usable
    ids = [9, 2, 3, 4, 0, 11]  # a run and scattered pages
    kv = torch.randn(L, 2, (len(ids) + 2) * B, H, D).to(dtype)
    layout.scatter(kv, ref, torch.tensor(ids), first_token=2 * B)
    paged.put_rows(kv, range(2, 2 + len(ids)), ids)  # rows from block position 2 on
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref, got))

    blocks = layout.gather(ref, torch.tensor(ids))  # [n, layers, 2, B, H, D]
    out = torch.empty_like(blocks)
    assert torch.equal(paged.gather(ids, out).view(torch.uint8), blocks.view(torch.uint8))

    again = caches_for(page, 12, dtype)
    PagedCaches(layout, again).put_slots([blocks[j] for j in range(len(ids))], ids)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref, again))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("writer", ["side_by_side", "k_transposed"])
@pytest.mark.parametrize(
    ("block_tokens", "head_dim", "offset"),
    [(16, 8, 0), (16, 8, 1), (6, 8, 0), (16, 6, 0), (16, 6, 3)],
    ids=["aligned", "misaligned", "tokens-not-by-4", "head-dim-not-by-4", "both-odd-misaligned"],
)
def test_native_paged_loads_match_the_reference_whatever_the_alignment_and_shape(
    writer: str, dtype: torch.dtype, block_tokens: int, head_dim: int, offset: int
) -> None:
    """The load's vectorised, streamed stores (float32 K transposed 4 x 4; K and V runs of 16-byte
    multiples) and their fallbacks (pages not 16-byte aligned: ``offset`` elements into the allocation;
    tokens or head_dim not multiples of 4) write exactly what the torch reference writes."""
    write, _ = WRITERS[writer]
    page = PageShape(1, H, block_tokens, 2 * head_dim)
    layout = probe(
        write, block_tokens=block_tokens, num_kv_heads=H, head_dim=head_dim, page=page, dtype=dtype
    )

    def caches(num_pages: int) -> list[torch.Tensor]:
        n = num_pages * H * block_tokens * 2 * head_dim
        return [
            torch.zeros(n + offset, dtype=dtype)[offset:].view(num_pages, *page.dims[1:]) for _ in range(L)
        ]

    ref, got = caches(7), caches(7)
    paged = PagedCaches(layout, got)
    assert paged.usable and (got[0].data_ptr() % 16 != 0) == (offset * got[0].element_size() % 16 != 0)
    ids = [5, 0, 1, 6, 3]
    kv = torch.randn(L, 2, len(ids) * block_tokens, H, head_dim).to(dtype)
    layout.scatter(kv, ref, torch.tensor(ids), first_token=0)
    paged.put_rows(kv, range(len(ids)), ids)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref, got))
    blocks = layout.gather(ref, torch.tensor(ids))
    again = caches(7)
    PagedCaches(layout, again).put_slots([blocks[j] for j in range(len(ids))], ids)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref, again))


def test_native_paged_copies_refuse_what_lies_outside() -> None:
    layout, page = layout_for("k_transposed", torch.float32)
    paged = PagedCaches(layout, caches_for(page, 4, torch.float32))
    kv = torch.zeros(L, 2, 2 * B, H, D)
    with pytest.raises(ValueError, match="page 4 outside"):
        paged.put_rows(kv, [0], [4])
    with pytest.raises(ValueError, match="page -1 outside"):
        paged.put_rows(kv, [0], [-1])
    with pytest.raises(ValueError, match="position 2 outside"):
        paged.put_rows(kv, [2], [0])
    with pytest.raises(ValueError, match="out must be"):  # a buffer too small for the blocks asked
        paged.gather([0, 1], torch.empty(1, L, 2, B, H, D))
    with pytest.raises(ValueError, match="rows"):  # another dtype than the pages'
        paged.put_rows(kv.to(torch.bfloat16), [0], [0])
    with pytest.raises(ValueError, match="slot"):
        paged.put_slots([torch.zeros(8)], [0])
    # the native checks themselves: sizes and strides whose products would overflow are refused
    nat, cells = native.module(), page.numel
    huge = np.array([[0, 1 << 62, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=np.int64)
    addrs = np.array([c.data_ptr() for c in paged.caches], dtype=np.int64)
    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="stride outside"):
        nat.copy_paged(
            addrs,
            cells * 4,
            4,
            huge,
            5,
            B // 5 or 1,
            H,
            D,
            4,
            one,
            1,
            one,
            np.zeros(0, np.int64),
            0,
            1,
            False,
        )
    with pytest.raises(ValueError, match="bad shapes"):  # a mode that disagrees with the rows given
        nat.copy_paged(
            addrs,
            cells * 4,
            4,
            paged._strides,
            1,
            B,
            H,
            D,
            4,
            one,
            0,
            one,
            np.zeros(0, np.int64),
            0,
            1,
            False,
        )
    assert not PagedCaches(layout, [c[:, :, :, :D] for c in caches_for(page, 4, torch.float32)]).usable
    mixed = caches_for(page, 4, torch.float32)
    mixed[1] = mixed[1].view(torch.int32)  # same bytes, another dtype: not one cache
    assert not PagedCaches(layout, mixed).usable
    with native.use(False):
        assert not PagedCaches(layout, caches_for(page, 4, torch.float32)).usable


@pytest.fixture
def ns32() -> Namespace:
    return Namespace(
        model_id="paged-model", revision="r1", dtype="float32", num_layers=L, num_kv_heads=H, head_dim=D,
        block_tokens=B,
    )  # fmt: skip


def test_restores_land_in_the_pages_from_each_tier(tmp_path, ns32: Namespace) -> None:
    """Host tier (slots copied in), disk (read into a small chunk, copied out of it), disk again with
    its blocks promoted on the way: every time the pages equal the reference scatter of the same restore
    into a tensor, and the pages of the blocks the caller holds are never written."""
    layout, page = layout_for("k_transposed", torch.float32)
    toks = list(range(6 * B))
    kv = make_kv(ns32, 6 * B, seed=3)
    ids = [7, 1, 2, 9]  # pages of blocks 2..5
    ref = caches_for(page, 10, torch.float32)
    layout.scatter(kv, ref, torch.tensor(ids), first_token=2 * B)
    spec = KVSpec.of(ns32)
    for host_bytes, tiers in ((1 << 20, ["host"]), (0, ["disk"]), (1 << 20, ["disk", "host"])):
        with TieredStore.open(tmp_path, host_bytes=host_bytes) as store:
            if not store.lookup(ns32, toks).num_blocks:
                store.save(ns32, toks, kv)
                store.flush()
            for tier in tiers:  # disk then host: the disk's blocks were promoted as they were read
                caches = caches_for(page, 10, torch.float32)
                sink = PagedSink(PagedCaches(layout, caches), spec, 2, ids)
                hit, got = store.restore(ns32, toks, out=sink, start_block=2)
                assert got is None and hit.num_blocks == 6 and hit.by_tier[tier] == 4 * B, (tier, hit)
                assert all(torch.equal(a, b) for a, b in zip(ref, caches)), tier
                assert torch.equal(sink.block(3), kv[:, :, 3 * B : 4 * B])  # what a write-back reads


def corrupt(cache, ns: Namespace, tokens: list[int], block: int) -> None:
    """Flip a byte of the payload of ``tokens``' block ``block`` in its segment file."""
    chain = BlockChain.of(ns, tokens)
    with DiskTier(cache, writer=False) as disk:
        e = disk.locate(chain.keys)[block]
        path = disk.segments.file(e.seg_id)
    with open(path, "r+b") as f:
        f.seek(e.offset + e.nbytes - 100)
        byte = f.read(1)
        f.seek(e.offset + e.nbytes - 100)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_bad_record_ends_the_restore_and_its_pages_are_not_written(tmp_path, ns32: Namespace) -> None:
    layout, page = layout_for("side_by_side", torch.float32)
    toks = list(range(6 * B))
    kv = make_kv(ns32, 6 * B, seed=4)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns32, toks, kv)
        store.flush()
    corrupt(tmp_path, ns32, toks, 3)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        caches = caches_for(page, 8, torch.float32)
        ids = [5, 6, 7, 0, 1, 2]
        sink = PagedSink(PagedCaches(layout, caches), KVSpec.of(ns32), 0, ids)
        hit, _ = store.restore(ns32, toks, out=sink)
        assert hit.num_blocks == 3  # block 3 fails its checksum: the prefix ends there
        ref = caches_for(page, 8, torch.float32)
        layout.scatter(kv[:, :, : 3 * B], ref, torch.tensor(ids[:3]))
        assert all(torch.equal(a, b) for a, b in zip(ref, caches))  # pages 0, 1, 2 never written


def test_tierkv_threads_leave_the_pin_of_the_engine_thread_that_started_them() -> None:
    """vLLM-CPU pins its worker's threads one core each (every thread but one OpenMP thread to core 0), and a
    thread inherits its creator's pin: tierkv's threads spread over every CPU the process's threads use."""
    from helpers import run_python

    r = run_python(
        """
        import os, threading
        every = os.sched_getaffinity(0)
        if len(every) < 2:
            print("one cpu"); raise SystemExit
        ready, done = threading.Event(), threading.Event()
        def omp_thread():  # as vLLM's second OpenMP thread: pinned to another core
            os.sched_setaffinity(0, {max(every)}); ready.set(); done.wait()
        threading.Thread(target=omp_thread).start()
        ready.wait()
        os.sched_setaffinity(0, {min(every)})  # the model's thread, pinned
        from tierkv import native
        from tierkv.cpus import process_cpus, spread_here
        assert process_cpus() == every, (process_cpus(), every)
        seen = []
        t = threading.Thread(target=lambda: (spread_here(), seen.append(os.sched_getaffinity(0))))
        t.start(); t.join()
        assert seen == [every] and os.sched_getaffinity(0) == {min(every)}, seen  # the engine's pin is kept
        native.module().set_work_cpus(sorted(every))
        done.set()
        print("spread")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("spread", "one cpu")
