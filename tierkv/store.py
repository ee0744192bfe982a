"""TieredStore: the public API. Save KV blocks write-behind, find and restore the longest cached prefix.

A prefix is served block by block from the fastest tier holding each block (GPU, host, disk, remote); it
ends at the first block no tier holds, or the first that fails verification (that block is purged and
counted, and the caller recomputes from there). Wrong KV is never served.

Saving blocks that live on a GPU: they enter the GPU tier by a device copy, and leave the device through
the staging ring (pinned slots, a side stream fenced on the compute stream); the ring's drain thread hands
them to the host tier and the disk writer. The inference thread never waits for a device-to-host copy.
Restoring into a GPU: GPU-tier blocks by a device copy, host blocks by DMA from pinned slots, disk blocks
read in chunks into two pinned buffers, each chunk uploaded while the next one is read into the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierkv import codec
from tierkv.errors import ConfigError, RecordError
from tierkv.keys import BlockChain, BlockKey, Namespace
from tierkv.layout import KVSpec
from tierkv.metrics import COUNTER_NAMES, Counters
from tierkv.staging import StagingRing
from tierkv.tiers.disk import DiskTier, Policy
from tierkv.tiers.gpu import GpuTier
from tierkv.tiers.host import HostTier
from tierkv.tiers.pool import BlockPool
from tierkv.tiers.remote import RemoteTier

log = logging.getLogger("tierkv.store")


@dataclasses.dataclass(frozen=True)
class Hit:
    """How much of a prompt is cached: ``num_tokens`` in all, ``by_tier`` tokens from each tier."""

    num_tokens: int
    by_tier: dict[str, int]
    num_blocks: int = 0
    restore_s: float = 0.0


def _as_tensor(buf: memoryview | bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    # Read-only use: torch warns that a bytes object is not writable; we never write through this view.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype).view(*shape)


# Disk blocks restored into a GPU are read and uploaded in chunks of this many bytes: the upload of one
# chunk overlaps the read of the next.
RESTORE_CHUNK_NBYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A block on its way to the host and disk tiers (the staging ring carries it as metadata)."""

    ns: Namespace
    spec: KVSpec
    key: BlockKey
    parent: BlockKey
    token_bytes: bytes
    created_s: float


def _rows_scatterable(t: torch.Tensor) -> bool:
    """Whether disk records can be scattered straight into ``t``: a CPU tensor whose every (layer, k/v)
    slab ``[tokens, kv_heads, head_dim]`` is contiguous (a token-slice of a larger buffer qualifies)."""
    _, _, _, H, D = t.shape
    return t.device.type == "cpu" and t.stride(4) == 1 and t.stride(3) == D and t.stride(2) == H * D


def _pair_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(i, j)`` pairs as ``(i0, j0, count)`` runs where both go up by one."""
    runs: list[tuple[int, int, int]] = []
    for i, j in pairs:
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == j:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, j, 1))
    return runs


class _Stager:
    """Two chunk buffers (pinned for a GPU, allocated once): records are read into one while the other is
    uploaded to the destination, asynchronously on a GPU. Each holds ``blocks`` blocks."""

    def __init__(self, spec: KVSpec, pin: bool) -> None:
        self.spec = spec
        self.pin = pin
        self.blocks = max(1, RESTORE_CHUNK_NBYTES // spec.block_nbytes)
        t0 = time.perf_counter()
        self.buffers = [torch.empty(spec.shape(self.blocks * spec.block_tokens), dtype=spec.dtype, pin_memory=pin)
                        for _ in range(2)]
        log.info("restore staging: 2 x %d blocks (%.1f MiB%s) in %.2f s", self.blocks,
                 2 * self.blocks * spec.block_nbytes / 2**20, ", pinned" if pin else "", time.perf_counter() - t0)
        self._events: list[Any] = [None, None]
        self._next = 0
        self.dest: torch.Tensor | None = None

    def acquire(self) -> int:
        """The next buffer, once its previous upload is done."""
        k, self._next = self._next, self._next ^ 1
        if self._events[k] is not None:
            self._events[k].synchronize()
            self._events[k] = None
        return k

    def upload(self, k: int, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy blocks ``j`` of buffer ``k`` to blocks ``i`` of the destination, for each ``(i, j)``."""
        dest, buf, B = self.dest, self.buffers[k], self.spec.block_tokens
        assert dest is not None
        for i0, j0, count in _pair_runs(pairs):
            for layer in range(self.spec.num_layers):  # per (layer, k/v): each run is contiguous there
                for kv in (0, 1):
                    dest[layer, kv, i0 * B : (i0 + count) * B].copy_(buf[layer, kv, j0 * B : (j0 + count) * B],
                                                                     non_blocking=True)
        if dest.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dest.device))
            self._events[k] = event


