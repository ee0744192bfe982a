"""TierKVConnector end to end, on CPU: each vLLM engine is its own process (``vllm_run.py``).

    base     no connector: the reference tokens and logprobs
    save     a cold store: P and Q computed and saved; P again under another tenant's cache_salt
    load     a new process on the same directory: a third tenant shares nothing; R (P's first 3 blocks,
             then other tokens) restores those 3; P then restores only blocks 3 and 4 (vLLM's own prefix
             cache holds 0..2 now); Q restores from tierkv (whole blocks, the last token left to
             compute); the second tenant gets its own blocks
    corrupt  block 2 of P damaged on disk: blocks 0 and 1 load, the rest is recomputed, the output is
             unchanged, and the damaged block is saved again
    async    asynchronous loads, block 3 of P damaged: P and Q load while X is computed, in one batch
``tierkv gc --check`` (the CLI, as an operator runs it beside vLLM) finds the store clean after each.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from vllm_engine import Engine, tierkv_cli

B = 128  # vLLM's CPU block size (the default)
P = random.Random(1).choices(range(3, 500), k=5 * B + 60)  # 5 whole blocks and a partial one
Q = random.Random(2).choices(range(3, 500), k=5 * B)  # exactly 5 blocks: all loaded, one token computed
R = P[: 3 * B] + random.Random(3).choices(range(3, 500), k=100)
X = random.Random(4).choices(range(3, 500), k=3 * B + 10)  # never stored before the async run


def _cached(result: dict, i: int) -> int:
    return result["results"][i]["num_cached_tokens"]


def _same_output(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"]
    # The KV is restored bit for bit; the logits of the first computed token come from a forward over fewer
    # tokens than the cold prefill's, so float rounding may differ in the last digits (vLLM's own prefix
    # cache differs from a cold prefill the same way, about 1e-6 here).
    assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)


def _namespace(cache: Path, salt: str):
    from tierkv.keys import Namespace

    spaces = [
        Namespace.from_json(n["spec"]) for n in tierkv_cli("stats", "--cache-dir", str(cache))["namespaces"]
    ]
    (ns,) = [n for n in spaces if n.tenant_salt == salt]
    return ns


def _corrupt(cache: Path, tokens: list[int], block: int) -> None:
    """Flip a byte of the payload of ``tokens``' block ``block`` in its segment file."""
    from tierkv.keys import BlockChain
    from tierkv.tiers.disk import DiskTier

    chain = BlockChain.of(_namespace(cache, ""), tokens)
    with DiskTier(cache, writer=False) as disk:
        entries = disk.locate(chain.keys)
        assert len(entries) == len(chain)
        e = entries[block]
        path = disk.segments.file(e.seg_id)
    with open(path, "r+b") as f:
        f.seek(e.offset + e.nbytes - 100)
        byte = f.read(1)
        f.seek(e.offset + e.nbytes - 100)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict:
    work = tmp_path_factory.mktemp("vllm-e2e")
    cache = work / "cache"
    engine = Engine(work, model_dir)
    connector = {"cache_dir": str(cache), "host_bytes": "64MiB", "disk_bytes": "1GiB", "ttl_s": "1h"}
    out: dict = {"cache": cache}
    out["base"] = engine.run("base", [{"tokens": P}, {"tokens": Q}, {"tokens": X}], None)
    out["save"] = engine.run(
        "save", [{"tokens": P}, {"tokens": Q}, {"tokens": P, "salt": "tenant-b"}], connector
    )
    out["gc_save"] = tierkv_cli("gc", "--check", "--cache-dir", str(cache))
    out["stats_save"] = tierkv_cli("stats", "--cache-dir", str(cache))
    out["load"] = engine.run(
        "load",
        [
            {"tokens": P, "salt": "tenant-c"},
            {"tokens": R},
            {"tokens": P},
            {"tokens": Q},
            {"tokens": P, "salt": "tenant-b"},
        ],
        connector,
    )
    out["gc_load"] = tierkv_cli("gc", "--check", "--cache-dir", str(cache))
    _corrupt(cache, P, 2)
    out["corrupt"] = engine.run("corrupt", [{"tokens": P}], connector)
    out["gc_corrupt"] = tierkv_cli("gc", "--check", "--cache-dir", str(cache))
    out["stats_corrupt"] = tierkv_cli("stats", "--cache-dir", str(cache))
    _corrupt(cache, P, 3)
    out["async"] = engine.run(
        "async",
        [],
        {**connector, "load_async": True},
        batches=[[{"tokens": P}, {"tokens": Q}, {"tokens": X}], [{"tokens": P}]],
        reset_between=True,
    )
    out["gc_async"] = tierkv_cli("gc", "--check", "--cache-dir", str(cache))
    (work / "summary.json").write_text(
        json.dumps({k: v for k, v in out.items() if k != "cache"}, default=str)[:100000]
    )
    return out


