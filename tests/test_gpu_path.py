"""The GPU path (issue 6): GPU tier, staging ring inside the store, pipelined restores, NVML telemetry.

On CPU every class runs through the same code with device ``cpu`` (a "gpu" tier in RAM, the ring with
synchronous copies, the chunked staging-and-upload restore into a tensor records cannot be scattered into).
The tests marked ``gpu`` repeat the essential ones on CUDA; they are skipped without it.
"""

import dataclasses

import pytest
import torch

from tierkv import TieredStore
from tierkv.layout import KVSpec
from tierkv.telemetry import gpu_telemetry
from tierkv.tiers import target as store_mod
from tierkv.tiers.gpu import gpu_budget_nbytes
from tierkv.worker import CachedModel

from helpers import make_kv
from test_worker import assert_close, prompt, tiny_model

CUDA = torch.cuda.is_available()


def open_store(path, *, gpu_nbytes: int = 0, device: str = "cpu", **kw) -> TieredStore:
    store = TieredStore.open(path, **kw)
    if gpu_nbytes:
        store.add_gpu_tier(gpu_nbytes, device)
    return store


def block_nbytes(ns) -> int:
    return KVSpec.of(ns).block_nbytes


# ------------------------------------------------------------------ GPU tier and tier order


def test_tier_order_is_gpu_then_host_then_disk(tmp_path, ns) -> None:
    toks = list(range(160))  # 10 blocks
    kv = make_kv(ns, 160)
    with open_store(tmp_path, gpu_nbytes=3 * block_nbytes(ns), host_bytes=6 * block_nbytes(ns)) as store:
        assert store.tier_names == ["gpu", "host", "disk"]
        for k in range(
            1, 11
        ):  # one block at a time: the disk writer lets go of each host slot before the next
            store.save(ns, toks[: 16 * k], kv[:, :, : 16 * k], start_block=k - 1)
            store.flush()
        # LRU keeps the last 3 blocks in the GPU tier and the last 6 in the host tier; disk has all 10.
        hit = store.lookup(ns, toks)
        assert hit.by_tier == {"gpu": 48, "host": 48, "disk": 64}
        got_hit, got = store.restore(ns, toks)
        assert got_hit.by_tier == hit.by_tier and torch.equal(got, kv)
        stats = store.stats()
        assert stats["gpu"]["hit_blocks"] == 3 and stats["gpu"]["capacity_nbytes"] == 3 * block_nbytes(ns)
        assert stats["gpu"]["blocks"] == 3


def test_disk_and_host_hits_are_promoted_into_the_gpu_tier(tmp_path, ns) -> None:
    toks = list(range(64))
    kv = make_kv(ns, 64, seed=3)
    with TieredStore.open(tmp_path, host_bytes=2**20) as store:
        store.save(ns, toks, kv)
        store.flush()
    with open_store(tmp_path, gpu_nbytes=2**20, host_bytes=2**20) as store:
        assert store.lookup(ns, toks).by_tier == {"gpu": 0, "host": 0, "disk": 64}
        store.restore(ns, toks)
        assert store.lookup(ns, toks).by_tier == {"gpu": 64, "host": 0, "disk": 0}
        _, got = store.restore(ns, toks)
        assert torch.equal(got, kv)


def test_a_gpu_only_store_serves_from_device_memory(ns) -> None:
    toks = list(range(48))
    kv = make_kv(ns, 48)
    with open_store(None, gpu_nbytes=2**20, host_bytes=0) as store:
        assert store.save(ns, toks, kv) == 0  # nothing leaves the device
        hit, got = store.restore(ns, toks)
        assert hit.by_tier["gpu"] == 48 and torch.equal(got, kv)


def test_gpu_budget_forms() -> None:
    assert gpu_budget_nbytes("0", "cpu") == 0
    assert gpu_budget_nbytes("auto", "cpu") == 0
    assert gpu_budget_nbytes("8GiB", "cpu") == 0  # one config for GPU nodes and CPU boxes: off on CPU
    if CUDA:
        assert gpu_budget_nbytes("1GiB", "cuda") == 2**30
        free, _ = torch.cuda.mem_get_info()
        assert 0 < gpu_budget_nbytes("0.25", "cuda") <= free // 4 * 1.05