def _source_runs(src: Sequence[int | None]) -> list[tuple[int, int, int]]:
    """``(tier, first, end)`` runs of consecutive blocks served by the same memory tier."""
    runs: list[tuple[int, int, int]] = []
    for i, k in enumerate(src):
        if k is None:
            continue
        if runs and runs[-1][0] == k and runs[-1][2] == i:
            runs[-1] = (k, runs[-1][1], i + 1)
        else:
            runs.append((k, i, i + 1))
    return runs


def _upload_run(dest: torch.Tensor, slots: Sequence[torch.Tensor], first: int, spec: KVSpec) -> None:
    """Blocks ``first..`` of ``dest`` from host slots: each slot is one contiguous DMA into a block-major
    buffer on ``dest``'s device, then one device copy puts the run in place (instead of a staged copy and
    a strided copy per block)."""
    n, B = len(slots), spec.block_tokens
    run = torch.empty((n, *spec.block_shape), dtype=spec.dtype, device=dest.device)
    for j, slot in enumerate(slots):
        run[j].copy_(slot.view(spec.dtype).view(spec.block_shape), non_blocking=True)
    dest[:, :, first * B : (first + n) * B].copy_(run.permute(1, 2, 0, 3, 4, 5).reshape(spec.shape(n * B)))


def _wait_for_copies(t: torch.Tensor) -> None:
    """Wait until the copies queued into ``t`` (a GPU tensor: asynchronous ones) are done."""
    if t.device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        event.synchronize()


def _expected(chain: BlockChain, spec: KVSpec, i: int) -> codec.Expected:
    """What block ``i`` of a request must be to be served."""
    return codec.Expected(chain.ns.digest, chain.keys[i], chain.tokens(i), chain.ns.dtype, spec.block_shape)


Tokens = Sequence[int] | np.ndarray | BlockChain  # a prompt's token ids, or its chain if already made


def _chain(ns: Namespace, tokens: Tokens) -> BlockChain:
    if isinstance(tokens, BlockChain):
        if tokens.ns != ns:
            raise ConfigError("the block chain was made for another namespace")
        return tokens
    return BlockChain.of(ns, tokens)


