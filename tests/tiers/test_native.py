"""The native data path against the Python one (the reference), on real segment files: the reader serves the
same blocks bit for bit, with the same misses, purges and counts for every kind of damage, buffered and with
O_DIRECT; the writer writes the same bytes, and runs no Python at idle priority."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import Namespace, TieredStore, codec, native
from tierkv.keys import BlockChain

from helpers import block_write, make_kv, uncache

pytestmark = pytest.mark.skipif(
    native.reason() is not None and os.environ.get("TIERKV_REQUIRE_NATIVE") != "1",
    reason=f"native reader unavailable: {native.reason()}",
)

# Records larger than the native reader's 1 MiB request: each is read in several O_DIRECT pieces.
BIG = Namespace(
    model_id="big", revision="r", dtype="float32", num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=64
)


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=5000))
def test_native_xxh3_is_xxhash_s(data: bytes) -> None:
    assert native.module().xxh3_64(data) == xxhash.xxh3_64_intdigest(data)


@pytest.mark.parametrize("nbytes", [16 << 10, (16 << 10) + 1, (1 << 20) + 7, 3 << 20])
def test_native_xxh3_is_xxhash_s_past_its_blocks_whichever_entry_point(nbytes: int) -> None:
    """Past xxh3's 16 KiB blocks, where its vector code runs: the library's dispatched entry points
    (AVX2, AVX-512; used where it exports them, ``XXH3_DISPATCHED``) and the plain ones
    (``TIERKV_XXH3_PLAIN=1``, in a process of its own) agree with xxhash's."""
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    assert native.module().xxh3_64(data) == xxhash.xxh3_64_intdigest(data)
    code = (
        "import sys, tierkv._native as n; d = sys.stdin.buffer.read(); print(n.XXH3_DISPATCHED, n.xxh3_64(d))"
    )
    env = dict(os.environ, TIERKV_XXH3_PLAIN="1")
    out = subprocess.run([sys.executable, "-c", code], input=data, env=env, capture_output=True, check=True)
    dispatched, digest = out.stdout.split()
    assert (int(dispatched), int(digest)) == (0, xxhash.xxh3_64_intdigest(data))


def _restore(path, ns: Namespace, prompts, *, use_native: bool, direct: bool = False, host_bytes: int = 0):
    if direct:
        uncache(path)  # else every record is in the page cache and read buffered
    out = []
    with native.use(use_native), TieredStore.open(path, host_bytes=host_bytes, direct_reads=direct) as store:
        for toks in prompts:
            hit, kv = store.restore(ns, toks)
            out.append((hit.num_tokens, None if kv is None else kv.clone()))
        stats = store.stats()["disk"]
    return out, stats


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
@pytest.mark.parametrize("layout", ["one-go", "interleaved"])
@pytest.mark.parametrize("space", ["small", "big"])
def test_native_serves_exactly_what_the_python_reader_serves(tmp_path, ns, direct, layout, space) -> None:
    space_ns = ns if space == "small" else BIG
    B = space_ns.block_tokens
    n_blocks = 9 if space == "small" else 3
    prompts = [[p * 100_000 + t for t in range(n_blocks * B + 5)] for p in range(3)]
    kvs = [make_kv(space_ns, len(t), seed=p) for p, t in enumerate(prompts)]
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        if layout == "one-go":
            for toks, kv in zip(prompts, kvs):
                store.save(space_ns, toks, kv)
        else:  # block b of every prompt before block b+1: no two blocks of a prompt adjacent on disk
            for b in range(n_blocks):
                for toks, kv in zip(prompts, kvs):
                    store.save(space_ns, toks[: (b + 1) * B], kv[:, :, : (b + 1) * B], start_block=b)
        store.flush()
    ref, _ = _restore(tmp_path, space_ns, prompts, use_native=False)
    got, stats = _restore(tmp_path, space_ns, prompts, use_native=True, direct=direct)
    for (n_ref, kv_ref), (n_got, kv_got), kv in zip(ref, got, kvs):
        assert n_ref == n_got == n_blocks * B
        assert torch.equal(kv_got, kv_ref) and torch.equal(kv_got, kv[:, :, : n_blocks * B])
    read = stats["read_cached_nbytes"] + stats["read_direct_nbytes"] + stats["read_blocking_nbytes"]
    assert read >= sum(k[:, :, : n_blocks * B].numel() * k.element_size() for k in kvs)
    if direct:  # read from the disk with O_DIRECT (the page cache was emptied), not from the page cache
        assert stats["read_direct_nbytes"] >= read - stats["read_cached_nbytes"] > 0


@pytest.mark.parametrize(
    ("host_bytes", "env", "direct"),
    [(64 << 20, None, True), (0, None, True), (64 << 20, "0", False), (0, "0", False)],
    ids=["host-tier", "no-host-tier", "host-tier-env-off", "no-host-tier-env-off"],
)
def test_a_store_reads_what_the_page_cache_lacks_with_o_direct_unless_asked_to_buffer(
    tmp_path, ns, monkeypatch, host_bytes, env, direct
) -> None:
    """The default read path reads what the page cache lacks with O_DIRECT, host tier or not (buffered
    reads fell behind the disk and cost a restart's first request 2x here: docs/architecture.md);
    ``TIERKV_DIRECT_READS=0`` reads everything buffered, so that the page cache keeps it. The same KV
    either way."""
    from tierkv.tiers.disk.files import has_cachestat

    if env is None:
        monkeypatch.delenv("TIERKV_DIRECT_READS", raising=False)
        direct = direct and has_cachestat()  # without cachestat(2) the default reads buffered
    else:
        monkeypatch.setenv("TIERKV_DIRECT_READS", env)
    toks, kv = _saved(tmp_path, ns, 6)
    uncache(tmp_path)
    with native.use(True), TieredStore.open(tmp_path, host_bytes=host_bytes) as store:
        hit, got = store.restore(ns, toks)
        stats = store.stats()["disk"]
    assert hit.num_tokens == len(toks) and torch.equal(got, kv)
    if direct:
        assert stats["read_direct_nbytes"] > 0
    else:
        assert stats["read_direct_nbytes"] == 0 and stats["read_blocking_nbytes"] > 0


def test_without_cachestat_the_default_reads_buffered_and_says_why(tmp_path, ns, monkeypatch) -> None:
    """Where the kernel lacks cachestat(2) (before Linux 6.5, or refused by seccomp) residency would be
    asked of mincore, mapping each range: the default then reads buffered, and the data path line says
    why; TIERKV_DIRECT_READS=1 still asks for O_DIRECT. The same KV either way."""
    from tierkv.tiers.disk import read_modes
    from tierkv.tiers.disk.files import accepts_direct_io

    if accepts_direct_io(tmp_path) is False:
        pytest.skip("this file system refuses O_DIRECT: TIERKV_DIRECT_READS=1 reads buffered here")
    monkeypatch.setattr(read_modes, "has_cachestat", lambda: False)  # (the default's choice is made there)
    monkeypatch.delenv("TIERKV_DIRECT_READS", raising=False)
    toks, kv = _saved(tmp_path, ns, 6)
    for env, direct in ((None, False), ("1", True)):
        if env is not None:
            monkeypatch.setenv("TIERKV_DIRECT_READS", env)
        uncache(tmp_path)
        with native.use(True), TieredStore.open(tmp_path, host_bytes=0) as store:
            hit, got = store.restore(ns, toks)
            stats = store.stats()["disk"]
            line = store._durable().read_path()
        assert hit.num_tokens == len(toks) and torch.equal(got, kv)
        assert (stats["read_direct_nbytes"] > 0) is direct
        assert ("no cachestat(2)" in line) is not direct, line


