"""One vLLM engine process for the connector tests: ``python vllm_run.py SPEC.json RESULT.json``.

SPEC: {"model": dir, "connector": extra-config dict or null (no connector), "prompts": [{"tokens": [...],
"salt": str or null, "kv_transfer_params": dict or null}, ...], "max_tokens": int, "logprobs": int, "block_size": int or null}. The prompts run
one after another (each its own ``generate``), greedy, ignoring EOS; or "batches": [[prompt, ...], ...],
each list one ``generate`` (scheduled together), "reset_between": true to empty vLLM's own prefix cache
between them. "faults": see ``faults.py``. RESULT: per prompt the generated
token ids, their logprobs, ``num_cached_tokens`` and seconds; plus the engine's start-up seconds.

``make_model(dir)`` writes the test model: a random-weight Llama (4 layers, 2 KV heads of 64) with a
large initializer range, so its next-token distributions are peaked and greedy decoding is stable.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

VOCAB = 512


def make_model(path: str | Path, sliding_window: int | None = None) -> Path:
    """``sliding_window``: a Mistral of the same size whose attention sees that many tokens (a model the
    connector cannot keep exactly: it must turn itself off)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    config_class, model_class = (
        (MistralConfig, MistralForCausalLM) if sliding_window else (LlamaConfig, LlamaForCausalLM)
    )
    extra = {"sliding_window": sliding_window} if sliding_window else {}
    cfg = config_class(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
        **extra,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20261201)
        model = model_class(cfg)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    _tokenizer().save_pretrained(tmp)
    tmp.rename(path)
    return path


def _tokenizer():  # noqa: ANN202
    """One word per token id, split on spaces: ``<pad> <s> </s>`` then ``t3`` .. ``t511``, so text ``"t5 t17"``
    is tokens [5, 17] (what the OpenAI server needs; the offline runs pass token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def main(spec_path: str, result_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TierKVConnector",
            "kv_connector_module_path": "tierkv.integrations.vllm",
            "kv_role": spec.get("kv_role", "kv_both"),
            "kv_load_failure_policy": spec.get("kv_load_failure_policy", "recompute"),
            # the self-check recomputes a sampled load: off unless a test asks (hit counts are asserted)
            "kv_connector_extra_config": {"self_check_rate": 0.0, **spec["connector"]},
        }
    # 128: CPU's default, and valid on GPU backends too (whose default, 16, the tests do not assume)
    kwargs["block_size"] = spec.get("block_size") or 128
    import torch

    if torch.cuda.is_available():  # a GPU run (scripts/gpu_check.sh): room for two engines at once
        kwargs["gpu_memory_utilization"] = 0.25
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        seed=0,
        **kwargs,
    )
    startup = time.perf_counter() - t0
    params = SamplingParams(
        temperature=0.0,
        max_tokens=spec.get("max_tokens", 8),
        ignore_eos=True,
        logprobs=spec.get("logprobs", 1),
        detokenize=False,
    )
    before_batch = None
    if spec.get("faults"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import faults

        before_batch = faults.install(spec["faults"], spec["connector"]["cache_dir"])
    results = []
    # "prompts": one generate call each; "batches": lists of prompts, each list one generate call (its
    # requests scheduled together, sharing steps)
    batches = spec.get("batches") or [[p] for p in spec["prompts"]]
    for n, batch in enumerate(batches):
        if n and spec.get("reset_between"):  # vLLM's own prefix cache forgets: the next batch asks tierkv
            llm.reset_prefix_cache()
        if before_batch is not None:
            before_batch(n)
        prompts = []
        per_prompt = []  # a prompt's "kv_transfer_params" reach the connector as vLLM's server passes them
        for p in batch:
            prompt = TokensPrompt(prompt_token_ids=p["tokens"])
            if p.get("salt"):
                prompt["cache_salt"] = p["salt"]
            prompts.append(prompt)
            own = params.clone()
            if p.get("kv_transfer_params") is not None:
                own.extra_args = {"kv_transfer_params": p["kv_transfer_params"]}
            per_prompt.append(own)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, per_prompt, use_tqdm=False)
        seconds = time.perf_counter() - t1
        for out in outs:
            gen = out.outputs[0]
            results.append(
                {
                    "tokens": list(gen.token_ids),
                    "logprobs": [lp[t].logprob for lp, t in zip(gen.logprobs or [], gen.token_ids)],
                    "num_cached_tokens": out.num_cached_tokens or 0,
                    "seconds": seconds,
                }
            )
    if before_batch is not None:
        faults.finish()
    del llm  # the engine shuts down: the connector's store is closed, its write-behind flushed
    summary = {"startup_s": startup, "results": results}
    if spec.get("faults"):
        summary["faults"] = faults.counts
    Path(result_path).write_text(json.dumps(summary))


if __name__ == "__main__":
    if sys.argv[1] == "--make-model":
        make_model(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
    else:
        main(sys.argv[1], sys.argv[2])
