"""Reading a run of disk records into KV memory, verified on the reading threads (the disk tier's
``read_into``). Kept apart from the façade because it needs torch, which the shell tools do not load."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from tierkv import codec, native
from tierkv.errors import RecordError
from tierkv.keys import BlockChain, BlockKey
from tierkv.layout import KVSpec
from tierkv.tiers.disk.files import TransientReadError, aligned
from tierkv.tiers.disk.native_read import ST_OK, ST_PYTHON
from tierkv.tiers.disk.read_modes import MIN_SAMPLE_NBYTES
from tierkv.tiers.disk.schema import Entry
from tierkv.tiers.target import Target, as_tensor, expected

if TYPE_CHECKING:
    from tierkv.tiers.disk import DiskTier
    from tierkv.tiers.disk.segments import SegmentDir

log = logging.getLogger("tierkv.disk")

__all__ = ["held_nbytes", "read_into", "read_records"]

# A run read with its promotions in the background is read in pieces of this size: small enough that most
# of the copying overlaps the reads, large enough to keep the native reader's requests in flight.
PIECE_NBYTES = 24 << 20

ReadInto = Callable[[Sequence[tuple[Entry, list[memoryview]]], Callable[[int], bool]], list[bool]]
ReadWhole = Callable[[Sequence[Entry]], contextlib.AbstractContextManager[list[memoryview]]]
# The native reader (native_read.read_run without its first arguments): records (i, entry, position) into a
# tensor; each record's status and the records' headers.
ReadNative = Callable[[Sequence[tuple[int, Entry, int]], torch.Tensor], tuple[list[int], memoryview]]


def _settle(pending: list[concurrent.futures.Future[None]]) -> None:
    """Every promotion left behind is over before ``target`` may be reused, whatever raised meanwhile
    (here, or on the promoting thread: ``Promoter.run`` logs its own errors; an interrupt waits too)."""
    interrupted: BaseException | None = None
    while True:
        try:
            concurrent.futures.wait(pending)
            break
        except BaseException as exc:  # KeyboardInterrupt: raised once the copies from target are done
            interrupted = exc
    for fut in pending:
        if not fut.cancelled() and fut.exception() is not None:
            log.error("promoting a restored piece failed: %r", fut.exception())
    if interrupted is not None:
        raise interrupted


def read_records(
    chain: BlockChain,
    entries: Sequence[Entry],
    first: int,
    target: torch.Tensor,
    base: int,
    read_into: ReadInto,
    read_whole: ReadWhole,
    verified: Callable[[int, torch.Tensor], None] | None = None,
    read_native: ReadNative | None = None,
    verified_run: Callable[[torch.Tensor, list[int], int], None] | None = None,
    background: Callable[..., concurrent.futures.Future[None]] | None = None,
) -> int:
    """Blocks ``first, first+1, ...`` (their ``entries``) into ``target`` at block positions ``i - base``;
    returns how many leading blocks verified.

    A raw record is scattered by preadv straight into place: the target's (layer, k/v) slabs as byte
    rows, a block's payload one chunk of each row (no bounce buffer, no second copy), and verified on
    the reading thread as soon as it is in. Compressed records are read whole and decoded.
    ``verified(i, block)`` gets each good block right after its check, on that thread.

    With ``read_native``, the raw records are read and verified by the native reader in one call without
    the GIL; once it returns, ``verified_run(target, good blocks, base)`` gets them at once (else
    ``verified`` each); with ``background`` (an executor's submit), a piece of the run at a time, on that
    executor while the next piece is read.
    """
    spec = KVSpec.of(chain.ns)
    B = spec.block_tokens
    prefix_nbytes = codec.HEADER_NBYTES + chain.block_token_nbytes
    # A raw record's length in each record version (equal when the token ids end on a multiple of 64).
    raw_nbytes = {
        codec.payload_at(v, chain.block_token_nbytes) + spec.block_nbytes for v in codec.RECORD_VERSIONS
    }
    scatter: list[tuple[int, Entry]] = []  # raw records: scattered straight into place
    whole: list[tuple[int, Entry]] = []
    for j, e in enumerate(entries):
        (scatter if e.nbytes in raw_nbytes else whole).append((first + j, e))
    chunk = spec.block_nbytes // (spec.num_layers * 2)
    nrows = spec.num_layers * 2
    pad = memoryview(bytearray(codec.PAYLOAD_ALIGN))  # sink for version 2's zeros before the payload
    rows: list[memoryview] = []  # the Python path's: the target's (layer, k/v) slabs as byte rows
    prefixes = memoryview(bytearray(prefix_nbytes * len(scatter)))

    def views(j: int) -> list[memoryview]:  # record j's prefix, then its chunk of each row
        if not rows:  # sliced per record: a memoryview slice is far cheaper than numpy's
            rows.extend(
                memoryview(target[layer, kv].view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
                for layer in range(spec.num_layers)
                for kv in (0, 1)
            )
        pos = scatter[j][0] - base
        zeros = scatter[j][1].nbytes - prefix_nbytes - spec.block_nbytes  # version 2's, before the payload
        return (
            [prefixes[j * prefix_nbytes : (j + 1) * prefix_nbytes]]
            + [pad[:zeros]] * (zeros > 0)
            + [row[pos * chunk : (pos + 1) * chunk] for row in rows]
        )

    def block(i: int) -> torch.Tensor:
        return target[:, :, (i - base) * B : (i - base + 1) * B]

    def place(i: int, payload: memoryview | bytes) -> None:
        block(i).copy_(as_tensor(payload, spec.dtype, spec.block_shape))

    # Compressed records of a raw one's length (scatter indices): read whole afterwards and decoded. Read
    # in place by the length's layout, the first bytes of a version-1 one of version 2's raw length went
    # to the padding's sink.
    again: set[int] = set()

    def verify(j: int, pieces: list[memoryview]) -> bool:  # record j, in place (on a reading thread)
        i = scatter[j][0]
        try:
            header, toks = codec.parse_header(pieces[0], scatter[j][1].nbytes)
            codec.check_expected(header, toks, expected(chain, i))
            if header.codec != codec.Codec.RAW:
                again.add(j)  # not served yet: ``whole`` below decodes it (or ends the run there)
                return True
            codec.check_raw_pieces(header, pieces[-nrows:])
        except RecordError:
            return False
        if verified is not None:
            verified(i, block(i))
        return True

    ok: list[bool] = []
    if scatter and read_native is not None:
        # With a background thread for the promotions, the run is read in pieces, each piece's good blocks
        # promoted there while the next is read; they are all done before this returns (``target`` may be
        # a chunk buffer that its caller reuses next).
        step = len(scatter)
        if verified_run is not None and background is not None:  # records enough for every reading thread
            step = max(native.READ_THREADS, PIECE_NBYTES // spec.block_nbytes)
        pending: list[concurrent.futures.Future[None]] = []
        try:
            for at in range(0, len(scatter), step):
                part = scatter[at : at + step]
                status, got = read_native([(i, e, i - base) for i, e in part], target)
                if step < len(scatter):
                    prefixes[at * prefix_nbytes : (at + len(part)) * prefix_nbytes] = got
                else:
                    prefixes = got
                passed: list[int] = []
                if status.count(ST_OK) == len(status):  # the common case, with no call per record
                    ok += [True] * len(status)
                    passed = [i for i, _ in part]
                else:
                    for j, st in enumerate(status, at):
                        if st == ST_PYTHON:  # compressed, of a raw record's length: Python decodes it
                            ok.append(verify(j, views(j)))
                        else:
                            ok.append(st == ST_OK)
                            if ok[-1]:
                                passed.append(scatter[j][0])
                if passed and verified_run is not None:
                    if step < len(scatter):  # in order, on the one thread: none refused for the other's lock
                        assert background is not None
                        pending.append(background(verified_run, target, passed, base))
                    else:
                        verified_run(target, passed, base)
                elif verified is not None:
                    for i in passed:
                        verified(i, block(i))
                if not all(ok):  # the run ends at the first bad record: the rest is not read
                    break
        except BaseException:
            for fut in pending:
                fut.cancel()  # not started yet: not wanted any more
            raise
        finally:
            _settle(pending)
    elif scatter:
        pieces = [views(j) for j in range(len(scatter))]
        ok = read_into([(e, pieces[j]) for j, (_, e) in enumerate(scatter)], lambda j: verify(j, pieces[j]))
    end = first + len(entries)
    if not all(ok):
        end = scatter[ok.index(False)][0]
    if again:
        whole = sorted(whole + [scatter[j] for j in again], key=lambda ie: ie[0])
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


def held_nbytes(segments: SegmentDir, entries: Sequence[Entry]) -> int | None:
    """How many bytes of ``entries``' records the page cache holds now (cachestat over each run of adjacent
    records), or None where that cannot be told."""
    if not entries:
        return None
    nat = native.module()
    held = 0
    with segments.held_fds(sorted({e.seg_id for e in entries})) as fds:
        start = prev = entries[0]
        run_nbytes = start.nbytes
        for e in [*entries[1:], None]:
            if e is not None and e.seg_id == prev.seg_id and e.offset == prev.offset + aligned(prev.nbytes):
                prev = e
                run_nbytes += e.nbytes
                continue
            if start.seg_id not in fds:
                return None
            got = nat.cached_nbytes(
                fds[start.seg_id][1], start.offset, prev.offset + prev.nbytes - start.offset
            )
            if got < 0:
                return None
            held += min(got, run_nbytes)  # the range spans the padding between records too
            if e is not None:
                start = prev = e
                run_nbytes = e.nbytes
    return held


def read_into(disk: DiskTier, chain: BlockChain, first: int, count: int, target: Target) -> int:
    """``DiskTier.read_into``: records verified on the reading threads; a bad one (or one an I/O error hit)
    ends the run and is purged, if still indexed: a sweep in another process may have released it
    meanwhile, and then it is a plain miss."""
    entries = disk._located(chain, first, count)
    target.created_s.update(zip(range(first, first + len(entries)), [e.created_s for e in entries]))
    failed: set[tuple[int, int, int]] = set()  # locations an I/O error hit
    scatter = functools.partial(disk.read_scatter, failed=failed)
    whole = functools.partial(disk.read, failed=failed)

    read_native = None
    modes = disk.segments.read_modes
    direct_mode, sample, total = False, False, 0
    if native.enabled():
        from tierkv.tiers.disk.native_read import read_run

        # one mode for the whole restore: its pieces would otherwise take turns, a buffered one's readahead
        # warming the next (read_modes.py)
        direct_mode = modes.direct()
        read_native = functools.partial(
            read_run, disk.segments, chain, failed=failed, direct_mode=direct_mode
        )
        # a choice to measure, on a restore big enough to be a sample (read_modes.py)
        total = sum([e.nbytes for e in entries])
        sample = modes.fixed is None and disk.segments.reads_direct and total >= MIN_SAMPLE_NBYTES

    def fill(buf: torch.Tensor, i0: int, n: int, base: int) -> int:
        part = entries[i0 - first : i0 - first + n]
        verified = target.verified if target.on_verified is not None else None  # no view per block
        run = target.verified_run if target.on_verified_run is not None else None
        behind = target.behind if run is not None else None  # promotions copied while the reader reads on
        return read_records(chain, part, i0, buf, base, scatter, whole, verified, read_native, run, behind)

    got = 0
    # In flight from here (another restore that overlaps is then no sample either), its time from here.
    token, held = (modes.begin() if sample else None), None
    t0 = time.perf_counter()
    try:
        if sample:
            # What the page cache held before the restore: its pieces count what their own readahead
            # brings in as cached, and its sample is what it read from the disk, in its whole time.
            with contextlib.suppress(OSError):  # no descriptors, say: no sample (the read says the rest)
                held = held_nbytes(disk.segments, entries)
        got = target.fill(first, len(entries), fill)
    except TransientReadError as exc:  # not the records' fault (no descriptors, no memory): a miss
        disk.counters.add("disk", "transient_read_errors")
        if not disk._transient_logged:
            disk._transient_logged = True
            log.warning("disk tier read failed (%s): a miss, nothing purged; further ones are counted", exc)
        return 0
    finally:
        if sample:  # read whole, alone, its residency known: a sample of its mode's speed
            counted = token if held is not None and got == len(entries) else None
            modes.end(counted, direct_mode, total - (held or 0), total, time.perf_counter() - t0)
    bad: dict[tuple[int, int, int], BlockKey] = {}
    if failed:
        bad = {e.location: chain.keys[first + j] for j, e in enumerate(entries) if e.location in failed}
    if got < len(entries):  # the one that ended the run, and any other an I/O error hit
        bad[entries[got].location] = chain.keys[first + got]
    for location, key in bad.items():
        if disk.still_indexed(key, location):  # else another process released it: a plain miss
            disk.counters.add("disk", "read_errors" if location in failed else "corrupt_blocks")
            disk._purge(key, location)
    disk.touch(chain.keys[first : first + got], sum([e.nbytes for e in entries[:got]]))
    return got
