"""The shared remote tier on a real Redis: shared hits, exactness, outages behind a breaker, a cluster."""

import shutil
import subprocess
import time

import pytest
import torch

from tierkv import TieredStore
from tierkv.errors import ConfigError
from tierkv.tiers.remote import CircuitBreaker

from helpers import REDIS_EPHEMERAL, ServerProcess, make_kv


def test_a_prefix_saved_by_worker_a_is_a_remote_hit_on_worker_b(tmp_path, ns, redis_server) -> None:
    toks = list(range(100))
    kv = make_kv(ns, 100)
    with TieredStore.open(tmp_path / "a", host_bytes=2**20, remote=redis_server.url, ttl_s=3600) as a:
        a.save(ns, toks, kv)
        a.flush()
    with TieredStore.open(tmp_path / "b", host_bytes=2**20, remote=redis_server.url) as b:
        assert b.lookup(ns, toks).by_tier == {"host": 0, "disk": 0, "remote": 96}
        hit, got = b.restore(ns, toks)
        assert hit.by_tier["remote"] == 96 and torch.equal(got, kv[:, :, :96])
        b.flush()
        assert b.lookup(ns, toks).by_tier == {"host": 96, "disk": 0, "remote": 0}  # promoted
        b.tier("host").clear()
        assert b.lookup(ns, toks).by_tier["disk"] == 96  # and written to the local disk
    import redis

    ttl = redis.Redis(port=redis_server.port).ttl(
        next(iter(redis.Redis(port=redis_server.port).keys(b"tkv:*")))
    )
    assert 3500 < ttl <= 3600


def test_foreign_or_corrupted_remote_value_is_a_miss_and_deleted(tmp_path, ns, redis_server) -> None:
    import redis

    toks = list(range(48))
    with TieredStore.open(None, host_bytes=2**20, remote=redis_server.url) as a:
        a.save(ns, toks, make_kv(ns, 48))
        a.flush()
    r = redis.Redis(port=redis_server.port)
    keys = sorted(r.keys(b"tkv:*"))
    assert len(keys) == 3
    from tierkv.keys import block_keys
    from tierkv.tiers.remote import RemoteTier

    second = RemoteTier.redis_key(ns.digest, block_keys(ns, toks)[1])
    value = bytearray(r.get(second))
    value[-3] ^= 0xFF
    r.set(second, bytes(value))
    with TieredStore.open(None, host_bytes=2**20, remote=redis_server.url) as b:
        hit, got = b.restore(ns, toks)
        assert hit.num_tokens == 16 and torch.equal(got, make_kv(ns, 48)[:, :, :16])
        assert b.stats()["remote"]["corrupt_blocks"] == 1
    assert r.get(second) is None


def test_records_without_a_deployment_mac_are_never_served(tmp_path, ns, redis_server) -> None:
    """A writer to the shared Redis (right key, valid checksum) without the secret cannot make a node
    serve its KV; a rotated secret keeps old records readable while both are listed, then refuses them;
    nothing a node cannot verify is deleted by it."""
    import redis

    old, new = b"old-secret-0123456789", b"new-secret-9876543210"
    forged, signed = list(range(48)), list(range(100, 148))
    with TieredStore.open(None, host_bytes=0, remote=redis_server.url) as writer:  # no secret: unsigned
        writer.save(ns, forged, make_kv(ns, 48, seed=1))
        writer.flush()
    with TieredStore.open(None, host_bytes=0, remote=redis_server.url, remote_secrets=(old,)) as a:
        a.save(ns, signed, make_kv(ns, 48, seed=2))
        a.flush()
        hit, _ = a.restore(ns, forged)
        assert hit.num_tokens == 0 and a.stats()["remote"]["mac_failures"] == 1
        hit, kv = a.restore(ns, signed)
        assert hit.num_tokens == 48 and torch.equal(kv, make_kv(ns, 48, seed=2))
    r = redis.Redis(port=redis_server.port)
    from tierkv.keys import block_keys
    from tierkv.tiers.remote import RemoteTier

    # Left alone (a node with a wrong secret must not wipe what the others read): the TTL removes it
    assert r.get(RemoteTier.redis_key(ns.digest, block_keys(ns, forged)[0])) is not None
    with TieredStore.open(None, host_bytes=0, remote=redis_server.url) as unsigned_node:
        assert unsigned_node.restore(ns, signed)[0].num_tokens == 0  # no secret: signed values not served
    moved = r.get(RemoteTier.redis_key(ns.digest, block_keys(ns, signed)[0]))
    r.set(RemoteTier.redis_key(ns.digest, block_keys(ns, forged)[0]), moved)  # a signed record moved
    with TieredStore.open(None, host_bytes=0, remote=redis_server.url, remote_secrets=(new, old)) as b:
        assert b.restore(ns, signed)[0].num_tokens == 48  # the old secret, still accepted
        assert b.restore(ns, forged)[0].num_tokens == 0  # its MAC names another key
    with TieredStore.open(None, host_bytes=0, remote=redis_server.url, remote_secrets=(new,)) as c:
        assert c.restore(ns, signed)[0].num_tokens == 0  # the rotation is over: refused
        assert c.stats()["remote"]["mac_failures"] == 1


