"""The FastAPI application: OpenAI-compatible completions and chat, metrics, health and admin."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierkv.errors import ConfigError
from tierkv.prompts import PromptError, encode_text, render_chat
from tierkv.server.config import ServeConfig
from tierkv.server.engine import Busy, ClientError, Engine
from tierkv.server.metrics import Metrics
from tierkv.server.schemas import ChatCompletionRequest, CompletionRequest, error_body
from tierkv.store import TieredStore
from tierkv.tiers.gpu import gpu_budget_nbytes
from tierkv.worker import CachedModel, GenerateResult, PrefillResult, StreamEvent

log = logging.getLogger("tierkv.server")

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (as vLLM does): logits / T would overflow float32
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # top_p is compared in float32: below this it rounds to 0


class JSON(Response):
    """JSON with non-ASCII escaped: generated text may hold escaped bytes (lone surrogates)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSON:
    return JSON(error_body(message, type_, param, code), status_code=status, headers=headers)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode() + b"\n\n"


class Server:
    """What the app serves: the store, the model, the executor and the metrics."""

    def __init__(self, config: ServeConfig, cm: CachedModel, store: TieredStore | None) -> None:
        self.config = config
        self.cm = cm
        self.store = store
        max_context = config.max_context or int(getattr(cm.model.config, "max_position_embeddings", 4096))
        self.engine = Engine(cm, max_queue=config.max_queue, max_context=max_context,
                             use_cache=not config.no_cache and store is not None)
        self.metrics = Metrics(self)
        self.model_name = cm.base_namespace.model_id
        # Token ids the model's embedding can look up: any other id is an IndexError on CPU and a
        # device-side assert on a GPU (which poisons the CUDA context for every later request).
        self.vocab_size = int(cm.model.get_input_embeddings().num_embeddings)
        from tierkv.explain import MissLog

        self.misses = MissLog(debug_prompts=config.debug_prompts)

    def close(self) -> None:
        self.engine.close()
        if self.store is not None:
            self.store.flush()
            self.store.close()


def load_server(config: ServeConfig) -> Server:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        dtype = getattr(torch, config.dtype)
    store = None if config.no_cache else open_store(config)
    if config.model:
        cm = CachedModel.from_pretrained(config.model, store, dtype=dtype, device=device,
                                         block_tokens=config.block_tokens, revision=config.revision)
    else:
        cm = CachedModel.default(store, dtype=dtype, device=device, block_tokens=config.block_tokens)
    if store is not None:  # sized after the model is loaded, so a fraction sees its weights as used
        gpu_nbytes = gpu_budget_nbytes(config.gpu_cache, cm.device)
        if gpu_nbytes:
            store.add_gpu_tier(gpu_nbytes, cm.device)
    return Server(config, cm, store)


def open_store(config: ServeConfig) -> TieredStore:
    return TieredStore.open(config.resolved_cache_dir(), host_bytes=config.host_cache,
                            disk_bytes=config.disk_budget, ttl_s=config.ttl, remote=config.remote,
                            remote_admit_after=config.remote_admit_after,
                            sweep_interval_s=config.sweep_interval_s)


