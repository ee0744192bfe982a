"""Decoding's small rules, apart from the model: the next token from the logits (greedy, or sampled with a
temperature and top-p), the generated text grown a token at a time, and where streamed text may be cut
(stop strings, characters still incomplete)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

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
    generation quadratic (4,000 tokens: 8 million token decodes, 2.9 s with a byte-level BPE tokenizer).

    ``text`` holds whole characters only; ``pending`` what the tokens since decode to while a character is
    incomplete (``finish`` adds it as the tokenizer decodes it). ``whole``: decode every token each step, as
    before: for tokenizers whose clean-up joins text across tokens (``clean_up_tokenization_spaces``:
    "do n't" is "don't"), which the difference of two pieces cannot follow. A piece whose decoding does not
    start with its context's switches to that too, so the text is always the tokenizer's text of all the
    tokens (a run of tokens that never completes a character is decoded again at each of its steps)."""

    @classmethod
    def of(cls, tokenizer: Any) -> TextStream:
        """For ``tokenizer`` (its ``decode``): whole where its clean-up joins text across tokens."""
        return cls(tokenizer.decode, whole=bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)))

    def __init__(self, decode: Callable[[list[int]], str], whole: bool = False) -> None:
        self._decode = decode
        self.whole = whole
        self.ids: list[int] = []
        self.text = self.pending = ""
        self._prefix = self._read = 0  # ids[_prefix:_read]: the context, decoded at the end of ``text``
        self._prefix_text = ""
        self._checked = 0  # how much of ``text`` held no stop string (``stopped``): its length before ``add``

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        self._checked = len(self.text)
        if not self.whole:
            new = self._decode(self.ids[self._prefix :])
            if new.startswith(self._prefix_text):
                if len(new) > len(self._prefix_text) and not maybe_partial(new[-1]):
                    self.text += new[len(self._prefix_text) :]
                    self.pending = ""
                    self._prefix, self._read = self._read, len(self.ids)
                    self._prefix_text = self._decode(self.ids[self._prefix : self._read])
                else:
                    self.pending = new[len(self._prefix_text) :]
                return
            self.whole = True  # the tokenizer rewrote the context: pieces cannot follow it
        text = self._decode(self.ids)
        cut = len(text)
        while cut and maybe_partial(text[cut - 1]):
            cut -= 1
        self.text, self.pending = text[:cut], text[cut:]

    def stopped(self, stop: Sequence[str]) -> bool:
        """Whether a stop string is in the text, asked after each ``add`` (only what it added, and as much
        before it as a stop string could start in, is searched); incomplete characters included as the
        tokenizer decodes them now (a stop string may end before one: "Answer: ", then a token of a space
        and half a character)."""
        return stop_in_tail(self.text + self.pending, stop, 0 if self.whole else self._checked)

    def finish(self) -> str:
        """``text`` with what is still pending (characters never completed), as the tokenizer decodes it."""
        if self.whole:
            self.text, self.pending = self._decode(self.ids), ""
        elif self._read < len(self.ids):
            self.text += self.pending
            self.pending = ""
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix : self._read])
        return self.text


def stop_in_tail(text: str, stop: Sequence[str], checked: int) -> bool:
    """Whether a stop string is in ``text``, whose first ``checked`` characters held none: only the new
    part and as much before it as a stop string could start in is searched (not all of it every step)."""
    longest = max((len(s) for s in stop), default=0)
    tail = text[max(0, checked - longest + 1) :]
    return any(s and s in tail for s in stop)
