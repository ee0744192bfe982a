"""The native reader's side in Python: one ``tierkv._native.read_run`` call per run of raw records, with
the GIL released for all of its reads and checks (see ``native/read.c``). ``reader.read_records`` calls
it where the native path is usable and keeps its own Python path as the fallback and the reference."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Sequence

import numpy as np
import torch

from tierkv import codec, native
from tierkv.keys import BlockChain
from tierkv.layout import KVSpec
from tierkv.tiers.disk.files import TransientReadError
from tierkv.tiers.disk.schema import Entry
from tierkv.tiers.disk.segments import SegmentDir

__all__ = ["ST_OK", "ST_PYTHON", "read_run"]

ST_OK, ST_BAD, ST_MEDIA, ST_PYTHON, ST_TRANSIENT = 0, 1, 2, 3, 4


def _keys_and_tokens(chain: BlockChain, blocks: list[int]) -> tuple[bytes, bytes]:
    """The blocks' keys and token ids, each joined: one slice each for a run of consecutive blocks."""
    first, n = blocks[0], len(blocks)
    if blocks == list(range(first, first + n)):
        step = chain.block_token_nbytes
        return b"".join(chain.keys[first : first + n]), chain.token_bytes[first * step : (first + n) * step]
    return b"".join(chain.keys[i] for i in blocks), b"".join(chain.tokens(i) for i in blocks)


def read_run(
    segments: SegmentDir,
    chain: BlockChain,
    records: Sequence[tuple[int, Entry, int]],
    target: torch.Tensor,
    failed: set[tuple[int, int, int]] | None,
    direct_mode: bool = True,
) -> tuple[list[int], memoryview]:
    """Raw records ``(block index, entry, block position in target)`` into ``target`` (a CPU tensor
    ``[layers, 2, tokens, kv_heads, head_dim]`` whose every slab is contiguous), verified. Returns each
    record's status (``ST_OK``; ``ST_PYTHON``: in place, but compressed, for Python to check; else not
    served) and the records' headers and token ids (``HEADER_NBYTES + token bytes`` each).

    ``direct_mode``: whether what the page cache lacks is read with O_DIRECT where the run holds such
    descriptors (the caller chooses once per restore: ``read_modes.py``). A record an I/O error of the medium hit is
    added to ``failed``; any other error of a read (no
    descriptors, no memory) raises ``TransientReadError``: a miss that says nothing about the record."""
    nat = native.module()
    spec = KVSpec.of(chain.ns)
    # The (layer, k/v) slabs' addresses, from the strides (indexing the tensor 2 x layers times cost more).
    base, (s0, s1), size = target.data_ptr(), target.stride()[:2], target.element_size()
    rows = [base + (layer * s0 + kv * s1) * size for layer in range(spec.num_layers) for kv in (0, 1)]
    chunk = spec.block_nbytes // len(rows)
    row_nbytes = target[0, 0].numel() * size
    token_nbytes = chain.block_token_nbytes
    prefix = bytearray((codec.HEADER_NBYTES + token_nbytes) * len(records))
    status = [ST_BAD] * len(records)
    try:
        held = segments.held_fds(sorted({e.seg_id for _, e, _ in records}))
        fds = held.__enter__()
    except OSError as exc:  # no descriptors left, say: nothing to do with the records
        raise TransientReadError(exc.errno, f"opening segments: {exc.strerror}") from None
    with contextlib.ExitStack() as stack:
        stack.push(held)
        present = [j for j, (_, e, _) in enumerate(records) if e.seg_id in fds]  # else unlinked: a miss
        if not present:
            return status, memoryview(prefix)
        flat: list[int] = []  # one flat list: numpy converts it far faster than tuples or rows
        for j in present:
            _, e, pos = records[j]
            flat += (*fds[e.seg_id], e.offset, e.nbytes, pos)
        reqs = np.array(flat, dtype=np.int64).reshape(-1, 6)
        blocks = [records[j][0] for j in present]
        got, errnos, (cached, direct, blocking) = nat.read_run(
            reqs,
            np.array(rows, dtype=np.int64),
            chunk,
            row_nbytes,
            prefix,
            token_nbytes,
            chain.ns.digest,
            *_keys_and_tokens(chain, blocks),
            codec.DTYPE_CODES[chain.ns.dtype],
            spec.block_shape,
            native.READ_THREADS,
            # O_DIRECT where the caller chose it and this run holds such descriptors
            int(direct_mode and any(dfd >= 0 for _, _, dfd in fds.values())),
        )
    counters = segments.counters
    counters.add("disk", "read_cached_nbytes", cached)
    counters.add("disk", "read_direct_nbytes", direct)
    counters.add("disk", "read_blocking_nbytes", blocking)
    view = memoryview(prefix)
    if len(present) == len(records) and got.count(ST_OK) == len(got):  # the common case, at once
        return list(got), view
    for k, j in enumerate(present):
        seg_id, offset, nbytes = records[j][1].location
        if got[k] == ST_TRANSIENT:
            raise TransientReadError(
                errnos[k], f"reading segment {seg_id}: {errno.errorcode.get(errnos[k], errnos[k])}"
            )
        if got[k] == ST_MEDIA:
            segments.read_error(
                OSError(errnos[k], errno.errorcode.get(errnos[k], "I/O error")), seg_id, offset
            )
            if failed is not None:
                failed.add((seg_id, offset, nbytes))
        status[j] = got[k]
    # The headers came back in ``present`` order: lay them out per record.
    if len(present) < len(records):
        size = codec.HEADER_NBYTES + token_nbytes
        out = bytearray(size * len(records))
        for k, j in enumerate(present):
            out[j * size : (j + 1) * size] = view[k * size : (k + 1) * size]
        view = memoryview(out)
    return status, view
