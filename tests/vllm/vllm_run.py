"""One vLLM engine process for the connector tests: ``python vllm_run.py SPEC.json RESULT.json``.

SPEC: {"model": dir, "connector": extra-config dict or null (no connector), "prompts": [{"tokens": [...],
"salt": str or null}, ...], "max_tokens": int, "logprobs": int, "block_size": int or null}. The prompts run
one after another (each its own ``generate``), greedy, ignoring EOS. RESULT: per prompt the generated
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


def make_model(path: str | Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    cfg = LlamaConfig(
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
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20261201)
        model = LlamaForCausalLM(cfg)
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
            "kv_connector_extra_config": spec["connector"],
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
    results = []
    for p in spec["prompts"]:
        prompt = TokensPrompt(prompt_token_ids=p["tokens"])
        if p.get("salt"):
            prompt["cache_salt"] = p["salt"]
        t1 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t1
        gen = out.outputs[0]
        results.append(
            {
                "tokens": list(gen.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(gen.logprobs or [], gen.token_ids)],
                "num_cached_tokens": out.num_cached_tokens or 0,
                "seconds": seconds,
            }
        )
    Path(result_path).write_text(json.dumps({"startup_s": startup, "results": results}))
    del llm  # the engine shuts down: the connector's store is closed, its write-behind flushed


if __name__ == "__main__":
    if sys.argv[1] == "--make-model":
        make_model(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
