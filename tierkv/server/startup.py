"""``tierkv serve``: load the model and the store, say what runs where, serve until SIGTERM, exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from tierkv.keys import NamespaceDigest
from tierkv.layout import KVSpec
from tierkv.server.app import create_app
from tierkv.server.config import ServeConfig, redact_url
from tierkv.server.guard import BodyGuard
from tierkv.server.state import Server, load_server
from tierkv.units import env_flag, format_size

log = logging.getLogger("tierkv.server")


# glibc's mallopt: allocations up to this size come from the heap, and freed memory stays with the process.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_NBYTES = 32 << 20  # glibc's largest on 64-bit
TRIM_THRESHOLD_NBYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Keep what the process frees for its next requests (glibc): a request's KV cache, a few MiB a layer,
    and a forward's temporaries would otherwise be mapped fresh and given back each time, every page of them
    faulted again; on this project's VM such pages cost a fault in the host too. SmolLM2's first request
    after a restart (2,864 tokens restored, 9 computed): 274-297 ms in 3 cycles against 305-742. The
    price: each glibc arena (one per thread that allocates, the model thread's above all) stays at its
    peak. ``TIERKV_KEEP_FREED_MEMORY=0`` turns it off. Whether it applied (glibc only)."""
    import ctypes
    import ctypes.util
    import platform

    if not env_flag("TIERKV_KEEP_FREED_MEMORY", True) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The trim first: alone it only keeps a heap's free top; the threshold alone would move allocations
    # into heaps that are then trimmed at once.
    if not mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_NBYTES):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_NBYTES))


def warm_up_http() -> float:
    """Import what the HTTP stack imports on its first streamed answer, before the first request: anyio
    loads its asyncio backend on first use (36 ms of SmolLM2's first request after a restart, measured
    with py-spy). Returns its seconds."""
    import anyio

    async def touch() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(anyio.sleep, 0)

    t0 = time.perf_counter()
    try:
        anyio.run(touch)
    except Exception as exc:  # the first request imports it instead
        log.warning("HTTP stack not warmed up: %s", exc)
    return time.perf_counter() - t0


def _threads_line(asked: int) -> str:
    import torch

    n = torch.get_num_threads()
    return f"{n} model thread{'s' if n != 1 else ''}" + (" (--threads)" if asked else "; --threads to change")


def _cached_line(store: Any, digest: NamespaceDigest) -> str | None:
    """What the disk tier holds at start-up (a restart's cache is there, or it is empty), from the index's
    exact totals: no scan. None without a disk tier."""
    from tierkv.tiers.disk import DiskTier

    disk = store.tier("disk")
    if not isinstance(disk, DiskTier):
        return None
    totals = disk.totals()
    blocks, nbytes = sum(b for b, _ in totals.values()), sum(n for _, n in totals.values())
    mine = totals.get(digest, (0, 0))[0]
    return (
        f"disk tier: {blocks:,} blocks ({format_size(nbytes)}) cached, {mine:,} of them for this model "
        f"({len(totals)} namespace{'s' if len(totals) != 1 else ''} in all)"
    )


def _budget_too_small(store: Any, ns: Any) -> str | None:
    """A disk budget below one block of the model's KV keeps nothing: said at start-up, not found later."""
    from tierkv.tiers.disk import DiskTier

    disk = store.tier("disk")
    budget = disk.policy.budget_nbytes if isinstance(disk, DiskTier) else None
    block = KVSpec.of(ns).block_nbytes
    if budget is None or budget >= block:
        return None
    return (
        f"disk tier: its budget ({format_size(budget)}) is smaller than one block of this model's KV "
        f"({format_size(block)}): nothing will be kept on disk (--disk-budget)"
    )