def sampling(temperature: float, top_p: float) -> tuple[float, float]:
    """The (temperature, top_p) to sample with: what the request asks, in a range float32 can compute.

    A temperature below ``GREEDY_BELOW`` is greedy. A top_p below float32's smallest normal keeps only
    the most likely token, which is what it asks for anyway (that token's probability is far above it).
    """
    if temperature < GREEDY_BELOW:
        return 0.0, 1.0
    return temperature, max(top_p, FLOAT32_TINY)


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class _CountAndCatch:
    """Counts each request by its route's template (``unmatched`` when none matched, so probes of random
    paths add no series), and answers an unexpected error with a 500 after which the connection lives on.

    Starlette's own last-resort handler re-raises after answering, and uvicorn then closes the kept-alive
    connection: the client's next request on it fails too. An error after the response has started
    (a broken stream) still propagates: that response cannot be completed, so its connection must end.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        started = False

        async def send_(message: dict[str, Any]) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception:
            if started:
                raise
            log.exception("internal error on %s", scope.get("path"))
            await _error(500, "internal server error", "server_error")(scope, receive, send_)
        finally:
            route = getattr(scope.get("route"), "path", None)  # set by the router once a route matched
            self.metrics.requests.labels(route or "unmatched", str(status)).inc()


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # SIGTERM: uvicorn has stopped accepting and drained the open requests; finish and flush.
        await asyncio.to_thread(server.close)
        log.info("flushed the store; bye")

    app = FastAPI(title="tierkv", lifespan=lifespan)
    app.state.server = server
    m = server.metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSON:
        errs = list(exc.errors())
        # Of a union's errors, the one about the value rather than "not this type of the union".
        first = next((e for e in errs if not str(e.get("type", "")).endswith("_type")), errs[0] if errs else {})
        # Without pydantic's union branch tags (stop.list[str] -> stop).
        param = ".".join(str(p) for p in first.get("loc", ())[1:]
                         if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))) or None
        if first.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON", code="invalid_json")
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSON:
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                      "invalid_request_error")

    app.add_middleware(_CountAndCatch, metrics=m)  # type: ignore[arg-type]

    @app.get("/health")
    async def health() -> JSON:
        return JSON({"status": "ok", "model": server.model_name, "queue_depth": server.engine.queued})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = await asyncio.to_thread(generate_latest, m.registry)  # reads LMDB totals: off the loop
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSON:
        return JSON({"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                                 "owned_by": "tierkv"}]})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        def tokenize() -> list[int]:
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                if len(prompt) != 1:
                    raise ClientError("prompt: a batch of several prompts is not supported (send one per request)",
                                      "prompt")
                prompt = prompt[0]
            if isinstance(prompt, list):
                vocab = server.vocab_size
                bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab), None)  # type: ignore[operator]
                if not prompt or bad is not None:
                    raise ClientError("prompt: token ids must be a non-empty list of ids from 0 to "
                                      f"{vocab - 1} (this model's vocabulary)"
                                      + (f"; got {prompt[bad]} at position {bad}" if bad is not None else ""),
                                      "prompt")
                return list(prompt)  # type: ignore[arg-type]
            if not prompt:
                raise ClientError("prompt must not be empty", "prompt")
            return encode_text(server.cm.tokenizer, prompt)
        return await _generate(req, tokenize, chat=False, default_max_tokens=16)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        def tokenize() -> list[int]:
            return render_chat(server.cm.tokenizer, [{"role": msg.role, "content": msg.text()}
                                                     for msg in req.messages])
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await _generate(req, tokenize, chat=True, default_max_tokens=256, max_tokens=max_tokens)

    async def _generate(req: Any, tokenize: Any, *, chat: bool, default_max_tokens: int,
                        max_tokens: int | None = None) -> Response:
        t_start = time.perf_counter()
        max_tokens = max_tokens or req.max_tokens
        engine = server.engine
        if (unsupported := req.unsupported()) is not None:
            return _error(400, unsupported[1], param=unsupported[0])
        temperature, top_p = sampling(req.temperature, req.top_p)

        def make() -> Iterator[StreamEvent]:
            ids = tokenize()
            budget = max_tokens or min(default_max_tokens, max(1, engine.max_context - len(ids)))
            engine.check_length(len(ids), budget, "messages" if chat else "prompt")
            salt = req.cache_salt or ""
            events = server.cm.stream(ids, budget, temperature=temperature, top_p=top_p, seed=req.seed,
                                      stop=req.stop_list(), cache_salt=salt, use_cache=engine.use_cache)
            first = next(events)
            if engine.use_cache and first.prefill is not None:
                server.misses.record(server.cm.namespace(salt), ids, first.prefill.hit.num_tokens, req.user,
                                     server.cm.tokenizer)
            yield first
            yield from events

        events = engine.stream(make)
        try:
            first = await events.__anext__()  # the prefill: errors surface here, before any byte is sent
        except Busy as exc:
            return _error(503, str(exc), "server_busy", headers={"Retry-After": "1"})
        except (ClientError, PromptError, ConfigError) as exc:
            return _error(400, str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", None))
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
            return JSON({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": server.model_name, "choices": [choice],
                         "usage": _usage(result)})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                c["delta"] = ({"role": "assistant"} if role else {}) | ({"content": delta} if delta is not None else {})
            else:
                c.update(text=delta or "", logprobs=None)
            return {"id": rid, "object": obj, "created": created, "model": server.model_name, "choices": [c]}

        async def body() -> AsyncIterator[bytes]:
            try:
                if chat:
                    yield _sse(chunk("", None, role=True))
                result: GenerateResult | None = None
                async for ev in events:
                    if ev.delta:
                        yield _sse(chunk(ev.delta, None))
                    if ev.result is not None:
                        result = ev.result
                assert result is not None
                m.completion_tokens.inc(len(result.token_ids))
                yield _sse(chunk(None if chat else "", result.finish_reason))
                if include_usage:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": server.model_name,
                                "choices": [], "usage": _usage(result)})
                yield b"data: [DONE]\n\n"
            except Exception:  # the status line is sent: say so in the stream and end it cleanly
                log.exception("internal error while streaming")
                yield _sse(error_body("internal server error", "server_error"))
                yield b"data: [DONE]\n\n"
            finally:
                await events.aclose()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _observe_prefill(pre: PrefillResult, t_start: float) -> None:
        m.ttft.observe(time.perf_counter() - t_start)
        if pre.hit.num_tokens:
            m.restore.observe(pre.restore_s)
        for tier, n in pre.hit.by_tier.items():
            m.prompt_tokens.labels(tier).inc(n)
        m.prompt_tokens.labels("computed").inc(pre.computed_tokens)

    # ------------------------------------------------------------------ admin

    def _admin_denied(request: Request) -> JSON | None:
        token = server.config.admin_token
        if not token:
            return _error(404, "the admin API is disabled (start the server with --admin-token)", "not_found_error")
        given = request.headers.get("authorization", "").encode("latin-1")  # as the bytes were sent
        if not hmac.compare_digest(given, f"Bearer {token}".encode()):  # constant time: no timing oracle
            return _error(401, "missing or wrong admin token", "authentication_error")
        if server.store is None or server.store.disk is None:
            return _error(409, "this server runs without a disk tier (--no-cache)")
        return None

    @app.get("/admin/stats")
    async def admin_stats(request: Request) -> JSON:
        if (denied := _admin_denied(request)) is not None:
            return denied
        from tierkv.inspect import store_stats

        report = await asyncio.to_thread(store_stats, server.store.disk)  # type: ignore[union-attr]
        # What only this process knows: its memory tiers, the staging ring and the hit counters.
        report["live"] = server.store.stats()  # type: ignore[union-attr]
        return JSON(report)

    @app.get("/admin/misses")
    async def admin_misses(request: Request) -> JSON:
        """Recent requests whose hit ended early, with where they diverged; hit rate per template."""
        if (denied := _admin_denied(request)) is not None:
            return denied
        return JSON(server.misses.report())

    @app.post("/admin/gc")
    async def admin_gc(request: Request) -> JSON:
        if (denied := _admin_denied(request)) is not None:
            return denied
        from tierkv.maintenance import run_gc
        from tierkv.units import parse_duration, parse_size

        opts = await _json_object(request)
        if isinstance(opts, JSON):
            return opts
        allowed = {"ttl", "max_age", "budget", "namespace", "all", "check", "compact", "dry_run"}
        if unknown := set(opts) - allowed:
            return _error(400, f"unknown gc option(s): {', '.join(sorted(unknown))}")
        try:
            kwargs = dict(
                ttl_s=parse_duration(opts["ttl"]) if opts.get("ttl") is not None else None,
                max_age_s=parse_duration(opts["max_age"]) if opts.get("max_age") is not None else None,
                budget_nbytes=parse_size(opts["budget"]) if opts.get("budget") is not None else None,
                namespace=opts.get("namespace"), purge_all=bool(opts.get("all")), check=bool(opts.get("check")),
                compact=bool(opts.get("compact")), dry_run=bool(opts.get("dry_run")))
            return JSON(await asyncio.to_thread(run_gc, server.store.disk, **kwargs))  # type: ignore[union-attr,arg-type]
        except ConfigError as exc:
            return _error(400, str(exc))

    @app.post("/admin/purge")
    async def admin_purge(request: Request) -> JSON:
        if (denied := _admin_denied(request)) is not None:
            return denied
        from tierkv.maintenance import run_gc

        opts = await _json_object(request)
        if isinstance(opts, JSON):
            return opts
        if bool(opts.get("namespace")) == bool(opts.get("all")):
            return _error(400, "give exactly one of namespace (a digest prefix) or all: true")
        try:
            out = await asyncio.to_thread(run_gc, server.store.disk, namespace=opts.get("namespace"),  # type: ignore[union-attr]
                                          purge_all=bool(opts.get("all")))
        except ConfigError as exc:
            return _error(400, str(exc))
        for pool in server.store.pools:  # type: ignore[union-attr]  # memory tiers hold no namespace index
            pool.clear()
        return JSON(out)

    async def _json_object(request: Request) -> dict[str, Any] | JSON:
        raw = await request.body()
        try:
            obj = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return _error(400, "the request body is not valid JSON", code="invalid_json")
        if not isinstance(obj, dict):
            return _error(400, "the request body must be a JSON object")
        return obj

    return app


def _usage(result: GenerateResult) -> dict[str, Any]:
    pre = result.prefill
    cached = pre.hit.num_tokens
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.token_ids),
        "total_tokens": result.prompt_tokens + len(result.token_ids),
        "prompt_tokens_details": {"cached_tokens": cached},
        "prompt_cache_hit_tokens": cached,
        "prompt_cache_miss_tokens": result.prompt_tokens - cached,
        "tierkv": {"cached_tokens_by_tier": pre.hit.by_tier, "restore_ms": round(pre.restore_s * 1e3, 3),
                   "prefill_ms": round((pre.restore_s + pre.forward_s) * 1e3, 3)},
    }


def serve(config: ServeConfig) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = load_server(config)
    _reserve_memory_tiers(server)
    ns = server.cm.base_namespace
    tiers = ["none (--no-cache)"] if server.store is None else [
        f"{pool.name} {pool.capacity_nbytes / 2**30:.1f} GiB" for pool in server.store.pools] + [
        f"disk {config.disk_budget / 2**30:.1f} GiB at {config.resolved_cache_dir()} (ttl {config.ttl:.0f}s, "
        + (f"swept every {config.sweep_interval_s:g}s)" if config.sweep_interval_s else "no background sweep)")]
    log.info("tierkv serve: model %s on %s (%s), namespace %s (block %d), tiers: %s, http://%s:%d",
             ns.model_id, server.cm.device, ns.dtype, ns.digest.hex()[:16], ns.block_tokens, ", ".join(tiers),
             config.host, config.port)
    from tierkv.server.guard import BodyGuard

    app = BodyGuard(create_app(server), max_nbytes=config.max_body, timeout_s=config.body_timeout)
    _GracefulServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                   timeout_graceful_shutdown=60)).run()


def _reserve_memory_tiers(server: Server) -> None:
    """Allocate (and pre-fault) the GPU and host pools now, not during the first request."""
    store = server.store
    if store is not None:
        from tierkv.layout import KVSpec

        for pool in store.pools:
            pool.reserve(KVSpec.of(server.cm.base_namespace).block_nbytes)


class _GracefulServer:
    """uvicorn's server, but SIGTERM ends in exit code 0 after the graceful shutdown.

    uvicorn re-raises a captured SIGTERM once it has shut down, which makes the process die of it (143):
    service managers read that as a failure. We finish the running request and flush the store first.
    """

    def __new__(cls, config: Any) -> Any:
        import signal
        import threading

        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

        return Server(config)
