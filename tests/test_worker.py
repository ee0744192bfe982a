"""Exactness of restored prefixes through real transformers models (random weights, real KV)."""

import dataclasses

import pytest
import torch

from tierkv import TieredStore
from tierkv.default_model import ByteTokenizer, build_default_model
from tierkv.worker import CachedModel

from helpers import run_python, save_byte_tokenizer

TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_model(
    store, dtype=torch.float32, seed=1, block_tokens=16, attn="auto", self_check_rate=0.0
) -> CachedModel:
    # float16 with eager attention: CPU SDPA in float16 is not invariant to the query length (see
    # test_float16_sdpa_tolerance); float32 and bfloat16 use SDPA, the default.
    attn = ("eager" if dtype == torch.float16 else "sdpa") if attn == "auto" else attn
    model = build_default_model(dtype, seed=seed, attn_implementation=attn, **TINY)
    return CachedModel(
        model,
        ByteTokenizer(),
        store,
        model_id="tiny",
        block_tokens=block_tokens,
        self_check_rate=self_check_rate,
    )


def prompt(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(salt)
    return torch.randint(3, 259, (n,), generator=g).tolist()


def assert_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        assert (a - b).abs().max().item() <= 1e-4
    else:
        assert torch.equal(a, b), f"max abs diff {(a - b).abs().max().item()}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("cached_len", "total_len"), [(16, 40), (128, 150), (160, 170), (64, 64)])
def test_restore_from_host_matches_cold_prefill(tmp_path, dtype, cached_len, total_len) -> None:
    """Hits of one block, of many, of all but a trailing partial block, and a fully cached prompt."""
    with TieredStore.open(None, host_bytes=2**26) as store:
        cm = tiny_model(store, DTYPES[dtype])
        ids = prompt(total_len)
        cm.prefill(ids[:cached_len])  # caches the full blocks of the first part
        cold = cm.prefill(ids, use_cache=False)
        warm = cm.prefill(ids)
        expect = min(cached_len, (total_len - 1) // 16 * 16) // 16 * 16
        assert warm.hit.num_tokens == expect and warm.hit.by_tier["host"] == expect
        assert warm.computed_tokens == total_len - expect
        assert_close(warm.logits, cold.logits, DTYPES[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_restore_from_disk_after_process_restart(tmp_path, dtype) -> None:
    ids = prompt(200, salt=3)
    r = run_python(f"""
        import torch
        from tierkv import TieredStore
        from test_worker import tiny_model, DTYPES
        with TieredStore.open({str(tmp_path)!r}, host_bytes=2**26) as store:
            tiny_model(store, DTYPES[{dtype!r}]).prefill({ids[:180]!r})
            store.flush()
    """)
    assert r.returncode == 0, r.stderr
    with TieredStore.open(tmp_path, host_bytes=2**26) as store:
        cm = tiny_model(store, DTYPES[dtype])
        warm = cm.prefill(ids)
        cold = cm.prefill(ids, use_cache=False)
        assert warm.hit.by_tier == {"host": 0, "disk": 176}
        assert_close(warm.logits, cold.logits, DTYPES[dtype])
        g_cold = cm.generate(ids, 32, use_cache=False)
        g_warm = cm.generate(ids, 32)
        # Promoted to the host tier, plus the block the previous prefill completed.
        assert g_warm.prefill.hit.by_tier == {"host": 192, "disk": 0}
        assert g_warm.token_ids == g_cold.token_ids


def test_float16_sdpa_tolerance() -> None:
    """The stated tolerance where bit-identity does not hold: float16 through CPU SDPA."""
    with TieredStore.open(None, host_bytes=2**26) as store:
        cm = tiny_model(store, torch.float16, attn="sdpa")
        for cached, total in ((176, 200), (64, 200), (160, 170)):
            ids = prompt(total, salt=cached)
            cm.prefill(ids[:cached])
            warm, cold = cm.prefill(ids), cm.prefill(ids, use_cache=False)
            assert warm.hit.num_tokens == cached
            assert (warm.logits - cold.logits).abs().max().item() <= 2e-3
            assert int(warm.logits.argmax()) == int(cold.logits.argmax())


def test_greedy_generation_identical_with_and_without_cache() -> None:
    with TieredStore.open(None, host_bytes=2**26) as store:
        cm = tiny_model(store, torch.bfloat16)
        ids = prompt(100, salt=5)
        base = cm.generate(ids, 32, use_cache=False)
        cm.generate(ids, 32)
        again = cm.generate(ids, 32)
        assert again.prefill.hit.num_tokens == 96
        assert again.token_ids == base.token_ids and len(base.token_ids) == 32


def test_seeded_sampling_is_reproducible() -> None:
    with TieredStore.open(None, host_bytes=2**26) as store:
        cm = tiny_model(store)
        ids = prompt(50)
        a = cm.generate(ids, 16, temperature=0.8, top_p=0.9, seed=7)
        b = cm.generate(ids, 16, temperature=0.8, top_p=0.9, seed=7)
        assert a.token_ids == b.token_ids and b.prefill.hit.num_tokens == 48


def test_conversation_hits_its_whole_history() -> None:
    with TieredStore.open(None, host_bytes=2**26) as store:
        cm = tiny_model(store)
        turn1 = prompt(70, salt=1)
        out1 = cm.generate(turn1, 40)
        turn2 = turn1 + out1.token_ids + prompt(30, salt=2)
        res = cm.prefill(turn2)
        # Everything the first turn saw (prompt + its generated tokens but the last) is cached.
        assert res.hit.num_tokens == (len(turn1) + len(out1.token_ids) - 1) // 16 * 16


def test_classic_prefix_cases_end_to_end() -> None:
    A, B, C, D, E = (prompt(16, salt=s) for s in range(10, 15))
    with TieredStore.open(None, host_bytes=2**26) as store:
        cm = tiny_model(store)
        cm.prefill(A + B + C + D + [5])
        assert cm.prefill(A + B + C + E + [5]).hit.num_tokens == 48
        assert cm.prefill(D + B + C + A + [5]).hit.num_tokens == 0


def test_other_weights_dtype_or_block_size_never_hit() -> None:
    ids = prompt(100)
    with TieredStore.open(None, host_bytes=2**26) as store:
        base = tiny_model(store)
        base.prefill(ids)
        assert base.prefill(ids).hit.num_tokens == 96
        for other in (
            tiny_model(store, seed=2),
            tiny_model(store, torch.bfloat16),
            tiny_model(store, block_tokens=32),
        ):
            assert other.base_namespace.digest != base.base_namespace.digest
            assert other.prefill(ids).hit.num_tokens == 0
        tuned = tiny_model(store)
        with torch.no_grad():
            next(tuned.model.parameters()).view(-1)[123] += 1e-3  # one weight of one tensor
        tuned = CachedModel(tuned.model, ByteTokenizer(), store, model_id="tiny", block_tokens=16)
        assert tuned.prefill(ids).hit.num_tokens == 0
        assert base.prefill(ids, cache_salt="tenant-b").hit.num_tokens == 0  # salts isolate tenants


ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(TINY, vocab_size=259)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(TINY, vocab_size=259)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(TINY, vocab_size=259)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(TINY, vocab_size=259, sliding_window=None)),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=128, n_layer=2, n_head=4, vocab_size=259, n_positions=1024),
    ),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_architectures_restore_exactly(arch) -> None:
    import transformers

    cfg_name, model_name, kwargs = ARCHS[arch]
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with TieredStore.open(None, host_bytes=2**26) as store:
        cm = CachedModel(model, ByteTokenizer(), store, model_id=arch, block_tokens=16)
        ids = prompt(90, salt=9)
        cm.prefill(ids[:70])
        cold = cm.prefill(ids, use_cache=False)
        warm = cm.prefill(ids)
        assert warm.hit.num_tokens == 64
        assert (warm.logits - cold.logits).abs().max().item() <= 1e-4
        assert cm.generate(ids, 16).token_ids == cm.generate(ids, 16, use_cache=False).token_ids


def test_embedded_default_model_shape_and_determinism() -> None:
    cm = CachedModel.default(None)
    ns = cm.base_namespace
    assert (ns.num_layers, ns.num_kv_heads, ns.head_dim, ns.dtype) == (6, 4, 64, "float32")
    assert 30e6 < sum(p.numel() for p in cm.model.parameters()) < 40e6
    again = CachedModel.default(None)
    assert again.base_namespace == ns  # same weights fingerprint: built identically
    assert dataclasses.replace(ns, tenant_salt="x").digest != ns.digest


def _save_local_model(path) -> None:
    """A tiny Llama and a byte-level BPE tokenizer saved as a Hugging Face directory (no hub)."""
    vocab_size = save_byte_tokenizer(path)
    model = build_default_model(
        torch.float32,
        seed=3,
        **dict(TINY, vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=None),
    )
    model.save_pretrained(path)


def test_local_hugging_face_directory_loads_offline_and_restores(tmp_path) -> None:
    _save_local_model(tmp_path / "my-model")
    with TieredStore.open(tmp_path / "cache", host_bytes=2**26) as store:
        cm = CachedModel.from_pretrained(tmp_path / "my-model", store, block_tokens=16)
        assert cm.base_namespace.model_id == "my-model"
        ids = cm.tokenizer.encode("The same system prompt comes back request after request. " * 3)
        cold = cm.prefill(ids, use_cache=False)
        cm.prefill(ids)
        warm = cm.prefill(ids)
        assert warm.hit.num_tokens == (len(ids) - 1) // 16 * 16 > 0
        assert (warm.logits - cold.logits).abs().max().item() <= 1e-4
        pinned = CachedModel.from_pretrained(tmp_path / "my-model", store, block_tokens=16, revision="v1")
        assert pinned.base_namespace.revision.startswith("v1+cfg:")
        assert pinned.prefill(ids).hit.num_tokens == 0  # another revision, another namespace


def test_not_a_model_directory_is_a_clear_error(tmp_path) -> None:
    from tierkv.errors import ConfigError

    with pytest.raises(ConfigError, match="no config.json"):
        CachedModel.from_pretrained(tmp_path, None)
    # a typo of a built-in name: the error names the built-in ones
    with pytest.raises(ConfigError, match="smollm does not exist; the built-in models are tiny, smollm2"):
        CachedModel.from_pretrained("smollm", None)


def test_stream_deltas_add_up_to_the_final_text_and_honour_stop() -> None:
    with TieredStore.open(None, host_bytes=2**26) as store:
        cm = tiny_model(store)
        ids = prompt(40, salt=21)
        full = cm.generate(ids, 48)
        assert full.finish_reason == "length" and len(full.token_ids) == 48
        stop = full.text[10:13]
        events = list(cm.stream(ids, 48, stop=[stop]))
        result = events[-1].result
        deltas = "".join(e.delta for e in events if e.delta is not None)
        assert events[0].prefill is not None and result is not None
        assert deltas == result.text == full.text[: full.text.find(stop)]
        assert result.finish_reason == "stop"


def test_stream_steps_at_every_token_also_while_its_text_is_held_back() -> None:
    """Each generated token is a step of the stream, with or without text to send: a caller that went
    away is noticed there (Engine.stream). A long stop string holds the text back: before, those tokens
    made no step, and a stream whose text stayed held back ran on to max_tokens unnoticed."""
    with TieredStore.open(None, host_bytes=2**26) as store:
        cm = tiny_model(store)
        ids = prompt(40, salt=22)
        events = list(cm.stream(ids, 24, stop=["x" * 200]))  # never matches; holds 199 characters back
        steps = [e for e in events if e.token_id is not None]
        result = events[-1].result
        assert result is not None and len(result.token_ids) == 24
        assert [e.token_id for e in steps] == result.token_ids
        assert all(e.delta is None for e in steps)  # all of it held back until the end


def test_byte_tokenizer_roundtrips_invalid_utf8() -> None:
    tok = ByteTokenizer()
    ids = [BYTE + 3 for BYTE in (0xE2, 0x82, 0x41, 0xFF, 0xC3, 0xA9)]
    assert tok.encode(tok.decode(ids), add_bos=False) == ids