def test_redis_outage_degrades_to_local_tiers_and_the_breaker_closes_again(
    tmp_path, ns, redis_server, monkeypatch
) -> None:
    import tierkv.tiers.remote as remote_mod

    monkeypatch.setattr(remote_mod, "DEFAULT_TIMEOUT_S", 0.2)
    with TieredStore.open(tmp_path, host_bytes=2**20, remote=redis_server.url) as store:
        store.tier("remote").breaker = CircuitBreaker(failures=2, cooldown_s=0.5)
        store.save(ns, list(range(32)), make_kv(ns, 32))
        store.flush()
        redis_server.kill()
        for p in range(1, 6):  # requests go on, correct, from the local tiers
            toks = [p * 1000 + t for t in range(32)]
            store.save(ns, toks, make_kv(ns, 32, seed=p))
            n, kv = store.load(ns, toks)
            assert n == 32 and torch.equal(kv, make_kv(ns, 32, seed=p))
            assert store.lookup(ns, [9] + toks[1:]).num_tokens == 0
        store.flush()
        assert (
            store.tier("remote").breaker.state in ("open", "half-open")
            and store.tier("remote").breaker.trips >= 1
        )
        t0 = time.monotonic()
        assert store.lookup(ns, [7] * 32).num_tokens == 0
        assert time.monotonic() - t0 < 0.1  # an open breaker costs nothing
        redis_server.start()
        time.sleep(0.6)
        toks = [9000 + t for t in range(32)]
        store.save(ns, toks, make_kv(ns, 32, seed=9))
        store.flush()
        assert store.tier("remote").breaker.state == "closed"
    with TieredStore.open(None, host_bytes=2**20, remote=redis_server.url) as other:
        assert other.lookup(ns, toks).by_tier["remote"] == 32  # saving to the remote tier resumed