def test_a_cold_store_changes_nothing_and_saves_the_whole_blocks(runs: dict) -> None:
    save, base = runs["save"], runs["base"]
    assert [_cached(save, i) for i in range(3)] == [0, 0, 0]
    _same_output(save["results"][0], base["results"][0])
    _same_output(save["results"][1], base["results"][1])
    spaces = runs["stats_save"]["namespaces"]
    assert sorted(n["blocks"] for n in spaces) == [5, 10]  # P and Q; P again under tenant-b's salt
    spec = json.loads(spaces[0]["spec"])
    assert spec["block_tokens"] == B and spec["dtype"] == "float32" and spec["num_layers"] == 4
    assert "vllm:cpu/" in spec["revision"] and spec["revision"].startswith("w:")


def test_a_new_process_loads_the_prompt_from_tierkv(runs: dict) -> None:
    load, base = runs["load"], runs["base"]
    assert _cached(load, 2) >= len(P) // B * B - B  # the brief's floor; in fact all 5 whole blocks
    assert _cached(load, 2) == 5 * B  # 3 from vLLM's own prefix cache (R's), 2 from tierkv
    _same_output(load["results"][2], base["results"][0])
    assert "loaded 0 blocks" not in load["log"]


def test_blocks_vllm_holds_are_not_read_again(runs: dict) -> None:
    load = runs["load"]
    assert _cached(load, 1) == 3 * B  # R: P's first 3 blocks, from tierkv
    # R 3 + P 2 + Q 5 + tenant-b's P 5 blocks loaded, and no more read (P's first 3 were vLLM's own:
    # reading them again would make it 18)
    assert "loaded 15 blocks (15 read, 0 failed)" in load["log"]


def test_a_fully_cached_prompt_is_loaded_but_its_last_token(runs: dict) -> None:
    """vLLM computes at least one token: of a prompt cached whole, all its blocks are loaded and only its
    last token is computed (not its last block), with the cold run's output."""
    load, base = runs["load"], runs["base"]
    assert _cached(load, 3) == 5 * B - 1
    _same_output(load["results"][3], base["results"][1])


def test_tenants_share_nothing(runs: dict) -> None:
    load, base = runs["load"], runs["base"]
    assert _cached(load, 0) == 0  # tenant-c: nothing of P's, though P and tenant-b's P are stored
    assert _cached(load, 4) == 5 * B  # tenant-b finds its own blocks
    _same_output(load["results"][0], base["results"][0])
    _same_output(load["results"][4], base["results"][0])


def test_a_corrupt_block_is_recomputed_and_saved_again(runs: dict) -> None:
    corrupt, base = runs["corrupt"], runs["base"]
    _same_output(corrupt["results"][0], base["results"][0])
    assert "did not restore; vLLM recomputes them" in corrupt["log"]
    assert runs["gc_corrupt"]["corrupt"] == 0
    unsalted = [n for n in runs["stats_corrupt"]["namespaces"] if json.loads(n["spec"])["tenant_salt"] == ""]
    assert unsalted[0]["blocks"] == 10  # P's block 2 is back, beside Q's


def test_asynchronous_loads_beside_a_computed_request_give_the_cold_output(runs: dict) -> None:
    """``load_async``: P (its block 3 damaged on disk) and Q load on the connector's thread while X, stored
    nowhere, is computed in the same batch; each request computes once its load is reported, from its first
    block that did not load. After vLLM's own prefix cache is emptied P loads whole again (block 3 was
    saved anew)."""
    run, base = runs["async"], runs["base"]
    assert "(loads asynchronous)" in run["log"]
    # vLLM 0.32 counts an asynchronous load's tokens as cached when it admits the request, before the
    # load ran: P's 5 blocks, of which 2 were then recomputed (the log and tierkv's counters say so)
    assert [_cached(run, i) for i in range(4)] == [5 * B, 5 * B - 1, 0, 5 * B]
    for i, j in ((0, 0), (1, 1), (2, 2), (3, 0)):
        _same_output(run["results"][i], base["results"][j])
    assert "2 of 5 blocks of" in run["log"] and "did not restore; vLLM recomputes them" in run["log"]
    assert "Recovered from KV load failure: 1 request(s) rescheduled (256 tokens affected)" in run["log"]
    assert "loaded 13 blocks (13 read, 2 failed)" in run["log"]  # P 3 + Q 5, then P 5


def test_gc_check_is_clean_after_every_run(runs: dict) -> None:
    for name in ("gc_save", "gc_load", "gc_corrupt", "gc_async"):
        assert runs[name]["corrupt"] == 0, (name, runs[name])
        assert runs[name]["checked"] > 0
