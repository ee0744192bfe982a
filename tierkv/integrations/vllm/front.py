"""``tierkv serve --engine vllm --api-keys FILE``: tenants in front of vLLM.

vLLM checks no tierkv keys, and the connector sees a request's ``cache_salt`` and nothing of who sent it.
So with API keys, ``tierkv serve`` runs vLLM on a private loopback port and serves the public one itself:

- every ``/v1`` request needs ``Authorization: Bearer KEY`` (401 ``invalid_api_key`` otherwise);
- the key's tenant sets the request's ``cache_salt`` (``tenancy.namespace_salt``: its derived salt, then
  the client's own ``cache_salt``, which only subdivides the tenant's space), so vLLM's own prefix cache
  and tierkv's namespaces are the tenant's;
- the cache-control fields of tierkv's own engine, sent at the top level, are checked as it checks them
  (a 400 naming the field) and moved into ``kv_transfer_params``, where the connector reads them;
- only ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` (salted) and ``/v1/models`` are
  served, each to vLLM's own route (never a path the client wrote); the answer comes back streamed;
  ``/health`` and ``/metrics`` are vLLM's;
- the tenants' quotas are written to the cache directory's index, where the connector's tiers evict by
  them (the connector is told ``front``: a ``cache_salt`` of the reserved tenant space is this front's).

vLLM listens on a Unix socket in a directory only this user can enter (and wants a token on its ``/v1``
routes, ``VLLM_API_KEY``): no other user can send it a ``cache_salt`` of the reserved tenant space.
Processes of the same user are trusted, as with the cache directory itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tierkv.server.responses import error, unauthorized
from tierkv.server.tenants import Tenants, namespace_salt
from tierkv.tenancy import Quota

__all__ = ["MAX_CACHE_SALT", "SALTED_ROUTES", "store_quotas", "create_front_app", "run_front"]

log = logging.getLogger("tierkv.front")

MAX_CACHE_SALT = 128  # vLLM's limit on a cache_salt (entrypoints' validate_cache_salt)
SALTED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")  # what the front serves
MAX_BODY_NBYTES = 64 << 20
STOP_WAIT_S = 60  # vLLM's own shutdown timeout (30 s, serve.py) and its workers' exit
FRONT_DRAIN_S = 10  # requests in flight at a SIGTERM get this long before vLLM is stopped


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


def store_quotas(cache_dir: str, quotas: dict[bytes, Quota]) -> None:
    """The quotas into the cache directory's index, as one more process on it (the design allows many).
    Called by ``Tenants`` on a thread of its own, one at a time."""
    from tierkv.metrics import Counters
    from tierkv.tiers.disk import DEFAULT_MAP_NBYTES
    from tierkv.tiers.disk.index import Index

    index = Index(
        Path(cache_dir).expanduser(),
        map_nbytes=DEFAULT_MAP_NBYTES,
        writer=True,
        sync=True,
        policy=None,
        counters=Counters(),
    )
    try:
        index.tenants.set_quotas(quotas)
    finally:
        index.close()


def _dumps(body: Any) -> bytes:
    return json.dumps(body).encode()


def _move_cache_control(body: dict[str, Any]) -> Response | None:
    """The cache-control fields a client sends at the top level, as to tierkv's own engine
    (``prompt_cache_retention``, ``prompt_cache_options``, ``tierkv``), moved into ``kv_transfer_params``,
    the one field vLLM hands the connector (vLLM drops the others without a word); then what
    ``kv_transfer_params`` holds checked by the rules of tierkv's own engine (a 400 naming the field),
    however the client split it. Nothing else may be in it: vLLM reads some of its keys itself (a remote
    prefill's cached tokens, counted as the client's own), which no tenant may set. Returns the 400, or
    None."""
    from tierkv.server.cache_control import CONTROL_FIELDS, CacheControlError, control_from_params

    fields = {k: body.pop(k) for k in sorted(CONTROL_FIELDS) if k in body}
    params = body.get("kv_transfer_params")
    if params is None:
        if not fields:
            return None
        params = {}
    if not isinstance(params, dict):
        return error(400, "kv_transfer_params must be an object", param="kv_transfer_params")
    if extra := sorted(set(params) - CONTROL_FIELDS):
        return error(
            400,
            f"kv_transfer_params.{extra[0]}: not taken with API keys (only {', '.join(sorted(CONTROL_FIELDS))})",
            param=f"kv_transfer_params.{extra[0]}",
        )
    for name in fields:
        if name in params:
            return error(400, f"{name}: given at the top level and in kv_transfer_params", param=name)
    params = {**params, **fields}
    if (refused := _explicit_breakpoints(body, params)) is not None:
        return refused
    try:
        control_from_params(params, 1)  # (only checked here: the connector applies it to the prompt)
    except CacheControlError as exc:
        return error(400, str(exc), param=exc.param)
    except ValueError as exc:  # (not expected: control_from_params names the field in a CacheControlError)
        return error(400, "cache control: " + " ".join(str(exc).split()), param=next(iter(params), None))
    body["kv_transfer_params"] = params
    return None


def _explicit_breakpoints(body: dict[str, Any], params: dict[str, Any]) -> Response | None:
    """A 400 for ``prompt_cache_options`` mode ``explicit`` beside breakpoints in the messages: vLLM does
    not pass the breakpoints on, so the request would save nothing (explicit mode without any), where
    tierkv's own engine keeps the marked prefixes."""
    options = params.get("prompt_cache_options")
    if not isinstance(options, dict) or options.get("mode") != "explicit":
        return None
    for m, msg in enumerate(body.get("messages") or ()):
        parts = msg.get("content") if isinstance(msg, dict) else None
        marked = [msg] + [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else [msg]
        if any(
            isinstance(p, dict) and ("cache_control" in p or "prompt_cache_breakpoint" in p) for p in marked
        ):
            return error(
                400,
                f"messages.{m}: breakpoints are not passed on to vLLM, so explicit mode would save nothing: "
                "mark the whole prompt instead (prompt_cache_options mode 'implicit', or tierkv.retention)",
                param=f"messages.{m}",
            )
    return None


def create_front_app(
    tenants: Any,
    transport: httpx.AsyncBaseTransport,
    token: str,
    child: subprocess.Popen[bytes] | None = None,
) -> Any:
    """The front's ASGI app: ``tenants`` (``server.tenants.Tenants``) checks keys; ``transport`` reaches
    vLLM, which wants ``token``; ``child`` is vLLM's process (the front stops when it exits)."""
    client = httpx.AsyncClient(
        transport=transport,
        base_url="http://vllm",
        timeout=httpx.Timeout(600.0, connect=5.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),  # as many as vLLM takes
    )

    async def watch_child() -> None:
        up = False
        while child is not None:
            if not up:  # said once, as vLLM's own server says it: requests before this are 503s
                with contextlib.suppress(httpx.HTTPError):
                    up = (await client.get("/health", timeout=2.0)).status_code == 200
                    if up:
                        log.info("vLLM is up: the front serves requests now")
            if child.poll() is not None:
                log.error("vLLM exited with status %s: stopping", child.returncode)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            await asyncio.sleep(1.0)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from tierkv.server.app import watch_keys

        tasks = [asyncio.create_task(watch_child()), asyncio.create_task(watch_keys(tenants))]
        yield
        for task in tasks:
            task.cancel()
        await client.aclose()

    app = FastAPI(title="tierkv front", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    async def forward(method: str, route: str, raw: bytes = b"") -> Response:
        """To vLLM's own route (a constant of this module, never the client's path), with vLLM's token."""
        headers = {"authorization": f"Bearer {token}"}
        if raw:
            headers["content-type"] = "application/json"
        try:
            upstream_r = await client.send(
                client.build_request(method, route, content=raw, headers=headers), stream=True
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
        return await forward("GET", "/health")

    @app.get("/metrics")
    async def metrics() -> Response:
        return await forward("GET", "/metrics")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if tenants.tenant(request.headers.get("authorization")) is None:
            return unauthorized("a valid API key is needed: Authorization: Bearer <key>")
        return await forward("GET", "/v1/models")

    async def salted(route: str, request: Request) -> Response:
        tenant = tenants.tenant(request.headers.get("authorization"))
        if tenant is None:
            return unauthorized("a valid API key is needed: Authorization: Bearer <key>")
        too_big = error(413, f"the request body is over {MAX_BODY_NBYTES // 2**20} MiB")
        try:
            if int(request.headers.get("content-length") or 0) > MAX_BODY_NBYTES:
                return too_big
        except ValueError:
            return error(400, "a bad Content-Length")
        chunks, size = [], 0
        async for chunk in request.stream():  # (chunked bodies too: never more than the cap in memory)
            size += len(chunk)
            if size > MAX_BODY_NBYTES:
                return too_big
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:  # a large body is parsed off the event loop
            body = json.loads(raw) if size < 1 << 20 else await asyncio.to_thread(json.loads, raw)
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
        refused = _move_cache_control(body)
        if refused is not None:
            return refused
        out = json.dumps(body).encode() if size < 1 << 20 else await asyncio.to_thread(_dumps, body)
        return await forward("POST", route, out)

    for route in SALTED_ROUTES:  # exact routes only: any other path is a 404 here, never forwarded

        async def endpoint(request: Request, route: str = route) -> Response:
            return await salted(route, request)

        app.add_api_route(route, endpoint, methods=["POST"])

    return app


def run_front(config: Any, extra_args: Sequence[str], python: str) -> int:
    """Run vLLM (``serve.vllm_command``) on a Unix socket in a private directory, wanting a token only
    this process knows, and the front on the public address, until a signal or vLLM's exit; then stop
    vLLM (it flushes the connector's store). Returns vLLM's status."""
    import uvicorn

    from tierkv.integrations.vllm.serve import say_settings, vllm_command, vllm_env

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = _as_mapping(config)
    public_host, public_port = str(options.get("host") or "127.0.0.1"), int(options.get("port") or 8000)
    private = tempfile.mkdtemp(prefix="tierkv-front-")  # mode 0700: no other user reaches the socket
    sock = os.path.join(private, "vllm.sock")
    token = secrets.token_urlsafe(32)  # (vLLM checks it on its /v1 routes only: the directory is the wall)
    cmd = vllm_command(options, [*extra_args, "--uds", sock], python)  # (--uds: host and port unused)
    cache_dir = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"][
        "cache_dir"
    ]
    env = vllm_env(options)
    say_settings(env, cmd, "behind the tenants' front, run")
    # (started before this process has threads of its own: preexec_fn runs between fork and exec)
    child = subprocess.Popen(  # its own session: a Ctrl-C at the terminal reaches the front only
        cmd,
        env={**os.environ, **env, "VLLM_API_KEY": token},
        preexec_fn=_die_with_parent,
        start_new_session=True,
    )
    tenants = Tenants(str(options["api_keys"]), functools.partial(store_quotas, cache_dir))
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
        app = create_front_app(tenants, httpx.AsyncHTTPTransport(uds=sock), token, child)
        uvicorn.run(
            app,
            host=public_host,
            port=public_port,
            log_level="warning",
            timeout_graceful_shutdown=FRONT_DRAIN_S,  # then vLLM, which flushes what the connector holds
        )
    finally:
        # A second signal while vLLM stops kills it (as an impatient operator means).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: child.kill())
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                log.error("vLLM did not stop within %d s: killed", STOP_WAIT_S)
                child.kill()
                child.wait()
        shutil.rmtree(private, ignore_errors=True)
    rc = child.returncode
    return 128 - rc if rc < 0 else rc  # killed by a signal: as a shell reports it (a supervisor restarts)