def _port_free(host: str, port: int) -> OSError | None:
    """Whether ``host:port`` can be bound now, asked before the model loads (seconds) rather than found
    after it; uvicorn binds it again later, and a process that takes it meanwhile still fails there."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(addr)
    except OSError as exc:
        return exc
    return None


def _cannot_listen(config: Any, why: str) -> None:
    log.error(
        "tierkv serve: cannot listen on http://%s:%s %s; another process may hold the port: --port picks "
        "another",
        config.host,
        config.port,
        why,
    )


def serve(config: ServeConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (exc := _port_free(config.host, config.port)) is not None:
        _cannot_listen(config, f"({exc})")
        raise SystemExit(3)  # uvicorn's status for a failed start
    kept = keep_freed_memory()  # before the model allocates anything
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    server = load_server(config)
    ns = server.cm.base_namespace
    if (
        server.store is not None
    ):  # allocate (and pre-fault) the memory tiers now, not during the first request
        server.store.reserve(ns)
        try:
            if line := _cached_line(server.store, ns.digest):
                log.info(line)
            if line := _budget_too_small(server.store, ns):
                log.warning(line)
        except Exception as exc:  # a line of the log: never a reason not to start
            log.warning("disk tier: could not read its totals: %s", exc)
        t0 = time.perf_counter()
        if tokens := server.cm.reserve_restore(server.engine.max_context):  # and where restores land (CPU)
            log.info(
                "restore buffer: %d tokens (%s), faulted in in %.2f s",
                tokens,
                format_size(tokens * KVSpec.of(ns).token_nbytes),
                time.perf_counter() - t0,
            )
    t0 = time.perf_counter()
    if tokens := server.cm.reserve_cache_storage(server.engine.max_context):  # and where caches keep their KV
        log.info(
            "cache storage: %d tokens (%s), faulted in in %.2f s",
            tokens,
            format_size(tokens * KVSpec.of(ns).token_nbytes),
            time.perf_counter() - t0,
        )
    # The model's first forward, before the first request rather than in it.
    log.info(
        "model and HTTP warmed up in %.2f s (%s); freed memory %s",
        server.engine.warm_up() + warm_up_http(),
        _threads_line(config.threads),
        "kept for later requests (TIERKV_KEEP_FREED_MEMORY=0: given back)" if kept else "given back",
    )
    tiers = ["none (--no-cache)"] if server.store is None else server.store.describe()

    def ready() -> None:  # once the port is bound: a client may connect from this line on
        log.info(
            "tierkv serve: listening on http://%s:%d: model %s on %s (%s), namespace %s (block %d), tiers: %s",
            config.host,
            config.port,
            ns.model_id,
            server.cm.device,
            ns.dtype,
            ns.digest.hex()[:16],
            ns.block_tokens,
            redact_url(", ".join(tiers)),  # the remote tier's URL may hold a password
        )

    _GracefulServer(
        uvicorn_config(server, log_level="warning"), on_ready=ready, in_flight=lambda: server.engine.queued
    ).run()


def uvicorn_config(server: Server, **overrides: Any) -> Any:
    """uvicorn's config for ``server``: the app behind its body guard, bounded in connections."""
    import uvicorn

    config = server.config
    app = BodyGuard(
        create_app(server),
        max_nbytes=config.max_body,
        timeout_s=config.body_timeout,
        max_total_nbytes=config.max_body_total,
        on_refusal=lambda scope, status: server.metrics.count_request(scope.get("path", ""), status),
    )
    options: dict[str, Any] = dict(
        host=config.host,
        port=config.port,
        timeout_graceful_shutdown=server.config.drain_timeout,
        # uvicorn counts the connection asking too (it answers 503 once connections >= the limit): + 1
        # so that max_connections are served.
        limit_concurrency=config.max_connections + 1,
    )
    return uvicorn.Config(app, **(options | overrides))


class _GracefulServer:
    """uvicorn's server, but SIGTERM ends in exit code 0 after the graceful shutdown.

    uvicorn re-raises a captured SIGTERM once it has shut down, which makes the process die of it (143):
    service managers read that as a failure. The running requests get ``timeout_graceful_shutdown``
    (--drain-timeout) to finish, then are cancelled (generation stops after its current token), and the
    store is flushed. A second signal cancels them at once; it does not skip the flush, as uvicorn's forced
    exit did (what the write-behind still held would be lost for the next start). A third exits at once.
    """

    def __new__(
        cls,
        config: Any,
        on_ready: Callable[[], None] | None = None,
        in_flight: Callable[[], int] | None = None,
    ) -> Any:
        import signal
        import threading

        import uvicorn

        class Server(uvicorn.Server):
            _signals = 0  # SIGTERM or SIGINT received: 1 drains, 2 cancels now, 3 exits without the flush
            _drained = False  # the requests are done or cancelled: the store is being flushed

            async def startup(self, sockets: Any = None) -> None:
                try:
                    await super().startup(sockets)
                except SystemExit:  # uvicorn logged why (the port in use, say) and stops the process
                    _cannot_listen(config, "(above)")
                    raise
                if on_ready is not None:
                    on_ready()

            def handle_exit(self, sig: int, frame: Any) -> None:
                # A signal handler: flags, and raw writes only (a log call here can meet the write it
                # interrupted); the loop logs what they mean (shutdown, _wait_tasks_to_complete).
                self._signals += 1
                self.should_exit = True
                if self._signals >= 3:  # the operator insists: exit now, what the flush had not written lost
                    os.write(2, b"tierkv serve: third signal: exiting without finishing the flush\n")
                    os._exit(1)
                if self._signals == 2 and self._drained:
                    os.write(2, b"tierkv serve: flushing the store; a third signal exits without it\n")

            async def shutdown(self, sockets: Any = None) -> None:
                log.info(
                    "stopping: %d request(s) running or queued get up to %gs to finish (--drain-timeout), "
                    "then are cancelled; then the store is flushed (a second signal cancels them now)",
                    in_flight() if in_flight is not None else 0,
                    config.timeout_graceful_shutdown,
                )
                await super().shutdown(sockets)

            async def _wait_tasks_to_complete(self) -> None:
                # uvicorn's wait, cut short by a second signal: the TimeoutError is the drain's own end
                # (uvicorn then cancels the requests' tasks and runs the shutdown that flushes the store).
                try:
                    if not (self.server_state.connections or self.server_state.tasks):
                        await super()._wait_tasks_to_complete()  # nothing to wait for: no suspension
                        return
                    waiting = asyncio.ensure_future(super()._wait_tasks_to_complete())
                    try:
                        while not waiting.done():
                            if self._signals >= 2:
                                log.warning(
                                    "second signal: cancelling the running requests now, then flushing"
                                )
                                raise TimeoutError
                            await asyncio.sleep(0.05)
                    finally:
                        waiting.cancel()
                    waiting.result()
                finally:
                    self._drained = True

            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                previous = {
                    sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
                }
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

        return Server(config)


__all__ = ["serve"]
