"""The FastAPI application: OpenAI-compatible completions and chat, metrics, health and admin."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierkv.errors import ConfigError
from tierkv.server.config import ServeConfig
from tierkv.server.engine import Busy, ClientError, Engine, encode_text, render_chat
from tierkv.server.metrics import Metrics
from tierkv.server.schemas import ChatCompletionRequest, CompletionRequest, error_body
from tierkv.store import TieredStore
from tierkv.tiers.gpu import gpu_budget_nbytes
from tierkv.worker import CachedModel, GenerateResult, PrefillResult, StreamEvent

log = logging.getLogger("tierkv.server")


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
    store = None
    if not config.no_cache:
        store = TieredStore.open(config.resolved_cache_dir(), host_bytes=config.host_cache,
                                 disk_bytes=config.disk_budget, ttl_s=config.ttl, remote=config.remote,
                                 remote_admit_after=config.remote_admit_after)
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
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON", code="invalid_json")
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSON:
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                      "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSON:
        log.exception("internal error on %s", request.url.path)
        return _error(500, "internal server error", "server_error")

    @app.middleware("http")
    async def _count(request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        m.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

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
            if isinstance(req.prompt, list):
                if not req.prompt or any(t < 0 for t in req.prompt):
                    raise ClientError("prompt: token ids must be a non-empty list of non-negative ints", "prompt")
                return list(req.prompt)
            if not req.prompt:
                raise ClientError("prompt must not be empty", "prompt")
            return encode_text(server.cm.tokenizer, req.prompt)
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

        def make() -> Iterator[StreamEvent]:
            ids = tokenize()
            budget = max_tokens or min(default_max_tokens, max(1, engine.max_context - len(ids)))
            engine.check_length(len(ids), budget)
            salt = req.cache_salt or ""
            events = server.cm.stream(ids, budget, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
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
        except (ClientError, ConfigError) as exc:
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
        if request.headers.get("authorization", "") != f"Bearer {token}":
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
        f"disk {config.disk_budget / 2**30:.1f} GiB at {config.resolved_cache_dir()} (ttl {config.ttl:.0f}s)"]
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
