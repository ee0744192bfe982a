"""Tenant quotas in the store (a real LMDB disk tier, an injected clock): eviction takes from tenants
above their quota first, pins stay within a tenant's pin quota, usage is counted per tenant."""

import lmdb
import pytest

from tierkv import TieredStore
from tierkv.errors import PinBudgetError
from tierkv.retention import Retention
from tierkv.tenancy import Quota, namespace_salt, tenant_id
from tierkv.tiers.disk import DiskTier

from helpers import make_kv, writer_held

RECORD = 4096  # one block of the test namespace's KV is one 4 KiB page on disk
A_SALT, B_SALT, C_SALT = "a" * 32, "b" * 32, "c" * 32


def _tenant(ns, secret: str):
    salted = ns.with_salt(namespace_salt(secret, ""))
    tid = tenant_id(salted.tenant_salt)
    assert tid is not None
    return salted, tid


def _prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(64)]  # 4 blocks of 16 tokens


def _open(path, now, **options) -> TieredStore:
    return TieredStore.open(path, host_bytes=0, clock=lambda: now[0], **options)


def _disk(store: TieredStore) -> DiskTier:
    disk = store.tier("disk")
    assert isinstance(disk, DiskTier)
    return disk


def _fill(store, now, ns, first: int, count: int) -> None:
    for i in range(first, first + count):
        now[0] += 1
        store.save(ns, _prompt(i), make_kv(ns, 64, seed=i))
        store.flush()


def _held(store, ns, first: int, count: int) -> int:
    return sum(store.lookup(ns, _prompt(i)).num_tokens == 64 for i in range(first, first + count))


@pytest.mark.parametrize("quotas", [True, False])
def test_a_tenant_within_its_quota_keeps_its_blocks_when_another_fills_the_disk(tmp_path, ns, quotas) -> None:
    """With quotas, the noisy tenant evicts only its own blocks; without (the control), the quiet
    tenant's older blocks go first, by LRU."""
    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    b, b_id = _tenant(ns, B_SALT)
    with _open(tmp_path, now, disk_bytes=40 * RECORD) as store:
        if quotas:
            store.set_quotas(
                {a_id: Quota("a", disk_nbytes=20 * RECORD), b_id: Quota("b", disk_nbytes=20 * RECORD)}
            )
        _fill(store, now, b, 0, 4)  # 16 blocks: within b's 20
        _fill(store, now, a, 100, 40)  # 160 blocks into a 40-block budget
        held_b = _held(store, b, 0, 4)
        usage = {tid: u for tid, (u, _) in _disk(store).tenants().items()}
        assert sum(u[1] for u in usage.values()) <= 40 * RECORD
        if quotas:
            assert held_b == 4
            assert usage[b_id][:2] == (16, 16 * RECORD)
            assert _held(store, a, 136, 4) == 4  # a keeps its newest blocks in what is left
        else:
            assert held_b == 0


def test_a_tenant_without_a_quota_is_evicted_before_one_within_its_quota(tmp_path, ns) -> None:
    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    c, _ = _tenant(ns, C_SALT)  # named by no quota
    with _open(tmp_path, now, disk_bytes=24 * RECORD) as store:
        store.set_quotas({a_id: Quota("a", disk_nbytes=16 * RECORD)})
        _fill(store, now, a, 0, 4)  # a's 16 blocks are the oldest
        _fill(store, now, c, 100, 6)  # c writes 24 blocks
        assert _held(store, a, 0, 4) == 4
        assert _held(store, c, 104, 2) == 2  # c keeps its newest in the 8 blocks left