def test_the_cachestat_probe_answers_as_this_kernel_does() -> None:
    """``has_cachestat`` asks the kernel with no file: yes from Linux 6.5 on, unless a seccomp filter is on
    this process (it may refuse the call); no before 6.5."""
    from tierkv.tiers.disk.files import has_cachestat

    release = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    with open("/proc/self/status") as f:
        filtered = any(line.split()[:2] == ["Seccomp:", "2"] for line in f)
    if release < (6, 5):
        assert has_cachestat() is False
    elif not filtered:
        assert has_cachestat() is True


def test_a_file_system_refusing_o_direct_gets_the_buffered_reader_streaming_its_runs(
    tmp_path, monkeypatch
) -> None:
    """O_DIRECT asked for (the default) where the file system refuses it: the reader runs its buffered
    mode, a cold run streamed through a file of its own, as with
    TIERKV_DIRECT_READS=0, not the O_DIRECT mode's unstreamed reads with no O_DIRECT descriptor."""
    from tierkv.tiers.disk import segments
    from tierkv.tiers.disk.files import has_cachestat

    if not has_cachestat():
        pytest.skip("no cachestat(2) here (before Linux 6.5, or refused): a run's residency is not known")
    monkeypatch.delenv("TIERKV_DIRECT_READS", raising=False)
    monkeypatch.setattr(segments, "accepts_direct_io", lambda folder: False)
    toks, kv = _saved(tmp_path, BIG, 24)
    uncache(tmp_path)
    streamed, _ = native.module().streamed_reads()
    with native.use(True), TieredStore.open(tmp_path, host_bytes=0) as store:
        assert store._durable().segments.direct_reads and not store._durable().segments.reads_direct
        hit, got = store.restore(BIG, toks)
        assert "buffered: this file system refuses O_DIRECT" in store._durable().read_path()
    assert hit.num_tokens == len(toks) and torch.equal(got, kv)
    assert native.module().streamed_reads()[0] - streamed == 24


