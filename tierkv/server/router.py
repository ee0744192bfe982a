"""``tierkv route``: a prefix-aware router in front of several ``tierkv serve`` workers.

Requests whose prompts share their first ``prefix_chars`` characters (the rendered messages but the
last, or the prompt) go to the same worker by consistent hashing, so their KV is where they land. A worker with
``max_inflight`` requests running spills new ones to the least loaded healthy worker; a worker that fails
its health check leaves the ring until it passes again (only its share of prefixes moves). Responses,
streams included, pass through unchanged, with an ``x-tierkv-worker`` header.

Routing hashes characters, not tokens, so the router needs no tokenizer: with the default 1024
characters, about 256 tokens of a BPE model (4 blocks of 64) or 1024 of the byte-level default model.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("tierkv.router")

VNODES = 64  # virtual nodes per worker: an even spread, and a failed worker's share spreads over the rest


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Ring:
    """Consistent hashing over the healthy workers."""

    def __init__(self, workers: list[str]) -> None:
        self.workers = workers
        self.healthy = set(workers)
        self._rebuild()

    def _rebuild(self) -> None:
        points = sorted(
            (_h(f"{w}#{v}".encode()), w) for w in self.workers if w in self.healthy for v in range(VNODES)
        )
        self._hashes = [p for p, _ in points]
        self._owners = [w for _, w in points]

    def set_health(self, worker: str, ok: bool) -> bool:
        """Returns True when the worker's state changed."""
        if ok == (worker in self.healthy):
            return False
        (self.healthy.add if ok else self.healthy.discard)(worker)
        self._rebuild()
        return True

    def owner(self, key: bytes) -> str | None:
        if not self._hashes:
            return None
        i = bisect.bisect(self._hashes, _h(key)) % len(self._hashes)
        return self._owners[i]


def routing_key(body: dict[str, Any], prefix_chars: int) -> bytes:
    """The start of the prompt as the worker will see it (plus the tenant's cache salt).

    For a chat, the last message is left out when there are earlier ones: the history is what the next
    turns share, the newest message is what differs. A request naming a ``prompt_cache_key`` (OpenAI's
    field for requests that share a long prefix) goes by that key instead.
    """
    salt = str(body.get("cache_salt") or "")
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return (salt + "\0prompt_cache_key\0" + key).encode("utf-8", "surrogatepass")
    if isinstance(body.get("messages"), list):
        msgs = [m for m in body["messages"] if isinstance(m, dict)]
        text = "".join(
            f"<|{m.get('role')}|>\n{m.get('content')}\n" for m in (msgs[:-1] if len(msgs) > 1 else msgs)
        )
    else:
        text = json.dumps(body.get("prompt"))
    return (salt + "\0" + text[:prefix_chars]).encode("utf-8", "surrogatepass")


class Router:
    def __init__(
        self,
        workers: list[str],
        *,
        prefix_chars: int = 1024,
        max_inflight: int = 4,
        health_interval_s: float = 2.0,
    ) -> None:
        if not workers:
            raise ValueError("give at least one worker URL")
        self.ring = Ring([w.rstrip("/") for w in workers])
        self.prefix_chars = prefix_chars
        self.max_inflight = max_inflight
        self.health_interval_s = health_interval_s
        self.inflight = dict.fromkeys(self.ring.workers, 0)
        self.routed = dict.fromkeys(self.ring.workers, 0)
        self.spilled = 0

    def choose(self, key: bytes) -> str | None:
        owner = self.ring.owner(key)
        if owner is None:
            return None
        if self.inflight[owner] >= self.max_inflight:
            least = min(self.ring.healthy, key=lambda w: self.inflight[w])
            if self.inflight[least] < self.inflight[owner]:
                self.spilled += 1
                return least
        return owner

    async def health_loop(self, client: Any) -> None:
        while True:
            for w in self.ring.workers:
                try:
                    ok = (await client.get(w + "/health", timeout=2.0)).status_code == 200
                except Exception:  # refused, timed out: unhealthy
                    ok = False
                if self.ring.set_health(w, ok):
                    log.warning(
                        "worker %s is %s", w, "back" if ok else "down: its prefixes move to the others"
                    )
            await asyncio.sleep(self.health_interval_s)


def create_router_app(router: Router) -> Any:
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(router.health_loop(client))
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="tierkv router", lifespan=lifespan)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": message, "type": "router_error", "param": None, "code": None}},
            status_code=status,
        )

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok" if router.ring.healthy else "no healthy worker",
            "workers": {
                w: {
                    "healthy": w in router.ring.healthy,
                    "inflight": router.inflight[w],
                    "routed": router.routed[w],
                }
                for w in router.ring.workers
            },
            "spilled": router.spilled,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for w in router.ring.healthy:
            r = await client.get(w + "/v1/models", headers=auth)
            return Response(r.content, r.status_code, media_type="application/json")
        return error(503, "no healthy worker")

    @app.api_route("/v1/{path:path}", methods=["POST", "DELETE"])  # (DELETE: /v1/cache, by prompt)
    async def proxy(path: str, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        key = routing_key(body, router.prefix_chars) if isinstance(body, dict) else raw[: router.prefix_chars]
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        for _attempt in range(len(router.ring.workers)):
            worker = router.choose(key)
            if worker is None:
                return error(503, "no healthy worker")
            router.inflight[worker] += 1
            router.routed[worker] += 1
            try:
                upstream = await client.send(
                    client.build_request(request.method, f"{worker}/v1/{path}", content=raw, headers=headers),
                    stream=True,
                )
                break
            except httpx.ConnectError:  # nothing was sent: safe to try the next worker on the ring
                router.inflight[worker] -= 1
                if router.ring.set_health(worker, False):
                    log.warning("worker %s refused a connection: out of the ring until healthy", worker)
            except httpx.HTTPError as exc:
                router.inflight[worker] -= 1
                router.ring.set_health(worker, False)
                return error(502, f"worker {worker} failed: {exc}")
        else:
            return error(503, "no healthy worker")
        out_headers = {
            k: v
            for k, v in upstream.headers.items()
            if k.lower() in ("content-type", "retry-after", "cache-control")
        }
        out_headers["x-tierkv-worker"] = worker

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                router.inflight[worker] -= 1

        return StreamingResponse(relay(), status_code=upstream.status_code, headers=out_headers)

    return app


def route(workers: list[str], host: str, port: int, prefix_chars: int, max_inflight: int) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check would bury the traffic
    router = Router(workers, prefix_chars=prefix_chars, max_inflight=max_inflight)
    log.info(
        "tierkv route: %d workers, prefix %d chars, spill past %d in flight, http://%s:%d",
        len(workers),
        prefix_chars,
        max_inflight,
        host,
        port,
    )
    uvicorn.run(create_router_app(router), host=host, port=port, log_level="warning")


__all__ = ["VNODES", "Ring", "Router", "create_router_app", "route", "routing_key"]
