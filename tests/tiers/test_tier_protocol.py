"""Every tier answers the Tier calls (tiers/base.py) the same way, and the store is a loop over whatever
tiers it is given: no tier name or position is baked into it."""

from __future__ import annotations

import pytest
import torch

from tierkv import TieredStore
from tierkv.keys import BlockChain
from tierkv.layout import KVSpec
from tierkv.tiers.admission import Admission
from tierkv.tiers.base import Tier
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.host import HostTier
from tierkv.tiers.pool import BlockPool
from tierkv.tiers.target import Stagers

from helpers import make_kv

SAVED, TOTAL = 3, 5  # blocks saved of a 5-block chain
ADMIT_AFTER = 2


def _remote(tmp_path, request) -> Tier:
    from tierkv.tiers.remote import RemoteTier

    return RemoteTier(request.getfixturevalue("redis_server").url)


FACTORIES = {
    "host": lambda tmp_path, request: HostTier(1 << 20, pin=False),
    "gpu-on-cpu": lambda tmp_path, request: GpuTier(1 << 20, device="cpu"),
    "disk": lambda tmp_path, request: DiskTier(tmp_path / "disk", sync=False),
    "admission-host": lambda tmp_path, request: Admission(HostTier(1 << 20, pin=False), ADMIT_AFTER),
    "admission-disk": lambda tmp_path, request: Admission(
        DiskTier(tmp_path / "disk", sync=False), ADMIT_AFTER
    ),
    "remote": _remote,
}


@pytest.fixture(params=list(FACTORIES))
def store(request, tmp_path):
    tier = FACTORIES[request.param](tmp_path, request)
    with TieredStore([tier]) as s:
        yield s


@pytest.fixture
def chain_kv(ns):
    toks = list(range(TOTAL * ns.block_tokens))
    return BlockChain.of(ns, toks), make_kv(ns, len(toks), seed=3)


def _save_first_blocks(store: TieredStore, ns, chain: BlockChain, kv: torch.Tensor) -> None:
    B = ns.block_tokens
    store.save(ns, chain.prefix(SAVED), kv[:, :, : SAVED * B])
    store.flush()


def test_probe_needs_read_into_and_stats_agree_after_a_save(store, ns, chain_kv) -> None:
    chain, kv = chain_kv
    (tier,) = store.tiers
    spec = KVSpec.of(ns)
    B = ns.block_tokens
    every = list(range(TOTAL))
    if isinstance(tier, Admission):  # a save before enough requests is not taken
        _save_first_blocks(store, ns, chain, kv)
        assert tier.probe(chain, every) == [False] * TOTAL
        assert tier.needs(chain, every) == [False] * TOTAL
        for _ in range(ADMIT_AFTER):
            assert store.restore(ns, chain)[0].num_tokens == 0  # each request counts
    _save_first_blocks(store, ns, chain, kv)

    assert tier.probe(chain, every) == [True] * SAVED + [False] * (TOTAL - SAVED)
    assert tier.probe(chain, [4, 2, 0]) == [False, True, True]  # per index, in the order asked
    assert tier.probe(chain, []) == []
    assert tier.needs(chain, every) == [not h for h in tier.probe(chain, every)]

    for dest in (
        torch.zeros(spec.shape(TOTAL * B), dtype=spec.dtype),  # filled in place
        torch.zeros(
            (spec.num_layers, 2, spec.num_kv_heads, TOTAL * B, spec.head_dim), dtype=spec.dtype
        ).transpose(2, 3),
    ):  # through the chunk buffers
        with Stagers().target(dest, spec) as target:
            assert tier.read_into(chain, 0, TOTAL, target) == SAVED  # the leading blocks held
            assert sorted(target.created_s) == list(range(SAVED))
        assert torch.equal(dest[:, :, : SAVED * B], kv[:, :, : SAVED * B])
    dest = torch.zeros(spec.shape(TOTAL * B), dtype=spec.dtype)
    with Stagers().target(dest, spec) as target:
        assert tier.read_into(chain, 1, 1, target) == 1  # a run from the middle
    assert torch.equal(dest[:, :, B : 2 * B], kv[:, :, B : 2 * B]) and not dest[:, :, :B].any()

    stats = tier.stats()
    assert all(isinstance(v, int) for v in stats.values())
    if "used_nbytes" in stats:
        assert stats["used_nbytes"] >= SAVED * spec.block_nbytes
    assert store.stats()[tier.name].items() >= stats.items()
    assert tier.describe()

    hit = store.lookup(ns, chain)
    assert hit.by_tier == {tier.name: SAVED * B} and hit.num_blocks == SAVED
    hit, got = store.restore(ns, chain)
    assert hit.by_tier == {tier.name: SAVED * B} and torch.equal(got, kv[:, :, : SAVED * B])


