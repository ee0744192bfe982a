"""Restore targets (tiers/target.py): where a record tier's fill writes, and the reused chunk buffers."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from tierkv.layout import KVSpec
from tierkv.tiers import target as target_mod
from tierkv.tiers.target import Stagers, rows_scatterable


def _expected(spec: KVSpec, num_blocks: int) -> torch.Tensor:
    """Block i of every (layer, k/v) holds values that name the block, so misplaced blocks show."""
    g = torch.Generator().manual_seed(5)
    return torch.randn(spec.shape(num_blocks * spec.block_tokens), generator=g).to(spec.dtype)


class Filler:
    """A record tier's fill: block i into ``buf`` at block position i - base; records every call."""

    def __init__(self, spec: KVSpec, source: torch.Tensor, bad: int | None = None) -> None:
        self.spec, self.source, self.bad = spec, source, bad
        self.calls: list[tuple[int, int, int, int]] = []  # (buffer data_ptr, first, count, base)
        self.buffers: list[torch.Tensor] = []

    def __call__(self, buf: torch.Tensor, first: int, count: int, base: int) -> int:
        assert rows_scatterable(buf)  # what every fill may rely on
        self.calls.append((buf.data_ptr(), first, count, base))
        self.buffers.append(buf)
        B = self.spec.block_tokens
        for i in range(first, first + count):
            if i == self.bad:
                return i - first  # block i failed verification: the run ends before it
            buf[:, :, (i - base) * B : (i - base + 1) * B] = self.source[:, :, i * B : (i + 1) * B]
        return count


def _transposed(spec: KVSpec, num_tokens: int) -> torch.Tensor:
    """A [layers, 2, tokens, heads, dim] view whose slabs are not contiguous: records cannot land in it."""
    L, _, _, H, D = spec.shape(num_tokens)
    t = torch.zeros((L, 2, H, num_tokens, D), dtype=spec.dtype).transpose(2, 3)
    assert not rows_scatterable(t)
    return t


@pytest.fixture
def spec(ns) -> KVSpec:
    return KVSpec.of(ns)


def test_a_cpu_destination_is_filled_in_place(spec) -> None:
    B = spec.block_tokens
    src = _expected(spec, 4)
    dest = torch.zeros_like(src)
    fill = Filler(spec, src)
    with Stagers().target(dest, spec) as t:
        assert t.fill(0, 4, fill) == 4
        assert not t.locked  # the chunk buffers were not needed
    assert fill.calls == [(dest.data_ptr(), 0, 4, 0)]  # one call, into dest itself
    assert torch.equal(dest, src)
    # A token slice of a larger buffer qualifies too (a caller's ``out`` longer than the hit).
    big = torch.zeros(spec.shape(8 * B), dtype=spec.dtype)
    with Stagers().target(big[:, :, : 4 * B], spec) as t:
        assert t.fill(1, 2, Filler(spec, src)) == 2
        assert not t.locked
    assert torch.equal(big[:, :, B : 3 * B], src[:, :, B : 3 * B])
    assert not big[:, :, :B].any() and not big[:, :, 3 * B :].any()


def test_a_cpu_fill_that_verifies_fewer_blocks_returns_that_count(spec) -> None:
    src = _expected(spec, 4)
    dest = torch.zeros_like(src)
    with Stagers().target(dest, spec) as t:
        assert t.fill(0, 4, Filler(spec, src, bad=2)) == 2
        assert t.fill(0, 0, Filler(spec, src)) == 0  # nothing asked: fill is not called


def test_a_destination_that_is_not_row_scatterable_goes_through_the_chunk_buffers(spec, monkeypatch) -> None:
    monkeypatch.setattr(target_mod, "RESTORE_CHUNK_NBYTES", 2 * spec.block_nbytes)  # two blocks per chunk
    src = _expected(spec, 5)
    dest = _transposed(spec, 5 * spec.block_tokens)
    fill = Filler(spec, src)
    stagers = Stagers()
    with stagers.target(dest, spec) as t:
        assert t.fill(0, 5, fill) == 5
        assert t.locked
    assert [c[1:] for c in fill.calls] == [(0, 2, 0), (2, 2, 2), (4, 1, 4)]  # chunk by chunk, from block 0
    ptrs = [c[0] for c in fill.calls]
    assert ptrs[0] != ptrs[1] and ptrs[2] == ptrs[0]  # the two buffers alternate
    assert dest.data_ptr() not in ptrs
    assert torch.equal(dest, src)