def test_server_config_checks_gpu_cache() -> None:
    from tierkv.errors import ConfigError
    from tierkv.server.config import ServeConfig

    assert ServeConfig.load({"gpu_cache": "0.2"}).gpu_cache == "0.2"
    assert ServeConfig.load({"gpu_cache": "4GiB"}).gpu_cache == "4gib"
    assert ServeConfig.load({}).gpu_cache == "auto"
    with pytest.raises(ConfigError, match="bad size"):
        ServeConfig.load({"gpu_cache": "lots"})


# ------------------------------------------------------------------ staging ring inside the store


def test_saves_through_the_staging_ring_reach_host_and_disk(tmp_path, ns) -> None:
    toks = list(range(200))
    kv = make_kv(ns, 200, seed=5)
    with TieredStore.open(tmp_path, host_bytes=2**20, staging=True) as store:
        assert store.save(ns, toks, kv) == 12
        store.flush()  # out of the ring, into the host tier, durable on disk
        assert store.stats()["staging"]["blocks_written"] == 12
        assert store.lookup(ns, toks).by_tier == {"host": 192, "disk": 0}
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        hit, got = store.restore(ns, toks)
        assert hit.by_tier == {"disk": 192} and torch.equal(got, kv[:, :, :192])


def test_a_full_staging_ring_drops_saves_and_counts_them(tmp_path, ns, monkeypatch) -> None:
    import threading

    gate = threading.Event()
    with TieredStore.open(None, host_bytes=2**20, staging=True) as store:
        store.writes.staging_nbytes, store.writes.staging_wait_s = 2 * block_nbytes(ns), 0.01
        original = store.writes._drain
        monkeypatch.setattr(store.writes, "_drain", lambda slot, p: (gate.wait(10), original(slot, p)))
        kept = store.save(ns, list(range(80)), make_kv(ns, 80))  # 5 blocks, 2 slots, a stalled consumer
        assert kept == 2 and store.stats()["staging"]["dropped_saves"] == 3
        gate.set()
        store.flush()
        assert store.lookup(ns, list(range(80))).num_tokens == 32  # the two that went through


def test_a_reused_source_buffer_does_not_change_what_was_saved(tmp_path, ns) -> None:
    """The worker reuses its save buffer on CPU: the ring (and the direct path) must have copied it."""
    for staging in (True, False):
        with TieredStore.open(tmp_path / str(staging), host_bytes=0, staging=staging) as store:
            toks = list(range(32))
            kv = make_kv(ns, 32, seed=9)
            blocks = (
                kv.view(ns.num_layers, 2, 2, 16, ns.num_kv_heads, ns.head_dim)
                .permute(2, 0, 1, 3, 4, 5)
                .contiguous()
            )
            store.save_blocks(ns, toks, blocks)
            blocks.fill_(0)
            store.flush()
            _, got = store.restore(ns, toks)
            assert torch.equal(got, kv), f"staging={staging}"


# ------------------------------------------------------------------ restores staged and uploaded in chunks


def _unscatterable_out(ns, num_tokens: int) -> torch.Tensor:
    # [L, 2, T, H, D] with heads outermost in memory: records cannot be scattered into it, so the store
    # reads into its staging buffer and uploads each verified chunk (the GPU restore's code path).
    spec = KVSpec.of(ns)
    return torch.zeros(
        spec.num_layers, 2, spec.num_kv_heads, num_tokens, spec.head_dim, dtype=spec.dtype
    ).transpose(2, 3)


def test_chunked_restore_through_the_staging_buffer_is_exact(tmp_path, ns, monkeypatch) -> None:
    monkeypatch.setattr(store_mod, "RESTORE_CHUNK_NBYTES", 3 * block_nbytes(ns))  # 4 chunks of 3 blocks
    toks = list(range(192))
    kv = make_kv(ns, 192, seed=11)
    with TieredStore.open(tmp_path, host_bytes=4 * block_nbytes(ns)) as store:
        store.save(ns, toks, kv)
        store.flush()
        out = _unscatterable_out(ns, 192)
        hit, got = store.restore(ns, toks, out=out)
        assert hit.by_tier == {"host": 64, "disk": 128}
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, kv)