@pytest.mark.parametrize("how", ["writer", "gc"])
def test_a_tenant_over_its_quota_loses_a_prompts_last_blocks_first(tmp_path, ns, how) -> None:
    """The quota's eviction takes a prompt from its end, as the budget's own does: what the tenant keeps
    of a long prompt is a prefix that hits. Before, it took the tenant's blocks in key order (a prompt's
    blocks share one time): 8 of 20 kept, a lookup reached none or one of them."""
    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    b, b_id = _tenant(ns, B_SALT)
    long_prompt = [7 + t for t in range(20 * 16)]
    budget = 16 * RECORD
    with _open(tmp_path, now, disk_bytes=budget if how == "writer" else None) as store:
        store.set_quotas({a_id: Quota("a", disk_nbytes=8 * RECORD), b_id: Quota("b", disk_nbytes=8 * RECORD)})
        _fill(store, now, b, 0, 2)  # 8 blocks, the oldest, within b's quota
        now[0] += 1
        with writer_held(store):  # the prompt in one batch: one eviction decides
            store.save(a, long_prompt, make_kv(a, len(long_prompt)))
        store.flush()
        if how == "gc":
            assert _disk(store).enforce_budget(budget).evicted == 12
        assert _held(store, b, 0, 2) == 2
        assert store.lookup(a, long_prompt).num_tokens == 8 * 16  # its first 8 blocks: all a holds
        assert _disk(store).usage()["live_nbytes"] == budget
        assert {tid: u for tid, (u, _) in _disk(store).tenants().items() if u[0]} == _recount(store)


def test_the_quotas_eviction_scans_a_long_shared_prefix_once_not_once_a_block(tmp_path, ns) -> None:
    """A tenant's old prefix of 200 blocks, each with a stored continuation, and 40 one-block
    continuations younger than it: evicting half of them asks for each row's continuations about once,
    where restarting the scan at the tenant's first row asked 200 times a block (3,000 blocks took 3 s
    in one write transaction)."""
    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    prefix = list(range(200 * 16))
    with _open(tmp_path, now) as store:
        store.save(a, prefix, make_kv(a, len(prefix)))
        store.flush()
        for i in range(40):
            now[0] += 1
            toks = prefix + [1_000_000 + 16 * i + t for t in range(16)]
            store.save(a, toks, make_kv(a, 16, seed=i), start_block=200, kv_start=200 * 16)
        store.flush()
        store.set_quotas({a_id: Quota("a", disk_nbytes=RECORD)})
        index = _disk(store).index
        calls, children = [0], index.children
        index.children = lambda *args, **kw: (calls.__setitem__(0, calls[0] + 1), children(*args, **kw))[1]
        assert _disk(store).enforce_budget(220 * RECORD).evicted == 20
        assert calls[0] < 3 * (200 + 40)
        assert store.lookup(a, prefix).num_tokens == len(prefix)  # the continuations went, oldest first
        assert {tid: u for tid, (u, _) in _disk(store).tenants().items() if u[0]} == _recount(store)


def test_budget_sweeps_of_gc_take_from_tenants_over_their_quota_first(tmp_path, ns) -> None:
    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    b, b_id = _tenant(ns, B_SALT)
    with _open(tmp_path, now) as store:  # no budget while writing
        store.set_quotas({a_id: Quota("a", disk_nbytes=8 * RECORD), b_id: Quota("b", disk_nbytes=8 * RECORD)})
        _fill(store, now, b, 0, 2)  # 8 blocks, the oldest
        _fill(store, now, a, 100, 6)  # 24 blocks
        report = _disk(store).enforce_budget(16 * RECORD)
        assert report.evicted == 16
        assert _held(store, b, 0, 2) == 2
        assert _held(store, a, 100, 6) == 2


