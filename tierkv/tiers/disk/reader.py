"""Reading a run of disk records into KV memory, verified on the reading threads (the disk tier's
``read_into``). Kept apart from the façade because it needs torch, which the shell tools do not load."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from tierkv import codec
from tierkv.errors import RecordError
from tierkv.keys import BlockChain
from tierkv.layout import KVSpec
from tierkv.tiers.disk.schema import Entry
from tierkv.tiers.target import as_tensor, expected

__all__ = ["read_records"]

ReadInto = Callable[[Sequence[tuple[Entry, list[memoryview]]], Callable[[int], bool]], list[bool]]
ReadWhole = Callable[[Sequence[Entry]], contextlib.AbstractContextManager[list[memoryview]]]


def read_records(
    chain: BlockChain,
    entries: Sequence[Entry],
    first: int,
    target: torch.Tensor,
    base: int,
    read_into: ReadInto,
    read_whole: ReadWhole,
    verified: Callable[[int, torch.Tensor], None] | None = None,
) -> int:
    """Blocks ``first, first+1, ...`` (their ``entries``) into ``target`` at block positions ``i - base``;
    returns how many leading blocks verified.

    A raw record is scattered by preadv straight into place: the target's (layer, k/v) slabs as byte
    rows, a block's payload one chunk of each row (no bounce buffer, no second copy), and verified on
    the reading thread as soon as it is in. Compressed records are read whole and decoded.
    ``verified(i, block)`` gets each good block right after its check, on that thread.
    """
    spec = KVSpec.of(chain.ns)
    B = spec.block_tokens
    prefix_nbytes = codec.HEADER_NBYTES + chain.block_token_nbytes
    raw_nbytes = prefix_nbytes + spec.block_nbytes
    rows: list[memoryview] = [  # sliced per record below: a memoryview slice is far cheaper than numpy's
        memoryview(target[layer, kv].view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
        for layer in range(spec.num_layers)
        for kv in (0, 1)
    ]
    chunk = spec.block_nbytes // (spec.num_layers * 2)
    scratch = memoryview(bytearray(prefix_nbytes * len(entries)))
    scatter: list[tuple[int, Entry, list[memoryview]]] = []
    whole: list[tuple[int, Entry]] = []
    for j, e in enumerate(entries):
        i, pos = first + j, first + j - base
        if e.nbytes == raw_nbytes:
            views = [scratch[j * prefix_nbytes : (j + 1) * prefix_nbytes]]
            views += [row[pos * chunk : (pos + 1) * chunk] for row in rows]
            scatter.append((i, e, views))
        else:
            whole.append((i, e))

    def block(i: int) -> torch.Tensor:
        return target[:, :, (i - base) * B : (i - base + 1) * B]

    def place(i: int, payload: memoryview | bytes) -> None:
        block(i).copy_(as_tensor(payload, spec.dtype, spec.block_shape))

    def verify(j: int) -> bool:  # on a reading thread, as soon as record j is in
        i, e, views = scatter[j]
        try:
            header, toks = codec.parse_header(views[0], e.nbytes)
            codec.check_expected(header, toks, expected(chain, i))
            if header.codec == codec.Codec.RAW:
                codec.check_raw_pieces(header, views[1:])
            else:  # a compressed record that happens to have the raw length
                place(i, codec.decode_payload(header, memoryview(b"".join(views[1:]))))
        except RecordError:
            return False
        if verified is not None:
            verified(i, block(i))
        return True

    ok = read_into([(e, v) for _, e, v in scatter], verify) if scatter else []
    end = first + len(entries)
    for (i, _, _), good in zip(scatter, ok):
        if not good:
            end = i
            break
    if whole:
        with read_whole([e for i, e in whole if i < end]) as records:
            for (i, _), rec in zip(whole, records):
                try:
                    place(i, codec.decode(rec, expected(chain, i)))
                except RecordError:
                    end = min(end, i)
                    break
                if verified is not None:
                    verified(i, block(i))
    return end - first
