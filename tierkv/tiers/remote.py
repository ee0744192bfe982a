"""The remote tier: block records shared by several workers through Redis or Valkey.

Keys are ``tkv:<namespace digest>:<block key>`` (binary), values the same self-verifying records the
disk tier writes, with a TTL (``EX``). Reads are pipelined; writes go through a bounded queue and a
background thread, in pipelined batches. The byte budget is the server's: run it with ``maxmemory`` and
``maxmemory-policy allkeys-lru``.

Anything that goes wrong remotely (refused connection, timeout, resharding) trips a circuit breaker: the
tier is skipped for a cooldown, then one probe decides. A request never fails because the remote tier did.

Signed records: anyone who can write to the Redis could otherwise store KV that every node serves for any
prompt (records carry checksums, not signatures). With deployment ``secrets`` each value is
``MAC_MAGIC || blake2b-256(redis key || record, key=scrypt(secret)) || record``; a value whose MAC no
secret accepts (unsigned, another secret, another key) is a miss, counted (``mac_failures``) and left
alone (a node with a wrong secret must not wipe what the others read). A node without secrets does not
serve signed values either. The first secret signs; the others are accepted while a rotation runs.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tierkv import codec
from tierkv.errors import RecordError
from tierkv.keys import BlockChain, BlockKey, NamespaceDigest
from tierkv.metrics import Counters
from tierkv.redact import redact_url
from tierkv.tiers.base import BlockWrite, Tier
from tierkv.tiers.batching import BatchQueue

if TYPE_CHECKING:
    import torch

    from tierkv.tiers.target import Target

__all__ = [
    "BREAKER_COOLDOWN_S",
    "BREAKER_FAILURES",
    "CircuitBreaker",
    "DEFAULT_TIMEOUT_S",
    "FLUSH_TIMEOUT_S",
    "QUEUE_BLOCKS",
    "RemoteTier",
    "MAC_MAGIC",
    "SENT_KEYS",
    "WRITE_BATCH",
    "connect",
    "is_signed",
    "mac_key",
    "mac_of",
    "sign",
    "unsign",
]

log = logging.getLogger("tierkv.remote")

DEFAULT_TIMEOUT_S = 0.5  # a slow remote must cost less than recomputing: fail fast, fall back
BREAKER_FAILURES = 3  # consecutive failures that open the breaker
BREAKER_COOLDOWN_S = 5.0
WRITE_BATCH = 64  # records per pipelined write
FLUSH_TIMEOUT_S = 120.0  # flush and close never wait longer for the writer
QUEUE_BLOCKS = 4096  # write-behind bound; past it saves are dropped and counted
SENT_KEYS = 65536  # blocks remembered as sent, so saves of a cached prefix do not send it again
MAC_MAGIC = b"TKM1"
MAC_NBYTES = 32


def mac_key(secret: bytes) -> bytes:
    """The MAC key of a deployment secret: scrypt (about 50 ms, once per secret at start), so that a
    record and its MAC read from Redis give no fast way to test guesses of the secret; any length."""
    return hashlib.scrypt(secret, salt=b"tierkv remote records", n=1 << 14, r=8, p=1, dklen=64)


def mac_of(key: bytes, redis_key: bytes, record: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=MAC_NBYTES, person=b"tierkv-remote")
    h.update(len(redis_key).to_bytes(4, "little") + redis_key)
    h.update(record)
    return h.digest()


def sign(key: bytes, redis_key: bytes, record: bytes) -> bytes:
    return MAC_MAGIC + mac_of(key, redis_key, record) + record


def is_signed(value: bytes | memoryview) -> bool:
    return bytes(memoryview(value)[: len(MAC_MAGIC)]) == MAC_MAGIC


def unsign(keys: Sequence[bytes], redis_key: bytes, value: bytes | memoryview) -> memoryview | None:
    """The record in a signed value, if one of ``keys`` (``mac_key``s) made its MAC; else None."""
    head = len(MAC_MAGIC) + MAC_NBYTES
    view = memoryview(value)
    if len(view) < head or bytes(view[: len(MAC_MAGIC)]) != MAC_MAGIC:
        return None
    record = view[head:]
    mac = bytes(view[len(MAC_MAGIC) : head])
    ok = False
    for key in keys:  # every key tried: no early exit to time
        ok |= hmac.compare_digest(mac, mac_of(key, redis_key, record))
    return record if ok else None


def _glob_escape(raw: bytes) -> bytes:
    """``raw`` matched literally by a Redis SCAN pattern."""
    return b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in raw)


class CircuitBreaker:
    """closed -> (N failures) -> open -> (cooldown) -> half-open: one probe -> closed or open again."""

    def __init__(
        self,
        failures: int = BREAKER_FAILURES,
        cooldown_s: float = BREAKER_COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._count = 0
        self._opened_at: float | None = None
        self._lock = threading.Lock()
        self.trips = 0

    @property
    def state(self) -> str:
        with self._lock:
            if self._opened_at is None:
                return "closed"
            return "half-open" if self.clock() - self._opened_at >= self.cooldown_s else "open"

    def allow(self) -> bool:
        return self.state != "open"

    def success(self) -> None:
        with self._lock:
            if self._opened_at is not None:
                log.warning("remote tier reachable again: breaker closed")
            self._count = 0
            self._opened_at = None

    def failure(self, exc: BaseException) -> None:
        with self._lock:
            self._count += 1
            if self._opened_at is not None:  # the half-open probe failed: another cooldown
                self._opened_at = self.clock()
            elif self._count >= self.failures:
                self._opened_at = self.clock()
                self.trips += 1
                log.warning(
                    "remote tier failing (%s): breaker open, local tiers only for %.0f s",
                    exc,
                    self.cooldown_s,
                )


def connect(url: str, timeout_s: float) -> Any:
    """``redis://host:port[/db]`` or ``redis+cluster://host:port`` (any node of the cluster)."""
    import redis

    if url.startswith("redis+cluster://"):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(
            "redis://" + url[len("redis+cluster://") :],
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


class RemoteTier(Tier):
    name = "remote"

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        counters: Counters | None = None,
        breaker: CircuitBreaker | None = None,
        secrets: Sequence[bytes] = (),
    ) -> None:
        """``secrets``: sign records with the first, accept any for reading (see the module's doc);
        none: unsigned records, as before."""
        self.url = url
        self.mac_keys = [mac_key(bytes(x)) for x in secrets]
        self.ttl_s = ttl_s
        self.counters = counters or Counters()
        self.breaker = breaker or CircuitBreaker()
        self.client = connect(url, timeout_s)
        # Blocks this process queued lately, when: a save does not send them again (bounded, oldest forgotten).
        self._sent: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._sent_lock = threading.Lock()
        self._sending = threading.Lock()  # held by the writer over a batch: liveness checked to sent
        self._batches: BatchQueue[Any] = BatchQueue(
            "tierkv-remote-writer", self._write, item_nbytes=lambda _: 1, batch_nbytes=WRITE_BATCH
        )
        self._closed = False

    @staticmethod
    def redis_key(ns_digest: bytes, key: BlockKey) -> bytes:
        return b"tkv:" + ns_digest[:16] + b":" + key

    def _call(self, fn: Callable[[], Any], default: Any) -> Any:
        if not self.breaker.allow():
            return default
        try:
            out = fn()
        except Exception as exc:  # redis errors, timeouts, resharding: degrade, never fail the request
            self.breaker.failure(exc)
            self.counters.add("remote", "write_errors" if default is None else "read_errors")
            return default
        self.breaker.success()
        return out

    def get_many(self, ns_digest: bytes, keys: Sequence[BlockKey]) -> list[bytes]:
        """Records of the leading ``keys`` present remotely (one pipelined round trip)."""
        if not keys:
            return []

        def fetch() -> list[bytes | None]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.get(self.redis_key(ns_digest, k))
            return pipe.execute()

        values = self._call(fetch, [])
        out = []
        for v in values:
            if v is None:
                break
            out.append(v)
        self.counters.add("remote", "bytes_read", sum(len(v) for v in out))
        return out

    def put(
        self,
        ns_digest: bytes,
        key: BlockKey,
        make: Callable[[], list[bytes | memoryview]],
        release: Callable[[], None] | None = None,
        live: Callable[[], bool] | None = None,
    ) -> bool:
        """Queue a record for the writer thread; False (counted) when the queue is full or the breaker open.
        It is not sent once ``live()`` is False (purged or invalidated meanwhile)."""
        if self._closed or not self.breaker.allow():
            self.counters.add("remote", "dropped_saves")
            return False
        if self._batches.pending >= QUEUE_BLOCKS:
            self.counters.add("remote", "dropped_saves")
            return False
        self._batches.put((ns_digest, key, make, release, live))
        return True

    # ---------------------------------------------------------------- the Tier calls

    def probe(self, chain: BlockChain, idx: Sequence[int]) -> list[bool]:
        if not idx:
            return []

        def exists() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            for i in idx:
                pipe.exists(self.redis_key(chain.ns.digest, chain.keys[i]))
            return pipe.execute()

        return [bool(x) for x in self._call(exists, [0] * len(idx))]

    def read_into(self, chain: BlockChain, first: int, count: int, target: Target) -> int:
        """One pipelined round trip; a record that fails verification is deleted remotely."""
        from tierkv.tiers.target import as_tensor, expected

        records = self.get_many(chain.ns.digest, chain.keys[first : first + count])
        spec = target.spec
        B = spec.block_tokens

        def fill(buf: torch.Tensor, i0: int, n: int, base: int) -> int:
            for i in range(i0, i0 + n):
                record: bytes | memoryview = records[i - first]
                if self.mac_keys or is_signed(record):
                    signed = unsign(self.mac_keys, self.redis_key(chain.ns.digest, chain.keys[i]), record)
                    if signed is None:
                        # Unsigned, or signed with no secret of ours (or ours missing): never served, and
                        # not deleted either: a node with a wrong or missing secret file, or one in the
                        # middle of a rotation, must not wipe the records the others can read. The TTL
                        # and Redis's LRU remove forgeries.
                        self.counters.add("remote", "mac_failures")
                        return i - i0
                    record = signed
                try:
                    header, payload = codec.decode_record(record, expected(chain, i))
                    target.created_s[i] = header.created_s  # its age goes with it: max-age still applies
                except RecordError:
                    self.counters.add("remote", "corrupt_blocks")
                    self.delete(chain.ns.digest, chain.keys[i])
                    return i - i0
                block = buf[:, :, (i - base) * B : (i - base + 1) * B]
                block.copy_(as_tensor(payload, spec.dtype, spec.block_shape))
                target.verified(i, block)
            return n

        return target.fill(first, len(records), fill)

    def needs(self, chain: BlockChain, idx: Sequence[int]) -> list[bool]:
        """Not sent by this process lately (a send that failed, or a record past its TTL, is sent again;
        one Redis evicted for its memory budget is not known here until it leaves this bounded set)."""
        now = time.monotonic()
        with self._sent_lock:
            sent = [self._sent.get(chain.keys[i]) for i in idx]
        return [t is None or (self.ttl_s is not None and now - t > self.ttl_s) for t in sent]

    def write(self, block: BlockWrite) -> bool:
        ok = self.put(block.ns.digest, block.key, block.encode, block.release, block.live)
        if ok:  # queued: not queued again; forgotten if the send fails, and once Redis expired it
            with self._sent_lock:
                self._sent[block.key] = time.monotonic()
                self._sent.move_to_end(block.key)
                while len(self._sent) > SENT_KEYS:
                    self._sent.popitem(last=False)
        return ok

    def stats(self) -> dict[str, int]:
        return {"breaker_open": int(self.breaker.state == "open"), "breaker_trips": self.breaker.trips}

    def describe(self) -> str:
        return f"remote {redact_url(self.url)}"  # for logs: a password in the URL stays out

    def delete(self, ns_digest: bytes, key: BlockKey) -> None:
        self._call(lambda: self.client.delete(self.redis_key(ns_digest, key)), None)

    def invalidate(self, ns: NamespaceDigest, keys: Sequence[BlockKey]) -> list[bool]:
        """Delete these records, after the batch being sent (checked live before the fence) is out."""
        with self._sending:
            pass
        with self._sent_lock:  # a save of them after this sends them again
            for key in keys:
                self._sent.pop(key, None)

        def delete() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(self.redis_key(ns, key))
            return pipe.execute()

        deleted = self._call(delete, None)
        if deleted is None:
            log.warning(
                "remote tier: %d invalidated blocks not deleted (unreachable); their TTL ends them", len(keys)
            )
            return [False] * len(keys)
        return [bool(n) for n in deleted]

    def drop(self, ns: NamespaceDigest | None) -> int:
        """Delete every record of namespace ``ns`` (None: every tierkv record), by SCAN, after the batch
        being sent is out."""
        with self._sending:
            pass
        with self._sent_lock:  # no namespace index here: all are sent again when saved
            self._sent.clear()
        pattern = b"tkv:" + (_glob_escape(ns[:16]) + b":*" if ns is not None else b"*")

        def delete(found: list[bytes]) -> int:
            pipe = self.client.pipeline(transaction=False)  # one key per DEL: a cluster's slots differ
            for k in found:
                pipe.delete(k)
            return sum(pipe.execute())

        def purge() -> int:
            n, found = 0, []
            for key in self.client.scan_iter(match=pattern, count=1000):  # deleting while scanning is fine
                found.append(key)
                if len(found) >= 1000:
                    n, found = n + delete(found), []
            return n + (delete(found) if found else 0)

        purged = self._call(purge, None)
        if purged is None:
            log.warning("remote tier: purge failed (unreachable); its records go with their TTL")
            return 0
        return int(purged)

    def _write(self, batch: list[Any]) -> None:
        with self._sending:  # a purge or invalidation waits for the batch whose liveness was checked
            self._send(batch)

    def _send(self, batch: list[Any]) -> None:
        records = []
        try:
            for ns_digest, key, make, _, live in batch:
                if live is None or live():
                    rkey = self.redis_key(ns_digest, key)
                    record = b"".join(make())
                    records.append((rkey, sign(self.mac_keys[0], rkey, record) if self.mac_keys else record))
        finally:
            for *_, release, _ in batch:
                if release is not None:
                    release()
        if not records:
            return
        ex = int(self.ttl_s) if self.ttl_s else None

        def send() -> bool:
            pipe = self.client.pipeline(transaction=False)
            for k, v in records:
                pipe.set(k, v, ex=ex)
            pipe.execute()
            return True

        if self._call(send, None):
            self.counters.add("remote", "blocks_written", len(records))
            self.counters.add("remote", "bytes_written", sum(len(v) for _, v in records))
        else:
            self.counters.add("remote", "dropped_saves", len(records))
            with self._sent_lock:  # not there: a later save sends them again
                for _, key, *_ in batch:
                    self._sent.pop(key, None)

    def flush(self) -> None:
        self._batches.join(FLUSH_TIMEOUT_S)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._batches.stop(FLUSH_TIMEOUT_S)
        try:
            self.client.close()
        except Exception:  # closing a dead connection
            pass
