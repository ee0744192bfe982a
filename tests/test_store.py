import dataclasses

import pytest
import torch

from tierkv import ConfigError, Namespace, TieredStore
from tierkv.keys import block_keys

from helpers import make_kv


def test_quickstart(tmp_path) -> None:
    ns = Namespace(
        model_id="my-model",
        revision="abc123",
        dtype="float16",
        num_layers=8,
        num_kv_heads=4,
        head_dim=64,
        block_tokens=64,
    )
    token_ids = list(range(300))
    kv = make_kv(ns, 300)
    with TieredStore.open(tmp_path / "cache", host_bytes=2**30, disk_bytes=20 * 2**30, ttl_s=86400) as store:
        store.save(ns, token_ids, kv)
        hit = store.lookup(ns, token_ids)
        assert hit.num_tokens == 256 and hit.by_tier == {"host": 256, "disk": 0}
        num_tokens, kv_prefix = store.load(ns, token_ids)
        assert num_tokens == 256 and torch.equal(kv_prefix, kv[:, :, :256])
        store.flush()
    with TieredStore.open(tmp_path / "cache", host_bytes=2**30) as store:
        hit = store.lookup(ns, token_ids)
        assert hit.by_tier == {"host": 0, "disk": 256}
        num_tokens, kv_prefix = store.load(ns, token_ids)
        assert num_tokens == 256 and torch.equal(kv_prefix, kv[:, :, :256])
        assert store.lookup(ns, token_ids).by_tier == {"host": 256, "disk": 0}  # promoted


def test_partial_prefix_and_divergence(tmp_path, ns) -> None:
    toks = list(range(80))
    kv = make_kv(ns, 80)
    with TieredStore.open(tmp_path, host_bytes=2**20) as store:
        assert store.save(ns, toks, kv) == 5
        other = toks[:40] + [9999] + toks[41:]
        assert store.lookup(ns, other).num_tokens == 32
        n, got = store.load(ns, other + [1, 2, 3])
        assert n == 32 and torch.equal(got, kv[:, :, :32])
        assert store.load(ns, [7] + toks[1:]) == (0, None)
        assert store.lookup(ns, toks[:15]).num_tokens == 0


def test_blocks_evicted_from_host_come_from_disk(tmp_path, ns) -> None:
    toks = list(range(160))
    kv = make_kv(ns, 160)
    block_nbytes = kv[:, :, :16].numel() * 2
    with TieredStore.open(tmp_path, host_bytes=3 * block_nbytes) as store:
        store.save(ns, toks, kv)
        store.flush()
        hit = store.lookup(ns, toks)
        assert hit.num_tokens == 160 and hit.by_tier["host"] == 3 * 16 and hit.by_tier["disk"] == 7 * 16
        hit, got = store.restore(ns, toks)
        assert torch.equal(got, kv)


def test_out_buffer_is_filled_in_place(tmp_path, ns) -> None:
    toks = list(range(64))
    kv = make_kv(ns, 64)
    out = torch.zeros(ns.num_layers, 2, 100, ns.num_kv_heads, ns.head_dim, dtype=torch.float16)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
        n, got = store.load(ns, toks, out=out)
    assert n == 64 and got.data_ptr() == out.data_ptr() and torch.equal(out[:, :, :64], kv)


def test_namespaces_are_isolated(tmp_path, ns) -> None:
    toks = list(range(64))
    with TieredStore.open(tmp_path, host_bytes=2**20) as store:
        store.save(ns, toks, make_kv(ns, 64))
        store.flush()
        for other in (
            dataclasses.replace(ns, tenant_salt="b"),
            dataclasses.replace(ns, revision="r2"),
            dataclasses.replace(ns, block_tokens=32),
        ):
            assert store.lookup(other, toks).num_tokens == 0
            assert store.load(other, toks) == (0, None)


def test_host_only_store(ns) -> None:
    toks = list(range(32))
    kv = make_kv(ns, 32)
    with TieredStore.open(None, host_bytes=2**20) as store:
        store.save(ns, toks, kv)
        n, got = store.load(ns, toks)
        assert n == 32 and torch.equal(got, kv)