def _saved(path, ns: Namespace, blocks: int, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    """A prompt of ``blocks`` blocks saved into a fresh store at ``path`` and flushed: its tokens and KV."""
    toks = list(range(blocks * ns.block_tokens))
    kv = make_kv(ns, blocks * ns.block_tokens, seed=seed)
    with TieredStore.open(path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
    return toks, kv


def _damage(path, store_ns: Namespace, toks, block: int, at: str) -> None:
    """Change one record on disk: a flipped byte in a chosen part, or a forged record of another block
    whose checksums are all valid (a foreign block under this key)."""
    with TieredStore.open(path, host_bytes=0) as store:
        disk = store.tier("disk")
        seg_id, offset, nbytes = disk.locate(BlockChain.of(store_ns, toks).keys)[block].location
        seg = disk.segments.file(seg_id)
    token_nbytes = 4 * store_ns.block_tokens
    where = {
        "magic": 0,
        "header": 40,  # inside the namespace digest: the header checksum fails
        "tokens": codec.HEADER_NBYTES + 5,
        "payload-first": codec.payload_at(2, token_nbytes),  # a new store's records are version 2
        "payload-last": nbytes - 1,
    }
    with open(seg, "r+b") as f:
        if at in where:
            f.seek(offset + where[at])
            byte = f.read(1)
            f.seek(offset + where[at])
            f.write(bytes([byte[0] ^ 0x40]))
            return
        other = dataclasses.replace(store_ns, tenant_salt="someone-else") if at == "foreign-ns" else store_ns
        other_toks = toks if at == "foreign-ns" else [t + 1 for t in toks]
        chain = BlockChain.of(other, other_toks)
        kv = make_kv(store_ns, store_ns.block_tokens, seed=9)
        rec = codec.encode(
            ns_digest=other.digest,
            parent_key=chain.parent(block),
            key=chain.keys[block],
            token_bytes=chain.tokens(block),
            dtype=store_ns.dtype,
            shape=tuple(kv.shape),
            payload=kv.contiguous().view(torch.uint8).numpy().tobytes(),
            created_s=0.0,
            version=2,
        )
        assert len(rec) == nbytes
        f.seek(offset)
        f.write(rec)


@pytest.mark.parametrize(
    "at", ["magic", "header", "tokens", "payload-first", "payload-last", "foreign-ns", "foreign-tokens"]
)
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_a_damaged_record_ends_the_prefix_and_is_purged_by_both_readers(tmp_path, ns, at, direct) -> None:
    B = ns.block_tokens
    toks = list(range(6 * B))
    kv = make_kv(ns, 6 * B)
    results = []
    for use_native in (False, True):
        path = tmp_path / f"native-{use_native}"
        with TieredStore.open(path, host_bytes=0) as store:
            store.save(ns, toks, kv)
            store.flush()
        _damage(path, ns, toks, 4, at)
        if direct:
            uncache(path)
        with native.use(use_native), TieredStore.open(path, host_bytes=0, direct_reads=direct) as store:
            hit, got = store.restore(ns, toks)
            if direct and use_native:
                assert store.stats()["disk"]["read_direct_nbytes"] > 0
            assert hit.num_tokens == 4 * B and torch.equal(got, kv[:, :, : 4 * B])
            store.flush()
            stats = store.stats()["disk"]
            assert stats["corrupt_blocks"] == 1 and stats["read_errors"] == 0
            assert store.tier("disk").probe(BlockChain.of(ns, toks), range(6)) == [True] * 4 + [False, True]
        results.append(hit.num_tokens)
    assert results[0] == results[1]


# native/read.c's HASH_PIECE_NBYTES: a read lands, and is hashed, in pieces this size
PIECE_NBYTES = 256 << 10


@pytest.mark.parametrize("where", ["first-piece", "a-later-piece-s-first-byte", "last-byte"])
@pytest.mark.parametrize("how", ["buffered", "buffered-cached", "odirect", "odirect-store-cached"])
def test_a_flipped_byte_in_any_piece_of_a_large_record_is_caught(tmp_path, where, how) -> None:
    """The native reader hashes a record's payload as it lands (read buffered: in pieces where the page
    cache holds it, else whole; with O_DIRECT, piece by piece out of its bounce buffer; by an O_DIRECT
    store, in pieces from the page cache that holds it): a flipped byte in any piece of a 2 MiB record
    ends the prefix there and is purged; the records before it are served exactly."""
    B = BIG.block_tokens
    toks, kv = _saved(tmp_path, BIG, 6)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        disk = store.tier("disk")
        seg_id, offset, nbytes = disk.locate(BlockChain.of(BIG, toks).keys)[4].location
        seg = disk.segments.file(seg_id)
    payload_at = codec.payload_at(2, 4 * B)
    assert nbytes - payload_at > 4 * PIECE_NBYTES  # several pieces
    at = {
        "first-piece": payload_at + 7,
        "a-later-piece-s-first-byte": PIECE_NBYTES,  # a large record's pieces start at its first byte
        "last-byte": nbytes - 1,
    }[where]
    with open(seg, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)
        f.seek(offset + at)
        f.write(bytes([byte[0] ^ 0x01]))
    if how.endswith("cached"):
        with open(seg, "rb") as f:
            f.read()
    else:
        uncache(tmp_path)
    arrived = native.module().hashed_on_arrival()
    direct = how.startswith("odirect")
    with native.use(True), TieredStore.open(tmp_path, host_bytes=0, direct_reads=direct) as store:
        hit, got = store.restore(BIG, toks)
        store.flush()  # the purge
        # the four served were checked against the digests taken as their bytes came in
        assert native.module().hashed_on_arrival() - arrived >= 4
        stats = store.stats()["disk"]
        assert hit.num_tokens == 4 * B and torch.equal(got, kv[:, :, : 4 * B])
        assert stats["corrupt_blocks"] == 1 and stats["read_errors"] == 0
        assert store.tier("disk").probe(BlockChain.of(BIG, toks), range(6)) == [True] * 4 + [False, True]
    if how == "odirect-store-cached":
        assert stats["read_cached_nbytes"] > 0 and stats["read_direct_nbytes"] == 0
    elif how == "odirect":
        assert stats["read_direct_nbytes"] > 0


def test_separate_runs_of_one_prompt_are_streamed_side_by_side(tmp_path) -> None:
    """A prompt whose records lie in two runs (another prompt saved between its halves): each run is a
    stream of its own, read through a file of its own by its own thread, and the whole prompt is served
    bit for bit."""
    from tierkv.tiers.disk.files import has_cachestat

    if not has_cachestat():
        pytest.skip("no cachestat(2) here (before Linux 6.5, or refused): a run's residency is not known")
    B = BIG.block_tokens
    toks = list(range(24 * B))
    kv = make_kv(BIG, 24 * B, seed=3)
    other = [10**6 + t for t in range(12 * B)]
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(BIG, toks[: 12 * B], kv[:, :, : 12 * B])
        store.flush()
        store.save(BIG, other, make_kv(BIG, 12 * B, seed=4))
        store.flush()
        store.save(BIG, toks, kv, start_block=12)
        store.flush()
        locs = store.tier("disk").locate(BlockChain.of(BIG, toks).keys)
    assert locs[11].offset + locs[11].nbytes < locs[12].offset  # two runs, the other prompt between them
    uncache(tmp_path)
    groups, files = native.module().streamed_reads()
    with native.use(True), TieredStore.open(tmp_path, host_bytes=0, direct_reads=False) as store:
        hit, got = store.restore(BIG, toks)
    assert hit.num_tokens == len(toks) and torch.equal(got, kv)
    assert native.module().streamed_reads() == (groups + 24, files + 2)


@pytest.mark.parametrize("fault", ["none", "bad-sector", "flipped-byte"])
def test_a_cold_run_is_read_as_one_stream_through_a_file_of_its_own(tmp_path, read_faults, fault) -> None:
    """A buffered run the page cache lacks: its adjacent records are one share, read by one thread through
    a file of its own (readahead keeps its state per open file, and sees one sequential stream). Served
    bit for bit; a bad sector or a flipped byte late in the run ends the prefix there, and only that
    record is purged."""
    from tierkv.tiers.disk.files import has_cachestat

    if not has_cachestat():
        pytest.skip(
            "no cachestat(2) here (before Linux 6.5, or refused): a run's residency is not known, and it is "
            "read as before"
        )
    B = BIG.block_tokens
    toks, kv = _saved(tmp_path, BIG, 24)  # 24 adjacent records of 2 MiB: a group each, one run
    chain = BlockChain.of(BIG, toks)
    bad = 17
    if fault == "flipped-byte":
        with TieredStore.open(tmp_path, host_bytes=0) as store:
            disk = store.tier("disk")
            seg_id, offset, nbytes = disk.locate(chain.keys)[bad].location
            seg = disk.segments.file(seg_id)
        with open(seg, "r+b") as f:
            f.seek(offset + nbytes - 1)
            byte = f.read(1)
            f.seek(offset + nbytes - 1)
            f.write(bytes([byte[0] ^ 0x01]))
    uncache(tmp_path)
    groups, files = native.module().streamed_reads()
    with native.use(True), TieredStore.open(tmp_path, host_bytes=0, direct_reads=False) as store:
        assert native.READ_THREADS == 8
        if fault == "bad-sector":
            read_faults.fail(store, chain, [bad])
        hit, got = store.restore(BIG, toks)
        store.flush()  # the purge
        assert native.module().streamed_reads() == (groups + 24, files + 1)
        served = 24 if fault == "none" else bad
        assert hit.num_tokens == served * B and torch.equal(got, kv[:, :, : served * B])
        stats = store.stats()["disk"]
        assert (stats["read_errors"], stats["corrupt_blocks"]) == {
            "none": (0, 0),
            "bad-sector": (1, 0),
            "flipped-byte": (0, 1),
        }[fault]
        read_faults.clear()
        assert store.tier("disk").probe(chain, range(24)) == [i != bad or fault == "none" for i in range(24)]


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
def test_a_truncated_segment_is_a_miss_from_where_it_ends(tmp_path, ns, data_path, direct) -> None:
    B = ns.block_tokens
    toks = list(range(5 * B))
    kv = make_kv(ns, 5 * B)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
        seg_id, offset, _ = store.tier("disk").locate(BlockChain.of(ns, toks).keys)[3].location
        seg = store.tier("disk").segments.file(seg_id)
    with TieredStore.open(tmp_path, host_bytes=0, direct_reads=direct) as store:
        os.truncate(seg, offset + 100)  # under a running store (an opening store checks segment lengths)
        if direct:
            uncache(tmp_path)  # the file now ends inside a page: O_DIRECT's short read
        hit, got = store.restore(ns, toks)
        assert hit.num_tokens == 3 * B and torch.equal(got, kv[:, :, : 3 * B])


def test_the_native_reader_promotes_what_it_read_into_the_host_tier(tmp_path, ns) -> None:
    B = ns.block_tokens
    toks, kv = _saved(tmp_path, ns, 8)
    with native.use(True), TieredStore.open(tmp_path, host_bytes=64 << 20) as store:
        hit, _ = store.restore(ns, toks)
        assert hit.by_tier["disk"] == 8 * B
        hit, got = store.restore(ns, toks)
        assert hit.by_tier["host"] == 8 * B and torch.equal(got, kv)


@pytest.mark.parametrize("damaged", [None, 5], ids=["whole", "damaged-at-5"])
def test_a_run_read_in_pieces_promotes_each_piece_on_the_promoting_thread(
    tmp_path, ns, monkeypatch, damaged
) -> None:
    """With a host tier, a disk run is read a piece at a time and each piece's blocks are promoted on the
    store's promoting thread while the next is read; every piece before a damaged record is promoted,
    none past it, and the restore waits for them all."""
    from tierkv.tiers.disk import reader
    from tierkv.tiers.pool import BlockPool

    B = ns.block_tokens
    toks, kv = _saved(tmp_path, ns, 9)
    if damaged is not None:
        _damage(tmp_path, ns, toks, damaged, "payload-last")
    block_nbytes = kv[:, :, :B].numel() * kv.element_size()
    monkeypatch.setattr(reader, "PIECE_NBYTES", 2 * block_nbytes)  # pieces of 2 blocks: 0-1, 2-3, 4-5, ...
    monkeypatch.setattr(native, "READ_THREADS", 2)  # (a piece holds a record for every reading thread)
    promoted_on: list[tuple[str, int]] = []
    put_run = BlockPool.put_run

    def spy(self, keys, *args, **kwargs):  # type: ignore[no-untyped-def]
        promoted_on.append((threading.current_thread().name, len(keys)))
        return put_run(self, keys, *args, **kwargs)

    monkeypatch.setattr(BlockPool, "put_run", spy)
    with native.use(True), TieredStore.open(tmp_path, host_bytes=64 << 20) as store:
        store.reserve(ns, populate_now=True)
        hit, got = store.restore(ns, toks)
        good = 9 if damaged is None else damaged
        assert hit.num_tokens == good * B and torch.equal(got, kv[:, :, : good * B])
        # each piece's good blocks, in order, on the promoting thread (done before the restore returned)
        assert promoted_on == [
            ("tierkv-promote_0", n) for n in ([2, 2, 2, 2, 1] if damaged is None else [2, 2, 1])
        ]
        assert store.lookup(ns, toks).by_tier["host"] == good * B
        hit, got = store.restore(ns, toks)
        assert hit.by_tier["host"] == good * B and torch.equal(got, kv[:, :, : good * B])


def test_a_transient_read_error_in_a_later_piece_is_a_miss_once_the_promotions_are_done(
    tmp_path, ns, monkeypatch
) -> None:
    """A read that fails not for the records' sake (no descriptors, say) in the second piece: the restore
    is a miss, not an error, and returns only once the first piece's promotion is over (its blocks,
    verified, are in the host tier; no promoting thread is left)."""
    from tierkv.tiers.disk import native_read, reader
    from tierkv.tiers.disk.files import TransientReadError

    B = ns.block_tokens
    toks, kv = _saved(tmp_path, ns, 8)
    block_nbytes = kv[:, :, :B].numel() * kv.element_size()
    monkeypatch.setattr(reader, "PIECE_NBYTES", 2 * block_nbytes)
    monkeypatch.setattr(native, "READ_THREADS", 2)  # pieces of 2 blocks
    calls = []
    real = native_read.read_run

    def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise TransientReadError(24, "opening segments: too many open files")
        return real(*args, **kwargs)

    monkeypatch.setattr(native_read, "read_run", flaky)
    with native.use(True), TieredStore.open(tmp_path, host_bytes=64 << 20) as store:
        store.reserve(ns, populate_now=True)
        hit, got = store.restore(ns, toks)
        assert hit.num_tokens == 0 and got is None
        assert store.stats()["disk"]["transient_read_errors"] == 1
        assert not [t for t in threading.enumerate() if t.name.startswith("tierkv-promote")]
        assert store.lookup(ns, toks).by_tier["host"] == 2 * B  # the first piece, promoted and kept
        monkeypatch.setattr(native_read, "read_run", real)
        hit, got = store.restore(ns, toks)
        assert hit.num_tokens == 8 * B and torch.equal(got, kv)


def test_concurrent_restores_read_in_pieces_each_promote_on_their_own_thread(
    tmp_path, ns, monkeypatch
) -> None:
    """Two threads restoring different prompts at once, each read in pieces: both exact, every block
    promoted, each restore's promotions on a thread of its own (neither waits behind the other's)."""
    from tierkv.tiers.disk import reader
    from tierkv.tiers.pool import BlockPool

    B = ns.block_tokens
    prompts = [[p * 100_000 + t for t in range(8 * B)] for p in range(2)]
    kvs = [make_kv(ns, 8 * B, seed=p) for p in range(2)]
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        for toks, kv in zip(prompts, kvs):
            store.save(ns, toks, kv)
        store.flush()
    block_nbytes = kvs[0][:, :, :B].numel() * kvs[0].element_size()
    monkeypatch.setattr(reader, "PIECE_NBYTES", 2 * block_nbytes)
    monkeypatch.setattr(native, "READ_THREADS", 2)
    on: dict[int, set[int]] = {0: set(), 1: set()}  # per restore: the promoting threads' idents
    put_run = BlockPool.put_run

    def spy(self, keys, *args, **kwargs):  # type: ignore[no-untyped-def]
        for p, toks in enumerate(prompts):
            if bytes(keys[0]) in {bytes(k) for k in BlockChain.of(ns, toks).keys}:
                on[p].add(threading.get_ident())
        return put_run(self, keys, *args, **kwargs)

    monkeypatch.setattr(BlockPool, "put_run", spy)
    results: list[tuple[int, bool]] = []
    with native.use(True), TieredStore.open(tmp_path, host_bytes=64 << 20) as store:
        store.reserve(ns, populate_now=True)
        go = threading.Barrier(2)

        def restore(p: int) -> None:
            go.wait()
            hit, got = store.restore(ns, prompts[p])
            results.append((hit.num_tokens, got is not None and torch.equal(got, kvs[p])))

        threads = [threading.Thread(target=restore, args=(p,)) for p in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == [(8 * B, True), (8 * B, True)]
        assert on[0] and on[1] and not on[0] & on[1]
        for toks in prompts:
            assert store.lookup(ns, toks).by_tier["host"] == 8 * B


def test_a_compressed_record_of_the_raw_length_goes_to_python_and_is_checked_there(tmp_path, ns) -> None:
    """A header that says zstd on a record exactly as long as a raw one: the native reader leaves its
    payload to Python's decoder, which refuses garbage (a miss), never serves it as raw KV."""
    from tierkv.tiers.disk.native_read import ST_PYTHON, read_run

    B = ns.block_tokens
    toks = list(range(2 * B))
    kv = make_kv(ns, 2 * B)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
        disk = store.tier("disk")
        chain = BlockChain.of(ns, toks)
        entries = disk.locate(chain.keys)
        seg_id, offset, nbytes = entries[1].location
    rec = bytearray(disk.segments.file(seg_id).read_bytes()[offset : offset + nbytes])
    fields = bytearray(rec[: codec.HEADER_NBYTES - 8])
    fields[6] = int(codec.Codec.ZSTD)
    check = xxhash.xxh3_64(bytes(fields))
    check.update(bytes(rec[codec.HEADER_NBYTES : codec.HEADER_NBYTES + 4 * B]))
    rec[: codec.HEADER_NBYTES] = bytes(fields) + check.intdigest().to_bytes(8, "little")
    with open(disk.segments.file(seg_id), "r+b") as f:
        f.seek(offset)
        f.write(rec)
    with native.use(True), TieredStore.open(tmp_path, host_bytes=0) as store:
        disk = store.tier("disk")
        out = torch.zeros_like(kv)
        status, _ = read_run(disk.segments, chain, [(0, entries[0], 0), (1, entries[1], 1)], out, set())
        assert status == [0, ST_PYTHON]
        hit, got = store.restore(ns, toks)
        assert hit.num_tokens == B and torch.equal(got, kv[:, :, :B])


def test_read_run_refuses_out_of_bounds_requests(tmp_path) -> None:
    """Checked with the GIL, before any thread reads: a record past the destination's rows, of another
    length than the layout's, at a negative position, or at the same position as another (one's bytes
    would lie where the other's were checked); keys or token ids for another number of records."""
    nat = native.module()
    out = np.zeros(4096, dtype=np.uint8)
    rows = np.array([out.ctypes.data], dtype=np.int64)
    prefix = bytearray(2 * (176 + 64))
    args = (rows, 1024, 4096, prefix, 64, b"\0" * 32, b"\0" * 32, b"\0" * 64, 0, (16,), 1, 0)
    two = (*args[:6], b"\0" * 64, b"\0" * 128, *args[8:])  # keys and token ids for two records
    fd = os.open(tmp_path / "seg", os.O_RDWR | os.O_CREAT, 0o600)
    size = 176 + 64 + 1024
    try:
        for pos, nbytes in [(4, size), (0, size - 1), (-1, size)]:
            reqs = np.array([[fd, fd, -1, 0, nbytes, pos]], dtype=np.int64)
            with pytest.raises(ValueError, match="out of bounds"):
                nat.read_run(reqs, *args)
        with pytest.raises(ValueError, match="inconsistent sizes"):  # keys for two records, one request
            nat.read_run(np.array([[fd, fd, -1, 0, size, 0]], dtype=np.int64), *two)
        with pytest.raises(ValueError, match="one position"):
            nat.read_run(
                np.array([[fd, fd, -1, 0, size, 1], [fd, fd, -1, 4096, size, 1]], dtype=np.int64), *two
            )
        # the same two at positions of their own pass the checks (and miss: the file is empty)
        status, _, _ = nat.read_run(
            np.array([[fd, fd, -1, 0, size, 0], [fd, fd, -1, 4096, size, 1]], dtype=np.int64), *two
        )
        assert len(status) == 2
    finally:
        os.close(fd)


def test_a_host_tier_restore_copies_natively_what_torch_copies(tmp_path, ns) -> None:
    """The host tier's native copy and its torch reference put the same bytes in place, into a whole
    destination and into a token-slice of a larger one (slabs contiguous, rows strided), from a first
    block past 0; and the native copy is what runs where it is built."""
    from tierkv.tiers import slot_copies

    B = ns.block_tokens
    toks = list(range(6 * B))
    kv = make_kv(ns, 6 * B)
    calls: list[int] = []
    real = slot_copies.copy_run

    def counting(dest, slots, first, spec):  # type: ignore[no-untyped-def]
        calls.append(len(slots))
        real(dest, slots, first, spec)

    got = {}
    for path in ("native", "python"):
        with native.use(path == "native"), TieredStore.open(tmp_path / path, host_bytes=64 << 20) as store:
            store.save(ns, toks, kv)
            slot_copies.copy_run = counting
            try:
                whole = torch.full_like(kv, -1)
                hit, _ = store.restore(ns, toks, out=whole, start_block=2)
                wide = torch.full(
                    (ns.num_layers, 2, 10 * B, ns.num_kv_heads, ns.head_dim), -1, dtype=kv.dtype
                )
                sliced = wide[:, :, 2 * B : 8 * B]
                hit2, _ = store.restore(ns, toks, out=sliced)
            finally:
                slot_copies.copy_run = real
            assert hit.by_tier["host"] == 4 * B and hit2.by_tier["host"] == 6 * B
            got[path] = (whole, wide)
        assert calls == ([4, 6] if path == "native" else []), (path, calls)
        calls.clear()
    assert torch.equal(got["native"][0], got["python"][0])
    assert torch.equal(got["native"][0][:, :, 2 * B :], kv[:, :, 2 * B :])
    assert torch.equal(got["native"][1], got["python"][1])
    assert torch.equal(got["native"][1][:, :, 2 * B : 8 * B], kv)
    assert (got["native"][1][:, :, : 2 * B] == -1).all() and (got["native"][1][:, :, 8 * B :] == -1).all()


def test_copy_blocks_refuses_positions_outside_the_slabs() -> None:
    nat = native.module()
    out = np.zeros(4096, dtype=np.uint8)
    src = np.ones(1024, dtype=np.uint8)
    rows = np.array([out.ctypes.data], dtype=np.int64)
    srcs = np.array([src.ctypes.data], dtype=np.int64)
    for pos in (4, -1, 2**62):
        with pytest.raises(ValueError):
            nat.copy_blocks(rows, 4096, 1024, srcs, np.array([pos], dtype=np.int64), 2, False)
    with pytest.raises(ValueError):  # a position for each block
        nat.copy_blocks(rows, 4096, 1024, srcs, np.array([0, 1], dtype=np.int64), 2, False)
    nat.copy_blocks(rows, 4096, 1024, srcs, np.array([3], dtype=np.int64), 2, False)
    assert out[3072:].all() and not out[:3072].any()
    out[1024:2048] = 7  # and back: position 1 gathered into the block
    nat.copy_blocks(rows, 4096, 1024, srcs, np.array([1], dtype=np.int64), 2, True)
    assert (src == 7).all()


@pytest.mark.parametrize("chunk", [64 << 10, (64 << 10) + 4])  # streamed; not 16-byte sized: memcpy
def test_copy_blocks_of_a_run_larger_than_the_caches_match_the_reference(chunk: int) -> None:
    """A run of 16 MiB or more is streamed into the slabs (not through the caches): same bytes, every
    block in place, nothing outside it touched."""
    nat = native.module()
    nrows, nblocks = 12, 24  # 12 x 24 x 64 KiB = 18 MiB
    rng = np.random.default_rng(0)
    slots = [rng.integers(0, 256, nrows * chunk, dtype=np.uint8) for _ in range(nblocks)]
    positions = rng.permutation(nblocks + 4)[:nblocks]  # scattered, some places left as they were
    slabs = [np.full((nblocks + 4) * chunk, 0xEE, dtype=np.uint8) for _ in range(nrows)]
    nat.copy_blocks(
        np.array([s.ctypes.data for s in slabs], dtype=np.int64),
        (nblocks + 4) * chunk,
        chunk,
        np.array([s.ctypes.data for s in slots], dtype=np.int64),
        positions.astype(np.int64),
        2,
        False,
    )
    want = [np.full((nblocks + 4) * chunk, 0xEE, dtype=np.uint8) for _ in range(nrows)]
    for slot, pos in zip(slots, positions):
        for r in range(nrows):
            want[r][pos * chunk : (pos + 1) * chunk] = slot[r * chunk : (r + 1) * chunk]
    for got, ref in zip(slabs, want):
        assert np.array_equal(got, ref)
    # And back (a save's copies, gathered from the slabs into the blocks), streamed as well.
    back = [np.zeros(nrows * chunk, dtype=np.uint8) for _ in range(nblocks)]
    nat.copy_blocks(
        np.array([s.ctypes.data for s in slabs], dtype=np.int64),
        (nblocks + 4) * chunk,
        chunk,
        np.array([b.ctypes.data for b in back], dtype=np.int64),
        positions.astype(np.int64),
        2,
        True,
    )
    for got, slot in zip(back, slots):
        assert np.array_equal(got, slot)


def test_the_native_writer_writes_the_python_writer_s_bytes(tmp_path, ns) -> None:
    B = ns.block_tokens
    toks = list(range(10 * B))
    kv = make_kv(ns, 10 * B)
    files = []
    for use_native in (False, True):
        path = tmp_path / f"native-{use_native}"
        with native.use(use_native), TieredStore.open(path, host_bytes=0, clock=lambda: 1000.0) as store:
            store.save(ns, toks, kv)
            store.flush()
        files.append(b"".join(p.read_bytes() for p in sorted((path / "segments").glob("*.seg"))))
        with native.use(not use_native), TieredStore.open(path, host_bytes=0) as store:  # the other reads it
            hit, got = store.restore(ns, toks)
            assert hit.num_tokens == 10 * B and torch.equal(got, kv)
    assert len(files[0]) >= 10 * 4096 and files[0] == files[1]


def _sealed_run(recs: list[codec.Unsealed]) -> bytes:
    """The Python reference of a run: each record sealed (``codec.seal``), padded to a page, back to back."""
    out = bytearray()
    for rec in recs:
        body = b"".join(bytes(b) for b in codec.seal(rec))
        out += body + bytes(-len(body) % 4096)
    return bytes(out)


@contextlib.contextmanager
def _segment_fds(path, direct: bool):
    """(a read-write descriptor of ``path``, created; its O_DIRECT one, or -1): closed after; the test is
    skipped where O_DIRECT is asked for and the file system refuses it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    dfd = -1
    try:
        if direct:
            try:
                dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                pytest.skip("this file system refuses O_DIRECT")
        yield fd, dfd
    finally:
        os.close(fd)
        if dfd >= 0:
            os.close(dfd)


def _head(version: int, rng=None) -> bytes:
    """A header's bytes to seal (random, or zeros), of record ``version`` (the writer lays a record out by
    it): its two checksums zero."""
    fields = bytearray(rng.randbytes(codec.HEADER_NBYTES - 16) if rng else bytes(codec.HEADER_NBYTES - 16))
    fields[4:6] = version.to_bytes(2, "little")
    return bytes(fields) + bytes(16)


def _mib_records(total_mib: int, payload_mib: int, seed: int) -> list[codec.Unsealed]:
    """Version-2 records of ``payload_mib`` MiB of random payload each, about ``total_mib`` MiB in all."""
    rng = np.random.default_rng(seed)
    return [
        codec.Unsealed(_head(2), os.urandom(64), rng.bytes(payload_mib << 20))
        for _ in range(total_mib // payload_mib)
    ]


def test_write_run_refuses_a_record_version_it_does_not_write(tmp_path) -> None:
    with _segment_fds(tmp_path / "run.seg", False) as (fd, _):
        for version in (0, 3):
            with pytest.raises(ValueError, match="record version"):
                native.module().write_run(fd, 0, [(_head(version), b"\1" * 64, b"\2" * 100)], 0, 0)
    assert (tmp_path / "run.seg").stat().st_size == 0


@pytest.mark.parametrize(
    ("sync", "direct", "idle"), [(0, False, 0), (1, False, 0), (1, True, 0), (0, True, 1)]
)
def test_write_run_in_many_chunks_writes_what_seal_writes(
    tmp_path, sync: int, direct: bool, idle: int
) -> None:
    """A run large enough for several chunks (by bytes, by the iovec limit: 300 small records, and one
    record larger than a chunk), sealed on several threads, is byte for byte the Python reference: each
    record sealed (codec.seal), padded to a page, back to back. With O_DIRECT, every write goes through the
    O_DIRECT descriptor from aligned images of at most 4 MiB: a record larger than one in pieces, its first
    (header and checksums) written last; one that fills one exactly in one write."""
    import random

    from tierkv.priority import native_idle

    if idle and not native_idle():
        pytest.skip("this process may not leave SCHED_IDLE")
    rng = random.Random(7)
    sizes = [rng.choice([4096, 40_000, 1 << 20, 3 << 20]) for _ in range(24)] + [100] * 300 + [9 << 20, 5]
    recs = [  # both record versions, mixed (version 2: zeros between token ids and payload)
        codec.Unsealed(_head(rng.randrange(1, 3), rng), os.urandom(64), os.urandom(n)) for n in sizes
    ]
    # and records near an image's 4 MiB, in both versions: filling one exactly (one write), ending on two
    # (in pieces, no zero tail), a page past one, 256 bytes past one; one 256 bytes over a chunk's 2 MiB
    lead = {1: codec.HEADER_NBYTES + 64, 2: codec.HEADER_NBYTES + 64 + 16}
    exact = [
        (2, (4 << 20) - lead[2]),
        (1, (8 << 20) - lead[1]),
        (1, (4 << 20) + 4096 - lead[1]),
        (2, 4 << 20),
        (2, 2 << 20),
    ]
    recs[-2:-2] = [codec.Unsealed(_head(v, rng), os.urandom(64), os.urandom(n)) for v, n in exact]
    assert {r.pad_nbytes for r in recs} == {0, 16}
    want = _sealed_run(recs)
    path = tmp_path / "run.seg"
    nat = native.module()
    with _segment_fds(path, direct) as (fd, dfd):
        nat.trace_writes(True)
        try:
            got = nat.write_run(fd, 4096, [(r.head, r.token_bytes, r.payload) for r in recs], sync, idle, dfd)
        finally:
            ops = nat.trace_writes(False)
        assert got == len(want)
    assert len(want) > 2 * (8 << 20)  # several chunks
    assert path.read_bytes()[4096:] == bytes(want)
    writes = [op for op in ops if op[0] == "write"]
    assert sum(n for *_, n in writes) == len(want)
    if direct:
        assert [efd for _, efd, _, _ in writes if efd == fd] == [] and max(n for *_, n in writes) <= 4 << 20
        lens = [-(-(codec.HEADER_NBYTES + 64 + r.pad_nbytes + len(r.payload)) // 4096) * 4096 for r in recs]
        assert sum(lens) == len(want)

        def pieces(j: int) -> list[tuple[int, int]]:  # record j's writes, in the order they were made
            at = 4096 + sum(lens[:j])
            return [(off - at, n) for _, _, off, n in writes if at <= off < at + lens[j]]

        first_exact = len(recs) - 2 - len(exact)
        assert pieces(first_exact) == [(0, 4 << 20)]  # fills an image: one write
        assert pieces(first_exact + 1) == [(4 << 20, 4 << 20), (0, 4 << 20)]  # two images, no zero tail
        for j in (first_exact + 2, first_exact + 3):  # a page past an image: that page, then the start
            assert pieces(j) == [(4 << 20, 4096), (0, 4 << 20)]
        assert pieces(first_exact + 4) == [(0, (2 << 20) + 4096)]  # a chunk of its own, in one image
        assert pieces(len(recs) - 2) == [(4 << 20, 4 << 20), (8 << 20, lens[-2] - (8 << 20)), (0, 4 << 20)]
    else:
        assert {efd for _, efd, _, _ in writes} == {fd}
    assert [op[0] for op in ops].count("sync") == sync
    # with O_DIRECT the run's space is allocated first, at once (its writes then run side by side)
    assert [op[1:] for op in ops if op[0] == "allocate"] == ([(fd, 4096, len(want))] if direct else [])


@pytest.mark.parametrize(
    ("skip", "fail", "sizes"),
    [(1, 1, [9 << 20]), (0, 1000, [9 << 20, 3 << 20, 40_000, 100, 100])],
    ids=["no-second-image-for-a-large-record", "no-image-at-all"],
)
def test_a_run_without_memory_for_its_images_is_written_buffered_and_whole(
    tmp_path, skip: int, fail: int, sizes: list[int]
) -> None:
    """write_run lays each chunk out in an aligned image for O_DIRECT, two for a record larger than one.
    Where an image cannot be had (no memory), that chunk is written buffered, in place, through the
    plain descriptor: the run is still byte for byte the Python reference."""
    import random

    rng = random.Random(11)
    recs = [codec.Unsealed(_head(2, rng), os.urandom(64), os.urandom(n)) for n in sizes]
    want = _sealed_run(recs)
    path = tmp_path / "run.seg"
    nat = native.module()
    with _segment_fds(path, True) as (fd, dfd):
        nat.trace_writes(True)
        nat.fail_images(skip, fail)
        try:
            got = nat.write_run(fd, 0, [(r.head, r.token_bytes, r.payload) for r in recs], 1, 0, dfd)
        finally:
            nat.fail_images(0, 0)
            ops = nat.trace_writes(False)
    assert got == len(want) and path.read_bytes() == want
    writes = [op for op in ops if op[0] == "write"]
    assert sum(n for *_, n in writes) == len(want)
    assert {efd for _, efd, _, _ in writes} == {fd}  # every chunk buffered: none through the O_DIRECT one
    assert [op[0] for op in ops].count("sync") == 1


@pytest.mark.parametrize("payload_mib", [1, 5], ids=["records", "records-larger-than-an-image"])
@pytest.mark.parametrize("direct", [False, True])
def test_a_failed_run_gives_its_space_back_and_a_retry_writes_it_whole(
    tmp_path, direct: bool, payload_mib: int
) -> None:
    """A write that fails in the middle of a run of several chunks (written side by side with O_DIRECT,
    a record larger than an image in pieces) fails the run with its errno; with O_DIRECT, the space the
    run allocated is given back (punched); the caller's retry at the same offset then writes every
    record, byte for byte."""
    import errno as errno_

    recs = _mib_records(24, payload_mib, seed=3)
    want = _sealed_run(recs)
    path = tmp_path / "run.seg"
    nat = native.module()
    batch = [(r.head, r.token_bytes, r.payload) for r in recs]
    with _segment_fds(path, direct) as (fd, dfd):
        st = os.fstat(fd)
        middle = 4096 + len(want) // 2  # in a chunk in the middle of the run
        nat.inject_fault(st.st_dev, st.st_ino, middle, middle + 1, errno_.ENOSPC, True)
        nat.trace_writes(True)
        try:
            with pytest.raises(OSError) as failed:
                nat.write_run(fd, 4096, batch, 1, 0, dfd)
        finally:
            ops = nat.trace_writes(False)
            nat.clear_faults()
        assert failed.value.errno == errno_.ENOSPC
        punched = [op[2:] for op in ops if op[0] == "punch"]
        assert punched == ([(4096, len(want))] if direct else [])
        if direct:
            assert os.fstat(fd).st_blocks * 512 < (1 << 20)  # what the failed run took is free again
        assert nat.write_run(fd, 4096, batch, 1, 0, dfd) == len(want)
    assert path.read_bytes()[4096:] == bytes(want)


def test_the_disk_writer_runs_python_at_nice_19_and_never_at_idle_priority(tmp_path, ns) -> None:
    """The writer thread's Python (here: encoding a record) runs at nice 19, and its records go through
    the native writer, which alone may go idle, without the GIL."""
    import threading

    from tierkv.tiers.base import BlockWrite

    seen: list[tuple[int, int]] = []
    B = ns.block_tokens
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        disk = store.tier("disk")
        nat = native.module()
        nat.trace_writes(True)
        try:
            for k in range(3):
                block = block_write(ns, list(range(k * 1000, k * 1000 + B)), make_kv(ns, B, seed=k))

                def spy(block: BlockWrite = block) -> codec.Unsealed:  # on the writer thread
                    tid = threading.get_native_id()
                    seen.append((os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)))
                    return block.unsealed()

                assert disk.put(ns.digest, block.key, spy, block.nbytes, 0.0, ns_spec=ns.spec_bytes)
                store.flush()
        finally:
            ops = nat.trace_writes(False)
        for k in range(3):
            hit, _ = store.restore(ns, list(range(k * 1000, k * 1000 + B)))
            assert hit.num_tokens == B
    assert len(seen) == 3 and all(policy == os.SCHED_OTHER and nice == 19 for policy, nice in seen)
    # each batch written natively; its sync is the writer thread's, in order (Writer._index_appended)
    assert [kind for kind, *_ in ops].count("write") >= 3 and "sync" not in [kind for kind, *_ in ops]


def test_write_run_at_idle_priority_comes_back_to_where_it_was(tmp_path) -> None:
    from tierkv.priority import native_idle

    if not native_idle():
        pytest.skip("this process may not leave SCHED_IDLE: the native writer does not go idle here")
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        native.module().write_run(fd, 0, [(_head(1), b"\1" * 64, b"\2" * 1000)], 1, 1)
    finally:
        os.close(fd)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, 0) == 0
    data = (tmp_path / "f").read_bytes()
    assert len(data) == 4096 and data[codec.HEADER_NBYTES : codec.HEADER_NBYTES + 64] == b"\1" * 64


@pytest.mark.parametrize("value", ["0", "false", "Off"])
def test_tierkv_native_off_in_words_turns_the_native_path_off_and_says_so(value: str) -> None:
    import subprocess
    import sys

    code = "from tierkv import native, priority; print(native.enabled(), native.describe(), priority.BACKGROUND_NICE)"
    env = {**os.environ, "TIERKV_NATIVE": value, "TIERKV_BACKGROUND_NICE": "lots"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr  # a bad nice value is a warning, not a crash at import
    assert r.stdout.strip() == f"False python (off by TIERKV_NATIVE={value}) 19"
    assert "TIERKV_BACKGROUND_NICE='lots' is not a nice value" in r.stderr


def test_o_direct_reads_beside_a_writer_appending_to_the_same_segment(tmp_path) -> None:
    """O_DIRECT reads of records in the segment a writer is still appending to (flushed records read
    while later ones are written behind them, the page cache dropped before each pass): every restore
    is the KV that was saved, bit for bit, and read from the disk, not from the page cache."""
    import threading
    import time

    n_tokens = 2 * BIG.block_tokens  # 4 MiB a prompt

    def toks(i: int) -> list[int]:
        return list(range(i * 100_000, i * 100_000 + n_tokens))

    kvs = {i: make_kv(BIG, n_tokens, seed=i) for i in range(20)}
    with TieredStore.open(tmp_path, host_bytes=0, direct_reads=True) as store:
        store.save(BIG, toks(0), kvs[0])
        store.flush()
        flushed = [0]

        def writer() -> None:
            for i in range(1, 20):
                store.save(BIG, toks(i), kvs[i])
                store.flush()
                flushed.append(i)

        t = threading.Thread(target=writer)
        t.start()
        checked = 0
        try:
            while t.is_alive() or checked < 4:
                uncache(tmp_path)
                for i in {0, *flushed[-2:]}:
                    hit, got = store.restore(BIG, toks(i))
                    assert hit.num_tokens == n_tokens and got is not None and torch.equal(got, kvs[i]), i
                    checked += 1
                time.sleep(0.001)
        finally:
            t.join(60)
        segments = {p.name for p in tmp_path.glob("**/*.seg")}
        assert checked >= 4 and store.stats()["disk"]["read_direct_nbytes"] > 0, (checked, segments)


@pytest.mark.parametrize("err", ["EINVAL", "EOPNOTSUPP"])
def test_o_direct_refused_after_open_is_read_and_written_buffered(tmp_path, ns, err: str) -> None:
    """A file system that opens a file O_DIRECT and then refuses the reads or writes through it (EINVAL from
    Linux's own, EOPNOTSUPP from some FUSE and network ones; injected here on the O_DIRECT descriptors
    only): the native writer writes buffered and loses nothing, the native reader reads buffered and
    serves the same KV."""
    import errno as errno_

    code = getattr(errno_, err)
    nat = native.module()
    B = ns.block_tokens
    prompts = [list(range(p * 1000, p * 1000 + 8 * B)) for p in range(3)]
    kvs = [make_kv(ns, 8 * B, seed=p) for p in range(3)]
    kwargs = {"host_bytes": 0, "direct_reads": True, "direct_writes": True}
    try:
        with TieredStore.open(tmp_path, **kwargs) as store:
            store.save(ns, prompts[0], kvs[0])
            store.flush()  # the segment exists now: its O_DIRECT writes refuse from here on
            (seg,) = sorted(tmp_path.glob("segments/*.seg"))
            st = os.stat(seg)
            nat.inject_fault(st.st_dev, st.st_ino, 0, 1 << 40, code, 1 | 2)  # writes, O_DIRECT only
            for toks, kv in zip(prompts[1:], kvs[1:]):
                store.save(ns, toks, kv)
            store.flush()
            disk = store.stats()["disk"]
            assert disk["blocks_written"] == 3 * 8 and disk["write_errors"] == disk["dropped_saves"] == 0
        nat.inject_fault(st.st_dev, st.st_ino, 0, 1 << 40, code, 2)  # and its O_DIRECT reads
        got, stats = _restore(tmp_path, ns, prompts, use_native=True, direct=True)
    finally:
        nat.clear_faults()
    for (n, kv), want in zip(got, kvs):
        assert n == 8 * B and kv is not None and torch.equal(kv, want)
    assert stats["read_direct_nbytes"] == 0 and stats["read_blocking_nbytes"] > 0  # read buffered
    # Without the faults, the same cold reads go through O_DIRECT (the fault is what made them buffered).
    again, stats = _restore(tmp_path, ns, prompts, use_native=True, direct=True)
    assert [n for n, _ in again] == [8 * B] * 3 and stats["read_direct_nbytes"] > 0


@pytest.mark.parametrize("payload_mib", [1, 5], ids=["records", "records-larger-than-an-image"])
@pytest.mark.parametrize("err", ["EINVAL", "EOPNOTSUPP"])
def test_a_run_whose_o_direct_writes_are_refused_is_written_buffered_then_synced(
    tmp_path, err: str, payload_mib: int
) -> None:
    """The writer's side of a refusal, one run: every chunk's O_DIRECT write is refused (injected on the
    O_DIRECT descriptor only), so each is written through the buffered descriptor instead (a record
    larger than an image too, piece by piece), and the run's sync comes after them all; the file holds
    the run byte for byte."""
    import errno as errno_

    recs = _mib_records(20, payload_mib, seed=5)
    want = _sealed_run(recs)
    path = tmp_path / "run.seg"
    nat = native.module()
    with _segment_fds(path, True) as (fd, dfd):
        st = os.fstat(fd)
        nat.inject_fault(st.st_dev, st.st_ino, 0, 1 << 40, getattr(errno_, err), 1 | 2)
        nat.trace_writes(True)
        try:
            assert nat.write_run(
                fd, 4096, [(r.head, r.token_bytes, r.payload) for r in recs], 1, 0, dfd
            ) == len(want)
        finally:
            ops = nat.trace_writes(False)
            nat.clear_faults()
    writes = [op for op in ops if op[0] == "write"]
    assert writes and {op[1] for op in writes} == {fd}  # none through the O_DIRECT descriptor
    assert sum(op[3] for op in writes) == len(want)
    kinds = [op[0] for op in ops]
    assert kinds.count("sync") == 1 and kinds.index("sync") > max(
        i for i, k in enumerate(kinds) if k == "write"
    )
    assert path.read_bytes()[4096:] == bytes(want)


@pytest.mark.parametrize("direct", [False, True])
def test_write_run_refuses_a_footprint_other_than_the_reserved_one_before_any_write(tmp_path, direct) -> None:
    """The writer reserves a run's file range and may write the next run right after it: a run whose records
    would take more (or less) than was reserved is refused before its first byte reaches the file."""
    recs = [codec.Unsealed(_head(2), os.urandom(64), os.urandom(n)) for n in (5000, 70_000)]
    want = _sealed_run(recs)
    batch = [(r.head, r.token_bytes, r.payload) for r in recs]
    path = tmp_path / "run.seg"
    nat = native.module()
    with _segment_fds(path, direct) as (fd, dfd):
        os.pwrite(fd, b"\xee" * 3 * 4096, 4096 + len(want))  # the next run's bytes, past the range
        before = path.read_bytes()
        for wrong in (len(want) - 4096, len(want) + 4096):
            nat.trace_writes(True)
            try:
                with pytest.raises(ValueError, match="reserved"):
                    nat.write_run(fd, 4096, batch, 1, 0, dfd, wrong)
            finally:
                ops = nat.trace_writes(False)
            assert ops == [] and path.read_bytes() == before
        # the right one writes; with sync 2 the fdatasync is left to the caller
        nat.trace_writes(True)
        try:
            assert nat.write_run(fd, 4096, batch, 2, 0, dfd, len(want)) == len(want)
        finally:
            ops = nat.trace_writes(False)
        assert "sync" not in [op[0] for op in ops]
        assert path.read_bytes()[4096 : 4096 + len(want)] == bytes(want)
        assert path.read_bytes()[4096 + len(want) :] == b"\xee" * 3 * 4096  # the next run's, untouched
        with pytest.raises(ValueError, match="sync"):
            nat.write_run(fd, 4096, batch, 3, 0, dfd, len(want))


def test_an_o_direct_read_after_a_buffered_one_stays_o_direct_and_leaves_the_page_cache_as_it_was(
    tmp_path,
) -> None:
    """A buffered restore leaves readahead's pages (and its marks) past its prompt. An O_DIRECT restore of
    the prompt saved next reads that cached part from the page cache, without readahead, and the rest
    with O_DIRECT: reading the marked pages through a descriptor with readahead started readahead of the
    next window, and the run (and every run after it) was read buffered, the page cache growing by each."""
    from tierkv.bench.machine import _resident_nbytes
    from tierkv.tiers.disk.files import has_cachestat

    if not has_cachestat():
        pytest.skip("no cachestat(2) here (before Linux 6.5, or refused): a run's residency is not known")
    B = BIG.block_tokens
    first, second = list(range(24 * B)), [10**6 + t for t in range(24 * B)]
    kvs = [make_kv(BIG, 24 * B, seed=s) for s in (7, 8)]
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        for toks, kv in zip((first, second), kvs):
            store.save(BIG, toks, kv)
        store.flush()
        if not store._durable().segments.direct_ok:
            pytest.skip("this file system refuses O_DIRECT")
    (seg,) = sorted(tmp_path.glob("**/*.seg"))

    def resident() -> int:
        fd = os.open(seg, os.O_RDONLY)
        try:
            return _resident_nbytes(fd) or 0
        finally:
            os.close(fd)

    uncache(tmp_path)
    with native.use(True), TieredStore.open(tmp_path, host_bytes=0, direct_reads=False) as store:
        assert store.restore(BIG, first)[0].num_tokens == len(first)
    before = resident()
    with native.use(True), TieredStore.open(tmp_path, host_bytes=0, direct_reads=True) as store:
        hit, got = store.restore(BIG, second)
        stats = store.stats()["disk"]
    assert hit.num_tokens == len(second) and torch.equal(got, kvs[1])
    assert stats["read_direct_nbytes"] >= 12 * (2 << 20)  # at least half of the 48 MiB past readahead's
    assert stats["read_cached_nbytes"] + stats["read_direct_nbytes"] >= 24 * (2 << 20)
    assert resident() == before
