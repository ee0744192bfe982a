"""``tierkv serve --engine vllm --api-keys FILE``: tenants in front of vLLM.

vLLM checks no tierkv keys, and the connector sees a request's ``cache_salt`` and nothing of who sent it.
So with API keys, ``tierkv serve`` runs vLLM on a private loopback port and serves the public one itself:

- every ``/v1`` request needs ``Authorization: Bearer KEY`` (401 ``invalid_api_key`` otherwise);
- the key's tenant sets the request's ``cache_salt`` (``tenancy.namespace_salt``: its derived salt, then
  the client's own ``cache_salt``, which only subdivides the tenant's space), so vLLM's own prefix cache
  and tierkv's namespaces are the tenant's;
- the rest goes to vLLM unchanged and comes back streamed; ``/health`` and ``/metrics`` are vLLM's;
- the tenants' quotas are written to the cache directory's index, where the connector's tiers evict by
  them (the connector is told ``front``: a ``cache_salt`` of the reserved tenant space is this front's).

vLLM listens on 127.0.0.1 only; a user of the same machine who can reach that port can still send any
``cache_salt`` (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tierkv.server.responses import error, unauthorized
from tierkv.server.tenants import Tenants, namespace_salt
from tierkv.tenancy import Quota

__all__ = ["MAX_CACHE_SALT", "SALTED_PATHS", "create_front_app", "run_front"]

log = logging.getLogger("tierkv.front")

MAX_CACHE_SALT = 128  # vLLM's limit on a cache_salt (entrypoints' validate_cache_salt)
SALTED_PATHS = {"completions", "chat/completions", "responses"}  # the routes that take a cache_salt
STOP_WAIT_S = 60  # vLLM's own shutdown timeout (30 s, serve.py) and its workers' exit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _as_mapping(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return dict(vars(config))


def _die_with_parent() -> None:
    """In vLLM's process, before exec: SIGTERM when the front dies, even killed (Linux's PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _store_quotas(cache_dir: str, quotas: dict[bytes, Quota]) -> None:
    """The quotas into the cache directory's index (another process on it, as the design allows)."""
    from tierkv.tiers.disk import DiskTier

    with DiskTier(cache_dir) as disk:
        disk.set_quotas(quotas)


def create_front_app(tenants: Any, upstream: str, child: subprocess.Popen[bytes] | None = None) -> Any:
    """The front's ASGI app: ``tenants`` (``server.tenants.Tenants``) checks keys; ``upstream`` is vLLM's
    URL; ``child`` its process (the front stops when it exits)."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))

    async def watch_child() -> None:
        while child is not None:
            if child.poll() is not None:
                log.error("vLLM exited with status %s: stopping", child.returncode)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            await asyncio.sleep(1.0)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(watch_child())
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="tierkv front", lifespan=lifespan)

    async def forward(method: str, path: str, raw: bytes, content_type: str | None) -> Response:
        headers = {"content-type": content_type} if content_type else {}
        try:
            upstream_r = await client.send(
                client.build_request(method, f"{upstream}/{path}", content=raw, headers=headers), stream=True
            )
        except httpx.ConnectError:
            return error(503, "the engine is not up yet (or has stopped): try again", "server_error")
        except httpx.HTTPError as exc:
            return error(502, f"the engine failed: {exc}", "server_error")
        out = {
            k: v
            for k, v in upstream_r.headers.items()
            if k.lower() in ("content-type", "retry-after", "cache-control")
        }

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream_r.aiter_raw():
                    yield chunk
            finally:
                await upstream_r.aclose()

        return StreamingResponse(relay(), status_code=upstream_r.status_code, headers=out)

    @app.get("/health")
    async def health() -> Response:
        return await forward("GET", "health", b"", None)

    @app.get("/metrics")
    async def metrics() -> Response:
        return await forward("GET", "metrics", b"", None)

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def v1(path: str, request: Request) -> Response:
        tenant = tenants.tenant(request.headers.get("authorization"))
        if tenant is None:
            return unauthorized("a valid API key is needed: Authorization: Bearer <key>")
        raw = await request.body()
        if request.method == "POST" and path.strip("/") in SALTED_PATHS:
            try:
                body = json.loads(raw)
            except ValueError:
                return error(400, "the request body is not JSON")
            if not isinstance(body, dict):
                return error(400, "the request body must be a JSON object")
            own = body.get("cache_salt")
            if own is not None and not isinstance(own, str):
                return error(400, "cache_salt must be a string", param="cache_salt")
            salt = namespace_salt(tenant, own or "")
            if len(salt) > MAX_CACHE_SALT:
                room = MAX_CACHE_SALT - len(namespace_salt(tenant, ""))
                return error(400, f"cache_salt: at most {room} characters with API keys", param="cache_salt")
            body["cache_salt"] = salt
            raw = json.dumps(body).encode()
        return await forward(request.method, f"v1/{path}", raw, request.headers.get("content-type"))

    return app


def run_front(config: Any, extra_args: Sequence[str], python: str) -> int:
    """Run vLLM (``serve.vllm_command``) on a private port and the front on the public one, until a
    signal or vLLM's exit; then stop vLLM (it flushes the connector's store). Returns vLLM's status."""
    import uvicorn

    from tierkv.integrations.vllm.serve import vllm_command, vllm_env

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = _as_mapping(config)
    public_host, public_port = str(options.get("host") or "127.0.0.1"), int(options.get("port") or 8000)
    private_port = _free_port()
    cmd = vllm_command({**options, "host": "127.0.0.1", "port": private_port}, extra_args, python)
    cache_dir = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"][
        "cache_dir"
    ]
    log.info("starting vLLM on 127.0.0.1:%d behind the tenants' front", private_port)
    # (started before this process has threads of its own: preexec_fn runs between fork and exec)
    child = subprocess.Popen(cmd, env={**os.environ, **vllm_env(options)}, preexec_fn=_die_with_parent)
    tenants = Tenants(str(options["api_keys"]), lambda quotas: _store_quotas(cache_dir, quotas))
    # uvicorn stops on SIGTERM or SIGINT, then raises the signal again with the handlers it found: these
    # let the front go on to stop vLLM (the default ones would end the process and orphan it).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        log.info(
            "tierkv serve --engine vllm: API keys of %d tenants from %s, http://%s:%d",
            len(tenants.names()),
            options["api_keys"],
            public_host,
            public_port,
        )
        uvicorn.run(
            create_front_app(tenants, f"http://127.0.0.1:{private_port}", child),
            host=public_host,
            port=public_port,
            log_level="warning",
        )
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                log.error("vLLM did not stop within %d s: killed", STOP_WAIT_S)
                child.kill()
                child.wait()
    return child.returncode if child.returncode and child.returncode > 0 else 0