def test_admission_shares_only_blocks_seen_twice(tmp_path, ns, redis_server) -> None:
    import redis

    r = redis.Redis(port=redis_server.port)
    with TieredStore.open(None, host_bytes=2**20, remote=redis_server.url, remote_admit_after=2) as store:
        once, twice = list(range(32)), [5000 + t for t in range(32)]
        for toks in (once, twice):
            store.restore(ns, toks)  # a request containing it (a miss)
            store.save(ns, toks, make_kv(ns, 32))
        store.flush()
        assert r.dbsize() == 0
        store.restore(ns, twice)  # the second request containing these blocks: now shared
        store.flush()
        assert r.dbsize() == 2


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is valid and free too."""
    import random
    import socket

    while True:
        p = random.randint(20000, 45000)
        try:
            for q in (p, p + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue


def test_redis_cluster(tmp_path, ns) -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli not installed (.ci/run installs them)")
    ports = [_cluster_port() for _ in range(3)]
    procs = [
        subprocess.Popen(
            [
                "redis-server",
                *("--port", str(p), "--bind", "127.0.0.1", *REDIS_EPHEMERAL),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(tmp_path / f"n{p}.conf"),
                "--dir",
                str(tmp_path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    try:
        time.sleep(0.5)
        r = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        time.sleep(1.0)
        url = f"redis+cluster://127.0.0.1:{ports[0]}"
        toks = list(range(160))
        with TieredStore.open(None, host_bytes=2**20, remote=url) as a:
            a.save(ns, toks, make_kv(ns, 160))
            a.flush()
        with TieredStore.open(None, host_bytes=2**20, remote=url) as b:
            hit, got = b.restore(ns, toks)
            assert hit.by_tier["remote"] == 160 and torch.equal(got, make_kv(ns, 160))
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.slow  # (two servers' starts, about 19 s: .ci/run runs it with --runslow)
def test_two_servers_share_one_redis(tmp_path, redis_server) -> None:
    msgs = [{"role": "system", "content": "You are exact. " * 60}, {"role": "user", "content": "hi"}]
    a = ServerProcess("--remote", redis_server.url, cache_dir=tmp_path / "a")
    try:
        ra = a.client().chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0)
    finally:
        assert a.stop() == 0
    b = ServerProcess("--remote", redis_server.url, cache_dir=tmp_path / "b")
    try:
        rb = b.client().chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0)
    finally:
        assert b.stop() == 0
    tiers = rb.usage.model_extra["tierkv"]["cached_tokens_by_tier"]
    assert tiers["remote"] == rb.usage.prompt_tokens_details.cached_tokens > 0
    assert rb.choices[0].message.content == ra.choices[0].message.content


def test_remote_hits_staged_in_chunks_are_exact(tmp_path, ns, redis_server, monkeypatch) -> None:
    """Remote records restored into a destination records cannot be scattered into (a GPU's path): they go
    through the chunk buffers, a chunk at a time, after the local disk blocks."""
    from tierkv.layout import KVSpec
    from tierkv.tiers import target as store_mod

    spec = KVSpec.of(ns)
    monkeypatch.setattr(store_mod, "RESTORE_CHUNK_NBYTES", 2 * spec.block_nbytes)
    toks = list(range(160))  # 10 blocks
    kv = make_kv(ns, 160, seed=4)
    with TieredStore.open(tmp_path / "a", host_bytes=0, remote=redis_server.url) as a:
        a.save(ns, toks, kv)
        a.flush()
    with TieredStore.open(tmp_path / "b", host_bytes=0, remote=redis_server.url) as b:
        b.save(ns, toks[:48], kv[:, :, :48])  # the first 3 blocks are on b's disk too
        b.flush()
        out = torch.zeros(
            spec.num_layers, 2, spec.num_kv_heads, 160, spec.head_dim, dtype=spec.dtype
        ).transpose(2, 3)
        hit, got = b.restore(ns, toks, out=out)
        assert hit.by_tier == {"disk": 48, "remote": 112}
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, kv)


def test_a_block_whose_send_failed_is_sent_again(ns) -> None:
    """Review finding: blocks were marked sent when queued, so a failed batch was never retried."""
    from tierkv.keys import BlockChain
    from tierkv.tiers.base import BlockWrite
    from tierkv.tiers.remote import RemoteTier

    tier = RemoteTier("redis://127.0.0.1:1", timeout_s=0.1)  # nothing listens there
    try:
        chain = BlockChain.of(ns, list(range(ns.block_tokens)))
        payload = make_kv(ns, ns.block_tokens).contiguous().view(-1).view(torch.uint8)
        assert tier.write(BlockWrite(ns, chain.keys[0], chain.parent(0), chain.tokens(0), 0.0, payload))
        tier.flush()
        assert tier.stats() is not None and tier.needs(chain, [0]) == [True]
    finally:
        tier.close()


def test_invalidate_and_purge_reach_the_remote_tier(tmp_path, ns, redis_server) -> None:
    """Invalidated blocks are deleted remotely (another worker then misses them) and a save after it sends
    the new KV; a purged namespace's records go (by SCAN), another namespace's stay."""
    import dataclasses

    import redis

    other = dataclasses.replace(ns, tenant_salt="other")
    toks = list(range(64))
    kv, other_kv = make_kv(ns, 64), make_kv(other, 64, seed=1)
    r = redis.Redis(port=redis_server.port)

    def worker_b():  # another worker, with nothing of its own
        return TieredStore.open(None, host_bytes=2**20, remote=redis_server.url)

    with TieredStore.open(tmp_path, host_bytes=2**20, remote=redis_server.url) as a:
        a.save(ns, toks, kv)
        a.save(other, toks, other_kv)
        a.flush()
        assert len(r.keys(b"tkv:*")) == 8
        assert a.invalidate(ns, toks, [1]) == 1
        assert len(r.keys(b"tkv:*")) == 7
        with worker_b() as b:
            hit, got = b.restore(ns, toks)
            assert hit.by_tier["remote"] == 16 and torch.equal(got, kv[:, :, :16])
        fixed = kv.clone()
        fixed[:, :, 16:32] = make_kv(ns, 16, seed=7)
        a.save(ns, toks, fixed)  # sent again: the tier forgot it had sent it
        a.flush()
        with worker_b() as b:
            hit, got = b.restore(ns, toks)
            assert hit.by_tier["remote"] == 64 and torch.equal(got, fixed)
        a.purge(ns.digest.hex()[:8])
        assert len(r.keys(b"tkv:*")) == 4
        with worker_b() as b:
            assert b.lookup(ns, toks).num_tokens == 0
            hit, got = b.restore(other, toks)
            assert hit.by_tier["remote"] == 64 and torch.equal(got, other_kv)


def test_the_remote_tier_describes_itself_without_its_password() -> None:
    """``describe`` goes into start-up logs (the vLLM connector's too): a URL's credentials stay out."""
    from tierkv.tiers.remote import RemoteTier

    tier = RemoteTier.__new__(RemoteTier)
    tier.url = "redis://user:s3cr3t@cache.internal:6379/0"
    assert tier.describe() == "remote redis://***@cache.internal:6379/0"


def test_the_vllm_connectors_store_signs_remote_records_with_its_secret_file(
    tmp_path, ns, redis_server
) -> None:
    """``kv_connector_extra_config`` ``remote_secret_file`` (what ``tierkv serve --engine vllm
    --remote-secret-file`` passes): the connector's store signs what it shares; a node without the secret
    does not serve it, a node with it does."""
    from tierkv.integrations.vllm.options import ConnectorOptions, release_store, shared_store

    secret_file = tmp_path / "remote.secret"
    secret_file.write_text("x" * 40 + "\n")
    options = ConnectorOptions.from_extra(
        {
            "cache_dir": str(tmp_path / "engine"),
            "remote": redis_server.url,
            "remote_secret_file": str(secret_file),
            "host_bytes": 0,
            "sweep_interval_s": 0,
        }
    )
    store = shared_store(options)
    try:
        toks = list(range(48))
        store.save(ns, toks, make_kv(ns, 48, seed=3))
        store.flush()
    finally:
        release_store(store)
    with TieredStore.open(None, host_bytes=0, remote=redis_server.url) as unsigned_node:
        assert unsigned_node.restore(ns, toks)[0].num_tokens == 0
    with TieredStore.open(None, host_bytes=0, remote=redis_server.url, remote_secrets=(b"x" * 40,)) as node:
        hit, kv = node.restore(ns, toks)
        assert hit.num_tokens == 48 and torch.equal(kv, make_kv(ns, 48, seed=3))
    bad = ConnectorOptions.from_extra({"remote_secret_file": str(secret_file)})  # and no remote tier
    with pytest.raises(ConfigError, match="no remote tier"):
        bad.store_kwargs()
