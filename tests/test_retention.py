"""Per-block retention, pins and memory-only saves in the store (an injected clock, a real LMDB disk tier)."""

import tarfile
from pathlib import Path

import lmdb
import pytest
import torch
from click.testing import CliRunner

from tierkv import TieredStore
from tierkv.cli import main
from tierkv.errors import ConfigError, PinBudgetError
from tierkv.retention import Retention, parse_duration
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.disk.schema import ENTRY_V1, STORE_FORMAT_VERSION, Entry

from helpers import make_kv

FIXTURES = Path(__file__).parent / "fixtures"


def _entries(store: TieredStore) -> dict[bytes, Entry]:
    disk = store.tier("disk")
    assert isinstance(disk, DiskTier)
    return {bytes(k): e for k, e in disk.iter_entries()}


def _prompt(i: int, tokens: int = 64) -> list[int]:
    return [1000 * (i + 1) + t for t in range(tokens)]


def _open(path, now, **options) -> TieredStore:
    return TieredStore.open(path, host_bytes=0, clock=lambda: now[0], **options)


def test_a_five_minute_block_expires_and_a_day_long_one_stays(tmp_path, ns) -> None:
    now = [10_000.0]
    plain, five_min, day = _prompt(0), _prompt(1), _prompt(2)
    with _open(tmp_path, now, ttl_s=60) as store:
        for i, toks in enumerate((plain, five_min, day)):
            store.save(ns, toks, make_kv(ns, 64, seed=i))
        store.retain(ns, five_min, Retention(ttl_s=parse_duration("5m")))
        store.retain(ns, day, Retention(ttl_s=parse_duration("24h")))
        store.flush()
        now[0] += 120  # past the store's TTL: only the plain prompt is gone, before any sweep
        assert [store.lookup(ns, t).num_tokens for t in (plain, five_min, day)] == [0, 64, 64]
        assert store.gc()["expired"] == 4  # the plain prompt's 4 blocks
        now[0] += 250  # 370 s after the save: the 5-minute retention has lapsed
        assert [store.lookup(ns, t).num_tokens for t in (five_min, day)] == [0, 64]
        assert store.gc()["expired"] == 4
    now[0] += 80_000  # a restart, then most of a day later (idle since the save)
    with _open(tmp_path, now, ttl_s=60) as store:
        assert store.lookup(ns, day).num_tokens == 64
        n, kv = store.load(ns, day)  # a hit slides the retention on
        assert n == 64 and torch.equal(kv, make_kv(ns, 64, seed=2))
        store.flush()
        now[0] += 80_000
        assert store.lookup(ns, day).num_tokens == 64
        now[0] += 10_000  # a day and more since the last hit
        assert store.lookup(ns, day).num_tokens == 0
        assert store.gc()["expired"] == 4
        assert _entries(store) == {}


def test_retention_is_extended_never_shortened(tmp_path, ns) -> None:
    now = [10_000.0]
    toks = _prompt(0)
    with _open(tmp_path, now, ttl_s=60) as store:
        store.save(ns, toks, make_kv(ns, 64))
        store.retain(ns, toks, Retention(ttl_s=3600))
        store.flush()
        store.retain(ns, toks, Retention(ttl_s=300))  # a shorter ask later changes nothing
        store.flush()
        assert {e.retain_s for e in _entries(store).values()} == {3600.0}
        now[0] += 3000
        assert store.lookup(ns, toks).num_tokens == 64


def test_retention_asked_before_the_block_is_indexed_applies_once_it_is(tmp_path, ns) -> None:
    """The server asks right after the save, while the blocks are still in the writer's queue."""
    now = [10_000.0]
    toks = _prompt(0, 160)
    with _open(tmp_path, now, ttl_s=60) as store:
        store.save(ns, toks, make_kv(ns, 160))
        store.retain(ns, toks, Retention(ttl_s=7200), num_blocks=5)  # at once, no flush between
        store.flush()
        entries = _entries(store)
        chain_keys = [bytes(k) for k in _keys(ns, toks)]
        assert [entries[k].retain_s for k in chain_keys] == [7200.0] * 5 + [0.0] * 5


def _keys(ns, toks):
    from tierkv.keys import BlockChain

    return BlockChain.of(ns, toks).keys


