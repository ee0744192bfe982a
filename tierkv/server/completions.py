"""The OpenAI-compatible generation routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``.

A request is tokenized and prefilled on the model thread (``Engine.stream``); errors surface with the
prefill, before any byte of the answer is sent. Then the whole answer (JSON) or a stream of events (SSE).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from jinja2 import TemplateError, TemplateSyntaxError  # chat templates' errors (jinja2 comes with torch)

from tierkv.errors import ConfigError, PinBudgetError
from tierkv.prompts import PromptError, encode_text, render_chat
from tierkv.retention import NO_CONTROL, CacheControl
from tierkv.server.cache_control import cache_control_of
from tierkv.server.engine import Busy, ClientError
from tierkv.server.responses import JSON, error, sse
from tierkv.server.schemas import ChatCompletionRequest, CompletionRequest, error_body
from tierkv.server.state import Server
from tierkv.worker import GenerateResult, PrefillResult, StreamEvent

log = logging.getLogger("tierkv.server")

GREEDY_BELOW = (
    1e-5  # temperatures below this sample greedily (as vLLM does): logits / T would overflow float32
)
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # top_p is compared in float32: below this it rounds to 0


def sampling(temperature: float, top_p: float) -> tuple[float, float]:
    """The (temperature, top_p) to sample with: what the request asks, in a range float32 can compute.

    A temperature below ``GREEDY_BELOW`` is greedy. A top_p below float32's smallest normal keeps only
    the most likely token, which is what it asks for anyway (that token's probability is far above it).
    """
    if temperature < GREEDY_BELOW:
        return 0.0, 1.0
    return temperature, max(top_p, FLOAT32_TINY)


def add_completion_routes(app: FastAPI, server: Server) -> None:
    m = server.metrics

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        def tokenize() -> list[int]:
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                if len(prompt) != 1:
                    raise ClientError(
                        "prompt: a batch of several prompts is not supported (send one per request)", "prompt"
                    )
                prompt = prompt[0]
            if isinstance(prompt, list):
                vocab = server.vocab_size
                bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab), None)  # type: ignore[operator]
                if not prompt or bad is not None:
                    raise ClientError(
                        "prompt: token ids must be a non-empty list of ids from 0 to "
                        f"{vocab - 1} (this model's vocabulary)"
                        + (f"; got {prompt[bad]} at position {bad}" if bad is not None else ""),
                        "prompt",
                    )
                return list(prompt)  # type: ignore[arg-type]
            if not prompt:
                raise ClientError("prompt must not be empty", "prompt")
            return encode_text(server.cm.tokenizer, prompt)

        return await _generate(
            req,
            request,
            tokenize,
            chat=False,
            default_max_tokens=16,
            control=lambda body, ids: cache_control_of(body, len(ids)),
        )

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        def render(messages: list[dict[str, str]]) -> list[int]:
            try:
                return render_chat(server.cm.tokenizer, messages)
            except TemplateSyntaxError:  # the model's template itself is broken: the server's fault (500)
                raise
            except TemplateError as exc:  # raise_exception(...) in the template (Llama-2, Mistral, Gemma
                # refuse some role orders), or a message it cannot render: the request's fault
                raise ClientError(
                    f"messages: the model's chat template does not accept these messages: {exc}", "messages"
                ) from None

        def tokenize() -> list[int]:
            return render([{"role": msg.role, "content": msg.text()} for msg in req.messages])

        def control(body: ChatCompletionRequest, ids: list[int]) -> CacheControl:
            def prefix_tokens(m: int, k: int | None) -> int:
                """Prompt tokens up to the end of part k of message m (k None: of the whole message): the
                chat rendered that far and compared with the whole (its template closes the turn: only the
                common part counts)."""
                msgs = [{"role": x.role, "content": x.text()} for x in body.messages[:m]]
                last = body.messages[m]
                if k is not None:
                    last = last.model_copy(update={"content": list(last.content or [])[: k + 1]})
                try:
                    upto = render(msgs + [{"role": last.role, "content": last.text()}])
                except ClientError:  # a template that refuses the cut chat: the whole messages before
                    upto = render(msgs) if msgs else []
                return next(
                    (i for i, (a, b) in enumerate(zip(ids, upto)) if a != b), min(len(ids), len(upto))
                )

            return cache_control_of(body, len(ids), prefix_tokens)

        max_tokens = req.max_completion_tokens or req.max_tokens
        return await _generate(
            req, request, tokenize, chat=True, default_max_tokens=256, max_tokens=max_tokens, control=control
        )

    async def _generate(
        req: CompletionRequest | ChatCompletionRequest,
        request: Request,
        tokenize: Callable[[], list[int]],
        *,
        chat: bool,
        default_max_tokens: int,
        max_tokens: int | None = None,
        control: Callable[[Any, list[int]], CacheControl] = lambda _body, _ids: NO_CONTROL,
    ) -> Response:
        t_start = time.perf_counter()
        max_tokens = max_tokens or req.max_tokens
        engine = server.engine
        salt = server.request_salt(request.headers.get("authorization"), req.cache_salt)
        if not isinstance(salt, str):  # 401 or 400
            return salt
        if (unsupported := req.unsupported()) is not None:
            return error(400, unsupported[1], param=unsupported[0])
        temperature, top_p = sampling(req.temperature, req.top_p)

        def make() -> Iterator[StreamEvent]:
            ids = tokenize()
            budget = max_tokens or min(default_max_tokens, max(1, engine.max_context - len(ids)))
            engine.check_length(len(ids), budget, "messages" if chat else "prompt")
            asked = control(req, ids)  # checked with the cache off too: a bad value is a 400 either way
            if not engine.use_cache:
                asked = NO_CONTROL
            if server.store is not None and any(r.ttl_s or r.pin_s for _, r in asked.prefixes):
                try:
                    server.store.check_retention()
                except ConfigError as exc:
                    raise ClientError(str(exc), "cache_control", "store_format_1") from None
            pin_tokens, pin_s = asked.pin
            if pin_s and server.store is not None:  # refused before any work, never dropped
                ns = server.cm.namespace(salt)
                try:
                    server.store.check_pin(ns, ids, pin_s, num_blocks=pin_tokens // ns.block_tokens)
                except (PinBudgetError, ConfigError) as exc:
                    raise ClientError(str(exc), "tierkv.pin", "pin_refused") from None
            events = server.cm.stream(
                ids,
                budget,
                temperature=temperature,
                top_p=top_p,
                seed=req.seed,
                stop=req.stop_list(),
                cache_salt=salt,
                use_cache=engine.use_cache,
                control=asked,
            )
            first = next(events)
            if engine.use_cache and first.prefill is not None:
                server.misses.record(
                    server.cm.namespace(salt),
                    ids,
                    first.prefill.hit.num_tokens,
                    req.user,
                    server.cm.tokenizer,
                )
            yield first
            yield from events

        events = engine.stream(make)
        try:
            first = await events.__anext__()  # the prefill: errors surface here, before any byte is sent
        except Busy as exc:
            return error(503, str(exc), "server_busy", headers={"Retry-After": "1"})
        except (ClientError, PromptError, ConfigError) as exc:
            return error(400, str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", None))
        assert first.prefill is not None
        _observe_prefill(first.prefill, t_start)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not req.stream:
            result = None
            async for ev in events:
                result = ev.result or result
            assert result is not None
            m.completion_tokens.inc(len(result.token_ids))
            choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice.update(text=result.text, logprobs=None)
            return JSON(
                {
                    "id": rid,
                    "object": "chat.completion" if chat else "text_completion",
                    "created": created,
                    "model": server.model_name,
                    "choices": [choice],
                    "usage": _usage(result),
                }
            )

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                c["delta"] = ({"role": "assistant"} if role else {}) | (
                    {"content": delta} if delta is not None else {}
                )
            else:
                c.update(text=delta or "", logprobs=None)
            return {"id": rid, "object": obj, "created": created, "model": server.model_name, "choices": [c]}

        async def body() -> AsyncIterator[bytes]:
            try:
                if chat:
                    yield sse(chunk("", None, role=True))
                result: GenerateResult | None = None
                async for ev in events:
                    if ev.delta:
                        yield sse(chunk(ev.delta, None))
                    if ev.result is not None:
                        result = ev.result
                assert result is not None
                m.completion_tokens.inc(len(result.token_ids))
                yield sse(chunk(None if chat else "", result.finish_reason))
                if include_usage:
                    yield sse(
                        {
                            "id": rid,
                            "object": obj,
                            "created": created,
                            "model": server.model_name,
                            "choices": [],
                            "usage": _usage(result),
                        }
                    )
                yield b"data: [DONE]\n\n"
            except Exception:  # the status line is sent: say so in the stream and end it cleanly
                log.exception("internal error while streaming")
                yield sse(error_body("internal server error", "server_error"))
                yield b"data: [DONE]\n\n"
            finally:
                await events.aclose()

        return _ClosingStream(
            body(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _observe_prefill(pre: PrefillResult, t_start: float) -> None:
        m.ttft.observe(time.perf_counter() - t_start)
        if pre.hit.num_tokens:
            m.restore.observe(pre.restore_s)
        for tier, n in pre.hit.by_tier.items():
            m.prompt_tokens.labels(tier).inc(n)
        m.prompt_tokens.labels("computed").inc(pre.computed_tokens)
        # one line a request: what an operator watching the log wants to see (a hit, from where, its cost)
        tiers = ", ".join(f"{t} {n}" for t, n in pre.hit.by_tier.items() if n) or "none"
        log.info(
            "prompt of %d tokens: %d cached (%s), %d computed; restore %.0f ms, prefill %.0f ms",
            pre.hit.num_tokens + pre.computed_tokens,
            pre.hit.num_tokens,
            tiers,
            pre.computed_tokens,
            pre.restore_s * 1e3,
            (pre.restore_s + pre.forward_s) * 1e3,
        )


def _usage(result: GenerateResult) -> dict[str, Any]:
    pre = result.prefill
    cached = pre.hit.num_tokens
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.token_ids),
        "total_tokens": result.prompt_tokens + len(result.token_ids),
        "prompt_tokens_details": {"cached_tokens": cached, "cache_write_tokens": pre.saved_tokens},
        "prompt_cache_hit_tokens": cached,
        "prompt_cache_miss_tokens": result.prompt_tokens - cached,
        "cache_read_input_tokens": cached,  # Anthropic's names
        "cache_creation_input_tokens": pre.saved_tokens,
        "tierkv": {
            "cached_tokens_by_tier": pre.hit.by_tier,
            "restore_ms": round(pre.restore_s * 1e3, 3),
            "prefill_ms": round((pre.restore_s + pre.forward_s) * 1e3, 3),
        },
    }


class _ClosingStream(StreamingResponse):
    """A stream whose body is closed however the response ends. Starlette leaves it suspended when the
    response is cancelled (a client gone while a send waits, the end of a drain): its generation would
    run on, to max_tokens, until the generator is collected."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            body = self.body_iterator
            if hasattr(body, "aclose"):
                await body.aclose()


__all__ = ["FLOAT32_TINY", "GREEDY_BELOW", "add_completion_routes", "sampling"]
