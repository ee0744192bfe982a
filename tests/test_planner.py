"""Restore or recompute: the planner's decisions, and a store that computes what a throttled tier would
be slower to read."""

import time

import pytest
import torch

from tierkv import TieredStore
from tierkv.planner import EXPLORE_EVERY, RestorePlanner

from helpers import make_kv


def test_without_both_estimates_everything_is_read() -> None:
    p = RestorePlanner()
    assert p.cut("m", ["host", "disk"], 1 << 20, 16) == 2
    p.observe_read("disk", 1 << 20, 1.0)
    assert p.cut("m", ["host", "disk"], 1 << 20, 16) == 2  # no prefill speed, no host bandwidth yet


def test_a_slow_tail_is_computed_and_a_fast_prefix_read() -> None:
    p = RestorePlanner()
    p.observe_read("host", 10 << 30, 1.0)  # 10 GiB/s: a 1 MiB block in 0.1 ms
    p.observe_read("disk", 1 << 20, 0.1)  # 10 MiB/s: a block in 100 ms
    p.observe_prefill("m", 16_000, 1.0)  # a 16-token block in 1 ms
    assert p.cut("m", ["host"] * 3 + ["disk"] * 5, 1 << 20, 16) == 3
    assert p.cut("m", ["disk"] * 4, 1 << 20, 16) == 0
    p.observe_prefill("other", 16, 1.0)  # another model computes a block in a second: read it all
    assert p.cut("other", ["host"] * 3 + ["disk"] * 5, 1 << 20, 16) == 8


def test_a_cut_tier_is_read_anyway_now_and_then_to_measure_it_again() -> None:
    p = RestorePlanner()
    p.observe_read("disk", 1 << 20, 0.1)
    p.observe_prefill("m", 16_000, 1.0)
    cuts = [p.cut("m", ["disk"] * 4, 1 << 20, 16) for _ in range(2 * EXPLORE_EVERY)]
    assert cuts.count(4) == 2 and cuts.count(0) == 2 * EXPLORE_EVERY - 2


def test_estimates_move_with_new_observations_and_ignore_clock_noise() -> None:
    p = RestorePlanner()
    p.observe_read("disk", 100, 1.0)
    p.observe_read("disk", 200, 1.0)
    assert p.estimates()["read_Bps"]["disk"] == pytest.approx(100 * 0.7 + 200 * 0.3)
    p.observe_read("disk", 1 << 30, 1e-9)  # too short to mean anything
    assert p.estimates()["read_Bps"]["disk"] == pytest.approx(130)


class Throttled:
    """A tier whose reads take ``delay_s`` per block longer (a congested network disk)."""

    def __init__(self, tier, delay_s: float) -> None:
        self._tier = tier
        self.delay_s = delay_s

    def __getattr__(self, name):
        return getattr(self._tier, name)

    def __hash__(self) -> int:
        return hash(self._tier)

    def read_into(self, chain, first, count, target) -> int:
        time.sleep(self.delay_s * count)
        return self._tier.read_into(chain, first, count, target)


def test_a_store_computes_what_a_throttled_tier_would_be_slower_to_read(tmp_path, ns) -> None:
    toks = list(range(128))  # 8 blocks
    kv = make_kv(ns, 128)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, kv)
        store.flush()
        (k,) = [i for i, t in enumerate(store.tiers) if t.name == "disk"]
        store.tiers[k] = Throttled(store.tiers[k], delay_s=0.02)
        hit, got = store.restore(ns, toks)  # no prefill speed known yet: read, and measured
        assert hit.num_blocks == 8 and torch.equal(got, kv)
        store.observe_prefill(ns, 16_000, 1.0)  # a block computed in 1 ms, read in 20
        hit, got = store.restore(ns, toks)
        assert hit.num_blocks == 0 and got is None
        assert store.stats()["store"]["recomputed_blocks"] == 8
        assert store.lookup(ns, toks).num_blocks == 8  # still cached: only this restore chose to compute
        store.tiers[k].delay_s = 0.0
        for _ in range(10):  # the model got slow (or busy): a block now takes a second to compute
            store.observe_prefill(ns, 16, 1.0)
        hit, got = store.restore(ns, toks)
        assert hit.num_blocks == 8 and torch.equal(got, kv)


def test_a_memory_tier_is_never_cut_whatever_the_estimates() -> None:
    p = RestorePlanner()
    p.observe_read("host", 1 << 20, 1.0)  # a badly measured 1 MiB/s host tier
    p.observe_read("disk", 1 << 20, 1.0)
    p.observe_prefill("m", 10**9, 1.0)  # and an absurdly fast model
    assert p.cut("m", ["host"] * 3 + ["disk"] * 2, 1 << 20, 16, memory={"host"}) == 3
    assert p.cut("m", ["host"] * 3, 1 << 20, 16, memory={"host"}) == 3
