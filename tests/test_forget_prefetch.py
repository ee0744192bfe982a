"""Deletion by prompt (``forget``) and ``prefetch`` in the store: a real LMDB disk tier and host tier."""

import torch

from tierkv import TieredStore
from tierkv.tiers.disk import DiskTier

from helpers import make_kv


def _keys_on_disk(store: TieredStore) -> set[bytes]:
    disk = store.tier("disk")
    assert isinstance(disk, DiskTier)
    return {bytes(k) for k, _ in disk.iter_entries()}


def test_forget_removes_only_what_no_other_prompt_extends(tmp_path, ns) -> None:
    system = list(range(48))  # 3 blocks shared by two conversations
    a, b = system + list(range(1000, 1032)), system + list(range(2000, 2064))
    with TieredStore.open(tmp_path, host_bytes=64 << 20) as store:
        store.save(ns, a, make_kv(ns, len(a), seed=1))
        store.save(ns, b, make_kv(ns, len(b), seed=2))
        store.flush()
        gone = store.forget(ns, b)
        assert (gone.blocks, gone.kept_shared, gone.removed) == (7, 3, 4)
        assert store.lookup(ns, b).num_tokens == 48  # the shared system prompt stays, in every tier
        assert store.lookup(ns, a).num_tokens == 80  # the other conversation is whole
        n, kv = store.load(ns, a)
        assert n == 80 and torch.equal(kv, make_kv(ns, len(a), seed=1))
        # The last prompt using the system prompt: now nothing else extends it
        assert store.forget(ns, a).removed == 5
        assert store.lookup(ns, a).num_tokens == 0
        store.flush()
        assert _keys_on_disk(store) == set()
    with TieredStore.open(tmp_path, host_bytes=64 << 20) as store:  # and after a restart
        assert store.lookup(ns, a).num_tokens == store.lookup(ns, b).num_tokens == 0


def test_forget_keeps_a_prompt_that_a_longer_one_extends_unless_asked(tmp_path, ns) -> None:
    short = list(range(32))
    long = short + list(range(500, 532))
    with TieredStore.open(tmp_path, host_bytes=64 << 20) as store:
        store.save(ns, long, make_kv(ns, 64))
        store.flush()
        assert store.forget(ns, short).removed == 0
        assert store.lookup(ns, long).num_tokens == 64
        gone = store.forget(ns, short, shared=True)
        assert gone.removed == 2 and gone.kept_shared == 0
        assert store.lookup(ns, long).num_tokens == 0  # its prefix is gone: nothing after it is reachable


def test_forget_drops_saves_still_on_their_way(tmp_path, ns) -> None:
    toks = list(range(64))
    with TieredStore.open(tmp_path, host_bytes=64 << 20) as store:
        store.save(ns, toks, make_kv(ns, 64))  # no flush: queued for the disk writer
        store.forget(ns, toks)
        store.flush()
        assert store.lookup(ns, toks).num_tokens == 0
        assert _keys_on_disk(store) == set()


def test_prefetch_brings_a_disk_prefix_into_the_host_tier(tmp_path, ns) -> None:
    toks = list(range(16 * 10))
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        store.save(ns, toks, make_kv(ns, len(toks), seed=5))
        store.flush()
    with TieredStore.open(tmp_path, host_bytes=64 << 20) as store:
        assert store.lookup(ns, toks).by_tier == {"host": 0, "disk": 160}
        # Chunks of 3 blocks: the prefix is read in pieces, each into memory it then frees
        before, after = store.prefetch(ns, toks, chunk_nbytes=3 * 2048)
        assert before.by_tier == {"host": 0, "disk": 160}
        assert after.by_tier == {"host": 160, "disk": 0}
        hit, kv = store.restore(ns, toks)
        assert hit.by_tier["host"] == 160 and torch.equal(kv, make_kv(ns, len(toks), seed=5))
    with TieredStore.open(tmp_path, host_bytes=0) as store:  # no memory tier: nothing to bring it to
        before, after = store.prefetch(ns, toks)
        assert before == after and after.by_tier == {"disk": 160}
