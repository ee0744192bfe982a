"""Why prompts miss the cache: where two prompts diverge, what in a template breaks caching, and which
recent requests ended their hit early (``MissLog``, behind ``GET /admin/misses``).

A prompt is reused block by block from token 0, so everything after the first differing token is
recomputed, whole blocks rounded down. A date on a template's first line makes every request miss; the
same date at the end costs one block.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from tierkv.keys import BlockKey, Namespace, block_keys


@dataclasses.dataclass(frozen=True)
class Divergence:
    first_divergent_token: int | None  # 0-based; None when one prompt is a prefix of the other
    block: int | None  # the block that token falls in
    reused_tokens: int  # of prompt B, restored from prompt A's cache
    recomputed_tokens: int  # of prompt B
    reused_blocks: int
    tokens_a: int
    tokens_b: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def diverge(a: Sequence[int], b: Sequence[int], block_tokens: int) -> Divergence:
    """What prompt B reuses of prompt A's cache, and where it stops."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    common = n if first is None else first
    # Whole blocks only, and at least one token of B is always computed (its logits are needed).
    reused = (
        min(common // block_tokens * block_tokens, (len(b) - 1) // block_tokens * block_tokens) if b else 0
    )
    return Divergence(
        first,
        None if first is None else first // block_tokens,
        reused,
        len(b) - reused,
        reused // block_tokens,
        len(a),
        len(b),
    )


def show(tokenizer: Any, ids: Sequence[int], start: int, end: int) -> str:
    return tokenizer.decode(list(ids[max(0, start) : max(0, end)]))


def around(
    tokenizer: Any,
    a: Sequence[int],
    b: Sequence[int],
    pos: int,
    width: int = 24,
    mark: tuple[str, str] = ("[[", "]]"),
) -> tuple[str, str]:
    """Text of A and B around ``pos``, the differing part between ``mark``s."""
    end_a = next((i for i in range(pos, len(a)) if i >= len(b) or a[i] == b[i]), len(a))
    end_b = next((i for i in range(pos, len(b)) if i >= len(a) or a[i] == b[i]), len(b))

    def one(ids: Sequence[int], stop: int) -> str:
        return (
            show(tokenizer, ids, pos - width, pos)
            + mark[0]
            + show(tokenizer, ids, pos, min(stop, pos + width))
            + mark[1]
            + show(tokenizer, ids, stop, stop + width)
        ).replace("\n", "\\n")

    return one(a, end_a), one(b, end_b)


# ------------------------------------------------------------------------------------------ lint

_DYNAMIC = [
    (
        "date",
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}(?:[T ][0-9:.]+(?:Z|[+-]\d{2}:?\d{2})?)?\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b|"
            r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? \d{1,2},? \d{4}\b|"
            r"\{\{\s*(?:date|today|now|time|timestamp)[^}]*\}\}",
            re.I,
        ),
    ),
    ("time", re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\s*(?:[AaPp][Mm]|UTC|Z)?\b")),
    ("uuid", re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I)),
    (
        "request id",
        re.compile(
            r"\b(?:request|req|trace|session|user|conversation|message)[ _-]?id\s*[:=#]?\s*\S+"
            r"|\{\{\s*\w*(?:id|uuid|nonce)\s*\}\}",
            re.I,
        ),
    ),
    ("hex id", re.compile(r"\b[0-9a-f]{16,}\b", re.I)),
    ("counter", re.compile(r"(?:#|\bno\.?\s*|\bturn\s*|\bstep\s*|\battempt\s*)\d+\b", re.I)),
]


@dataclasses.dataclass(frozen=True)
class Finding:
    kind: str
    text: str
    char_offset: int
    token_offset: int
    invalidated_tokens: int  # tokens after it: recomputed whenever it changes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lint(text: str, encode: Any, min_invalidated: int = 64) -> list[Finding]:
    """Dynamic-looking content with at least ``min_invalidated`` tokens after it, worst first."""
    total = len(encode(text))
    found: dict[tuple[int, int], Finding] = {}
    for kind, pattern in _DYNAMIC:
        for m in pattern.finditer(text):
            if any(s <= m.start() < e for (s, e) in found):  # already reported as a more specific kind
                continue
            tok = len(encode(text[: m.start()]))
            after = total - tok
            if after >= min_invalidated:
                found[(m.start(), m.end())] = Finding(kind, m.group(0), m.start(), tok, after)
    return sorted(found.values(), key=lambda f: -f.invalidated_tokens)


def suggestion(findings: list[Finding]) -> str:
    if not findings:
        return "No dynamic-looking content before large stable content: this template caches well."
    kinds = ", ".join(sorted({f.kind for f in findings}))
    worst = findings[0]
    return (
        f"Move the dynamic parts ({kinds}) after the stable content, e.g. into the last message or the "
        f"template's end: the {worst.kind} {worst.text!r} at token {worst.token_offset} makes "
        f"{worst.invalidated_tokens} tokens miss whenever it changes."
    )


# ------------------------------------------------------------------------------------------ miss log