def test_a_tenant_pins_within_its_pin_quota_and_hears_only_of_its_own_pins(tmp_path, ns) -> None:
    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    b, b_id = _tenant(ns, B_SALT)
    with _open(tmp_path, now, disk_bytes=64 * RECORD, pin_bytes=16 * RECORD) as store:
        store.set_quotas({a_id: Quota("a", pin_nbytes=6 * RECORD), b_id: Quota("b")})
        for t in (a, b):
            for i in range(3):
                store.save(t, _prompt(i), make_kv(t, 64, seed=i))
        store.flush()
        store.check_pin(a, _prompt(0), 3600)
        store.retain(a, _prompt(0), Retention(pin_s=3600))
        store.flush()
        with pytest.raises(PinBudgetError, match="your 24.0 KiB pin quota") as refused:
            store.check_pin(a, _prompt(1), 3600)  # 4 + 4 > 6 blocks
        assert "64.0 KiB" not in str(refused.value)  # the store's pin budget is not told
        store.check_pin(a, _prompt(1), 3600, num_blocks=2)  # 4 + 2 fit
        # a pin asked without the check (another process, say) is held to the quota when written
        store.retain(a, _prompt(1), Retention(pin_s=3600))
        store.flush()
        usage = {tid: u for tid, (u, _) in _disk(store).tenants().items()}
        assert usage[a_id][2:] == (6, 6 * RECORD)
        # b has no pin quota: the store's budget (16 blocks, 6 pinned) holds it, and it is told no more
        for i in (0, 1):
            store.check_pin(b, _prompt(i), 3600, num_blocks=4)
            store.retain(b, _prompt(i), Retention(pin_s=3600))
        store.flush()
        with pytest.raises(PinBudgetError, match="the store's pin budget is taken") as refused:
            store.check_pin(b, _prompt(2), 3600)
        assert "KiB" not in str(refused.value)


def test_stats_name_tenants_and_count_their_usage(tmp_path, ns) -> None:
    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    with _open(tmp_path, now, disk_bytes=64 * RECORD) as store:
        store.set_quotas({a_id: Quota("acme", disk_nbytes=32 * RECORD)})
        _fill(store, now, a, 0, 2)
        _fill(store, now, ns, 10, 1)  # a block of no tenant is in no tenant's row
        rows = store.report()["tenants"]
    assert rows == [
        {
            "tenant": "acme",
            "blocks": 8,
            "nbytes": 8 * RECORD,
            "pinned_blocks": 0,
            "pinned_nbytes": 0,
            "disk_quota_nbytes": 32 * RECORD,
            "host_quota_nbytes": None,
            "pin_quota_nbytes": None,
        }
    ]
    assert A_SALT not in repr(rows)
    from click.testing import CliRunner

    from tierkv.cli import main

    text = CliRunner().invoke(main, ["stats", "--cache-dir", str(tmp_path)]).output
    assert "tenant     acme   8 blocks" in text and "disk quota 128.0 KiB" in text
    assert "no tenant  4 blocks" in text  # the namespace of no tenant's blocks
    assert text.count(" tenant acme") == 1  # its namespace line names it
    assert A_SALT not in text


def test_rows_of_blocks_stored_before_are_filled_when_a_writer_opens(tmp_path, ns) -> None:
    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    with _open(tmp_path, now) as store:
        _fill(store, now, a, 0, 3)
        before = _disk(store).tenants()
    env = lmdb.open(str(tmp_path / "index"), max_dbs=16, subdir=True)  # as a build without them left it
    with env.begin(write=True) as txn:
        for name in (b"tenants", b"tenant_time"):
            txn.drop(env.open_db(name, txn=txn), delete=True)
        txn.delete(b"tenant_rows", db=env.open_db(b"meta", txn=txn))
    env.close()
    with _open(tmp_path, now) as store:
        assert _disk(store).tenants() == before
        assert before[a_id][0] == (12, 12 * RECORD, 0, 0)