def test_bad_kv_shape_or_dtype_is_a_config_error(tmp_path, ns) -> None:
    with TieredStore.open(tmp_path, host_bytes=2**20) as store:
        with pytest.raises(ConfigError):
            store.save(ns, list(range(32)), make_kv(ns, 16))
        with pytest.raises(ConfigError):
            store.save(ns, list(range(32)), make_kv(ns, 32).float())


def test_stats_count_hits_per_tier(tmp_path, ns) -> None:
    toks = list(range(64))
    with TieredStore.open(tmp_path, host_bytes=2**20) as store:
        store.save(ns, toks, make_kv(ns, 64))
        store.flush()
        store.load(ns, toks)
        s = store.stats()
    assert s["host"]["hit_tokens"] == 64 and s["host"]["hit_blocks"] == 4
    assert s["disk"]["blocks_written"] == 4 and s["disk"]["live_nbytes"] > 0


def test_corrupt_disk_block_cuts_prefix_and_is_purged(tmp_path, ns) -> None:
    toks = list(range(64))
    kv = make_kv(ns, 64)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
        entries = sorted(store.tier("disk").iter_entries(), key=lambda ke: ke[1].offset)
    seg = tmp_path / "segments" / f"{entries[2][1].seg_id:010d}.seg"
    data = bytearray(seg.read_bytes())
    data[entries[2][1].offset + entries[2][1].nbytes - 5] ^= 0xFF  # one payload byte of block 2
    seg.write_bytes(bytes(data))
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        n, got = store.load(ns, toks)
        assert n == 32 and torch.equal(got, kv[:, :, :32])
        store.flush()
        assert store.stats()["disk"]["corrupt_blocks"] == 1
        assert store.lookup(ns, toks).num_tokens == 32  # purged, not served again


@pytest.mark.parametrize("codec_", ["zstd", "zstd_shuffle"])
def test_compressed_records_roundtrip_through_disk(tmp_path, ns, codec_: str) -> None:
    toks = list(range(64))
    kv = make_kv(ns, 64)
    with TieredStore.open(tmp_path, host_bytes=0, codec_=codec_) as store:
        store.save(ns, toks, kv)
        store.flush()
    with TieredStore.open(tmp_path, host_bytes=0) as store:  # reads whatever codec each record says
        n, got = store.load(ns, toks)
    assert n == 64 and torch.equal(got, kv)


def test_a_writer_that_falls_behind_never_starves_the_host_tier(tmp_path, ns, monkeypatch) -> None:
    """Writers hold at most half the host slots; past that they get their own copy, so the newest blocks
    still enter the host tier while the disk writer is stalled, and nothing is lost once it resumes."""
    import threading

    gate = threading.Event()
    toks = list(range(16 * 12))  # 12 blocks
    kv = make_kv(ns, 16 * 12, seed=2)
    block_nbytes = kv[:, :, :16].numel() * 2
    with TieredStore.open(tmp_path, host_bytes=8 * block_nbytes) as store:
        write_batch = store.tier("disk").writer._write_batch
        monkeypatch.setattr(
            store.tier("disk").writer, "_write_batch", lambda items: (gate.wait(10), write_batch(items))
        )
        for k in range(1, 13):  # one block per request, as a server saves them
            store.save(ns, toks[: 16 * k], kv[:, :, : 16 * k], start_block=k - 1)
        in_host = store.tier("host").contains(block_keys(ns, toks))
        assert in_host[-4:] == [True] * 4  # the newest blocks are in RAM although the writer is stuck
        assert sum(in_host) == 8 and store.tier("host")._held <= 4
        gate.set()
        store.flush()
        assert store.tier("host")._held == 0
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        hit, got = store.restore(ns, toks)
        assert hit.by_tier["disk"] == 16 * 12 and torch.equal(got, kv)


