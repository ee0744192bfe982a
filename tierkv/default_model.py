"""The embedded default model: a small Llama built from a fixed config with seeded random weights.

Its outputs are gibberish (the weights are random), but its architecture, KV shapes and costs are real,
and it needs nothing from the network: every machine builds the same model. KV: 6 layers x 2 x 4 KV heads
x 64 x 4 bytes = 12 KiB per token in float32.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ByteTokenizer", "DEFAULT_MODEL_ID", "DEFAULT_SEED", "build_default_model", "default_config"]

DEFAULT_MODEL_ID = "tierkv-default-llama-35m"
DEFAULT_SEED = 20261130
PAD_ID, BOS_ID, EOS_ID, BYTE_OFFSET = 0, 1, 2, 3


_ESCAPE_BASE = 0xF700  # invalid byte b (0x80..0xFF) <-> U+F780..U+F7FF, a private-use range


class ByteTokenizer:
    """Byte-level tokenizer: token = byte + 3; ids 0, 1, 2 are pad, bos and eos.

    Bytes that are not valid UTF-8 (the random model emits many) decode to private-use characters
    U+F780..U+F7FF, one per byte, and encode back to the same byte. Text therefore round-trips exactly
    through any JSON client: a conversation sent back tokenizes to what the model generated, and hits its
    whole history. (A user's own U+F780..U+F7FF characters become those raw bytes: a documented quirk.)
    """

    pad_token_id = PAD_ID
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    vocab_size = 256 + BYTE_OFFSET
    chat_template = None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        raw = text.translate(_TO_SURROGATE).encode("utf-8", "surrogateescape")
        return ([BOS_ID] if add_bos else []) + [b + BYTE_OFFSET for b in raw]

    def decode(self, ids: list[int]) -> str:
        raw = bytes(i - BYTE_OFFSET for i in ids if i >= BYTE_OFFSET)
        return raw.decode("utf-8", "surrogateescape").translate(_FROM_SURROGATE)


_FROM_SURROGATE = {0xDC00 + b: _ESCAPE_BASE + b for b in range(0x80, 0x100)}
_TO_SURROGATE = {v: k for k, v in _FROM_SURROGATE.items()}


def default_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    cfg: dict[str, Any] = dict(
        vocab_size=256 + BYTE_OFFSET,
        hidden_size=512,
        intermediate_size=3072,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=16384,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def build_default_model(
    dtype: torch.dtype = torch.float32,
    seed: int = DEFAULT_SEED,
    *,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> Any:
    """About 35M parameters; identical weights for the same seed and torch version.

    ``attn_implementation="eager"`` makes float16 restores bit-identical on CPU: PyTorch's CPU SDPA
    kernel in float16 can round the last rows differently for different query lengths (measured: up to
    5e-4 on logits), so a suffix forward after a restore may differ from a one-pass prefill by a few ulps.
    """
    from transformers import LlamaForCausalLM

    config = default_config(**overrides)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()  # type: ignore[arg-type]  # transformers' decorated .to() confuses mypy
