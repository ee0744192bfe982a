"""What the engine (``worker.CachedModel``) returns: a prefill's result, a stream's events, a generation's
result. ``tierkv.worker`` exports them too."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tierkv.store import Hit

__all__ = ["GenerateResult", "PrefillResult", "StreamEvent"]


@dataclasses.dataclass
class PrefillResult:
    logits: torch.Tensor  # [vocab] logits of the next token, float32
    cache: Any  # the model's cache object, holding every prompt token (None once a ``stream`` has ended)
    hit: Hit  # tokens restored from each tier
    computed_tokens: int
    restore_s: float
    forward_s: float
    saved_tokens: int = 0  # prompt tokens handed to the store after it (the cache writes they cost)


@dataclasses.dataclass
class StreamEvent:
    """One step of ``CachedModel.stream``: the prefill, a generated token (``delta``: the text it releases,
    None while text is held back), or the result."""

    prefill: PrefillResult | None = None
    delta: str | None = None
    token_id: int | None = None
    result: GenerateResult | None = None


@dataclasses.dataclass
class GenerateResult:
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str  # "stop" or "length"
    prefill: PrefillResult
    prompt_tokens: int