def test_a_pin_survives_budget_pressure_that_evicts_everything_else(tmp_path, ns) -> None:
    now = [10_000.0]
    record = 4096  # one block of this namespace's KV is one 4 KiB page on disk
    with _open(tmp_path, now, ttl_s=3600, disk_bytes=40 * record, pin_bytes=8 * record) as store:
        pinned, kept = _prompt(0), _prompt(1)
        store.save(ns, pinned, make_kv(ns, 64, seed=0))
        store.check_pin(ns, pinned, 3600)
        store.retain(ns, pinned, Retention(pin_s=3600))
        store.save(ns, kept, make_kv(ns, 64, seed=1))
        store.retain(ns, kept, Retention(ttl_s=86400))
        store.flush()
        for i in range(2, 40):  # 38 prompts of 4 blocks into a budget of 40 blocks
            now[0] += 1
            store.save(ns, _prompt(i), make_kv(ns, 64, seed=i))
            store.flush()
        assert store.lookup(ns, pinned).num_tokens == 64
        n, kv = store.load(ns, pinned)
        assert n == 64 and torch.equal(kv, make_kv(ns, 64, seed=0))
        # A prompt a request asked to keep went after every block of the store's own retention
        assert store.lookup(ns, kept).num_tokens == 64
        assert store.lookup(ns, _prompt(2)).num_tokens == 0
        report = store.report()
        assert report["retention"]["pinned"]["blocks"] == 4
        assert report["retention"]["retained"]["blocks"] == 4
        # Once the pin ends the blocks are evictable again
        now[0] += 3700
        store.gc()
        for i in range(40, 50):
            now[0] += 1
            store.save(ns, _prompt(i), make_kv(ns, 64, seed=i))
            store.flush()
        assert store.lookup(ns, pinned).num_tokens == 0
        assert store.report()["retention"]["pinned"]["blocks"] == 0


def test_a_pin_over_the_budget_is_refused_and_pins_nothing(tmp_path, ns) -> None:
    now = [10_000.0]
    record = 4096
    with _open(tmp_path, now, disk_bytes=40 * record, pin_bytes=6 * record) as store:
        first, second = _prompt(0), _prompt(1)
        store.save(ns, first, make_kv(ns, 64))
        store.check_pin(ns, first, 60)
        store.retain(ns, first, Retention(pin_s=60))
        store.flush()
        with pytest.raises(PinBudgetError, match="pin budget"):
            store.check_pin(ns, second, 60)  # 4 + 4 blocks > 6
        store.check_pin(ns, first, 600)  # re-pinning what is pinned takes no more room
        store.check_pin(ns, second, 60, num_blocks=2)  # 4 + 2 fit
    with _open(tmp_path, now, disk_bytes=40 * record, pin_bytes=0) as store:
        with pytest.raises(PinBudgetError, match="no pin budget"):
            store.check_pin(ns, second, 60)


def test_pins_past_the_budget_when_written_are_not_taken_and_counted(tmp_path, ns) -> None:
    """Two processes may each pass the check; the transaction that writes the pins holds the line."""
    now = [10_000.0]
    record = 4096
    with _open(tmp_path, now, disk_bytes=40 * record, pin_bytes=6 * record) as store:
        a, b = _prompt(0), _prompt(1)
        for i, toks in enumerate((a, b)):
            store.save(ns, toks, make_kv(ns, 64, seed=i))
        store.flush()
        store.retain(ns, a, Retention(pin_s=60))  # no check_pin: as if another process had checked
        store.retain(ns, b, Retention(pin_s=60))
        store.flush()
        pinned = sum(bool(e.pin_until_s) for e in _entries(store).values())
        assert pinned == 6
        assert store.stats()["disk"]["pins_refused"] == 2


def test_memory_only_leaves_no_disk_record(tmp_path, ns) -> None:
    now = [10_000.0]
    toks = _prompt(0)
    with TieredStore.open(tmp_path, host_bytes=64 << 20, clock=lambda: now[0]) as store:
        store.save(ns, toks, make_kv(ns, 64), memory_only=True)
        store.flush()
        assert store.lookup(ns, toks).by_tier == {"host": 64, "disk": 0}
        assert _entries(store) == {}
        # A hit asking the same does not write it back either; a plain hit would
        hit, _ = store.restore(ns, toks, memory_only=True)
        assert hit.by_tier["host"] == 64
        store.flush()
        assert _entries(store) == {}
    with TieredStore.open(tmp_path, host_bytes=64 << 20, clock=lambda: now[0]) as store:
        assert store.lookup(ns, toks).num_tokens == 0  # nothing survived the restart


def _version_of(store: TieredStore) -> bytes:
    disk = store.tier("disk")
    assert isinstance(disk, DiskTier)
    with disk.index.read() as txn:
        return bytes(txn.get(b"format_version", db=disk.index.db["meta"]))