MAX_LABEL = 64  # characters of a request's ``user`` kept as its template label


@dataclasses.dataclass
class _Seen:
    at_s: float
    ns: bytes  # the namespace digest: model and tenant (cache_salt); prompts are compared only within one
    template: str
    keys: list[BlockKey]
    ids: list[int] | None  # only with debug_prompts


class MissLog:
    """Recent prompts' block-key chains (keys only, no text unless ``debug_prompts``), bounded.

    Holds the last ``capacity`` prompts and misses, and at most ``max_templates`` rows of the hit rate per
    template (the row updated least recently goes first). A miss is explained only by an earlier prompt of
    the same namespace, so never by another tenant's (another ``cache_salt``) prompt or text.
    """

    def __init__(self, capacity: int = 256, debug_prompts: bool = False, max_templates: int = 1024) -> None:
        self.debug_prompts = debug_prompts
        self.max_templates = max_templates
        self._recent: collections.deque[_Seen] = collections.deque(maxlen=capacity)
        self._misses: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        # (namespace, template) -> [cached tokens, prompt tokens, requests], least recently updated first
        self._by_template: collections.OrderedDict[tuple[str, str], list[int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def record(
        self, ns: Namespace, ids: Sequence[int], cached_tokens: int, user: str | None, tokenizer: Any
    ) -> None:
        keys = block_keys(ns, ids)
        B = ns.block_tokens
        hit_blocks = cached_tokens // B
        user = user[:MAX_LABEL] if user else None
        template = user or (keys[0].hex()[:16] if keys else "short prompts")
        digest = bytes(ns.digest)
        with self._lock:
            # The earlier prompt this one resembles: of this namespace only, the longest shared chain of
            # block keys (the latest of equals); one sharing no block only if it is of the same template.
            best, best_blocks = None, 0
            for seen in reversed(self._recent):
                if seen.ns != digest:
                    continue
                n = 0
                while n < min(len(seen.keys), len(keys)) and seen.keys[n] == keys[n]:
                    n += 1
                if n > best_blocks or (best is None and seen.template == template):
                    best, best_blocks = seen, n
            possible = (len(ids) - 1) // B  # blocks that could have been restored
            if best is not None and hit_blocks < possible:
                miss: dict[str, Any] = {
                    "at_s": time.time(),
                    "user": user,
                    "template": template,
                    "namespace": digest.hex()[:16],
                    "prompt_tokens": len(ids),
                    "cached_tokens": cached_tokens,
                    "restorable_tokens": possible * B,
                    "closest_earlier_shared_blocks": best_blocks,
                    "diverged_in_block": best_blocks,
                    "diverged_at_token_at_most": (best_blocks + 1) * B,
                }
                if self.debug_prompts and best.ids is not None:
                    d = diverge(best.ids, ids, B)
                    if d.first_divergent_token is not None:
                        a_txt, b_txt = around(
                            tokenizer, best.ids, ids, d.first_divergent_token, width=16, mark=("", "")
                        )
                        miss["diverged_at_token"] = d.first_divergent_token
                        miss["explanation"] = (
                            f"the prefix broke at token {d.first_divergent_token}: "
                            f"{_diff_text(tokenizer, ids, best.ids, d.first_divergent_token)}"
                        )
                        miss["snippets"] = {"earlier": a_txt, "this": b_txt}
                self._misses.append(miss)
            self._recent.append(
                _Seen(time.time(), digest, template, keys, list(ids) if self.debug_prompts else None)
            )
            row = self._by_template.setdefault((digest.hex()[:16], template), [0, 0, 0])
            self._by_template.move_to_end((digest.hex()[:16], template))
            row[0] += cached_tokens
            row[1] += len(ids)
            row[2] += 1
            while len(self._by_template) > self.max_templates:
                self._by_template.popitem(last=False)

    def report(self, limit: int = 50) -> dict[str, Any]:
        with self._lock:
            templates = [
                {
                    "template": t,
                    "namespace": ns,
                    "requests": r,
                    "cached_tokens": c,
                    "prompt_tokens": p,
                    "hit_rate": c / p if p else 0.0,
                }
                for (ns, t), (c, p, r) in self._by_template.items()
            ]
            return {
                "misses": list(self._misses)[-limit:][::-1],
                "templates": sorted(templates, key=lambda r: -r["requests"]),
            }


def _diff_text(tokenizer: Any, this: Sequence[int], earlier: Sequence[int], pos: int) -> str:
    """The words around the first difference, in both prompts: ``'2026-09-08' against '2026-09-07'``."""

    def word(ids: Sequence[int]) -> str:
        before = tokenizer.decode(list(ids[max(0, pos - 32) : pos]))
        after = tokenizer.decode(list(ids[pos : pos + 48]))
        head = re.search(r"\S*$", before)
        tail = re.match(r"\S*", after)
        return repr((head.group(0) if head else "") + (tail.group(0) if tail else ""))

    return f"{word(this)} against {word(earlier)}"


__all__ = ["MAX_LABEL", "Divergence", "Finding", "MissLog", "around", "diverge", "lint", "show", "suggestion"]
