"""Where a restore writes: the destination KV tensor, and how a tier's blocks get into it.

A destination is ``[layers, 2, tokens, kv_heads, head_dim]`` on any device. Record tiers (disk, remote)
fill CPU memory whose every (layer, k/v) slab is contiguous: a CPU destination is filled in place
(records scattered straight into it); any other goes through two chunk buffers (pinned for a GPU):
records are read into one while the other is uploaded. Memory pools copy slots straight in.

A destination may also be a ``Sink``, an engine's own memory that is no KV tensor (vLLM's pages): record
tiers then fill the chunk buffers, the sink copying one into place (on a thread: its copy releases the
GIL) while the next is read, and memory pools hand it their slots, so restored KV is copied once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from tierkv import codec
from tierkv.cpus import spread_here
from tierkv.keys import BlockChain
from tierkv.layout import KVSpec

log = logging.getLogger("tierkv.store")

__all__ = [
    "RESTORE_CHUNK_NBYTES",
    "Sink",
    "Stagers",
    "Target",
    "as_tensor",
    "expected",
    "rows_scatterable",
    "wait_for_copies",
]

# Record-tier blocks restored into a GPU are read and uploaded in chunks of this many bytes: the upload of
# one chunk overlaps the read of the next.
RESTORE_CHUNK_NBYTES = 32 << 20

# fill(buffer, first, count, base): put blocks first..first+count-1 into ``buffer`` (block i at block
# position i - base, every slab contiguous) and verify them; returns how many leading blocks are exact.
Fill = Callable[[torch.Tensor, int, int, int], int]


class Sink(Protocol):
    """A restore's destination that is not one KV tensor: blocks ``0..num_blocks-1`` of the prompt, each
    handed over as soon as it is restored (``Target.fill``, ``BlockPool.read_into``)."""

    spec: KVSpec
    num_blocks: int

    def put_rows(self, kv: torch.Tensor, positions: Sequence[int], blocks: Sequence[int]) -> None:
        """Blocks ``blocks`` from block ``positions`` of ``kv`` (CPU, every (layer, k/v) slab contiguous)."""

    def put_slots(self, slots: Sequence[torch.Tensor], blocks: Sequence[int]) -> None:
        """Blocks ``blocks`` from canonical blocks (``[layers, 2, block_tokens, kv_heads, head_dim]``,
        contiguous CPU memory: a memory tier's slots)."""

    def block(self, i: int) -> torch.Tensor:
        """A copy of block ``i`` as restored (canonical, on CPU): for the tiers written back after it."""


def as_tensor(buf: memoryview | bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    # Read-only use: torch warns that a bytes object is not writable; we never write through this view.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype).view(*shape)


def expected(chain: BlockChain, i: int) -> codec.Expected:
    """What block ``i`` of a request must be to be served."""
    ns = chain.ns
    return codec.Expected(ns.digest, chain.keys[i], chain.tokens(i), ns.dtype, KVSpec.of(ns).block_shape)


def wait_for_copies(t: torch.Tensor) -> None:
    """Wait until the copies queued into ``t`` (a GPU tensor: asynchronous ones) are done."""
    if t.device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        event.synchronize()


def rows_scatterable(t: torch.Tensor) -> bool:
    """Whether records can be scattered straight into ``t``: a CPU tensor whose every (layer, k/v) slab
    ``[tokens, kv_heads, head_dim]`` is contiguous (a token-slice of a larger buffer qualifies)."""
    _, _, _, H, D = t.shape
    return t.device.type == "cpu" and t.stride(4) == 1 and t.stride(3) == D and t.stride(2) == H * D


class _Stager:
    """Two chunk buffers (pinned for a GPU, allocated once): records are read into one while the other is
    uploaded to the destination, asynchronously on a GPU. Each holds ``blocks`` blocks."""

    def __init__(self, spec: KVSpec, pin: bool) -> None:
        self.spec = spec
        self.pin = pin
        self.blocks = max(1, RESTORE_CHUNK_NBYTES // spec.block_nbytes)
        t0 = time.perf_counter()
        self.buffers = [
            torch.empty(spec.shape(self.blocks * spec.block_tokens), dtype=spec.dtype, pin_memory=pin)
            for _ in range(2)
        ]
        if not pin:  # faulted in now (pinned memory is): not a page fault per 4 KiB in the first restore
            for buf in self.buffers:
                buf.view(torch.uint8).fill_(0)
        log.info(
            "restore staging: 2 x %d blocks (%.1f MiB%s) in %.2f s",
            self.blocks,
            2 * self.blocks * spec.block_nbytes / 2**20,
            ", pinned" if pin else "",
            time.perf_counter() - t0,
        )
        self._events: list[Any] = [None, None]
        self._next = 0

    def acquire(self) -> int:
        """The next buffer, once its previous upload is done."""
        k, self._next = self._next, self._next ^ 1
        if self._events[k] is not None:
            self._events[k].synchronize()
            self._events[k] = None
        return k

    def upload(self, k: int, dest: torch.Tensor, first: int, count: int) -> None:
        """Blocks ``0..count-1`` of buffer ``k`` to blocks ``first..`` of ``dest``."""
        B = self.spec.block_tokens
        buf = self.buffers[k]
        for layer in range(self.spec.num_layers):  # per (layer, k/v): the run is contiguous there
            for kv in (0, 1):
                dest[layer, kv, first * B : (first + count) * B].copy_(
                    buf[layer, kv, : count * B], non_blocking=True
                )
        if dest.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dest.device))
            self._events[k] = event


class Stagers:
    """The store's chunk buffers, made on first need and kept; one restore uses them at a time."""

    def __init__(self) -> None:
        self._stager: _Stager | None = None
        self._lock = threading.Lock()
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None  # a sink's copies, made on need
        self._closed = False

    def copier(self) -> concurrent.futures.ThreadPoolExecutor:
        """One thread for sinks' copies out of the chunk buffers; call it holding the stager (``_lock``)."""
        if self._closed:
            raise RuntimeError("the store is closed")
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tierkv-sink", initializer=spread_here
            )
        return self._copier

    def reserve(self, spec: KVSpec) -> None:
        """The CPU chunk buffers for ``spec`` and the sinks' copier now (the buffers faulted in), not on
        the first restore that needs them."""
        self._acquire(spec, False)
        try:
            self.copier()
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:  # after any restore using the copier
            self._closed = True
            copier, self._copier = self._copier, None
            self._stager = None  # its buffers (pinned, for a GPU) go with the store
        if copier is not None:
            copier.shutdown(wait=True)

    @contextlib.contextmanager
    def target(self, dest: torch.Tensor | Sink, spec: KVSpec) -> Iterator[Target]:
        """A ``Target`` over ``dest`` for one restore; on exit every queued copy into ``dest`` is done and
        the memory the tiers held for it (slots being copied from) is let go."""
        with contextlib.ExitStack() as held:
            target = Target(dest, spec, held, self._acquire, self.copier)
            try:
                yield target
            finally:
                target.close_behind()  # the promotions a reader left behind are done (it waits for them)
                try:
                    if isinstance(dest, torch.Tensor):  # a sink's copies are done when its calls return
                        wait_for_copies(dest)  # before the slots and the chunk buffers are let go
                finally:  # a device error in the wait must not block every later chunked restore
                    if target.locked:
                        self._lock.release()

    def _acquire(self, spec: KVSpec, pin: bool) -> _Stager:
        self._lock.acquire()
        try:
            stager = self._stager
            if stager is None or stager.spec != spec or stager.pin != pin:
                self._stager = None  # the old pair is let go before the new one is allocated
                stager = self._stager = _Stager(spec, pin)
        except BaseException:  # memory short: this restore fails, the next one may try again
            self._lock.release()
            raise
        return stager


