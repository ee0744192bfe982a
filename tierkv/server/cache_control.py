"""Cache control per request, in the fields clients already send, turned into ``CacheControl``.

- OpenAI: ``prompt_cache_options`` (``ttl`` ``"30m"``, the least every breakpoint the request writes is
  kept after each use; ``mode`` ``"implicit"``: the whole prompt is one, ``"explicit"``: only the parts
  marked are, and without any nothing is saved), ``prompt_cache_breakpoint: {"mode": "explicit", "ttl":
  "30m" | "12h"}`` on chat content parts (the prefix up to the end of that part), the older
  ``prompt_cache_retention`` (``"in_memory"``: the prompt's new blocks stay in memory, never on disk;
  ``"24h"``: kept at least a day after each use) and ``prompt_cache_key`` (routing affinity in ``tierkv
  route``; never a namespace).
- Anthropic-style ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` on chat content parts: the
  prefix up to the end of that part is kept at least that long after each use (at most four breakpoints).
- tierkv's own ``"tierkv": {"retention": "2h", "pin": "1h", "no_store": true}``: a retention of any
  length up to 30 days, a pin (never evicted or idle-expired until it ends, within the pin budget), or
  nothing saved at all.

A value the server does not know is a 400 naming the field: silently caching less (or more) than a
client asked for is the one thing a cache control must not do.

The same fields reach the vLLM connector in a request's ``kv_transfer_params`` (vLLM's server passes no
other field through): ``integrations/vllm/scheduler.py`` reads them with ``cache_control_of`` too.
Nothing here imports the server (FastAPI, the model): the connector runs inside vLLM.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError

from tierkv.errors import ConfigError
from tierkv.retention import CacheControl, Retention, parse_duration

__all__ = [
    "ANTHROPIC_TTLS_S",
    "CacheControlError",
    "OPENAI_TTLS_S",
    "PromptCacheOptions",
    "MAX_BREAKPOINTS",
    "OPENAI_RETENTIONS",
    "TierkvCacheOptions",
    "CONTROL_FIELDS",
    "cache_control_of",
    "control_from_params",
]

OPENAI_RETENTIONS = {"in_memory": Retention(memory_only=True), "24h": Retention(ttl_s=86400.0)}
OPENAI_TTLS_S = {"30m": 1800.0, "12h": 43200.0}
ANTHROPIC_TTLS_S = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4  # OpenAI's and Anthropic's limit; each costs a render of the chat up to it


class PromptCacheOptions(BaseModel):
    """OpenAI's ``prompt_cache_options``."""

    model_config = ConfigDict(extra="forbid")

    mode: str = "implicit"
    ttl: str = "30m"


