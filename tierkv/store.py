"""TieredStore: the public API. Save KV blocks write-behind, find and restore the longest cached prefix.

A prefix is served block by block from the fastest tier holding each block (host, then disk); it ends at
the first block no tier holds, or the first that fails verification (that block is purged and counted,
and the caller recomputes from there). Wrong KV is never served.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import lmdb
import numpy as np
import torch

from tierkv import codec
from tierkv.errors import ConfigError, RecordError
from tierkv.keys import BlockKey, Namespace, NamespaceDigest, block_keys, root_key, tokens_to_bytes
from tierkv.layout import KVSpec
from tierkv.metrics import COUNTER_NAMES, Counters
from tierkv.tiers.disk import DiskTier, Policy
from tierkv.tiers.host import HostTier
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


def _expected(ns: Namespace, spec: KVSpec, keys: Sequence[BlockKey], token_bytes: bytes, i: int) -> codec.Expected:
    """What block ``i`` of a request must be to be served."""
    B = ns.block_tokens
    return codec.Expected(ns.digest, keys[i], token_bytes[i * B * 4 : (i + 1) * B * 4], ns.dtype, spec.block_shape)


class TieredStore:
    def __init__(self, host: HostTier | None, disk: DiskTier | None, *, codec_: codec.Codec = codec.Codec.RAW,
                 clock: Callable[[], float] = time.time, counters: Counters | None = None,
                 remote: RemoteTier | None = None) -> None:
        self.host = host
        self.disk = disk
        self.remote = remote
        self.tiers = ("host", "disk", "remote") if remote is not None else ("host", "disk")
        self.codec = codec_
        self.clock = clock
        self.counters = counters or Counters()
        self._registered: set[NamespaceDigest] = set()

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
        **disk_options: int,
    ) -> TieredStore:
        """Open (or create) a store. ``path=None`` gives a host-only store; ``host_bytes=0`` a disk-only one.

        ``remote`` (``redis://host:port`` or ``redis+cluster://host:port``) adds a tier shared by several
        workers; ``remote_admit_after`` shares a block only once that many requests contained it.
        """
        if host_bytes < 0 or (disk_bytes is not None and disk_bytes <= 0):
            raise ConfigError("host_bytes must be >= 0 and disk_bytes > 0")
        counters = Counters()
        if isinstance(codec_, str):
            codec_ = codec.Codec[codec_.upper().replace("-", "_")]
        host = HostTier(host_bytes, counters=counters) if host_bytes else None
        disk = None
        if path is not None:
            disk = DiskTier(Path(path), policy=Policy(disk_bytes, ttl_s, max_age_s), clock=clock, sync=sync,
                            counters=counters, **disk_options)
        remote_tier = None
        if remote is not None:
            from tierkv.tiers.remote import RemoteTier

            remote_tier = RemoteTier(remote, ttl_s=ttl_s, admit_after=remote_admit_after, counters=counters)
        return cls(host, disk, codec_=codec_, clock=clock, counters=counters, remote=remote_tier)

    # ---------------------------------------------------------------- save

    def _register(self, ns: Namespace) -> None:
        if ns.digest not in self._registered:
            if self.disk is not None:
                try:
                    self.disk.register_namespace(ns)
                except lmdb.Error as exc:  # a full disk: the spec is only for stats; retried next save
                    log.warning("could not register namespace %s: %s", ns.digest.hex()[:16], exc)
                    return
            self._registered.add(ns.digest)

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

    def save(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, kv: torch.Tensor,
             *, start_block: int = 0, kv_start: int = 0) -> int:
        """Keep the full blocks of ``token_ids`` (KV ``[layers, 2, tokens, kv_heads, head_dim]``).

        Returns at once: the host copy is made now, the disk write happens behind (a dropped disk write is
        counted, never an error). Blocks before ``start_block`` are known cached and skipped. ``kv`` may
        start at token ``kv_start`` (<= ``start_block * block_tokens``) instead of 0. Returns the number
        of blocks newly kept.
        """
        keys = block_keys(ns, token_ids)
        if not 0 <= kv_start <= start_block * ns.block_tokens:
            raise ConfigError(f"kv_start {kv_start} must be in 0..start_block * block_tokens")
        spec = self._check_kv(ns, kv, len(keys) * ns.block_tokens - kv_start)
        if not keys:
            return 0
        self._register(ns)
        token_bytes = tokens_to_bytes(token_ids)
        in_host = self.host.contains(keys) if self.host is not None else [False] * len(keys)
        B = ns.block_tokens
        kept = 0
        now = self.clock()
        for i in range(start_block, len(keys)):
            if in_host[i]:
                continue
            block = kv[:, :, i * B - kv_start : (i + 1) * B - kv_start]
            if block.device.type != "cpu":
                block = block.to("cpu")
            share = self.remote is not None and self.remote.admitted(keys[i])
            sinks = (self.disk is not None) + share
            held = self.host.put(keys[i], block, hold=sinks > 0) if self.host is not None else None
            kept += 1
            if not sinks:
                continue
            payload = held if held is not None else block.contiguous().view(-1).view(torch.uint8)
            parent = keys[i - 1] if i else root_key(ns.digest)
            tb = token_bytes[i * B * 4 : (i + 1) * B * 4]
            if share and held is not None and self.disk is not None:
                self.host.retain(held)  # type: ignore[union-attr]  # one reference per writer
            if self.disk is not None:
                make, release = self._record_fn(ns, spec, parent, keys[i], tb, payload, held is not None, now)
                if not self.disk.put(ns.digest, keys[i], make, spec.block_nbytes + codec.HEADER_NBYTES + len(tb),
                                     now, release=release):
                    release()
            if share:
                make, release = self._record_fn(ns, spec, parent, keys[i], tb, payload, held is not None, now)
                if not self.remote.put(ns.digest, keys[i], make, release):  # type: ignore[union-attr]
                    release()
        return kept

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

    def lookup(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray) -> Hit:
        """How many leading tokens are cached, and where. Reads no payload."""
        keys = block_keys(ns, token_ids)
        in_host = self.host.contains(keys) if self.host is not None else [False] * len(keys)
        first_gap = next((i for i, h in enumerate(in_host) if not h), len(keys))
        n_disk = 0
        if self.disk is not None and first_gap < len(keys):
            n_disk = self._disk_extent(keys, in_host, first_gap)
        n = first_gap + n_disk
        host_blocks = sum(in_host[:n])
        B = ns.block_tokens
        by_tier = {"host": host_blocks * B, "disk": (n - host_blocks) * B}
        if self.remote is not None:
            m = self.remote.lookup(ns.digest, keys[n:]) if n < len(keys) else 0
            by_tier["remote"] = m * B
            n += m
        return Hit(n * B, by_tier, n)

    def _disk_extent(self, keys: Sequence[BlockKey], in_host: Sequence[bool], start: int) -> int:
        """Blocks from ``start`` on that host or disk hold, asking the disk only for the host's gaps."""
        assert self.disk is not None
        wanted = [i for i in range(start, len(keys)) if not in_host[i]]
        have = self.disk.lookup([keys[i] for i in wanted])
        end = wanted[have] if have < len(wanted) else len(keys)
        return end - start

    def load(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray,
             out: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None]:
        """The KV of the longest verified cached prefix: ``(num_tokens, kv[:, :, :num_tokens])``.

        ``out`` (``[layers, 2, >= tokens, kv_heads, head_dim]``, any device) is filled in place if given,
        saving an allocation; past the returned prefix its content is unspecified (a block that failed
        verification may have been read into it). Returns ``(0, None)`` on a miss.
        """
        hit, kv = self.restore(ns, token_ids, out)
        return hit.num_tokens, kv

    def restore(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray,
                out: torch.Tensor | None = None) -> tuple[Hit, torch.Tensor | None]:
        """Like ``load``, with the ``Hit`` (tokens per tier, restore time)."""
        t0 = time.perf_counter()
        keys = block_keys(ns, token_ids)
        spec = KVSpec.of(ns)
        B = ns.block_tokens
        by_tier = dict.fromkeys(self.tiers, 0)
        if out is not None:
            self._check_kv(ns, out, 0)
            keys = keys[: out.shape[2] // B]
        if not keys:
            return Hit(0, by_tier), None
        token_bytes = tokens_to_bytes(np.asarray(token_ids)[: len(keys) * B])
        host_ctx = self.host.read(keys) if self.host is not None else contextlib.nullcontext([None] * len(keys))
        with host_ctx as host_views:
            in_host = [v is not None for v in host_views]
            first_gap = next((i for i, h in enumerate(in_host) if not h), len(keys))
            wanted = [i for i in range(first_gap, len(keys)) if not in_host[i]]
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
            target = out if out is not None and out.is_contiguous() and out.device.type == "cpu" else \
                torch.empty(spec.shape(n_all * B), dtype=spec.dtype)
            disk_idx = wanted[: len(entries)]
            disk_idx = [i for i in disk_idx if i < n]
            ok_until = self._restore_from_disk(ns, spec, keys, token_bytes, disk_idx, entries, target)
            n_local = min(n, ok_until)
            for i in range(n_local):
                if in_host[i]:
                    target[:, :, i * B : (i + 1) * B].copy_(host_views[i].view(spec.dtype).view(spec.block_shape))
            by_tier["host"] = sum(in_host[:n_local]) * B
            by_tier["disk"] = n_local * B - by_tier["host"]
            m = 0
            if n_local == n and remote_records:
                m = self._restore_from_remote(ns, spec, keys, token_bytes, n, remote_records, target)
                by_tier["remote"] = m * B
            n = n_local + m
        if self.remote is not None and self.remote.admit_after > 1 and self.host is not None:
            self._share_newly_admitted(ns, spec, keys[:n], token_bytes)
        if target is not out and out is not None and n:
            out[:, :, : n * B].copy_(target[:, :, : n * B])
            target = out
        self.counters.add("store", "miss_blocks", len(keys) - n)
        for tier, tokens in by_tier.items():
            if tokens:
                self.counters.add(tier, "hit_blocks", tokens // B)
                self.counters.add(tier, "hit_tokens", tokens)
        hit = Hit(n * B, by_tier, n, time.perf_counter() - t0)
        return hit, (target[:, :, : n * B] if n else None)

    def _restore_from_disk(self, ns: Namespace, spec: KVSpec, keys: Sequence[BlockKey], token_bytes: bytes,
                           idx: list[int], entries: list, target: torch.Tensor) -> int:
        """Read and verify disk blocks ``idx`` into ``target``; returns the first block index that failed
        (or ``len(keys)``). Blocks are verified in order, so everything before the returned index is exact.
        """
        if not idx:
            return len(keys)
        assert self.disk is not None
        B = ns.block_tokens
        prefix_nbytes = codec.HEADER_NBYTES + 4 * B
        raw_nbytes = prefix_nbytes + spec.block_nbytes
        # target as uint8 rows, one per (layer, k/v): a block's payload is one chunk of each row, so a raw
        # record is scattered by preadv straight into place (no bounce buffer, no second copy).
        rows = target.view(torch.uint8).numpy().reshape(spec.num_layers * 2, -1)
        chunk = spec.block_nbytes // (spec.num_layers * 2)
        scratch = memoryview(bytearray(prefix_nbytes * len(idx)))
        scatter, whole = [], []
        for j, (i, e) in enumerate(zip(idx, entries)):
            if e.nbytes == raw_nbytes:
                views = [scratch[j * prefix_nbytes : (j + 1) * prefix_nbytes]]
                views += [memoryview(rows[r, i * chunk : (i + 1) * chunk]) for r in range(rows.shape[0])]
                scatter.append((i, e, views))
            else:
                whole.append((i, e))
        def verify(j: int) -> bool:  # on a reading thread, as soon as record j is in
            i, e, views = scatter[j]
            expected = _expected(ns, spec, keys, token_bytes, i)
            try:
                header, toks = codec.parse_header(views[0], e.nbytes)
                codec.check_expected(header, toks, expected)
                if header.codec == codec.Codec.RAW:
                    codec.check_raw_pieces(header, views[1:])
                else:  # a compressed record that happens to have the raw length
                    payload = codec.decode_payload(header, memoryview(b"".join(views[1:])))
                    target[:, :, i * B : (i + 1) * B].copy_(_as_tensor(payload, spec.dtype, spec.block_shape))
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
                    expected = _expected(ns, spec, keys, token_bytes, i)
                    try:
                        payload = codec.decode(rec, expected)
                    except RecordError:
                        failed_at = i
                        self._purge_if_indexed(keys[i], e)
                        break
                    target[:, :, i * B : (i + 1) * B].copy_(_as_tensor(payload, spec.dtype, spec.block_shape))
        good = [i for i in idx if i < failed_at]
        self.disk.touch([keys[i] for i in good], sum(e.nbytes for i, e in zip(idx, entries) if i < failed_at))
        if self.host is not None:  # promote: the next hit on these blocks comes from RAM
            for i in good:
                self.host.put(keys[i], target[:, :, i * B : (i + 1) * B])
        return failed_at

    def _restore_from_remote(self, ns: Namespace, spec: KVSpec, keys: Sequence[BlockKey], token_bytes: bytes,
                             start: int, records: list[bytes], target: torch.Tensor) -> int:
        """Verify remote records for blocks ``start, start+1, ...`` into ``target``; promote them into the
        local tiers. Returns how many verified (a bad one is deleted remotely and ends the prefix)."""
        assert self.remote is not None
        B = ns.block_tokens
        now = self.clock()
        for j, rec in enumerate(records):
            i = start + j
            expected = _expected(ns, spec, keys, token_bytes, i)
            try:
                payload = codec.decode(rec, expected)
            except RecordError:
                self.counters.add("remote", "corrupt_blocks")
                self.remote.delete(ns.digest, keys[i])
                return j
            block = target[:, :, i * B : (i + 1) * B]
            block.copy_(_as_tensor(payload, spec.dtype, spec.block_shape))
            if self.host is not None:
                self.host.put(keys[i], block)
            if self.disk is not None:  # the verified record as it is: no re-encoding
                self._register(ns)
                self.disk.put(ns.digest, keys[i], rec, len(rec), now)
        return len(records)

    def _share_newly_admitted(self, ns: Namespace, spec: KVSpec, keys: Sequence[BlockKey], token_bytes: bytes) -> None:
        """Blocks cached here that just reached the admission count go to the remote tier now."""
        assert self.remote is not None and self.host is not None
        B = ns.block_tokens
        now = self.clock()
        due = [i for i, k in enumerate(keys) if self.remote.sightings(k) == self.remote.admit_after]
        if not due:
            return
        with self.host.read([keys[i] for i in due]) as views:
            for i, view in zip(due, views):
                if view is None:
                    continue
                self.host.retain(view)
                parent = keys[i - 1] if i else root_key(ns.digest)
                make, release = self._record_fn(ns, spec, parent, keys[i], token_bytes[i * B * 4 : (i + 1) * B * 4],
                                                view, True, now)
                if not self.remote.put(ns.digest, keys[i], make, release):
                    release()

    def _purge_if_indexed(self, key: BlockKey, e: object) -> None:
        assert self.disk is not None
        location = e.location  # type: ignore[attr-defined]
        # A sweep in another process may have released it while we read: then it is a plain miss.
        if self.disk.still_indexed(key, location):
            self.disk.purge(key, location)

    # ---------------------------------------------------------------- lifecycle

    def flush(self) -> None:
        """Wait until every saved block is durable on disk."""
        if self.disk is not None:
            self.disk.flush()
        if self.remote is not None:
            self.remote.flush()

    def stats(self) -> dict[str, dict[str, int]]:
        snap = self.counters.snapshot()
        for tier in (*self.tiers, "store"):
            snap.setdefault(tier, dict.fromkeys(COUNTER_NAMES, 0))
        if self.host is not None:
            snap["host"].update(used_nbytes=self.host.used_nbytes, capacity_nbytes=self.host.capacity_nbytes,
                                blocks=len(self.host))
        if self.disk is not None:
            snap["disk"].update(self.disk.usage())
        if self.remote is not None:
            snap["remote"].update(breaker_open=int(self.remote.breaker.state == "open"),
                                  breaker_trips=self.remote.breaker.trips)
        return snap

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.disk is not None:
            self.disk.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Hit", "TieredStore"]