class Target:
    """One restore's destination, as tiers see it (made by ``Stagers.target``)."""

    def __init__(
        self,
        dest: torch.Tensor | Sink,
        spec: KVSpec,
        held: contextlib.ExitStack,
        acquire: Callable[[KVSpec, bool], _Stager],
        copier: Callable[[], concurrent.futures.Executor] | None = None,
    ) -> None:
        self.sink: Sink | None = None if isinstance(dest, torch.Tensor) else dest
        self.dest: torch.Tensor | None = dest if isinstance(dest, torch.Tensor) else None
        self.spec = spec
        self.created_s: dict[int, float] = {}  # block index -> creation time, where the source knows it
        self._held = held
        self._acquire = acquire
        self._copier = copier
        self._stager: _Stager | None = None
        self.locked = False
        # Called with (block index, its KV on CPU) for each block a source read and verified, on the
        # reading thread while the bytes are still in cache (the store promotes it there).
        self.on_verified: Callable[[int, torch.Tensor], None] | None = None
        # The same for a run of blocks verified at once: (buffer, block indices, the buffer's first block).
        self.on_verified_run: Callable[[torch.Tensor, list[int], int], None] | None = None
        self._behind: concurrent.futures.ThreadPoolExecutor | None = None

    def behind(self, fn: Callable[..., None], *args: Any) -> concurrent.futures.Future[None]:
        """Run ``fn(*args)`` on this restore's own thread (started on the first call), in order: a reader
        has ``verified_run`` copy what was verified while it reads on (and waits for the futures before
        the buffer is reused or handed back). One thread a restore: concurrent restores do not wait behind
        each other's copies, and the restore's end joins it."""
        if self._behind is None:
            self._behind = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tierkv-promote", initializer=spread_here
            )
        return self._behind.submit(fn, *args)

    def close_behind(self) -> None:
        if self._behind is not None:
            self._behind.shutdown(wait=True, cancel_futures=True)
            self._behind = None

    def verified(self, i: int, block: torch.Tensor) -> None:
        if self.on_verified is not None:
            self.on_verified(i, block)

    def verified_run(self, buf: torch.Tensor, idx: list[int], base: int) -> None:
        """Blocks ``idx`` verified at once, at block positions ``i - base`` of ``buf`` (a reader that checks
        a whole run before it returns): one batched promotion instead of one a block."""
        if self.on_verified_run is not None:
            self.on_verified_run(buf, idx, base)
        elif self.on_verified is not None:
            B = self.spec.block_tokens
            for i in idx:
                self.on_verified(i, buf[:, :, (i - base) * B : (i - base + 1) * B])

    def block(self, i: int) -> torch.Tensor:
        """Block ``i`` as restored: a view of the destination tensor, or a sink's copy."""
        if self.sink is not None:
            return self.sink.block(i)
        assert self.dest is not None
        B = self.spec.block_tokens
        return self.dest[:, :, i * B : (i + 1) * B]

    def hold(self, cm: contextlib.AbstractContextManager[Any]) -> Any:
        """Keep ``cm`` entered until the restore is over and its copies are done (a memory tier's slots
        being read by asynchronous copies)."""
        return self._held.enter_context(cm)

    def fill(self, first: int, count: int, fill: Fill) -> int:
        """Have ``fill`` put blocks ``first..first+count-1`` into CPU memory with contiguous slabs: ``dest``
        itself when it qualifies, else the chunk buffers, each chunk uploaded while the next is filled.
        Returns how many leading blocks ``fill`` verified (blocks past them are unspecified in ``dest``)."""
        if count <= 0:
            return 0
        if self.dest is not None and rows_scatterable(self.dest):
            return fill(self.dest, first, count, 0)
        if self._stager is None:
            on_gpu = self.dest is not None and self.dest.device.type == "cuda"
            self._stager = self._acquire(self.spec, on_gpu)
            self.locked = True
        stager = self._stager
        done = 0
        copying: concurrent.futures.Future[None] | None = None  # a sink's copy out of the other buffer
        try:
            while done < count:
                n = min(stager.blocks, count - done)
                k = stager.acquire()
                got = fill(stager.buffers[k], first + done, n, first + done)
                if self.sink is not None:
                    if copying is not None:  # the other buffer's copy, before this one's starts
                        copying.result()
                    blocks = range(first + done, first + done + got)
                    if self._copier is not None and got:
                        copying = self._copier().submit(
                            self.sink.put_rows, stager.buffers[k], range(got), blocks
                        )
                    else:
                        copying = None
                        self.sink.put_rows(stager.buffers[k], range(got), blocks)
                else:
                    assert self.dest is not None
                    stager.upload(k, self.dest, first + done, got)
                done += got
                if got < n:
                    break
        finally:
            if copying is not None:  # raises the copy's error, if any: the restore fails whole
                copying.result()
        return done
