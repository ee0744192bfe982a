"""Faults through a real vLLM engine (CPU, float32) with the connector: nothing wrong is served or saved.

Concurrent requests sharing prefixes (each round one batch: vLLM schedules them together, so requests hit
each other's loading blocks in its prefix cache), vLLM's own prefix cache emptied between rounds so every
round restores from tierkv. Faults hit the store below the connector (``faults.py``): restores that stop
part-way, records damaged on disk, EIO from reads, ENOSPC on writes, another process purging the
directory. The sampled self-check is on. Each run's greedy tokens must equal those of an engine without
the connector on the same batches; then a fault-free pass over the same directory must too (so nothing
wrong was saved). A second scenario stores wrong KV behind valid checksums: only the self-check can see
it, and it must.

The short variant runs in CI; ``--runslow`` runs more users, rounds and faults.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from test_vllm_e2e import _corrupt, _namespace
from vllm_engine import Engine, tierkv_cli

B = 128


def _workload(users: int, rounds: int, seed: int) -> list[list[dict]]:
    """``rounds`` batches: users in groups sharing a system prompt of 2 or 3 blocks; each round a user's
    prompt grows by its previous turn's worth of tokens (a chat)."""
    rng = random.Random(seed)
    systems = [rng.choices(range(3, 500), k=n * B + 17) for n in (2, 3, 2)]
    histories = [
        systems[u % len(systems)] + rng.choices(range(3, 500), k=rng.randrange(40, 160)) for u in range(users)
    ]
    batches = []
    for _ in range(rounds):
        batches.append([{"tokens": list(h)} for h in histories])
        histories = [h + rng.choices(range(3, 500), k=rng.randrange(60, 200)) for h in histories]
    return batches


def _stats(log: str) -> dict[str, int]:
    m = re.search(
        r"loaded (\d+) blocks \((\d+) read, (\d+) failed\).*saved (\d+) in .*?(\d+) not saved after failed "
        r"loads, self-check (\d+) blocks \((\d+) differed\)",
        log,
    )
    assert m, "no connector summary in the engine's log"
    keys = ("loaded", "read", "failed", "saved", "unsound", "checked", "differed")
    return dict(zip(keys, map(int, m.groups())))


def _tokens(run: dict) -> list[list[int]]:
    return [r["tokens"] for r in run["results"]]


def _mismatches(run: dict, base: dict) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(_tokens(run), _tokens(base))) if a != b]


@pytest.fixture(scope="module", params=["short", pytest.param("long", marks=pytest.mark.slow)])
def fault_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> dict:
    long = request.param == "long"
    work = tmp_path_factory.mktemp(f"vllm-faults-{request.param}")
    cache = work / "cache"
    engine = Engine(work, model_dir)
    batches = _workload(users=12 if long else 6, rounds=5 if long else 3, seed=7)
    connector = {"cache_dir": str(cache), "host_bytes": "16MiB", "disk_bytes": "1GiB", "sync": False}
    common = {"batches": batches, "reset_between": True}
    base = engine.start("base", [], None, **common)
    warm = engine.run("warm", [], connector, batches=batches[:1], reset_between=True)
    for tokens in (batches[0][0]["tokens"], batches[0][1]["tokens"]):  # damage two stored records
        _corrupt(cache, tokens, 1)
    faults = {
        "seed": 3,
        "partial_load": 0.3,
        "read_eio": 0.2,
        "write_enospc": 0.5,
        "purge_at_batches": [1, 3] if long else [1],
    }
    faulty = engine.run("faulty", [], {**connector, "self_check_rate": 0.3}, faults=faults, **common)
    verify = engine.run("verify", [], connector, **common)
    return {"base": engine.wait(base), "warm": warm, "faulty": faulty, "verify": verify, "cache": cache}


