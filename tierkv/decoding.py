"""Decoding's small rules, apart from the model: the next token from the logits (greedy, or sampled with a
temperature and top-p), and where streamed text may be cut (stop strings, characters still incomplete)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["cut_at_stop", "maybe_partial", "pick"]


def pick(logits: torch.Tensor, temperature: float, top_p: float, rng: torch.Generator | None) -> int:
    # Values float32 cannot compute with are taken for what they ask: a temperature this small is greedy
    # (1/T overflows), a top_p below the smallest normal keeps the most likely token (it underflows).
    if temperature < 1e-5 or not math.isfinite(temperature):
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        return int(torch.argmax(logits))
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < max(top_p, float(torch.finfo(torch.float32).tiny))
        keep[0] = True  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=rng))


def maybe_partial(ch: str) -> bool:
    """A replacement character or an escaped byte may still become part of a multi-byte character."""
    return ch == "\ufffd" or "\udc80" <= ch <= "\udcff" or "\uf780" <= ch <= "\uf7ff"


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    cut = min((text.find(s) for s in stop if s and s in text), default=-1)
    return text[:cut] if cut >= 0 else text