def test_blocks_for_another_device_are_copied_one_run_at_a_time() -> None:
    from tierkv.spread import blocks_on as _blocks_on

    B = 4
    dest = (
        torch.arange(10 * B, dtype=torch.float32).view(1, 1, 10 * B, 1, 1).expand(2, 2, -1, 1, 1).contiguous()
    )
    idx = [0, 1, 2, 5, 6, 9]
    got = list(_blocks_on(torch.device("meta"), dest, idx, B))
    assert [i for i, _ in got] == idx and all(b.shape == (2, 2, B, 1, 1) and b.is_meta for _, b in got)
    parts = [b._base for _, b in got]  # the copied run each block is a view of
    assert [len({id(p) for p in parts[a:b]}) for a, b in ((0, 3), (3, 5), (5, 6))] == [1, 1, 1]
    assert len({id(p) for p in parts}) == 3  # one copy per run of consecutive blocks: 0-2, 5-6, 9
    assert [p.shape[2] for p in (parts[0], parts[3], parts[5])] == [3 * B, 2 * B, B]
    same = list(_blocks_on(dest.device, dest, idx, B))
    assert all(torch.equal(b, dest[:, :, i * B : (i + 1) * B]) for i, b in same)


@pytest.mark.parametrize("host_bytes", [2**20, 0], ids=["host", "disk"])
def test_restore_from_start_block_reads_only_the_blocks_after_it(tmp_path, ns, host_bytes) -> None:
    """An engine that holds blocks 0..1 itself asks for the rest: those two are neither probed nor read
    (here the store does not even have them), and its rows for them are left alone."""
    toks = list(range(96))  # 6 blocks of 16
    kv = make_kv(ns, 96)
    with TieredStore.open(tmp_path, host_bytes=host_bytes) as store:
        assert store.save(ns, toks, kv, start_block=2) == 4
        store.flush()
        assert store.load(ns, toks) == (0, None)  # block 0 is not cached: from 0, a miss
        out = torch.full((ns.num_layers, 2, 96, ns.num_kv_heads, ns.head_dim), 7.0, dtype=torch.float16)
        hit, got = store.restore(ns, toks, out=out, start_block=2)
        tier = "host" if host_bytes else "disk"
        assert hit.num_blocks == 6 and hit.num_tokens == 96 and hit.by_tier[tier] == 64
        assert got is not None and got.data_ptr() == out.data_ptr()
        assert torch.equal(out[:, :, 32:], kv[:, :, 32:]) and bool((out[:, :, :32] == 7).all())
        assert store.stats()[tier]["hit_blocks"] == 4
        hit, got = store.restore(ns, toks, out=out, start_block=6)  # the caller holds them all
        assert hit.num_blocks == 0 and got is None
        store.save(ns, toks[:32] + [5] * 64, make_kv(ns, 96), start_block=2)  # another suffix
        hit, _ = store.restore(ns, toks[:32] + [9] * 64, out=out, start_block=2)
        assert hit.num_blocks == 0  # nothing cached from block 2 of this prompt: a miss
        with pytest.raises(ConfigError, match="start_block"):
            store.restore(ns, toks, out=out, start_block=7)
        with pytest.raises(ConfigError, match="needs out"):  # rows 0..31 would be garbage
            store.restore(ns, toks, start_block=2)


def test_blocks_the_caller_holds_are_kept_recent_by_its_restores(ns) -> None:
    """An engine that keeps a shared prefix in its own cache restores from past it every time: the store's
    copies of that prefix must stay alive (LRU here; the disk's sliding TTL alike) or they would be the
    first evicted, and every chain under the prefix lost with them."""
    block_nbytes = make_kv(ns, 16).numel() * 2
    a, b, c = list(range(96)), [7] * 32, [8] * 32  # 6, 2 and 2 blocks
    with TieredStore.open(None, host_bytes=8 * block_nbytes) as store:  # host only: its LRU decides
        store.save(ns, a, make_kv(ns, 96))
        store.save(ns, b, make_kv(ns, 32))  # the host tier is full: a0..a5, b0, b1
        out = torch.empty(ns.num_layers, 2, 96, ns.num_kv_heads, ns.head_dim, dtype=torch.float16)
        hit, _ = store.restore(ns, a, out=out, start_block=2)  # the caller holds a0, a1
        assert hit.num_blocks == 6
        store.save(ns, c, make_kv(ns, 32))  # evicts the two least recent blocks
        assert store.lookup(ns, a).num_blocks == 6 and store.lookup(ns, b).num_blocks == 0
