"""The FastAPI application: OpenAI-compatible completions and chat, metrics, health and admin.

The routes live beside it: ``completions`` (generation), ``admin`` (``/admin/*``); what they serve is a
``state.Server``; ``startup.serve`` runs the app under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierkv.server.admin import add_admin_routes
from tierkv.server.cache_routes import add_cache_routes
from tierkv.server.completions import add_completion_routes
from tierkv.server.middleware import CountAndCatch
from tierkv.server.responses import JSON, error, unauthorized
from tierkv.server.state import Server

log = logging.getLogger("tierkv.server")


KEYS_CHECK_S = 2.0  # how often the keys file is looked at without requests (a stat)


async def watch_keys(tenants: Any) -> None:
    """Reload the keys file when it changes, requests or not (quotas reach the store and metrics)."""
    while True:
        await asyncio.sleep(KEYS_CHECK_S)
        try:
            tenants.refresh()
        except Exception:  # (a file system error): the next look tries again
            log.exception("api keys: looking at the keys file failed")


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watch = asyncio.create_task(watch_keys(server.tenants)) if server.tenants is not None else None
        yield
        if watch is not None:
            watch.cancel()
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
        first = next(
            (e for e in errs if not str(e.get("type", "")).endswith("_type")), errs[0] if errs else {}
        )
        # Without pydantic's union branch tags (stop.list[str] -> stop).
        param = (
            ".".join(
                str(p)
                for p in first.get("loc", ())[1:]
                if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))
            )
            or None
        )
        if first.get("type") == "json_invalid":
            return error(400, "the request body is not valid JSON", code="invalid_json")
        content_type = request.headers.get("content-type", "")
        if tuple(first.get("loc", ())) == ("body",) and "json" not in content_type:
            # curl -d sends form encoding unless told: the body was never read as JSON
            return error(
                400,
                "the request body must be JSON, sent with Content-Type: application/json (this one's: "
                f"{content_type or 'none'})",
                code="invalid_content_type",
            )
        msg = str(first.get("msg", "invalid request")).removeprefix(
            "Value error, "
        )  # our validators' own words
        return error(400, f"{param or 'body'}: {msg}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSON:
        return error(
            exc.status_code,
            str(exc.detail),
            "not_found_error" if exc.status_code == 404 else "invalid_request_error",
        )

    app.add_middleware(CountAndCatch, metrics=m)

    @app.get("/health")
    async def health() -> JSON:
        return JSON({"status": "ok", "model": server.model_name, "queue_depth": server.engine.queued})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = await asyncio.to_thread(generate_latest, m.registry)  # reads LMDB totals: off the loop
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSON:
        if server.tenants is not None and server.tenants.tenant(request.headers.get("authorization")) is None:
            return unauthorized("a valid API key is needed: Authorization: Bearer <key>")
        return JSON(
            {
                "object": "list",
                "data": [{"id": server.model_name, "object": "model", "created": 0, "owned_by": "tierkv"}],
            }
        )

    add_completion_routes(app, server)
    add_admin_routes(app, server)
    add_cache_routes(app, server)
    m.static_routes = frozenset(p for r in app.routes if "{" not in (p := getattr(r, "path", "{")))
    return app


__all__ = ["create_app"]
