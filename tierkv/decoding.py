"""Decoding's small rules, apart from the model: the next token from the logits (greedy, or sampled with a
temperature and top-p), the generated text grown a token at a time, and where streamed text may be cut
(stop strings, characters still incomplete)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["TextStream", "cut_at_stop", "maybe_partial", "pick", "stop_in_tail"]


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


class TextStream:
    """The generated tokens' text, grown a token at a time. Each step decodes only the tokens since the last
    complete character and the few before them (their context: a tokenizer that drops a leading space does
    so for both, and the difference is the new text); decoding every token at every step made a long
    generation quadratic (4,000 tokens: 8 million token decodes).

    ``text`` holds whole characters only: a token that ends inside a multi-byte character waits for the
    next (``finish`` adds what is left as the tokenizer decodes it)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # ids[_prefix:_read]: the context, decoded at the end of ``text``
        self._prefix_text = ""

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        new = self._decode(self.ids[self._prefix :])
        if len(new) > len(self._prefix_text) and not maybe_partial(new[-1]):
            self.text += new[len(self._prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix : self._read])

    def finish(self) -> str:
        """``text`` with what is still pending (characters never completed), as the tokenizer decodes it."""
        if self._read < len(self.ids):
            new = self._decode(self.ids[self._prefix :])
            self.text += new[len(self._prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix : self._read])
        return self.text


def stop_in_tail(text: str, stop: Sequence[str], checked: int) -> bool:
    """Whether a stop string is in ``text``, whose first ``checked`` characters held none: only the new
    part and as much before it as a stop string could start in is searched (not all of it every step)."""
    longest = max((len(s) for s in stop), default=0)
    tail = text[max(0, checked - longest + 1) :]
    return any(s and s in tail for s in stop)