@pytest.mark.parametrize("quotas", [True, False])
def test_the_host_tier_takes_slots_from_tenants_above_their_quota_first(tmp_path, ns, quotas) -> None:
    from tierkv.keys import BlockChain
    from tierkv.layout import KVSpec

    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    b, b_id = _tenant(ns, B_SALT)
    slot = KVSpec.of(ns).block_nbytes
    store = TieredStore.open(tmp_path, host_bytes=16 * slot, clock=lambda: now[0])
    with store:
        if quotas:
            store.set_quotas({a_id: Quota("a", host_nbytes=8 * slot), b_id: Quota("b", host_nbytes=8 * slot)})
        _fill(store, now, b, 0, 2)  # 8 blocks: b's quota
        _fill(store, now, a, 100, 10)  # 40 blocks through a 16-slot host tier
        host = store.tier("host")
        held_b = sum(sum(host.contains(BlockChain.of(b, _prompt(i)).keys)) for i in range(2))
        assert held_b == (8 if quotas else 0)
        usage = store.tenant_usage()
        assert usage[a_id]["host_nbytes"] == (8 if quotas else 16) * slot
        assert usage[a_id]["disk_nbytes"] > 0  # (no disk budget: every block is there)


def _recount(store: TieredStore) -> dict[bytes, tuple[int, int, int, int]]:
    """Per tenant, from the entries themselves: what the exact totals must say."""
    namespaces = _disk(store).namespaces()
    out: dict[bytes, list[int]] = {}
    for _, e in _disk(store).iter_entries():
        tid = namespaces[e.ns_digest].tenant_id
        if tid is not None:
            row = out.setdefault(tid, [0, 0, 0, 0])
            row[0] += 1
            row[1] += e.footprint
            if e.pin_until_s:
                row[2] += 1
                row[3] += e.footprint
    return {tid: tuple(r) for tid, r in out.items()}


def test_tenant_totals_stay_exact_through_every_kind_of_change_and_drift_is_repaired(tmp_path, ns) -> None:
    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    b, b_id = _tenant(ns, B_SALT)
    with _open(tmp_path, now, ttl_s=600, disk_bytes=32 * RECORD, pin_bytes=8 * RECORD) as store:
        store.set_quotas(
            {a_id: Quota("a", disk_nbytes=12 * RECORD), b_id: Quota("b", disk_nbytes=12 * RECORD)}
        )

        def exact() -> None:
            assert {tid: u for tid, (u, _) in _disk(store).tenants().items() if u[0]} == _recount(store)

        _fill(store, now, a, 0, 3)
        _fill(store, now, b, 10, 3)
        store.check_pin(a, _prompt(0), 60)
        store.retain(a, _prompt(0), Retention(pin_s=60))  # pinned
        store.retain(b, _prompt(10), Retention(ttl_s=3600))  # retained
        store.flush()
        exact()
        _fill(store, now, a, 20, 6)  # evictions past the budget, by quota
        exact()
        store.forget(b, _prompt(11))  # a deletion by prompt
        store.flush()
        exact()
        now[0] += 120  # the pin ends; a sweep returns its blocks to the store's own class
        store.gc()
        exact()
        now[0] += 1000  # past the TTL: expiry of every block not retained
        store.gc()
        exact()
        # an older build beside this one moves blocks without the rows: the totals drift, a sweep fixes them
        index = _disk(store).index
        index.write(lambda txn: txn.drop(index.db["tenants"], delete=False))
        assert not any(u[0] for u, _ in _disk(store).tenants().values())
        store.gc()
        exact()


