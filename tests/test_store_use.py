"""The store in an engine builder's hands (from such a user's trial): a store never closed, a close beside
saves, a store used after its close, token ids and options of the wrong kind. Each was silent, lost
data, or could serve another prompt's KV before."""

from __future__ import annotations

import threading
from collections import UserDict

import numpy as np
import pytest
import torch

from tierkv import ConfigError, Namespace, StoreClosedError, TieredStore

from helpers import make_kv, run_python


def test_a_store_never_closed_is_flushed_at_exit_and_says_so(tmp_path) -> None:
    r = run_python(f"""
        import torch
        from tierkv import Namespace, TieredStore
        ns = Namespace("m", "r", "float32", 2, 2, 8, block_tokens=4)
        store = TieredStore.open({str(tmp_path)!r}, host_bytes=1 << 20)
        store.save(ns, list(range(16)), torch.ones(2, 2, 16, 2, 8))
        # the program ends here, its store never closed
    """)
    assert r.returncode == 0, r.stderr
    assert "a store was still open at exit: closed now, its saves flushed to disk" in r.stderr, r.stderr
    ns = Namespace("m", "r", "float32", 2, 2, 8, block_tokens=4)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        assert store.lookup(ns, list(range(16))).by_tier["disk"] == 16  # lost before


def test_a_save_beside_a_close_lands_whole_or_raises(tmp_path, ns) -> None:
    """Saves racing a close: each either returned and is on disk after a reopen, or raised
    StoreClosedError (before, one returned and its blocks never reached the disk)."""
    prompts = [[1000 * p + t for t in range(4 * ns.block_tokens)] for p in range(60)]
    kv = make_kv(ns, 4 * ns.block_tokens, seed=1)
    store = TieredStore.open(tmp_path, host_bytes=1 << 20)
    landed: list[list[int]] = []
    refused: list[BaseException] = []
    go = threading.Barrier(4)

    def saver(part: int) -> None:
        go.wait()
        for toks in prompts[part::3]:
            try:
                store.save(ns, toks, kv)
            except StoreClosedError as exc:
                refused.append(exc)
                continue
            landed.append(toks)

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    go.wait()
    store.close()
    for t in threads:
        t.join()
    assert len(landed) + len(refused) == len(prompts)
    with TieredStore.open(tmp_path, host_bytes=0) as again:
        missing = [t[0] for t in landed if again.lookup(ns, t).num_tokens != len(t)]
    assert missing == []


def test_a_closed_store_refuses_every_use_with_one_error(tmp_path, ns) -> None:
    """After close: StoreClosedError, where a save met LMDB's own error and a load from the host tier was
    served as if the store were open. A second close does nothing."""
    toks = list(range(2 * ns.block_tokens))
    for path in (tmp_path, None):
        store = TieredStore.open(path, host_bytes=1 << 20)
        store.save(ns, toks, make_kv(ns, len(toks)))
        store.close()
        for use in (
            lambda s: s.save(ns, toks, make_kv(ns, len(toks))),
            lambda s: s.lookup(ns, toks),
            lambda s: s.load(ns, toks),
            lambda s: s.flush(),
        ):
            with pytest.raises(StoreClosedError, match="the store is closed"):
                use(store)
        store.close()


def test_token_ids_must_be_one_prompts_integers(ns) -> None:
    """A tokenizer's ``[1, T]`` batch read as a one-token prompt (nothing saved, every lookup a miss,
    silently), and float ids as the integers they round down to: another prompt's blocks."""
    toks = list(range(3 * ns.block_tokens))
    with TieredStore.open(None, host_bytes=1 << 20) as store:
        store.save(ns, toks, make_kv(ns, len(toks)))
        for bad, says in (
            (torch.tensor([toks]), rf"1-D; got shape \[1, {len(toks)}\]"),
            (np.array(toks) + 0.5, "must be integers, got float64"),
            (torch.tensor(toks, dtype=torch.float32), "must be integers, got float32"),
            ("hello", "got str"),
            ((t for t in toks), "got generator"),
            (UserDict(input_ids=toks), "a tokenizer's encoding: pass its input_ids"),
        ):
            with pytest.raises(ConfigError, match=says):
                store.lookup(ns, bad)
            with pytest.raises(ConfigError, match=says):
                store.save(ns, bad, make_kv(ns, len(toks)))
        # what is one prompt's integers, in any of its forms, is the same prompt
        for good in (toks, tuple(toks), np.array(toks), np.array(toks, dtype=np.uint32), torch.tensor(toks)):
            assert store.lookup(ns, good).num_tokens == len(toks)


def test_open_refuses_options_it_does_not_take_and_reads_sizes_as_text(tmp_path) -> None:
    """A misspelt ``ttl`` was ignored (blocks never expired) on a memory-only store, and a TypeError
    naming an internal class with a path; sizes and durations as the command line writes them."""
    for path in (None, tmp_path):
        with pytest.raises(ConfigError, match="unknown option.*ttl; it takes .*ttl_s"):
            TieredStore.open(path, ttl=5)
    with pytest.raises(ConfigError, match="disk_bytes given for a store without a disk tier"):
        TieredStore.open(None, disk_bytes=1 << 20)
    with pytest.raises(ConfigError, match="host_bytes: bad size 'lots'"):
        TieredStore.open(None, host_bytes="lots")
    with pytest.raises(ConfigError, match="host_bytes must be a number of bytes"):
        TieredStore.open(None, host_bytes=1.5)
    with TieredStore.open(tmp_path, host_bytes="1MiB", disk_bytes="64MiB", ttl_s="2h") as store:
        line = " ".join(store.describe())
    assert "host 1.0 MiB" in line and "disk 64.0 MiB" in line and "ttl 7200s" in line, line


