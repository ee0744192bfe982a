"""Record versions on disk: a new store writes version 2 (the payload 64-byte aligned in the record); a store
an older build wrote (format 2, committed as is) is read, extended and written in version 1 until an
operator upgrades it, then takes version 2; one prefix of both versions restores exactly, on both data
paths, buffered and with O_DIRECT."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tierkv import Namespace, TieredStore, codec, native
from tierkv.cli import main
from tierkv.keys import BlockChain

from helpers import block_write, make_kv, uncache

FIXTURES = Path(__file__).parent / "fixtures"
HOLD = "import sys; from tierkv import TieredStore\nwith TieredStore.open(sys.argv[1], host_bytes=0):\n    print('open', flush=True); sys.stdin.read()"


def _versions(path: Path, ns: Namespace, toks: list[int]) -> list[int]:
    """Each stored block's record version, and check that its payload starts where that version says."""
    with TieredStore.open(path, host_bytes=0) as store:
        entries = store.tier("disk").locate(BlockChain.of(ns, toks).keys)
        files = {e.seg_id: store.tier("disk").segments.file(e.seg_id) for e in entries}
    out = []
    for e in entries:
        with open(files[e.seg_id], "rb") as f:
            f.seek(e.offset)
            rec = f.read(e.nbytes)
        header, _, payload = codec.decode_header(rec)
        assert e.nbytes - payload.nbytes == codec.payload_at(header.version, 4 * ns.block_tokens)
        out.append(header.version)
    return out


def _restores_exactly(path: Path, ns: Namespace, toks: list[int], kv: torch.Tensor) -> None:
    paths = [(False, False)] + ([(True, False), (True, True)] if native.enabled() else [])
    for use_native, direct in paths:
        uncache(path)
        with native.use(use_native), TieredStore.open(path, host_bytes=0, direct_reads=direct) as store:
            hit, got = store.restore(ns, toks)
            assert hit.num_tokens == len(toks), (use_native, direct)
            assert torch.equal(got, kv), (use_native, direct)
            assert store.stats()["disk"]["corrupt_blocks"] == 0


def _format_of(path: Path) -> int:
    with TieredStore.open(path, host_bytes=0) as store:
        return store.tier("disk").format_version()


def test_a_new_store_writes_records_whose_payload_is_64_byte_aligned(tmp_path, ns) -> None:
    toks = list(range(4 * ns.block_tokens))
    kv = make_kv(ns, len(toks), seed=1)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
    assert _format_of(tmp_path) == 3
    assert _versions(tmp_path, ns, toks) == [2] * 4
    assert codec.payload_at(2, 4 * ns.block_tokens) % 64 == 0 != codec.payload_at(1, 4 * ns.block_tokens) % 64
    _restores_exactly(tmp_path, ns, toks, kv)


def test_a_store_of_format_2_keeps_version_1_records_until_upgraded_and_serves_both(
    tmp_path, ns, monkeypatch
) -> None:
    """The fixture was written by the previous build (3fc9972): prompts 0..63 and 100..131."""
    path = tmp_path / "old"
    path.mkdir()
    with tarfile.open(FIXTURES / "store-format-2.tar.gz") as tar:
        tar.extractall(path, filter="data")
    old = list(range(64))
    assert _format_of(path) == 2
    r = CliRunner().invoke(main, ["stats", "--cache-dir", str(path)])
    assert "format 2 (`tierkv gc --upgrade` makes it 3" in r.output, r.output
    _restores_exactly(path, ns, old, make_kv(ns, 64, seed=3))
    _restores_exactly(path, ns, list(range(100, 132)), make_kv(ns, 32, seed=4))

    # Extended by this build: older builds may still share the store, so its new blocks stay version 1.
    longer = old + list(range(5000, 5032))
    kv = torch.cat([make_kv(ns, 64, seed=3), make_kv(ns, 32, seed=5)], dim=2)
    with TieredStore.open(path, host_bytes=0) as store:
        store.save(ns, longer, kv, start_block=4)
        store.flush()
    assert _format_of(path) == 2
    assert _versions(path, ns, longer) == [1] * 6

    import tierkv.archive.export as export

    read, real = [], export.read_parents  # a format-2 store has its parents rows: no record is read
    monkeypatch.setattr(
        export, "read_parents", lambda disk, entries: (read.extend(entries), real(disk, entries))[1]
    )
    r = CliRunner().invoke(main, ["gc", "--upgrade", "--ttl", "3650d", "--cache-dir", str(path)])
    assert r.exit_code == 0, r.output
    assert "upgraded from format 2 to 3" in r.output and "indexed for 0 blocks" in r.output and read == []
    assert _format_of(path) == 3

    # After the upgrade, new blocks are version 2; one prefix of both versions restores exactly.
    longest = longer + list(range(7000, 7032))
    kv = torch.cat([kv, make_kv(ns, 32, seed=6)], dim=2)
    with TieredStore.open(path, host_bytes=0) as store:
        store.save(ns, longest, kv, start_block=6)
        store.flush()
    assert _versions(path, ns, longest) == [1] * 6 + [2] * 2
    _restores_exactly(path, ns, longest, kv)


