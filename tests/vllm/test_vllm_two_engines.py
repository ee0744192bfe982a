"""Two vLLM engines, each its own process, on one cache directory at the same time (two workers of one
node): both save the same prompt and one of their own, concurrently; a third engine then finds all of it.

The store's cross-process rules under test: one writer at a time per LMDB environment, a block written
twice is stored once, and no process sees another's half-written block.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from vllm_engine import Engine, tierkv_cli

B = 128
SHARED = random.Random(11).choices(range(3, 500), k=4 * B + 10)
OWN = [random.Random(12 + i).choices(range(3, 500), k=3 * B + 10) for i in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict:
    work = tmp_path_factory.mktemp("vllm-two")
    cache = work / "cache"
    engine = Engine(work, model_dir)
    connector = {"cache_dir": str(cache), "host_bytes": "64MiB", "disk_bytes": "1GiB"}
    started = [
        engine.start(f"writer{i}", [{"tokens": SHARED}, {"tokens": OWN[i]}], connector) for i in range(2)
    ]
    out = {f"writer{i}": engine.wait(s) for i, s in enumerate(started)}
    out["gc_writers"] = tierkv_cli("gc", "--check", "--cache-dir", str(cache))
    out["stats_writers"] = tierkv_cli("stats", "--cache-dir", str(cache))
    out["reader"] = engine.run(
        "reader", [{"tokens": SHARED}, {"tokens": OWN[0]}, {"tokens": OWN[1]}], connector
    )
    out["gc_reader"] = tierkv_cli("gc", "--check", "--cache-dir", str(cache))
    return out


def test_two_engines_write_one_store_at_once(runs: dict) -> None:
    for name in ("writer0", "writer1"):
        shared, own = runs[name]["results"]
        # the shared prompt is computed, or found when the other engine saved it first (they race)
        assert shared["num_cached_tokens"] in (0, 4 * B) and own["num_cached_tokens"] == 0
        assert " failed) in " in runs[name]["log"] and " 0 failed) in " in runs[name]["log"]
        assert "tierkv: saving" not in runs[name]["log"]  # no failed save
    assert runs["writer0"]["results"][0]["tokens"] == runs["writer1"]["results"][0]["tokens"]
    (space,) = runs["stats_writers"]["namespaces"]
    assert space["blocks"] == 4 + 3 + 3  # the shared prompt's blocks stored once
    assert runs["gc_writers"]["corrupt"] == 0 and runs["gc_writers"]["checked"] == 10


def test_a_third_engine_finds_both_engines_blocks(runs: dict) -> None:
    reader = runs["reader"]["results"]
    assert [r["num_cached_tokens"] for r in reader] == [4 * B, 3 * B, 3 * B]
    assert reader[0]["tokens"] == runs["writer0"]["results"][0]["tokens"]
    assert reader[1]["tokens"] == runs["writer0"]["results"][1]["tokens"]
    assert reader[2]["tokens"] == runs["writer1"]["results"][1]["tokens"]
    for i, lp in enumerate((runs["writer0"]["results"][0], runs["writer0"]["results"][1])):
        assert reader[i]["logprobs"] == pytest.approx(lp["logprobs"], abs=1e-4)
    assert runs["gc_reader"]["corrupt"] == 0