def test_faults_never_change_an_answer(fault_runs: dict) -> None:
    base = fault_runs["base"]
    assert _mismatches(fault_runs["warm"], base) == []
    assert _mismatches(fault_runs["faulty"], base) == []


def test_the_faults_really_happened(fault_runs: dict) -> None:
    injected = fault_runs["faulty"]["faults"]
    assert all(injected[kind] > 0 for kind in ("partial_load", "read_eio", "write_enospc", "purge")), injected
    stats = _stats(fault_runs["faulty"]["log"])
    assert stats["loaded"] > 0 and stats["failed"] > 0  # hits were served, and loads failed


def test_the_self_check_ran_and_found_nothing(fault_runs: dict) -> None:
    stats = _stats(fault_runs["faulty"]["log"])
    assert stats["checked"] > 0 and stats["differed"] == 0


def test_nothing_wrong_was_saved(fault_runs: dict) -> None:
    """A fault-free pass over the same directory restores what the faulty run saved: the same answers."""
    verify = fault_runs["verify"]
    assert _mismatches(verify, fault_runs["base"]) == []
    assert sum(r["num_cached_tokens"] for r in verify["results"]) > 0
    assert _stats(verify["log"])["loaded"] > 0
    assert tierkv_cli("gc", "--check", "--cache-dir", str(fault_runs["cache"]))["corrupt"] == 0


@pytest.mark.parametrize("load_async", [False, True], ids=["sync-loads", "async-loads"])
def test_the_self_check_finds_wrong_kv_behind_a_valid_checksum(
    tmp_path: Path, model_dir: Path, load_async: bool
) -> None:
    """Other KV stored under a prompt's keys, with valid checksums: verification cannot see it, the
    self-check must, and purge it with what was computed from it (the prompt's next hit is exact again).
    With asynchronous loads too: there the checked blocks are the load's first, vLLM frees and reallocates
    the request's blocks before it recomputes them, and the check must still compare them."""
    import torch

    from tierkv.keys import BlockChain
    from tierkv.layout import KVSpec
    from tierkv.store import TieredStore

    cache = tmp_path / "cache"
    engine = Engine(tmp_path, model_dir)
    rng = random.Random(11)
    X = rng.choices(range(3, 500), k=5 * B + 40)  # 3 blocks poisoned, 2 computed from them
    other = rng.choices(range(3, 500), k=B)
    connector = {
        "cache_dir": str(cache),
        "host_bytes": 0,
        "disk_bytes": "1GiB",
        "sync": False,
        "load_async": load_async,
    }
    base = engine.start("base", [{"tokens": X}], None)
    engine.run("namespace", [{"tokens": other}], connector)  # creates the engine's namespace
    ns = _namespace(cache, "")
    with TieredStore.open(cache, host_bytes=0) as store:
        spec = KVSpec.of(ns)
        wrong = torch.randn((3, *spec.block_shape), generator=torch.Generator().manual_seed(1)).to(spec.dtype)
        store.save_blocks(ns, BlockChain.of(ns, X[: 3 * B]), wrong)
        store.flush()
    # Unchecked: the poison is served, and blocks 3 and 4 computed from it are saved. Then every load is
    # checked: the namespace goes, descendants included, and the answer comes from the recomputation.
    engine.run("unchecked", [{"tokens": X}], connector)
    checked = engine.run("checked", [{"tokens": X}], {**connector, "self_check_rate": 1.0})
    after = engine.run("after", [{"tokens": X}], connector)
    base = engine.wait(base)
    stats = _stats(checked["log"])
    assert ("(loads asynchronous)" in checked["log"]) is load_async
    assert stats["checked"] > 0 and stats["differed"] > 0
    assert "differs from vLLM's recomputation" in checked["log"]
    assert _tokens(checked) == _tokens(base)  # a checked load is recomputed: the answer is exact anyway
    assert after["results"][0]["num_cached_tokens"] == 5 * B  # saved again, from the recomputation
    assert _tokens(after) == _tokens(base)