def _format_version(path: Path) -> bytes:
    env = lmdb.open(str(path / "index"), max_dbs=16, subdir=True, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return bytes(txn.get(b"format_version", db=env.open_db(b"meta", txn=txn, create=False)))
    finally:
        env.close()


def test_a_store_of_format_version_1_serves_and_takes_retention_once_upgraded(tmp_path, ns) -> None:
    """A cache directory written before per-block retention (by the previous build, committed as is). It
    stays format 1, readable by that build, until an operator upgrades it: a request cannot decide when
    older builds sharing the directory start to fail."""
    path = tmp_path / "old"
    path.mkdir()
    with tarfile.open(FIXTURES / "store-format-1.tar.gz") as tar:
        tar.extractall(path, filter="data")
    assert _format_version(path) == b"1"
    toks = list(range(64))
    now = [0.0]
    with TieredStore.open(path, host_bytes=0, ttl_s=3600, clock=lambda: now[0]) as store:
        now[0] = max(e.last_access_s for e in _entries(store).values()) + 60  # as if an hour had not passed
        n, kv = store.load(ns, toks)
        assert n == 64 and torch.equal(kv, make_kv(ns, 64, seed=3))
        assert store.lookup(ns, list(range(100, 132))).num_tokens == 32
        with pytest.raises(ConfigError, match="gc --upgrade"):
            store.check_retention()
        with pytest.raises(ConfigError, match="gc --upgrade"):
            store.forget(ns, toks)  # which prompts extend which is not known yet
        store.retain(ns, toks, Retention(ttl_s=7200))  # not written: the entries stay format 1
        store.flush()
        assert {e.retain_s for e in _entries(store).values()} == {0.0}
        assert _version_of(store) == b"1"
    r = CliRunner().invoke(main, ["gc", "--upgrade", "--ttl", "3650d", "--cache-dir", str(path)])
    assert r.exit_code == 0, r.output
    assert "upgraded from format 1 to 3" in r.output and "indexed for 6 blocks" in r.output
    assert _format_version(path) == str(STORE_FORMAT_VERSION).encode()
    with TieredStore.open(path, host_bytes=0, ttl_s=3600, clock=lambda: now[0]) as store:
        store.check_retention()
        store.retain(ns, toks, Retention(ttl_s=7200))
        store.flush()
        assert {e.retain_s for e in _entries(store).values()} == {7200.0, 0.0}
        # The parents found at the upgrade: a prompt sharing the first 3 blocks keeps them when the old
        # one is forgotten
        longer = toks[:48] + list(range(900, 932))
        store.save(ns, longer, make_kv(ns, 80, seed=9))
        store.flush()
        assert store.forget(ns, toks).kept_shared == 3
        assert store.lookup(ns, longer).num_tokens == 80


def test_max_age_sweeps_remove_blocks_of_every_class(tmp_path, ns) -> None:
    now = [10_000.0]
    with _open(tmp_path, now, ttl_s=60, max_age_s=600, disk_bytes=1 << 20) as store:
        for i in range(3):
            store.save(ns, _prompt(i), make_kv(ns, 64, seed=i))
        store.retain(ns, _prompt(1), Retention(ttl_s=3600))
        store.check_pin(ns, _prompt(2), 3600)
        store.retain(ns, _prompt(2), Retention(pin_s=3600))
        store.flush()
        for _ in range(13):  # keep all three in use past their max age
            now[0] += 50
            for i in range(3):
                store.lookup(ns, _prompt(i))
                store.load(ns, _prompt(i))
            store.flush()
        assert store.gc()["expired"] == 12
        assert _entries(store) == {}
        report = store.report()["retention"]
        assert report["pinned"]["blocks"] == report["retained"]["blocks"] == 0


def test_a_retention_shorter_than_the_store_ttl_is_no_ask(tmp_path, ns) -> None:
    now = [10_000.0]
    with _open(tmp_path, now, ttl_s=3600) as store:
        store.save(ns, _prompt(0), make_kv(ns, 64))
        store.retain(ns, _prompt(0), Retention(ttl_s=300))
        store.flush()
        assert {e.retain_s for e in _entries(store).values()} == {0.0}  # kept an hour anyway
        # Entries without a retention or a pin are the 64-byte format-1 entries
        assert _version_of(store) == str(STORE_FORMAT_VERSION).encode()  # (a new store: format 3)
        disk = store.tier("disk")
        with disk.index.read() as txn:
            assert {len(v) for _, v in txn.cursor(db=disk.index.db["index"])} == {ENTRY_V1.size}


def test_durations_and_retention_values_are_checked() -> None:
    assert parse_duration("5m") == 300 and parse_duration("1h") == 3600 and parse_duration("24h") == 86400
    assert parse_duration(90) == 90
    for bad in ("", "forever", "-5m", "0", "31d", "1e400", True):
        with pytest.raises(ConfigError):
            parse_duration(bad)
    with pytest.raises(ConfigError):
        Retention(ttl_s=float("nan"))
    assert Retention(ttl_s=300).merge(Retention(pin_s=60, memory_only=True)) == Retention(300, 60, True)


def test_pins_over_a_lowered_budget_are_not_extended(tmp_path, ns) -> None:
    """A restart with a smaller pin budget: the pins taken end as asked, none is extended meanwhile."""
    now = [10_000.0]
    record = 4096
    with _open(tmp_path, now, disk_bytes=40 * record, pin_bytes=8 * record) as store:
        for i in (0, 1):
            store.save(ns, _prompt(i), make_kv(ns, 64, seed=i))
            store.retain(ns, _prompt(i), Retention(pin_s=600))
        store.flush()
    with _open(tmp_path, now, disk_bytes=40 * record, pin_bytes=4 * record) as store:
        ends = {e.pin_until_s for e in _entries(store).values()}
        store.retain(ns, _prompt(0), Retention(pin_s=3600))
        store.flush()
        assert {e.pin_until_s for e in _entries(store).values()} == ends == {10_600.0}
        assert store.stats()["disk"]["pins_refused"] == 4
        now[0] += 700  # the pins ended: there is room again
        store.check_pin(ns, _prompt(0), 60)