class CacheControlError(ConfigError):
    """A cache-control field the server does not know (a 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class TierkvCacheOptions(BaseModel):
    """The ``tierkv`` request field: what the OpenAI and Anthropic fields cannot say."""

    model_config = ConfigDict(extra="forbid")

    retention: str | float | None = None  # "2h", "7d", seconds
    pin: str | float | None = None
    no_store: StrictBool = False


def cache_control_of(
    body: Any,
    num_tokens: int,
    prefix_tokens: Callable[[int, int | None], int] | None = None,
) -> CacheControl:
    """The cache control a completion or chat request (``body``, a schema object) asks for its prompt of
    ``num_tokens`` tokens. ``prefix_tokens(m, k)``: for a chat, how many of the prompt's tokens the
    messages up to part ``k`` of message ``m`` make (``k`` None: up to the end of message ``m``). CacheControlError (a 400) naming the field otherwise."""
    prefixes: list[tuple[int, Retention]] = []
    memory_only = no_store = False
    retention = getattr(body, "prompt_cache_retention", None)
    if retention is not None:
        asked = OPENAI_RETENTIONS.get(retention) if isinstance(retention, str) else None
        if asked is None:
            raise CacheControlError(
                f"prompt_cache_retention: must be one of {', '.join(map(repr, OPENAI_RETENTIONS))}, "
                f"got {retention!r}",
                "prompt_cache_retention",
            )
        memory_only = asked.memory_only
        if asked.ttl_s:
            prefixes.append((num_tokens, asked))
    options: PromptCacheOptions | None = getattr(body, "prompt_cache_options", None)
    default_ttl_s = 0.0
    if options is not None:
        if options.mode not in ("implicit", "explicit"):
            raise CacheControlError(
                f"prompt_cache_options.mode: must be 'implicit' or 'explicit', got {options.mode!r}",
                "prompt_cache_options.mode",
            )
        default_ttl_s = _one_of(options.ttl, OPENAI_TTLS_S, "prompt_cache_options.ttl")
        if options.mode == "implicit":
            prefixes.append((num_tokens, Retention(ttl_s=default_ttl_s)))
    ext: TierkvCacheOptions | None = getattr(body, "tierkv", None)
    if ext is not None:
        no_store = ext.no_store
        for field in ("retention", "pin"):
            value = getattr(ext, field)
            if value is None:
                continue
            if memory_only:
                raise CacheControlError(
                    f"tierkv.{field}: a {field} keeps the prompt on disk; prompt_cache_retention "
                    "'in_memory' keeps it off: ask for one of them",
                    f"tierkv.{field}",
                )
            seconds = _duration(value, f"tierkv.{field}")
            prefixes.append(
                (num_tokens, Retention(ttl_s=seconds) if field == "retention" else Retention(pin_s=seconds))
            )
    marks = _breakpoints(getattr(body, "messages", None) or (), default_ttl_s or OPENAI_TTLS_S["30m"])
    marked: list[int] = []
    for m, k, ttl_s in marks:
        if prefix_tokens is None:
            raise CacheControlError(
                "cache_control: only chat content parts take cache_control", "cache_control"
            )
        marked.append(prefix_tokens(m, k))
        prefixes.append((marked[-1], Retention(ttl_s=ttl_s)))
    # Explicit mode: only the marked prefixes are kept (OpenAI writes only its explicit breakpoints)
    save_tokens = max(marked) if options is not None and options.mode == "explicit" and marked else None
    if no_store and (prefixes or memory_only):
        raise CacheControlError(
            "tierkv.no_store: nothing is saved for this request, so it cannot also ask for a retention, "
            "a pin or in_memory",
            "tierkv.no_store",
        )
    if options is not None and options.mode == "explicit" and not marked and not memory_only:
        if prefixes:  # (tierkv's own retention or pin: the whole prompt, as asked)
            save_tokens = None
        else:
            no_store = (
                True  # OpenAI: without an explicit breakpoint "the request does not use prompt caching"
            )
    return CacheControl(tuple(prefixes), memory_only, no_store, save_tokens)


def _duration(value: str | float, field: str) -> float:
    try:
        return parse_duration(value, field)
    except CacheControlError:
        raise
    except ConfigError as exc:
        raise CacheControlError(str(exc), field) from None


def _one_of(value: Any, allowed: dict[str, float], field: str) -> float:
    if value not in allowed:
        raise CacheControlError(
            f"{field}: must be one of {', '.join(map(repr, allowed))}, got {value!r}", field
        )
    return allowed[value]


def _breakpoints(messages: Sequence[Any], openai_ttl_s: float) -> list[tuple[int, int | None, float]]:
    """(message, part, ttl_s) of each content part marked as the end of a prefix to keep: Anthropic's
    ``cache_control`` or OpenAI's ``prompt_cache_breakpoint``, checked. A mark on the message itself
    (part None) ends the prefix at the message's end."""
    out: list[tuple[int, int | None, float]] = []

    def marks(where: Any, field: str, m: int, k: int | None) -> None:
        if (cc := where.get("cache_control")) is not None:
            out.append(
                (m, k, _mark(cc, f"{field}.cache_control", "type", "ephemeral", ANTHROPIC_TTLS_S, "5m"))
            )
        if (bp := where.get("prompt_cache_breakpoint")) is not None:
            ttl_s = _mark(bp, f"{field}.prompt_cache_breakpoint", "mode", "explicit", OPENAI_TTLS_S, None)
            out.append((m, k, ttl_s or openai_ttl_s))

    for m, msg in enumerate(messages):
        if isinstance(msg.content, list):
            for k, part in enumerate(msg.content):
                if isinstance(part, dict):
                    marks(part, f"messages.{m}.content.{k}", m, k)
        marks(
            {"cache_control": msg.cache_control, "prompt_cache_breakpoint": msg.prompt_cache_breakpoint},
            f"messages.{m}",
            m,
            None,
        )
    if len(out) > MAX_BREAKPOINTS:
        raise CacheControlError(
            f"cache_control: at most {MAX_BREAKPOINTS} breakpoints per request, got {len(out)}", "messages"
        )
    return out


def _mark(
    value: Any, field: str, kind: str, expected: str, ttls_s: dict[str, float], default: str | None
) -> float:
    """The ttl of one breakpoint object ({kind: expected, "ttl": ...}); 0.0 for none and no default."""
    if not isinstance(value, dict) or value.get(kind) != expected:
        raise CacheControlError(f'{field}: must be {{"{kind}": "{expected}"}} with an optional ttl', field)
    unknown = set(value) - {kind, "ttl"}
    if unknown:
        raise CacheControlError(f"{field}: unknown field(s) {', '.join(sorted(unknown))}", field)
    ttl = value.get("ttl", default)
    return 0.0 if ttl is None else _one_of(ttl, ttls_s, f"{field}.ttl")


CONTROL_FIELDS = frozenset({"tierkv", "prompt_cache_retention", "prompt_cache_options"})


def _parsed(schema: type[BaseModel], field: str, params: dict[str, Any]) -> Any:
    """``params[field]`` as ``schema`` where it is an object (else as it is, checked by the caller): a value
    the schema refuses is a CacheControlError naming the field inside it, as the server's 400 does."""
    value = params.get(field)
    if not isinstance(value, dict):
        return value
    try:
        return schema(**value)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join([field, *(str(p) for p in first.get("loc", ()))])
        raise CacheControlError(f"{param}: {first.get('msg', 'not understood')}", param) from None


def control_from_params(params: dict[str, Any], num_tokens: int) -> CacheControl:
    """The cache control in a vLLM request's ``kv_transfer_params`` (``prompt_cache_retention``,
    ``prompt_cache_options`` with implicit mode, ``tierkv``): the prompt has no messages there, so no
    breakpoints. CacheControlError or pydantic's ValueError on a value it does not know."""
    body = types.SimpleNamespace(
        prompt_cache_retention=params.get("prompt_cache_retention"),
        prompt_cache_options=_parsed(PromptCacheOptions, "prompt_cache_options", params),
        tierkv=_parsed(TierkvCacheOptions, "tierkv", params),
        messages=None,
    )
    for field in ("prompt_cache_options", "tierkv"):
        value = getattr(body, field)
        if value is not None and not isinstance(value, BaseModel):
            raise CacheControlError(f"{field}: must be an object", field)
    return cache_control_of(body, num_tokens)