def test_a_corrupt_block_in_a_later_chunk_cuts_the_prefix_there(tmp_path, ns, monkeypatch) -> None:
    monkeypatch.setattr(store_mod, "RESTORE_CHUNK_NBYTES", 2 * block_nbytes(ns))
    toks = list(range(160))
    kv = make_kv(ns, 160, seed=12)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
        entries = sorted(store.tier("disk").iter_entries(), key=lambda ke: ke[1].offset)
    e = entries[7][1]  # block 7: in the 4th chunk
    segment = tmp_path / "segments" / f"{e.seg_id:010d}.seg"
    data = bytearray(segment.read_bytes())
    data[e.offset + e.nbytes - 5] ^= 0xFF
    segment.write_bytes(bytes(data))
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        out = _unscatterable_out(ns, 160)
        hit, got = store.restore(ns, toks, out=out)
        assert hit.num_tokens == 7 * 16 and torch.equal(got, kv[:, :, : 7 * 16])
        assert store.stats()["disk"]["corrupt_blocks"] == 1


# ------------------------------------------------------------------ the worker through ring and GPU tier


def test_worker_through_ring_and_gpu_tier_is_exact(tmp_path) -> None:
    with open_store(tmp_path, gpu_nbytes=2**24, host_bytes=2**24, staging=True) as store:
        cm = tiny_model(store, torch.bfloat16)
        ids = prompt(150, salt=4)
        first = cm.generate(ids, 12)
        cold = cm.prefill(ids, use_cache=False)
        warm = cm.prefill(ids)
        assert warm.hit.by_tier["gpu"] == 144 and warm.computed_tokens == 6
        assert_close(warm.logits, cold.logits, torch.bfloat16)
        assert cm.generate(ids, 12).token_ids == first.token_ids
        store.flush()
        assert store.stats()["staging"]["blocks_written"] >= 9
    with TieredStore.open(tmp_path, host_bytes=0) as store:  # what the ring handed on is durable and exact
        cm = tiny_model(store, torch.bfloat16)
        warm = cm.prefill(ids)
        assert warm.hit.by_tier["disk"] == 144
        assert_close(warm.logits, cold.logits, torch.bfloat16)


def test_worker_save_gathers_blocks_in_canonical_order(tmp_path) -> None:
    """The worker's batched gather must store what a plain per-block copy of the cache would."""
    from tierkv.adapters import cache_layers

    with TieredStore.open(None, host_bytes=2**24) as store:
        cm = tiny_model(store)
        ids = prompt(100, salt=6)
        pre = cm.prefill(ids)
        keys, values = cache_layers(pre.cache, cm.layout)
        expect = torch.stack(
            [
                torch.stack([k[:, :96].transpose(0, 1), v[:, :96].transpose(0, 1)])
                for k, v in zip(keys, values)
            ]
        )
        _, got = store.restore(cm.namespace(), ids[:96])
        assert torch.equal(got, expect)


# ------------------------------------------------------------------ NVML telemetry


def test_telemetry_without_a_gpu_is_empty_and_stats_still_work(tmp_path) -> None:
    from click.testing import CliRunner

    from tierkv.cli import main

    if CUDA:
        pytest.skip("this machine has a GPU: see test_telemetry_on_a_gpu")
    assert gpu_telemetry() == []
    with TieredStore.open(tmp_path, host_bytes=0):
        pass
    res = CliRunner().invoke(main, ["stats", "--cache-dir", str(tmp_path), "--json"])
    assert res.exit_code == 0 and '"gpus": []' in res.output


@pytest.mark.gpu
def test_telemetry_on_a_gpu() -> None:
    samples = gpu_telemetry()
    assert samples and samples[0].memory_total_nbytes > 2**30
    assert 0 <= samples[0].utilization_gpu_pct <= 100


# ------------------------------------------------------------------ on CUDA


@pytest.mark.gpu
def test_cuda_restore_from_every_tier_is_bit_exact(tmp_path, ns) -> None:
    toks = list(range(320))  # 20 blocks
    kv = make_kv(ns, 320, seed=21).cuda()
    with open_store(
        tmp_path, gpu_nbytes=5 * block_nbytes(ns), device="cuda", host_bytes=10 * block_nbytes(ns)
    ) as store:
        for k in range(1, 21):  # one block at a time, so the LRU order is exact (see the first test)
            store.save(ns, toks[: 16 * k], kv[:, :, : 16 * k], start_block=k - 1)
            store.flush()
        out = torch.zeros_like(kv)
        hit, got = store.restore(ns, toks, out=out)
        assert hit.by_tier == {"gpu": 80, "host": 80, "disk": 160}
        assert got.is_cuda and torch.equal(got, kv)


