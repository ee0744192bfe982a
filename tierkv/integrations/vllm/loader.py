"""The connector's asynchronous loads (``load_async``): a thread that restores requests into vLLM's pages
while the engine computes others, and the loads that ended, collected on the model thread.

vLLM holds a request whose load is asynchronous (``WAITING_FOR_REMOTE_KVS``) until every worker reported
it done, its failed blocks with it (``get_finished``, then ``get_block_ids_with_load_errors`` in the same
step), and rewinds it to its first failed block before it computes any of it. So nothing is computed from
a block that did not load, and a load needs no taint (``guard.py`` is for synchronous loads).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from tierkv.cpus import spread_here
from tierkv.integrations.vllm.meta import BlockSpan
from tierkv.keys import Namespace

log = logging.getLogger("vllm.tierkv")

__all__ = ["IDLE_WAIT_S", "Loaded", "Loader"]

# A load still running after this is logged (once): its request waits for it, and so do the loads behind it
SLOW_LOAD_S = 30.0
# How long a step that computes nothing waits for an asynchronous load to end before it reports (a request
# arriving meanwhile is scheduled that much later; without it vLLM's engine spins on empty steps)
IDLE_WAIT_S = 0.01


@dataclasses.dataclass
class Loaded:
    """What a load did: its first ``got`` blocks are in vLLM's pages (``kv``: the buffer they were restored
    into, kept for a self-check only)."""

    span: BlockSpan
    got: int
    hit: Any = None
    kv: torch.Tensor | None = None
    read_s: float = 0.0
    seconds: float = 0.0


def _done(loaded: Loaded) -> concurrent.futures.Future[Loaded]:
    job: concurrent.futures.Future[Loaded] = concurrent.futures.Future()
    job.set_result(loaded)
    return job


# A restore of a span into vLLM's pages: (span, a buffer maker, the namespace it began in) -> what it did
Restore = Callable[[BlockSpan, Callable[..., torch.Tensor], Namespace], Loaded]


class Loader:
    def __init__(self, restore: Restore, device: torch.device, dtype: torch.dtype) -> None:
        self._restore = restore
        self._device, self._dtype = device, dtype
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # made at the first load
        self._stream: Any = None  # the loader thread's CUDA stream (one: the allocator reuses per stream)
        # req_id -> (span, the epoch it began in, its job), in flight or not yet collected
        self._jobs: dict[str, tuple[BlockSpan, str, concurrent.futures.Future[Loaded]]] = {}
        # req_id -> when its load began on the thread (monotonic; inf once logged as slow)
        self._started: dict[str, float] = {}

    def failed(self, span: BlockSpan, epoch: str) -> None:
        """A load that cannot run (no store, nothing to load): done at once, nothing loaded."""
        self._jobs[span.req_id] = (span, epoch, _done(Loaded(span, 0)))

    def submit(self, span: BlockSpan, ns: Namespace, epoch: str) -> None:
        if not span.block_ids or not span.token_ids:  # nothing to load (its blocks, if any, fail)
            self.failed(span, epoch)
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tierkv-load", initializer=spread_here
            )
        try:
            job = self._pool.submit(self._run, span, ns)
        except RuntimeError:  # a pool that cannot start its thread: the load failed, vLLM computes it
            log.exception("tierkv: could not start the asynchronous load of %s", span.req_id)
            # (submit queued it before the thread failed to start: a later thread would run it, into
            # blocks vLLM may have given to another request by then)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            job = _done(Loaded(span, 0))
        self._jobs[span.req_id] = (span, epoch, job)

    def _run(self, span: BlockSpan, ns: Namespace) -> Loaded:
        """On the loader thread: into a buffer of its own (the model thread's are reused), and on a GPU on
        the loader's stream, synchronised before the load counts as done."""

        self._started[span.req_id] = time.monotonic()

        def fresh(name: str, shape: tuple[int, ...], grow_dim: int) -> torch.Tensor:
            return torch.empty(shape, dtype=self._dtype, device=self._device)

        if self._device.type != "cuda":
            return self._restore(span, fresh, ns)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        try:
            with torch.cuda.stream(self._stream):
                return self._restore(span, fresh, ns)
        finally:
            self._stream.synchronize()

    def collect(self, epoch: str, *, idle: bool) -> list[Loaded]:
        """The loads that ended since the last call. One begun before a reset of the connector's cache
        (another ``epoch``: vLLM reset it, e.g. for new weights) read the old epoch's KV: it counts as
        failed, every block. ``idle``: this step computes nothing, so wait a little for a load first."""
        if idle and self._jobs:
            jobs = [job for _, _, job in self._jobs.values()]
            concurrent.futures.wait(jobs, timeout=IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)
        out = []
        now = time.monotonic()
        for req_id, started in list(self._started.items()):  # (the loader thread adds entries)
            if now - started > SLOW_LOAD_S and req_id in self._jobs and not self._jobs[req_id][2].done():
                self._started[req_id] = math.inf  # logged once
                log.warning(
                    "tierkv: the asynchronous load of %s has run for %.0f s (a stalled disk or remote tier?); "
                    "its request and the loads queued behind it wait for it",
                    req_id,
                    now - started,
                )
        for req_id in [r for r, (_, _, job) in self._jobs.items() if job.done()]:
            span, began, job = self._jobs.pop(req_id)
            self._started.pop(req_id, None)
            if job.cancelled():  # stopped before it ran (the worker is closing)
                out.append(Loaded(span, 0))
                continue
            try:
                loaded = job.result()
            except Exception:  # the restore catches the store's failures; this is a bug: recompute it all
                log.exception("tierkv: the asynchronous load of %s failed", req_id)
                loaded = Loaded(span, 0)
            if began != epoch and loaded.got:
                log.info("tierkv: %s was loaded from before a cache reset; vLLM recomputes it", req_id)
                loaded = Loaded(span, 0, loaded.hit, None, loaded.read_s, loaded.seconds)
            out.append(loaded)
        return out

    def stop(self) -> None:
        """Wait for the loads still writing into vLLM's pages (before the store they read goes)."""
        if self._pool is not None:  # the running load ends; those queued behind it never start
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
