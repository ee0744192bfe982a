"""Cache control through vLLM: the fields ``tierkv serve`` takes, given in a request's ``kv_transfer_params``
(the one field vLLM's server passes to a connector), honoured by TierKVConnector in a real vLLM engine."""

from __future__ import annotations

import random
from pathlib import Path

from vllm_engine import Engine, tierkv_cli

B = 128  # vLLM's CPU block size (the default)


def _prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(3, 500), k=3 * B + 10)  # 3 whole blocks


def test_kv_transfer_params_carry_retention_memory_only_and_no_store(tmp_path: Path, model_dir: Path) -> None:
    cache = tmp_path / "cache"
    connector = {"cache_dir": str(cache), "host_bytes": "64MiB", "disk_bytes": "1GiB", "ttl_s": "1h"}
    kept, in_memory, nothing, bad, again, later = (_prompt(i) for i in (11, 12, 13, 14, 15, 16))
    run = Engine(tmp_path, model_dir).run(
        "control",
        [
            {"tokens": kept, "kv_transfer_params": {"tierkv": {"retention": "7d"}}},
            {"tokens": in_memory, "kv_transfer_params": {"prompt_cache_retention": "in_memory"}},
            {"tokens": nothing, "kv_transfer_params": {"tierkv": {"no_store": True}}},
            {"tokens": bad, "kv_transfer_params": {"tierkv": {"retention": "forever"}}},  # ignored, logged
            {"tokens": again},
            # ... then pinned while vLLM's own prefix cache holds it: vLLM loads and saves none of it
            {"tokens": again, "kv_transfer_params": {"tierkv": {"pin": "2h"}}},
            {"tokens": later, "kv_transfer_params": {"tierkv": {"no_store": True}}},
            {"tokens": later},  # saves normally: what vLLM's cache holds of it, tierkv had not, is saved
        ],
        connector,
    )
    assert len(run["results"]) == 8
    stats = tierkv_cli("stats", "--cache-dir", str(cache))
    # On disk: the kept prompt (7 days after each use), the one whose control was refused (the TTL), and
    # the one pinned the second time, and the one kept out of it the first time and not the second
    assert stats["blocks"] == 12
    assert stats["retention"]["retained"]["by_ttl"] == {
        "7.0d": {"blocks": 3, "nbytes": 3 * stats["live_nbytes"] // 12}
    }
    assert stats["retention"]["default"]["blocks"] == 6
    assert stats["retention"]["pinned"]["blocks"] == 3
    from tierkv.keys import BlockChain, Namespace
    from tierkv.tiers.disk import DiskTier

    (ns,) = [Namespace.from_json(n["spec"]) for n in stats["namespaces"]]
    with DiskTier(cache, writer=False) as disk:
        for tokens, held in ((kept, 3), (in_memory, 0), (nothing, 0), (bad, 3), (again, 3), (later, 3)):
            assert disk.lookup(BlockChain.of(ns, tokens).keys) == held