def test_a_namespace_takes_integers_for_its_shape() -> None:
    """``num_layers=4.0`` named another namespace than 4 (its digest hashed '4.0'); a numpy integer, what
    a model's config may hold, is the int it is."""
    base = {"model_id": "m", "revision": "r", "dtype": "float32", "num_kv_heads": 2, "head_dim": 8}
    for bad in ("4", 4.0, True):
        with pytest.raises(ConfigError, match="num_layers must be an integer"):
            Namespace(**base, num_layers=bad)
    assert Namespace(**base, num_layers=np.int64(4)).digest == Namespace(**base, num_layers=4).digest


def test_a_dropped_store_is_collected_and_a_call_inside_a_call_goes_on_while_closing(tmp_path, ns) -> None:
    """From the change's cold review: the exit's registry held every store until closed (a program that
    drops unclosed stores grew without bound); a call made inside another (a restore's refresh of the
    blocks it was given, from ``start_block``) was refused once a close began, though the close was
    waiting for the outer one; a close from inside a call (a signal handler's) waited 30 s for itself."""
    import gc
    import time
    import weakref

    store = TieredStore.open(None, host_bytes=1 << 20)
    store.save(ns, list(range(ns.block_tokens)), make_kv(ns, ns.block_tokens))
    dropped = weakref.ref(store)
    del store
    gc.collect()
    assert dropped() is None

    toks = list(range(3 * ns.block_tokens))
    store = TieredStore.open(tmp_path, host_bytes=0)
    store.save(ns, toks, make_kv(ns, len(toks)))
    store.flush()
    entered, release = threading.Event(), threading.Event()
    check_kv = store._check_kv

    def slow_check(*args, **kwargs):  # the restore is in flight, its refresh still to come
        entered.set()
        release.wait(10)
        return check_kv(*args, **kwargs)

    store._check_kv = slow_check
    out = torch.zeros_like(make_kv(ns, len(toks)))
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(store.restore(ns, toks, out, start_block=1)[0]))
    reader.start()
    assert entered.wait(10)
    closer = threading.Thread(target=store.close)
    closer.start()
    time.sleep(0.2)
    release.set()
    reader.join(10)
    closer.join(10)
    assert got and got[0].num_tokens == len(toks), got  # the refresh inside it went on
    assert not closer.is_alive()

    store = TieredStore.open(tmp_path, host_bytes=0)
    disk = store.tier("disk")
    probe = disk.probe

    def closing_probe(*args, **kwargs):  # as a signal handler run inside the lookup would
        store.close()
        return probe(*args, **kwargs)

    disk.probe = closing_probe
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - whatever the closed tier says: the close returned first
        store.lookup(ns, toks)
    assert time.monotonic() - t0 < 5.0


def test_a_second_close_waits_for_the_first_and_a_failing_step_closes_the_rest(tmp_path, ns) -> None:
    """A close beside another returned before the first had flushed (a caller exiting then lost saves);
    a close whose write-behind raised left every tier open (the owners lock held), and a retry did
    nothing."""
    import fcntl
    import os
    import time

    store = TieredStore.open(tmp_path, host_bytes=1 << 20)
    slow_close = store.writes.close
    ended: dict[str, float] = {}

    def slow() -> None:
        time.sleep(0.5)
        slow_close()
        ended["first"] = time.monotonic()

    store.writes.close = slow
    first = threading.Thread(target=store.close)
    first.start()
    time.sleep(0.1)
    store.close()
    ended["second"] = time.monotonic()
    first.join()
    assert ended["second"] >= ended["first"]

    store = TieredStore.open(tmp_path, host_bytes=1 << 20)

    def broken() -> None:
        raise RuntimeError("the write-behind failed to stop")

    store.writes.close = broken
    with pytest.raises(RuntimeError, match="failed to stop"):
        store.close()
    fd = os.open(tmp_path / "owners.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the disk tier closed all the same
    finally:
        os.close(fd)


def test_the_vllm_connectors_store_is_flushed_at_exit_without_the_advice(tmp_path) -> None:
    """The connector closes its store itself (release_store, or its own exit hook): the exit's advice to
    close the store is not for its users."""
    r = run_python(f"""
        import torch
        from tierkv import Namespace
        from tierkv.integrations.vllm.options import ConnectorOptions, shared_store
        ns = Namespace("m", "r", "float32", 2, 2, 8, block_tokens=4)
        store = shared_store(ConnectorOptions(cache_dir={str(tmp_path)!r}, host_bytes=1 << 20))
        store.save(ns, list(range(16)), torch.ones(2, 2, 16, 2, 8))
    """)
    assert r.returncode == 0 and "still open at exit" not in r.stderr, r.stderr
    ns = Namespace("m", "r", "float32", 2, 2, 8, block_tokens=4)
    with TieredStore.open(tmp_path, host_bytes=0) as store:
        assert store.lookup(ns, list(range(16))).by_tier["disk"] == 16


def test_a_disk_budget_below_one_block_drops_its_saves_counted_and_says_so(tmp_path, ns, caplog) -> None:
    """A store of the Python API whose disk budget cannot hold one block kept nothing, and flush said
    nothing was lost (the server says it at start-up, where it knows the model)."""
    toks = list(range(4 * ns.block_tokens))
    with TieredStore.open(tmp_path, host_bytes=0, disk_bytes=1000) as store:
        store.save(ns, toks, make_kv(ns, len(toks)))
        assert store.flush() == 4
        assert store.lookup(ns, toks).num_tokens == 0
    assert "smaller than one block" in caplog.text