def test_a_chunked_fill_stops_at_the_first_block_that_fails(spec, monkeypatch) -> None:
    monkeypatch.setattr(target_mod, "RESTORE_CHUNK_NBYTES", 2 * spec.block_nbytes)
    B = spec.block_tokens
    src = _expected(spec, 6)
    dest = _transposed(spec, 6 * B)
    fill = Filler(spec, src, bad=3)
    with Stagers().target(dest, spec) as t:
        assert t.fill(1, 5, fill) == 2  # blocks 1 and 2; block 3 failed
    assert [c[1:] for c in fill.calls] == [(1, 2, 1), (3, 2, 3)]  # no chunk read past the failure
    assert torch.equal(dest[:, :, B : 3 * B], src[:, :, B : 3 * B])
    assert not dest[:, :, :B].any()  # nothing was asked of block 0
    assert not dest[:, :, 4 * B :].any()  # nor uploaded past the verified run


def test_stagers_reuse_one_buffer_pair(spec, monkeypatch) -> None:
    monkeypatch.setattr(target_mod, "RESTORE_CHUNK_NBYTES", 2 * spec.block_nbytes)
    src = _expected(spec, 4)
    stagers = Stagers()
    seen: set[int] = set()
    for _ in range(3):  # three restores, each of two chunks
        dest = _transposed(spec, 4 * spec.block_tokens)
        fill = Filler(spec, src)
        with stagers.target(dest, spec) as t:
            assert t.fill(0, 4, fill) == 4
        seen |= {c[0] for c in fill.calls}
        assert torch.equal(dest, src)
    assert len(seen) == 2  # the same two buffers every time, allocated once
    # Another block shape gets its own pair.
    other = KVSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_tokens * 2, spec.dtype)
    dest = _transposed(other, 2 * other.block_tokens)
    fill = Filler(other, _expected(other, 2))
    with stagers.target(dest, other) as t:
        assert t.fill(0, 2, fill) == 2
    fresh = {c[0] for c in fill.calls}
    assert len(fresh) == 2 and not fresh & seen  # made while the old pair was still alive: other memory
    assert torch.equal(dest, _expected(other, 2))


def test_the_chunk_buffers_are_let_go_when_a_restore_fails(spec, monkeypatch) -> None:
    monkeypatch.setattr(target_mod, "RESTORE_CHUNK_NBYTES", 2 * spec.block_nbytes)
    stagers = Stagers()
    src = _expected(spec, 2)
    with (
        pytest.raises(RuntimeError, match="a tier failed"),
        stagers.target(_transposed(spec, 2 * spec.block_tokens), spec) as t,
    ):
        t.fill(0, 2, Filler(spec, src))
        raise RuntimeError("a tier failed")

    def restore() -> None:
        dest = _transposed(spec, 2 * spec.block_tokens)
        with stagers.target(dest, spec) as t2:
            t2.fill(0, 2, Filler(spec, src))

    other = threading.Thread(target=restore, daemon=True)  # a lock still held would block it for ever
    other.start()
    other.join(30)
    assert not other.is_alive()


def test_hold_keeps_a_context_until_the_restore_is_over(spec) -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def slots():
        events.append("held")
        yield "views"
        events.append("released")

    dest = torch.zeros(spec.shape(spec.block_tokens), dtype=spec.dtype)
    with Stagers().target(dest, spec) as t:
        assert t.hold(slots()) == "views"
        assert events == ["held"]
        assert t.block(0).data_ptr() == dest.data_ptr() and t.block(0).shape == spec.block_shape
    assert events == ["held", "released"]


def test_a_failed_chunk_buffer_allocation_does_not_block_later_restores(spec, monkeypatch) -> None:
    stagers = Stagers()
    src = _expected(spec, 2)
    monkeypatch.setattr(target_mod, "RESTORE_CHUNK_NBYTES", 1 << 58)  # a real allocation failure
    with pytest.raises(RuntimeError, match="allocate"), stagers.target(_transposed(spec, 32), spec) as t:
        t.fill(0, 2, Filler(spec, src))
    monkeypatch.setattr(target_mod, "RESTORE_CHUNK_NBYTES", 2 * spec.block_nbytes)
    done = threading.Event()

    def restore() -> None:
        dest = _transposed(spec, 2 * spec.block_tokens)
        with stagers.target(dest, spec) as t2:
            t2.fill(0, 2, Filler(spec, src))
        done.set()

    threading.Thread(target=restore, daemon=True).start()
    assert done.wait(
        3
    )  # blocked on the leaked lock otherwise (the thread is a daemon: it cannot hang the run)