@pytest.mark.gpu
def test_cuda_worker_restores_exact_kv_from_every_tier(tmp_path) -> None:
    """On a GPU the restored KV is bit-identical to the KV the model computed, and the same restored KV
    gives bit-identical logits whichever tier it came from. Cold against warm logits is compared with a
    tolerance: a 300-token forward and a 12-token one may pick other GEMM/attention kernels (other
    reduction orders) for the same row, a property of the kernels and not of the cache."""
    from tierkv.adapters import cache_layers
    from tierkv.default_model import ByteTokenizer

    model = tiny_model(None, torch.bfloat16).model.cuda()
    ids = prompt(300, salt=8)
    with open_store(tmp_path, gpu_nbytes=2**26, device="cuda", host_bytes=2**26) as store:
        cm = CachedModel(model, ByteTokenizer(), store, model_id="tiny", block_tokens=16)
        first = cm.generate(ids, 16)
        cold = cm.prefill(ids, use_cache=False)
        from_gpu = cm.prefill(ids)
        assert from_gpu.hit.by_tier["gpu"] == 288
        store.flush()  # the ring has handed every block to the host tier
        store.tier("gpu").clear()  # type: ignore[union-attr]
        from_host = cm.prefill(ids)
        assert from_host.hit.by_tier["host"] == 288
        assert cm.generate(ids, 16).token_ids == first.token_ids
        store.flush()
    with TieredStore.open(tmp_path, host_bytes=2**26) as store:  # disk -> pinned staging -> device
        cm = CachedModel(model, ByteTokenizer(), store, model_id="tiny", block_tokens=16)
        from_disk = cm.prefill(ids)
        assert from_disk.hit.by_tier["disk"] == 288
    cold_k, cold_v = cache_layers(cold.cache, cm.layout)
    for warm in (from_gpu, from_host, from_disk):
        k, v = cache_layers(warm.cache, cm.layout)
        assert all(torch.equal(a[:, :288], b[:, :288]) for a, b in zip(k + v, cold_k + cold_v))
        assert torch.equal(warm.logits, from_gpu.logits)
        assert int(warm.logits.argmax()) == int(cold.logits.argmax())
        assert (warm.logits - cold.logits).abs().max().item() <= 5e-2


def test_host_runs_uploaded_block_major_land_in_place(ns) -> None:
    """The GPU restore's upload of a run of host blocks (DMA per block, one device copy per run), on CPU."""
    from tierkv.spread import runs_of as _runs
    from tierkv.tiers.slot_copies import upload_run

    assert _runs([0, 0, 1, 1, 1, 0, 2]) == [(0, 0, 2), (1, 2, 5), (0, 5, 6), (2, 6, 7)]
    spec = KVSpec.of(ns)
    kv = make_kv(ns, 80, seed=13)
    slots = [kv[:, :, i * 16 : (i + 1) * 16].contiguous().view(-1).view(torch.uint8) for i in range(1, 4)]
    dest = torch.zeros(spec.shape(80), dtype=spec.dtype)
    upload_run(dest, slots, 1, spec)
    assert (
        torch.equal(dest[:, :, 16:64], kv[:, :, 16:64])
        and not dest[:, :, :16].any()
        and not dest[:, :, 64:].any()
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpu_tier_runs_land_in_place_with_one_gather(ns, monkeypatch, dtype) -> None:
    """The GPU tier's restore of a run of slots (one gather, one strided copy per piece), on CPU: slots
    wider than a block (only the block's bytes are read), blocks out of slot order, runs cut into pieces,
    the rest of the destination kept."""
    from tierkv.tiers import slot_copies

    ns = dataclasses.replace(ns, dtype=dtype)
    spec = KVSpec.of(ns)
    kv = make_kv(ns, 80, seed=17)
    blocks = [kv[:, :, i * 16 : (i + 1) * 16].contiguous().view(-1).view(torch.uint8) for i in range(5)]
    pool = torch.zeros((6, spec.block_nbytes + 64), dtype=torch.uint8)
    for slot, b in zip((4, 0, 5, 2), blocks[1:]):
        pool[slot, : spec.block_nbytes] = b
    for piece_nbytes in (64 << 20, spec.block_nbytes, 3 * spec.block_nbytes):  # one piece, 1 block, 3 + 1
        monkeypatch.setattr(slot_copies, "DEVICE_RUN_NBYTES", piece_nbytes)
        dest = torch.full(spec.shape(80), 7.0, dtype=spec.dtype)
        slot_copies.device_run(dest, [pool[s] for s in (4, 0, 5, 2)], 1, spec)
        assert torch.equal(dest[:, :, 16:80], kv[:, :, 16:80])
        assert bool((dest[:, :, :16] == 7.0).all())