def test_version_2_records_round_trip_and_convert(ns) -> None:
    chain = BlockChain.of(ns, list(range(ns.block_tokens)))
    kv = make_kv(ns, ns.block_tokens, seed=2)
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    args = dict(
        ns_digest=ns.digest,
        parent_key=chain.parent(0),
        key=chain.keys[0],
        token_bytes=chain.tokens(0),
        dtype=ns.dtype,
        shape=tuple(kv.shape),
        payload=payload,
        created_s=1.0,
    )
    v1, v2 = codec.encode(**args), codec.encode(**args, version=2)
    assert len(v2) == codec.payload_at(2, len(chain.tokens(0))) + len(payload) == len(v1) + 16
    assert v2[len(v2) - len(payload) :] == payload and v2[240:256] == bytes(16)
    for rec, version in ((v1, 1), (v2, 2)):
        header, got = codec.decode_record(
            rec, codec.Expected(ns.digest, chain.keys[0], chain.tokens(0), ns.dtype, tuple(kv.shape))
        )
        assert header.version == version and bytes(got) == payload
    # unseal into the other version, sealed again: exactly what encoding in that version gives
    h1, h2 = codec.decode_header(v1)[0], codec.decode_header(v2)[0]
    assert b"".join(bytes(b) for b in codec.seal(codec.unseal(v1, h1, 2))) == v2
    assert b"".join(bytes(b) for b in codec.seal(codec.unseal(v2, h2, 1))) == v1
    assert b"".join(bytes(b) for b in codec.seal(codec.unseal(v2, h2))) == v2
    # a version-2 record cut to version 1's length (or marked 1) is refused, not misread
    with pytest.raises(codec.RecordError):
        codec.decode_header(v2[:240] + v2[256:])
    relabelled = bytearray(v1)
    relabelled[4] = 3
    with pytest.raises(codec.RecordError, match="version 3"):
        codec.decode_header(bytes(relabelled))
    with pytest.raises(ValueError):
        codec.encode(**args, version=3)


def _mark_format(path: Path, version: int) -> None:
    import lmdb

    env = lmdb.open(str(path / "index"), max_dbs=16, subdir=True)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"format_version", str(version).encode(), db=env.open_db(b"meta", txn=txn))
    finally:
        env.close()