def test_the_host_tier_never_loses_a_block_waiting_for_the_disk_to_a_quota() -> None:
    """A tenant above its host quota gives up its clean blocks first; its blocks still waiting for the
    disk (dirty) are not taken for the quota while a clean block is anywhere."""
    import torch

    from tierkv.keys import BlockKey
    from tierkv.tiers.host import HostTier

    pool = HostTier(4 * 64, pin=False)
    a_id, b_id = b"a" * 16, b"b" * 16
    pool.set_quotas({a_id: Quota("a", host_nbytes=64), b_id: Quota("b", host_nbytes=3 * 64)})

    def put(name: str, tenant: bytes) -> BlockKey:
        key = BlockKey(name.encode().ljust(32, b"\0"))
        assert pool.put(key, torch.zeros(64, dtype=torch.uint8), tenant=tenant) is not None
        return key

    a1, a2 = put("a1", a_id), put("a2", a_id)
    assert pool.mark_dirty(a1) and pool.mark_dirty(a2)
    b1, b2 = put("b1", b_id), put("b2", b_id)
    b3 = put("b3", b_id)  # a is above its quota, but holds only dirty blocks: b's oldest clean one goes
    assert pool.contains([a1, a2, b1, b2, b3]) == [True, True, False, True, True]
    a3 = put("a3", a_id)  # a needs a slot: its own clean blocks are none; b's oldest clean one goes
    pool.hold(a1)  # (a1 written: held by the writer, no longer dirty), then released clean
    pool.release(pool.hold(a1))
    a4 = put("a4", a_id)  # now a is above its quota with a clean block: its own oldest clean one goes
    held = dict(zip(["a1", "a2", "a3", "a4", "b2", "b3"], pool.contains([a1, a2, a3, a4, b2, b3])))
    assert held["a2"] and held["a4"] and held["b3"]
    assert not held["b2"] and held["a1"] != held["a3"]  # b2 went for a3; then one of a's own clean blocks


def test_pin_quotas_that_fit_the_budget_decide_a_tenants_pin_alone(tmp_path, ns) -> None:
    """With every tenant's pin quota inside the pin budget, a tenant's pin is admitted on its own quota:
    pins outside the tenants (a server without keys on the same directory) fill the budget, and the
    tenant hears nothing of them; the writing transaction still holds the budget (counted)."""
    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    b, b_id = _tenant(ns, B_SALT)
    with _open(tmp_path, now, disk_bytes=64 * RECORD, pin_bytes=8 * RECORD) as store:
        store.set_quotas({a_id: Quota("a", pin_nbytes=4 * RECORD), b_id: Quota("b", pin_nbytes=4 * RECORD)})
        for t, i in ((ns, 0), (ns, 1), (a, 2)):
            store.save(t, _prompt(i), make_kv(t, 64, seed=i))
        store.flush()
        for i in (0, 1):  # 8 blocks pinned by no tenant: the budget is full
            store.check_pin(ns, _prompt(i), 60)
            store.retain(ns, _prompt(i), Retention(pin_s=60))
        store.flush()
        store.check_pin(a, _prompt(2), 60)  # not refused: a's own quota has room
        store.retain(a, _prompt(2), Retention(pin_s=60))
        store.flush()
        assert store.stats()["disk"]["pins_refused"] == 4  # the budget held where the pins were written
        with pytest.raises(PinBudgetError, match="your 16.0 KiB pin quota"):
            store.check_pin(a, _prompt(2) + _prompt(3), 60)  # 8 blocks: past a's own quota


def test_a_process_never_told_the_quotas_adopts_those_stored_in_its_cache_directory(tmp_path, ns) -> None:
    """As the vLLM connector's store does, behind the front that stores them: its host tier too."""
    from tierkv.keys import BlockChain
    from tierkv.layout import KVSpec

    now = [10_000.0]
    a, a_id = _tenant(ns, A_SALT)
    b, b_id = _tenant(ns, B_SALT)
    slot = KVSpec.of(ns).block_nbytes
    with TieredStore.open(tmp_path, host_bytes=0, clock=lambda: now[0]) as front:
        front.set_quotas({a_id: Quota("a", host_nbytes=8 * slot), b_id: Quota("b", host_nbytes=8 * slot)})
    with TieredStore.open(tmp_path, host_bytes=16 * slot, clock=lambda: now[0]) as store:
        _fill(store, now, b, 0, 2)
        _fill(store, now, a, 100, 10)
        host = store.tier("host")
        assert sum(sum(host.contains(BlockChain.of(b, _prompt(i)).keys)) for i in range(2)) == 8
