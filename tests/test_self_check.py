"""The sampled self-check of the transformers engine: a prefill over a restored prefix also computed cold.

Verification (checksums, keys, token ids) cannot see KV that was already wrong when it was saved; the
self-check can. Here wrong KV is stored under a prompt's keys with valid checksums (what a bug upstream of
the store, or a poisoned shared tier, would leave), and the check must find it, answer from the cold
prefill, and purge it; on a sound store it must find nothing.
"""

from __future__ import annotations

import torch

from tierkv import TieredStore
from tierkv.keys import BlockChain
from tierkv.layout import KVSpec

from test_worker import prompt, tiny_model


def _poison(store: TieredStore, cm, ids: list[int], blocks: int) -> None:
    """Other KV under ``ids``' first ``blocks`` keys, checksums valid."""
    ns = cm.namespace()
    chain = BlockChain.of(ns, ids[: blocks * ns.block_tokens])
    store.invalidate(ns, chain, range(blocks))
    spec = KVSpec.of(ns)
    wrong = torch.randn((blocks, *spec.block_shape), generator=torch.Generator().manual_seed(3)).to(
        spec.dtype
    )
    store.save_blocks(ns, chain, wrong)
    store.flush()


def test_the_self_check_finds_wrong_kv_behind_valid_checksums_and_answers_exactly(tmp_path) -> None:
    with TieredStore.open(tmp_path / "cache", host_bytes=2**26) as store:
        cm = tiny_model(store)
        ids = prompt(100)
        cold = cm.prefill(ids, use_cache=False)
        cm.prefill(ids)  # saves blocks 0..5
        _poison(store, cm, ids, 6)
        unchecked = cm.prefill(ids)  # the poison is served: no check can see it
        assert unchecked.hit.num_tokens == 96
        assert not torch.equal(unchecked.logits, cold.logits)

        longer = ids + prompt(60, salt=7)
        cold_longer = cm.prefill(longer, use_cache=False)
        cm.prefill(longer)  # unchecked: blocks 6..9 computed from the poison, and saved
        store.flush()

        cm.self_check_rate = 1.0
        checked = cm.prefill(ids)
        stats = store.stats()["store"]
        assert stats["checked_blocks"] == 6 and stats["check_mismatch_blocks"] == 6
        assert torch.equal(checked.logits, cold.logits)  # answered from the cold prefill

        cm.self_check_rate = 0.0
        store.flush()
        again = cm.prefill(ids)  # the poison was purged, and the cold prefill's blocks saved instead
        assert again.hit.num_tokens == 96
        assert (again.logits - cold.logits).abs().max() <= 1e-4
        # What an unchecked request computed from the poison went with the namespace: none of it is served.
        descendant = cm.prefill(longer)
        assert descendant.hit.num_tokens == 96
        assert (descendant.logits - cold_longer.logits).abs().max() <= 1e-4


def test_the_self_check_finds_nothing_on_a_sound_store(tmp_path) -> None:
    with TieredStore.open(tmp_path / "cache", host_bytes=2**26) as store:
        cm = tiny_model(store, self_check_rate=1.0)
        ids = prompt(100)
        cm.prefill(ids)
        for _ in range(3):
            result = cm.prefill(ids)
            assert result.hit.num_tokens == 96
        stats = store.stats()["store"]
        assert stats["checked_blocks"] == 18 and stats["check_mismatch_blocks"] == 0