def test_a_store_of_only_a_disk_tier(tmp_path, ns, chain_kv) -> None:
    chain, kv = chain_kv
    B = ns.block_tokens
    with TieredStore([DiskTier(tmp_path, sync=False)]) as store:
        assert store.tier_names == ["disk"] and store.durable
        _save_first_blocks(store, ns, chain, kv)
        hit, got = store.restore(ns, chain)
        assert hit.by_tier == {"disk": SAVED * B} and torch.equal(got, kv[:, :, : SAVED * B])
        assert store.stats()["disk"]["hit_blocks"] == SAVED
    with TieredStore([DiskTier(tmp_path, sync=False)]) as store:  # durable: a new process sees it
        assert store.lookup(ns, chain).num_tokens == SAVED * B


def test_tier_names_are_whatever_the_tiers_are_called(tmp_path, ns, chain_kv) -> None:
    chain, kv = chain_kv
    B = ns.block_tokens
    fast, slow = BlockPool(1 << 20, name="fast"), BlockPool(1 << 20, name="slow")
    with TieredStore([fast, slow, DiskTier(tmp_path, sync=False)]) as store:
        assert store.tier_names == ["fast", "slow", "disk"] and store.tier("slow") is slow
        _save_first_blocks(store, ns, chain, kv)
        assert store.lookup(ns, chain).by_tier == {"fast": SAVED * B, "slow": 0, "disk": 0}
        fast.clear()
        assert store.lookup(ns, chain).by_tier == {"fast": 0, "slow": SAVED * B, "disk": 0}
        hit, got = store.restore(ns, chain)
        assert hit.by_tier["slow"] == SAVED * B and torch.equal(got, kv[:, :, : SAVED * B])
        assert store.lookup(ns, chain).by_tier["fast"] == SAVED * B  # promoted into the faster pool
        fast.clear()
        slow.clear()
        hit, got = store.restore(ns, chain)
        assert hit.by_tier["disk"] == SAVED * B and torch.equal(got, kv[:, :, : SAVED * B])
        assert fast.probe(chain, range(SAVED)) == slow.probe(chain, range(SAVED)) == [True] * SAVED
        stats = store.stats()
        assert {"fast", "slow", "disk", "store"} <= set(stats)
        assert stats["slow"]["hit_blocks"] == SAVED and stats["disk"]["hit_blocks"] == SAVED


def test_a_store_with_its_tiers_in_another_order(tmp_path, ns, chain_kv) -> None:
    chain, kv = chain_kv
    B = ns.block_tokens
    memory = HostTier(1 << 20, pin=False)
    with TieredStore([DiskTier(tmp_path, sync=False), memory]) as store:
        _save_first_blocks(store, ns, chain, kv)
        assert memory.probe(chain, range(SAVED)) == [True] * SAVED  # saved to every tier
        assert store.lookup(ns, chain).by_tier == {"disk": SAVED * B, "host": 0}  # the first tier holding it
        hit, got = store.restore(ns, chain)
        assert hit.by_tier == {"disk": SAVED * B, "host": 0} and torch.equal(got, kv[:, :, : SAVED * B])


def test_admission_writes_blocks_served_from_above_once_admitted(ns, chain_kv) -> None:
    chain, kv = chain_kv
    B = ns.block_tokens
    shared = BlockPool(1 << 20, name="shared")
    admission = Admission(shared, ADMIT_AFTER)
    with TieredStore([HostTier(1 << 20, pin=False), admission]) as store:
        _save_first_blocks(store, ns, chain, kv)
        assert shared.probe(chain, range(SAVED)) == [False] * SAVED  # seen by no request yet
        for n in range(1, ADMIT_AFTER + 1):
            hit, got = store.restore(ns, chain)
            store.flush()
            assert hit.by_tier == {"host": SAVED * B, "shared": 0}
            assert admission.sightings(chain.keys[0]) == n
            assert shared.probe(chain, range(SAVED)) == [n == ADMIT_AFTER] * SAVED  # written once admitted
        with shared.read(list(chain.keys[:SAVED])) as views:
            spec = KVSpec.of(ns)
            for i, v in enumerate(views):
                assert torch.equal(v.view(spec.dtype).view(spec.block_shape), kv[:, :, i * B : (i + 1) * B])