def test_a_compressed_record_of_a_raw_ones_length_is_read_whole_and_served(tmp_path) -> None:
    """A version-1 zstd record whose length is a raw version-2 record's (17 token ids end 12 bytes short of
    a 64-byte boundary; zstd frames 69,632 incompressible bytes in 12 more) is read in place by that
    layout, its first bytes into the padding's sink: it must be read again whole, not purged."""
    ns = Namespace(
        model_id="m",
        revision="r",
        dtype="float16",
        num_layers=2,
        num_kv_heads=8,
        head_dim=64,
        block_tokens=17,
    )
    toks = list(range(3 * 17))
    kv = torch.randint(0, 256, (3 * 69632,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    kv = kv.view(torch.float16).reshape(2, 2, 8, 3 * 17, 64).permute(0, 1, 3, 2, 4).contiguous()
    with TieredStore.open(tmp_path, host_bytes=0):
        pass
    _mark_format(tmp_path, 2)  # as an older build's store: records of version 1
    with TieredStore.open(tmp_path, host_bytes=0, codec_="zstd") as store:
        store.save(ns, toks, kv)
        store.flush()
        entries = store.tier("disk").locate(BlockChain.of(ns, toks).keys)
    assert (
        {e.nbytes for e in entries} == {codec.payload_at(2, 68) + 69632} != {codec.payload_at(1, 68) + 69632}
    )
    assert _versions(tmp_path, ns, toks) == [1] * 3
    for use_native in (False, True) if native.enabled() else (False,):
        with native.use(use_native), TieredStore.open(tmp_path, host_bytes=0) as store:
            hit, got = store.restore(ns, toks)
            assert hit.num_tokens == len(toks) and torch.equal(got.view(torch.int16), kv.view(torch.int16))
            assert store.stats()["disk"]["corrupt_blocks"] == 0


def test_archives_carry_version_1_and_an_import_lays_records_out_as_its_store_takes(tmp_path, ns) -> None:
    """An export from a format-3 store is readable by older builds (records of version 1); an import
    writes each record in the version its store takes."""
    from tierkv.archive.frames import FRAME_HEAD_NBYTES, Kind

    toks = list(range(4 * ns.block_tokens))
    kv = make_kv(ns, len(toks), seed=7)
    with TieredStore.open(tmp_path / "src", host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
    assert _versions(tmp_path / "src", ns, toks) == [2] * 4
    archive = tmp_path / "a.tkv"
    r = CliRunner().invoke(main, ["export", "--cache-dir", str(tmp_path / "src"), str(archive)])
    assert r.exit_code == 0, r.output
    data, pos, versions = archive.read_bytes(), 16, []
    while pos < len(data):
        kind, nbytes = data[pos + 4], int.from_bytes(data[pos + 8 : pos + 16], "little")
        if kind == Kind.RECORD:
            body = data[pos + FRAME_HEAD_NBYTES : pos + FRAME_HEAD_NBYTES + nbytes]
            versions.append(codec.decode_header(body)[0].version)
        pos += FRAME_HEAD_NBYTES + nbytes
    assert versions == [1] * 4
    with TieredStore.open(tmp_path / "old", host_bytes=0):
        pass
    _mark_format(tmp_path / "old", 2)
    for dst, want in (("new", 2), ("old", 1)):
        r = CliRunner().invoke(main, ["import", "--cache-dir", str(tmp_path / dst), str(archive)])
        assert r.exit_code == 0, r.output
        assert _versions(tmp_path / dst, ns, toks) == [want] * 4
        _restores_exactly(tmp_path / dst, ns, toks, kv)


def test_an_upgrade_waits_for_the_store_to_be_its_own(tmp_path, ns) -> None:
    """Another process with the store open may be an older build: the upgrade is refused, nothing marked."""
    with TieredStore.open(tmp_path, host_bytes=0):
        pass
    _mark_format(tmp_path, 2)
    holder = subprocess.Popen(  # a server, say, of this build or an older one
        [sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        r = CliRunner().invoke(main, ["gc", "--upgrade", "--cache-dir", str(tmp_path)])
        assert r.exit_code == 2 and "other processes have this store open" in r.output
    finally:
        holder.communicate("", timeout=60)
    assert _format_of(tmp_path) == 2
    r = CliRunner().invoke(main, ["gc", "--upgrade", "--dry-run", "--cache-dir", str(tmp_path)])
    assert r.exit_code == 0 and "format 2: would be upgraded to 3" in r.output and _format_of(tmp_path) == 2
    r = CliRunner().invoke(main, ["gc", "--upgrade", "--cache-dir", str(tmp_path)])
    assert r.exit_code == 0 and _format_of(tmp_path) == 3
    r = CliRunner().invoke(main, ["gc", "--upgrade", "--cache-dir", str(tmp_path)])
    assert r.exit_code == 0 and "format 3: already the newest" in r.output


@pytest.mark.parametrize("block_tokens", [16, 17, 64])
def test_a_block_write_s_size_bounds_its_record_in_every_version(block_tokens: int) -> None:
    """The writer queues count a block at ``BlockWrite.nbytes``: never less than its record, whichever
    version the store writes (version 2 pads its token ids to 64 bytes)."""
    ns = Namespace(
        model_id="m", revision="r", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
        block_tokens=block_tokens,
    )  # fmt: skip
    block = block_write(ns, list(range(block_tokens)), make_kv(ns, block_tokens))
    sizes = {v: sum(memoryview(b).nbytes for b in block.encode(v)) for v in codec.RECORD_VERSIONS}
    assert block.nbytes == max(sizes.values()) >= min(sizes.values())