class TieredStore:
    def __init__(self, host: HostTier | None, disk: DiskTier | None, *, codec_: codec.Codec = codec.Codec.RAW,
                 clock: Callable[[], float] = time.time, counters: Counters | None = None,
                 remote: RemoteTier | None = None, gpu: GpuTier | None = None, staging: bool | None = None,
                 staging_nbytes: int = 512 << 20, staging_wait_s: float = 0.005) -> None:
        """``staging``: blocks go to the host and disk tiers through the staging ring; None (default) when
        they are on a CUDA device, True also on CPU (the same code path, synchronous copies).
        ``staging_nbytes``: the ring's pinned memory, and as much again of GPU blocks waiting for a slot.
        A prefill whose new blocks fit in both never waits for the drain; past that each block waits at
        most ``staging_wait_s`` for a slot, then is dropped (counted).
        """
        self.gpu = gpu
        self.host = host
        self.disk = disk
        self.remote = remote
        self.pools: list[BlockPool] = [p for p in (gpu, host) if p is not None]  # fastest first
        self.tiers = (("gpu",) if gpu is not None else ()) + ("host", "disk") + (
            ("remote",) if remote is not None else ())
        self.codec = codec_
        self.clock = clock
        self.counters = counters or Counters()
        self.staging = staging
        self.staging_nbytes = staging_nbytes
        self.staging_wait_s = staging_wait_s
        self._ring: StagingRing | None = None
        self._ring_lock = threading.Lock()
        self._stager: _Stager | None = None  # chunk buffers of restores into a GPU
        self._restore_lock = threading.Lock()

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str] | None,
        *,
        host_bytes: int = 1 << 30,
        disk_bytes: int | None = None,
        ttl_s: float | None = None,
        max_age_s: float | None = None,
        codec_: codec.Codec | str = codec.Codec.RAW,
        clock: Callable[[], float] = time.time,
        sync: bool = True,
        remote: str | None = None,
        remote_admit_after: int = 1,
        gpu_bytes: int = 0,
        device: str | torch.device = "cuda",
        staging: bool | None = None,
        sweep_interval_s: float = 0.0,
        **disk_options: int,
    ) -> TieredStore:
        """Open (or create) a store. ``path=None`` gives a host-only store; ``host_bytes=0`` a disk-only one.

        ``remote`` (``redis://host:port`` or ``redis+cluster://host:port``) adds a tier shared by several
        workers; ``remote_admit_after`` shares a block only once that many requests contained it.
        ``gpu_bytes`` adds a GPU tier of that size on ``device`` (see ``tiers.gpu.gpu_budget_nbytes``).
        ``sweep_interval_s`` > 0 runs the disk tier's expiry and budget sweep in the background that often
        (a server does; 0 leaves sweeping to ``tierkv gc``). ``ttl_s`` applies to the memory tiers too.
        """
        if host_bytes < 0 or (disk_bytes is not None and disk_bytes <= 0):
            raise ConfigError("host_bytes must be >= 0 and disk_bytes > 0")
        counters = Counters()
        if isinstance(codec_, str):
            codec_ = codec.Codec[codec_.upper().replace("-", "_")]
        ages = {"ttl_s": ttl_s, "max_age_s": max_age_s, "clock": clock}
        host = HostTier(host_bytes, counters=counters, **ages) if host_bytes else None
        disk = None
        if path is not None:
            disk = DiskTier(Path(path), policy=Policy(disk_bytes, ttl_s, max_age_s), clock=clock, sync=sync,
                            counters=counters, sweep_interval_s=sweep_interval_s, **disk_options)
        remote_tier = None
        if remote is not None:
            from tierkv.tiers.remote import RemoteTier

            remote_tier = RemoteTier(remote, ttl_s=ttl_s, admit_after=remote_admit_after, counters=counters)
        gpu = GpuTier(gpu_bytes, device=device, counters=counters, **ages) if gpu_bytes else None
        return cls(host, disk, codec_=codec_, clock=clock, counters=counters, remote=remote_tier, gpu=gpu,
                   staging=staging)

    def add_gpu_tier(self, capacity_nbytes: int, device: torch.device | str) -> None:
        """Add the GPU tier (a server does this once the model is loaded, before serving)."""
        if self.gpu is not None:
            raise ConfigError("this store already has a GPU tier")
        ages = {"ttl_s": self.host.ttl_s, "max_age_s": self.host.max_age_s} if self.host is not None else {}
        self.gpu = GpuTier(capacity_nbytes, device=device, counters=self.counters, clock=self.clock, **ages)
        self.pools.insert(0, self.gpu)
        self.tiers = ("gpu", *self.tiers)

    # ---------------------------------------------------------------- save

    def _check_kv(self, ns: Namespace, kv: torch.Tensor, min_tokens: int) -> KVSpec:
        spec = KVSpec.of(ns)
        if kv.dim() != 5 or kv.shape[0] != spec.num_layers or kv.shape[1] != 2 or tuple(kv.shape[3:]) != (
                spec.num_kv_heads, spec.head_dim):
            raise ConfigError(f"kv must be {list(spec.shape(min_tokens))} (layers, 2, tokens, kv heads, head dim), "
                              f"got {list(kv.shape)}")
        if kv.dtype != spec.dtype:
            raise ConfigError(f"kv dtype {kv.dtype} differs from the namespace's {ns.dtype}")
        if kv.shape[2] < min_tokens:
            raise ConfigError(f"kv holds {kv.shape[2]} tokens, fewer than the {min_tokens} asked for")
        return spec

    def save(self, ns: Namespace, token_ids: Tokens, kv: torch.Tensor,
             *, start_block: int = 0, kv_start: int = 0) -> int:
        """Keep the full blocks of ``token_ids`` (KV ``[layers, 2, tokens, kv_heads, head_dim]``, any device).

        Returns at once: the memory tiers' copies are made now (or, through the staging ring, queued), the
        disk write happens behind (a dropped save is counted, never an error). Blocks before
        ``start_block`` are known cached and skipped. ``kv`` may start at token ``kv_start``
        (<= ``start_block * block_tokens``) instead of 0. Returns the number of blocks handed on.
        """
        chain = _chain(ns, token_ids)
        if not 0 <= kv_start <= start_block * ns.block_tokens:
            raise ConfigError(f"kv_start {kv_start} must be in 0..start_block * block_tokens")
        self._check_kv(ns, kv, chain.num_tokens - kv_start)
        B = ns.block_tokens
        blocks = [kv[:, :, i * B - kv_start : (i + 1) * B - kv_start] for i in range(start_block, len(chain))]
        return self._save(chain, start_block, blocks)

    def save_blocks(self, ns: Namespace, token_ids: Tokens, blocks: torch.Tensor,
                    *, start_block: int = 0) -> int:
        """Like ``save`` for blocks ``start_block..`` given block-major, ``[N, layers, 2, block_tokens,
        kv_heads, head_dim]`` (as ``kernels.gather_blocks`` makes them: each block one contiguous piece)."""
        chain = _chain(ns, token_ids)
        spec = KVSpec.of(ns)
        if blocks.dim() != 6 or tuple(blocks.shape[1:]) != spec.block_shape or blocks.dtype != spec.dtype:
            raise ConfigError(f"blocks must be [N, {', '.join(map(str, spec.block_shape))}] of {ns.dtype}, "
                              f"got {list(blocks.shape)} of {blocks.dtype}")
        if start_block + blocks.shape[0] != len(chain):
            raise ConfigError(f"{blocks.shape[0]} blocks from block {start_block} do not end at the prompt's "
                              f"last full block ({len(chain)})")
        return self._save(chain, start_block, list(blocks.unbind(0)), stacked=blocks)

    def _save(self, chain: BlockChain, start: int, blocks: Sequence[torch.Tensor],
              stacked: torch.Tensor | None = None) -> int:
        """``blocks`` are blocks ``start..`` (``stacked``: the same as one contiguous tensor, if they are)."""
        if not blocks:
            return 0
        ns, keys = chain.ns, chain.keys
        spec = KVSpec.of(ns)
        device = blocks[0].device
        if self.gpu is not None and self.gpu.device == device:  # device copies, on the compute stream
            if stacked is not None:
                self.gpu.put_many(keys[start:], stacked)
            else:
                for i, block in enumerate(blocks, start):
                    self.gpu.put(keys[i], block)
        if self.host is None and self.disk is None and self.remote is None:
            return 0
        in_host = self.host.contains(keys[start:]) if self.host is not None else [False] * len(blocks)
        if self.disk is not None and any(in_host):
            # A block in RAM may have left the disk (expired, evicted, a dropped save): write it again, or
            # a restart would lose what the RAM copy hid.
            on_disk = self.disk.holds(keys[start:])
            in_host = [h and d for h, d in zip(in_host, on_disk)]
        ring = self._ring_for(spec, device)
        now = self.clock()
        todo = [j for j in range(len(blocks)) if not in_host[j]]
        pending = [_Pending(ns, spec, keys[start + j], chain.parent(start + j), chain.tokens(start + j), now)
                   for j in todo]
        if ring is not None:
            # Model KV on a GPU is never written again: the ring may hold it while its slots are busy.
            accepted = ring.submit_many([blocks[j] for j in todo], pending, keep_reference=device.type == "cuda")
            return sum(accepted)
        for j, p in zip(todo, pending):
            self._keep(blocks[j] if device.type == "cpu" else blocks[j].cpu(), p)
        return len(todo)

    def _ring_for(self, spec: KVSpec, device: torch.device) -> StagingRing | None:
        """The staging ring for blocks on ``device`` (made on first use), or None to copy directly."""
        if not (self.staging or (self.staging is None and device.type == "cuda")):
            return None
        with self._ring_lock:
            if self._ring is None:
                slots = max(2, self.staging_nbytes // spec.block_nbytes)
                self._ring = StagingRing(slots, spec.block_nbytes, device=device, on_ready=self._drain,
                                         wait_s=self.staging_wait_s, pending_nbytes=self.staging_nbytes,
                                         counters=self.counters)
            ring = self._ring
        if ring.device != device or ring.slots.shape[1] < spec.block_nbytes:
            return None  # another device or a larger block than the slots: the direct path
        return ring

    def _drain(self, slot: torch.Tensor, pending: _Pending) -> None:
        """The staging ring's consumer (its drain thread): the slot is reused after this returns."""
        spec = pending.spec
        self._keep(slot[: spec.block_nbytes].view(spec.dtype).view(spec.block_shape), pending)

    def _keep(self, block: torch.Tensor, p: _Pending) -> None:
        """Copy a block (CPU) into the host tier and queue it for the disk and remote tiers."""
        share = self.remote is not None and self.remote.admitted(p.key)
        sinks = (self.disk is not None) + share
        hold = sinks > 0 and self.host is not None and self.host.can_hold()
        slot = self.host.put(p.key, block, hold=hold, created_s=p.created_s) if self.host is not None else None
        if not sinks:
            return
        held = slot if hold else None
        # Without a held host slot the writers get their own copy: the caller may reuse ``block`` at once.
        payload = held if held is not None else block.clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8)
        if share and held is not None and self.disk is not None:
            self.host.retain(held)  # type: ignore[union-attr]  # one reference per writer
        if self.disk is not None:
            make, release = self._record_fn(p.ns, p.spec, p.parent, p.key, p.token_bytes, payload, held is not None,
                                            p.created_s)
            if not self.disk.put(p.ns.digest, p.key, make, p.spec.block_nbytes + codec.HEADER_NBYTES + len(p.token_bytes),
                                 p.created_s, release=release, ns_spec=p.ns.spec_bytes):
                release()
        if share:
            make, release = self._record_fn(p.ns, p.spec, p.parent, p.key, p.token_bytes, payload, held is not None,
                                            p.created_s)
            if not self.remote.put(p.ns.digest, p.key, make, release):  # type: ignore[union-attr]
                release()

    def _record_fn(self, ns: Namespace, spec: KVSpec, parent: BlockKey, key: BlockKey, token_bytes: bytes,
                   payload: torch.Tensor, held: bool,
                   created_s: float) -> tuple[Callable[[], list[bytes | memoryview]], Callable[[], None]]:
        """(encode, release): the record is encoded on the disk writer thread, not the inference thread,
        straight from the host slot; ``release`` frees the slot once the record is written (or skipped)."""
        def make() -> list[bytes | memoryview]:
            return codec.encode_parts(ns_digest=ns.digest, parent_key=parent, key=key, token_bytes=token_bytes,
                                      dtype=ns.dtype, shape=spec.block_shape, payload=payload.numpy().data,
                                      created_s=created_s, codec=self.codec)

        def release() -> None:
            if held and self.host is not None:
                self.host.release(payload)

        return make, release

    # ---------------------------------------------------------------- lookup and load

    def lookup(self, ns: Namespace, token_ids: Tokens) -> Hit:
        """How many leading tokens are cached, and where. Reads no payload."""
        keys = _chain(ns, token_ids).keys
        src = self._memory_sources(keys)
        in_mem = [t is not None for t in src]
        first_gap = next((i for i, h in enumerate(in_mem) if not h), len(keys))
        n_disk = 0
        if self.disk is not None and first_gap < len(keys):
            n_disk = self._disk_extent(keys, in_mem, first_gap)
        n = first_gap + n_disk
        B = ns.block_tokens
        by_tier = {p.name: sum(t == k for t in src[:n]) * B for k, p in enumerate(self.pools)}
        by_tier.setdefault("host", 0)
        by_tier["disk"] = n * B - sum(by_tier.values())
        if self.remote is not None:
            m = self.remote.lookup(ns.digest, keys[n:]) if n < len(keys) else 0
            by_tier["remote"] = m * B
            n += m
        return Hit(n * B, by_tier, n)

    def _memory_sources(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Per block, the index in ``self.pools`` of the fastest memory tier holding it (None: none)."""
        src: list[int | None] = [None] * len(keys)
        for k in range(len(self.pools) - 1, -1, -1):  # the fastest last: it wins
            for i, has in enumerate(self.pools[k].contains(keys)):
                if has:
                    src[i] = k
        return src

    def _disk_extent(self, keys: Sequence[BlockKey], in_mem: Sequence[bool], start: int) -> int:
        """Blocks from ``start`` on that memory or disk holds, asking the disk only for memory's gaps."""
        assert self.disk is not None
        wanted = [i for i in range(start, len(keys)) if not in_mem[i]]
        have = self.disk.lookup([keys[i] for i in wanted])
        end = wanted[have] if have < len(wanted) else len(keys)
        return end - start

    def load(self, ns: Namespace, token_ids: Tokens,
             out: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None]:
        """The KV of the longest verified cached prefix: ``(num_tokens, kv[:, :, :num_tokens])``.

        ``out`` (``[layers, 2, >= tokens, kv_heads, head_dim]``, any device) is filled in place if given,
        saving an allocation; past the returned prefix its content is unspecified (a block that failed
        verification may have been read into it). Returns ``(0, None)`` on a miss.
        """
        hit, kv = self.restore(ns, token_ids, out)
        return hit.num_tokens, kv

    def restore(self, ns: Namespace, token_ids: Tokens,
                out: torch.Tensor | None = None) -> tuple[Hit, torch.Tensor | None]:
        """Like ``load``, with the ``Hit`` (tokens per tier, restore time)."""
        t0 = time.perf_counter()
        chain = _chain(ns, token_ids)
        spec = KVSpec.of(ns)
        B = ns.block_tokens
        by_tier = dict.fromkeys(self.tiers, 0)
        if out is not None:
            self._check_kv(ns, out, 0)
            chain = chain.prefix(out.shape[2] // B)
        keys = chain.keys
        if not keys:
            return Hit(0, by_tier), None
        with contextlib.ExitStack() as held:
            views = [held.enter_context(p.read(keys)) for p in self.pools]
            src = [next((k for k in range(len(views)) if views[k][i] is not None), None) for i in range(len(keys))]
            first_gap = next((i for i, t in enumerate(src) if t is None), len(keys))
            wanted = [i for i in range(first_gap, len(keys)) if src[i] is None]
            entries = self.disk.locate([keys[i] for i in wanted]) if wanted and self.disk is not None else []
            n = wanted[len(entries)] if len(entries) < len(wanted) else len(keys)
            if self.remote is not None and self.remote.admit_after > 1:  # count requests per block
                for k in keys:
                    self.remote.sighting(k)
            # Past the local tiers: the shared remote tier (one pipelined round trip).
            remote_records = self.remote.get_many(ns.digest, keys[n:]) if self.remote is not None and \
                n < len(keys) else []
            n_all = n + len(remote_records)
            if n_all == 0:
                self.counters.add("store", "miss_blocks", len(keys))
                return Hit(0, by_tier), None
            dest = out if out is not None else torch.empty(spec.shape(n_all * B), dtype=spec.dtype)
            disk_idx = [i for i in wanted[: len(entries)] if i < n]
            needs_read = bool(disk_idx) or bool(remote_records)
            # Memory-tier blocks first: on a GPU these copies (device copies, DMA from pinned host slots) run
            # while the disk blocks are read. Past a block that then fails verification, ``dest`` is
            # unspecified, as documented.
            for k, a, b in _source_runs(src[:n]):
                if dest.device.type == "cuda" and self.pools[k].device.type == "cpu":
                    _upload_run(dest, [views[k][i] for i in range(a, b)], a, spec)
                else:
                    for i in range(a, b):
                        dest[:, :, i * B : (i + 1) * B].copy_(views[k][i].view(spec.dtype).view(spec.block_shape),
                                                              non_blocking=True)
            with self._stager_for(dest, spec, needs_read) as stager:
                ok_until = self._restore_from_disk(chain, spec, disk_idx, entries, dest, stager)
                n_local = min(n, ok_until)
                for k, pool in enumerate(self.pools):
                    by_tier[pool.name] = sum(t == k for t in src[:n_local]) * B
                by_tier["disk"] = n_local * B - sum(by_tier[p.name] for p in self.pools)
                m = 0
                if n_local == n and remote_records:
                    m = self._restore_from_remote(chain, spec, n, remote_records, dest, stager)
                    by_tier["remote"] = m * B
                n = n_local + m
                if self.gpu is not None and self.gpu.device == dest.device:  # promote: next hit is a device copy
                    for i in range(n):
                        if src[i] != 0:
                            self.gpu.put(keys[i], dest[:, :, i * B : (i + 1) * B])
                _wait_for_copies(dest)  # before the host slots and the chunk buffers are let go
                self._keep_on_disk(chain, spec, src[:n], views)
        if self.remote is not None and self.remote.admit_after > 1 and self.host is not None:
            self._share_newly_admitted(chain.prefix(n), spec)
        self.counters.add("store", "miss_blocks", len(keys) - n)
        for tier, tokens in by_tier.items():
            if tokens:
                self.counters.add(tier, "hit_blocks", tokens // B)
                self.counters.add(tier, "hit_tokens", tokens)
        hit = Hit(n * B, by_tier, n, time.perf_counter() - t0)
        return hit, (dest[:, :, : n * B] if n else None)

    def _keep_on_disk(self, chain: BlockChain, spec: KVSpec, src: Sequence[int | None],
                      views: Sequence[list[torch.Tensor | None]]) -> None:
        """Blocks served from memory refresh their disk copy's TTL; one whose disk copy is gone (expired,
        evicted, its save dropped) is written again from its host slot, so a restart does not lose it."""
        if self.disk is None or self.disk.read_only:
            return
        ns, keys = chain.ns, chain.keys
        mem = [i for i, t in enumerate(src) if t is not None]
        if not mem:
            return
        self.disk.touch([keys[i] for i in mem])
        if self.host is None:
            return
        h = self.pools.index(self.host)
        lost = [i for i, held in zip(mem, self.disk.holds([keys[i] for i in mem])) if not held and src[i] == h]
        for i in lost:
            view = views[h][i]
            assert view is not None
            created_s = self.host.created_s(keys[i])  # its age goes with it: max-age still applies
            self.host.retain(view)  # the writer's reference, released once written
            make, release = self._record_fn(ns, spec, chain.parent(i), keys[i], chain.tokens(i), view, True,
                                            created_s)
            nbytes = spec.block_nbytes + codec.HEADER_NBYTES + chain.block_token_nbytes
            if not self.disk.put(ns.digest, keys[i], make, nbytes, created_s, release=release,
                                 ns_spec=ns.spec_bytes):
                release()

    @contextlib.contextmanager
    def _stager_for(self, dest: torch.Tensor, spec: KVSpec, needed: bool) -> Iterator[_Stager | None]:
        """None when records can be scattered straight into ``dest`` (a CPU tensor); else the chunk buffers
        (pinned when ``dest`` is on a GPU), held for this restore."""
        if not needed or _rows_scatterable(dest):
            yield None
            return
        with self._restore_lock:
            pin = dest.device.type == "cuda"
            stager = self._stager
            if stager is None or stager.spec != spec or stager.pin != pin:
                stager = self._stager = _Stager(spec, pin)
            stager.dest = dest
            try:
                yield stager
            finally:
                _wait_for_copies(dest)  # the next restore may overwrite the buffers
                stager.dest = None

    def _restore_from_disk(self, chain: BlockChain, spec: KVSpec, idx: list[int], entries: list,
                           dest: torch.Tensor, stager: _Stager | None) -> int:
        """Read and verify disk blocks ``idx`` into ``dest``; returns the first block index that failed
        (or ``len(keys)``). Blocks are verified in order, so everything before the returned index is exact.

        With a ``stager``, blocks are read a chunk at a time into one of its buffers, and each verified chunk
        is uploaded to ``dest`` while the next is read into the other buffer.
        """
        if not idx:
            return len(chain)
        if stager is None:
            return self._read_disk_blocks(chain, spec, idx, entries, dest, {i: i for i in idx})
        for c in range(0, len(idx), stager.blocks):
            part, part_entries = idx[c : c + stager.blocks], entries[c : c + stager.blocks]
            k = stager.acquire()
            local = {i: j for j, i in enumerate(part)}
            failed_at = self._read_disk_blocks(chain, spec, part, part_entries, stager.buffers[k], local)
            stager.upload(k, [(i, local[i]) for i in part if i < failed_at])
            if failed_at < len(chain):
                return failed_at
        return len(chain)

    def _read_disk_blocks(self, chain: BlockChain, spec: KVSpec, idx: list[int], entries: list,
                          target: torch.Tensor, pos: dict[int, int]) -> int:
        """One read of disk blocks ``idx`` into ``target``, block ``i`` at block position ``pos[i]`` (records
        scattered in place, verified on the reading threads); returns the first index that failed or
        ``len(keys)``."""
        assert self.disk is not None
        keys = chain.keys
        B = chain.ns.block_tokens
        prefix_nbytes = codec.HEADER_NBYTES + chain.block_token_nbytes
        raw_nbytes = prefix_nbytes + spec.block_nbytes
        # target's (layer, k/v) slabs as byte rows: a block's payload is one chunk of each row, so a raw
        # record is scattered by preadv straight into place (no bounce buffer, no second copy).
        rows = [target[layer, kv].view(torch.uint8).reshape(-1).numpy()
                for layer in range(spec.num_layers) for kv in (0, 1)]
        chunk = spec.block_nbytes // (spec.num_layers * 2)
        scratch = memoryview(bytearray(prefix_nbytes * len(idx)))
        scatter, whole = [], []
        for j, (i, e) in enumerate(zip(idx, entries)):
            if e.nbytes == raw_nbytes:
                views = [scratch[j * prefix_nbytes : (j + 1) * prefix_nbytes]]
                views += [memoryview(row[pos[i] * chunk : (pos[i] + 1) * chunk]) for row in rows]
                scatter.append((i, e, views))
            else:
                whole.append((i, e))
        def verify(j: int) -> bool:  # on a reading thread, as soon as record j is in
            i, e, views = scatter[j]
            expected = _expected(chain, spec, i)
            try:
                header, toks = codec.parse_header(views[0], e.nbytes)
                codec.check_expected(header, toks, expected)
                if header.codec == codec.Codec.RAW:
                    codec.check_raw_pieces(header, views[1:])
                else:  # a compressed record that happens to have the raw length
                    payload = codec.decode_payload(header, memoryview(b"".join(views[1:])))
                    target[:, :, pos[i] * B : (pos[i] + 1) * B].copy_(_as_tensor(payload, spec.dtype, spec.block_shape))
            except RecordError:
                return False
            return True

        ok = self.disk.read_into([(e, v) for _, e, v in scatter], verify) if scatter else []
        failed_at = len(keys)
        for (i, e, _), good in zip(scatter, ok):
            if not good:
                failed_at = i
                self._purge_if_indexed(keys[i], e)
                break
        if whole:
            with self.disk.read([e for _, e in whole]) as records:
                for (i, e), rec in zip(whole, records):
                    if i >= failed_at:
                        break
                    expected = _expected(chain, spec, i)
                    try:
                        payload = codec.decode(rec, expected)
                    except RecordError:
                        failed_at = i
                        self._purge_if_indexed(keys[i], e)
                        break
                    target[:, :, pos[i] * B : (pos[i] + 1) * B].copy_(_as_tensor(payload, spec.dtype, spec.block_shape))
        good = [i for i in idx if i < failed_at]
        self.disk.touch([keys[i] for i in good], sum(e.nbytes for i, e in zip(idx, entries) if i < failed_at))
        if self.host is not None:  # promote: the next hit on these blocks comes from RAM
            created = {i: e.created_s for i, e in zip(idx, entries)}
            for i in good:
                self.host.put(keys[i], target[:, :, pos[i] * B : (pos[i] + 1) * B], created_s=created[i])
        return failed_at

    def _restore_from_remote(self, chain: BlockChain, spec: KVSpec, start: int, records: list[bytes],
                             dest: torch.Tensor, stager: _Stager | None) -> int:
        """Verify remote records for blocks ``start, start+1, ...`` into ``dest`` (through the stager's
        buffers, a chunk at a time, when it has one); promote them into the local tiers. Returns how many
        verified (a bad one is deleted remotely and ends the prefix)."""
        if stager is None:
            return self._verify_remote(chain, spec, start, records, dest, 0)
        done = 0
        for c in range(0, len(records), stager.blocks):
            part = records[c : c + stager.blocks]
            k = stager.acquire()
            m = self._verify_remote(chain, spec, start + c, part, stager.buffers[k], start + c)
            stager.upload(k, [(start + c + j, j) for j in range(m)])
            done += m
            if m < len(part):
                break
        return done

    def _verify_remote(self, chain: BlockChain, spec: KVSpec, start: int, records: list[bytes],
                       target: torch.Tensor, base: int) -> int:
        """Decode remote records for blocks ``start, ...`` into ``target`` (block ``i`` at ``i - base``)."""
        assert self.remote is not None
        ns, keys = chain.ns, chain.keys
        B = ns.block_tokens
        now = self.clock()
        for j, rec in enumerate(records):
            i = start + j
            expected = _expected(chain, spec, i)
            try:
                payload = codec.decode(rec, expected)
            except RecordError:
                self.counters.add("remote", "corrupt_blocks")
                self.remote.delete(ns.digest, keys[i])
                return j
            block = target[:, :, (i - base) * B : (i - base + 1) * B]
            block.copy_(_as_tensor(payload, spec.dtype, spec.block_shape))
            if self.host is not None:
                self.host.put(keys[i], block)
            if self.disk is not None:  # the verified record as it is: no re-encoding
                self.disk.put(ns.digest, keys[i], rec, len(rec), now, ns_spec=ns.spec_bytes)
        return len(records)

    def _share_newly_admitted(self, chain: BlockChain, spec: KVSpec) -> None:
        """Blocks cached here that just reached the admission count go to the remote tier now."""
        assert self.remote is not None and self.host is not None
        ns, keys = chain.ns, chain.keys
        now = self.clock()
        due = [i for i, k in enumerate(keys) if self.remote.sightings(k) == self.remote.admit_after]
        if not due:
            return
        with self.host.read([keys[i] for i in due]) as views:
            for i, view in zip(due, views):
                if view is None:
                    continue
                self.host.retain(view)
                make, release = self._record_fn(ns, spec, chain.parent(i), keys[i], chain.tokens(i), view, True, now)
                if not self.remote.put(ns.digest, keys[i], make, release):
                    release()

    def _purge_if_indexed(self, key: BlockKey, e: object) -> None:
        assert self.disk is not None
        location = e.location  # type: ignore[attr-defined]
        # A sweep in another process may have released it while we read: then it is a plain miss.
        if self.disk.still_indexed(key, location):
            self.disk.purge(key, location)

    # ---------------------------------------------------------------- maintenance (the admin API's calls)

    @property
    def durable(self) -> bool:
        """Whether the store has a durable tier (gc, purge and the disk report need one)."""
        return self.disk is not None

    def _durable(self) -> DiskTier:
        if self.disk is None:
            raise ConfigError("this store has no disk tier")
        return self.disk

    def gc(self, **options: Any) -> dict[str, Any]:
        """One gc pass over the disk tier (``maintenance.run_gc``'s options); ConfigError without one."""
        from tierkv.maintenance import run_gc

        return run_gc(self._durable(), **options)

    def purge(self, namespace: str | None = None, *, purge_all: bool = False) -> dict[str, Any]:
        """Drop one namespace (a digest prefix) or everything from the disk tier, and empty the memory
        tiers (they keep no namespace index, so they are cleared whole)."""
        out = self.gc(namespace=namespace, purge_all=purge_all)
        for pool in self.pools:
            pool.clear()
        return out

    def report(self) -> dict[str, Any]:
        """``tierkv stats``' report of the disk tier, plus what only this process knows under ``live``."""
        from tierkv.inspect import store_stats

        out = store_stats(self._durable())
        out["live"] = self.stats()
        return out

    def reserve(self, ns: Namespace) -> None:
        """Allocate (and pre-fault) the memory tiers for ``ns``'s blocks now, not on the first request."""
        for pool in self.pools:
            pool.reserve(KVSpec.of(ns).block_nbytes)

    def describe(self) -> list[str]:
        """One phrase per tier, fastest first, for a start-up log line."""
        out = [f"{pool.name} {pool.capacity_nbytes / 2**30:.1f} GiB" for pool in self.pools]
        if self.disk is not None:
            out.append(self.disk.describe())
        if self.remote is not None:
            out.append(f"remote {self.remote.url}")
        return out

    # ---------------------------------------------------------------- lifecycle

    def flush(self) -> None:
        """Wait until every saved block is durable on disk."""
        if self._ring is not None:  # first out of the staging ring, into the host tier and the disk queue
            self._ring.flush()
        if self.disk is not None:
            self.disk.flush()
        if self.remote is not None:
            self.remote.flush()

    @property
    def tier_names(self) -> list[str]:
        """The tiers' names, fastest first (the ``tier`` label of metrics, the keys of ``Hit.by_tier``)."""
        return list(self.tiers)

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per tier name (``tier_names``), ``store`` and ``staging``; every tier with a size also
        has ``used_nbytes`` and ``capacity_nbytes`` (0: no budget)."""
        snap = self.counters.snapshot()
        for tier in (*self.tiers, "store"):
            snap.setdefault(tier, dict.fromkeys(COUNTER_NAMES, 0))
        for pool in self.pools:
            snap[pool.name].update(used_nbytes=pool.used_nbytes, capacity_nbytes=pool.capacity_nbytes,
                                   blocks=len(pool))
        if self.disk is not None:
            usage = self.disk.usage()
            snap["disk"].update(usage, used_nbytes=usage["live_nbytes"], capacity_nbytes=usage["budget_nbytes"])
        if self.remote is not None:
            snap["remote"].update(breaker_open=int(self.remote.breaker.state == "open"),
                                  breaker_trips=self.remote.breaker.trips)
        return snap

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
        if self.remote is not None:
            self.remote.close()
        if self.disk is not None:
            self.disk.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Hit", "TieredStore"]
