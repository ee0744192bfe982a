"""No wrong KV is saved when a load fails: the connector's worker side, step by step, one rank and two.

Each test drives ``WorkerSide`` with the metadata the scheduler side sends (``fake_engine.worker``: a real
store, vLLM's paged caches as tensors written through a probed layout), makes a load fail, "runs the
forward" by writing the pages vLLM would compute, and checks what reached the store. Two ranks run as two
processes over a gloo group, as vLLM's tensor-parallel CPU group is.
"""

from __future__ import annotations

import multiprocessing
import random
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_engine import LAYERS, B, D, H, request, scheduler
from fake_engine import worker as make_worker

P = random.Random(5).choices(range(3, 500), k=3 * B + 10)  # request A: 3 whole blocks
Q = P[: 3 * B] + random.Random(6).choices(range(3, 500), k=B + 5)  # request B: A's 3 blocks, then its own


def _span(req: str, tokens: list[int], first: int, ids: list[int], deps: list[int] = ()) -> Any:
    from tierkv.integrations.vllm.meta import BlockSpan

    end = first + len(ids)
    span = BlockSpan(req, tokens[: end * B], "", first, list(ids))
    span.deps = list(deps)  # (set apart: a span without the field is the code before the fix, which fails)
    return span


def _meta(loads: list = (), saves: list = (), checks: list = ()) -> Any:
    from tierkv.integrations.vllm.meta import TierKVMetadata

    meta = TierKVMetadata(loads=list(loads), saves=list(saves))
    meta.checks = list(checks)
    return meta


def _kv(blocks: int, seed: int) -> torch.Tensor:
    """Canonical KV ``[blocks, layers, 2, B, H, D]`` (what ``save_blocks`` takes)."""
    return torch.randn((blocks, LAYERS, 2, B, H, D), generator=torch.Generator().manual_seed(seed))


def _compute(w: Any, ids: list[int], kv: torch.Tensor) -> None:
    """The forward writes blocks ``ids`` of every layer (``kv`` canonical, block-major)."""
    w.layout.scatter(kv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3), w.caches, torch.tensor(ids))


def _stored(w: Any, tokens: list[int]) -> int:
    """Blocks of ``tokens`` the store holds, from block 0."""
    w.store.flush()
    return w.store.lookup(w.ns, tokens).num_blocks


def _holds(w: Any, tokens: list[int], block: int) -> bool:
    """Whether any tier holds block ``block`` of ``tokens`` (whatever precedes it)."""
    from tierkv.keys import BlockChain

    w.store.flush()
    chain = BlockChain.of(w.ns, tokens)
    return any(tier.probe(chain, [block])[0] for tier in w.store.tiers)


def _prepare(w: Any, blocks: int) -> torch.Tensor:
    """P's first ``blocks`` blocks in the store, as a cold prefill would have saved them."""
    kv = _kv(3, seed=1)
    w.store.save_blocks(w.ns, P[: blocks * B], kv[:blocks])
    w.store.flush()
    return kv


def test_a_request_that_read_a_failed_load_in_the_same_step_saves_nothing(tmp_path: Path) -> None:
    """One worker: vLLM registers A's loading blocks in its prefix cache at allocation, so B, scheduled in
    the same step, hits them. A's block 2 is not in the store (evicted after the lookup): B's block 3 was
    computed from garbage and must not be saved, although B's own load (none) did not fail."""
    w = make_worker(tmp_path)
    _prepare(w, 2)  # the scheduler saw 3 blocks; block 2 is gone by the load
    w.start_load(_meta(loads=[_span("A", P, 0, [10, 11, 12])]))
    _compute(w, [13], _kv(1, seed=9))  # B's block 3, attending to vLLM blocks 10..12
    w.save(_meta(loads=[_span("A", P, 0, [10, 11, 12])], saves=[_span("B", Q, 3, [13], [10, 11, 12])]))
    assert w.take_load_errors() == {12}
    assert not _holds(w, Q, 3)  # B's block 3 not saved
    assert w.stats["unsound_save_blocks"] == 1 and {12, 13} <= w.guard.tainted
    # The next step: vLLM recomputes A's block 2 (A rewound to it) and B's block 3 in the same forward.
    good = _kv(2, seed=2)
    _compute(w, [12, 13], good)
    w.save(_meta(saves=[_span("B", Q, 3, [13], [10, 11, 12]), _span("A", P, 2, [12], [10, 11])]))
    assert _stored(w, Q) == 4 and not w.guard.tainted  # both sound: A's recomputation is in the step
    hit, kv = w.store.restore(w.ns, Q[: 4 * B])
    assert torch.equal(kv[:, :, 3 * B :], good[1].permute(0, 1, 2, 3, 4))


def test_a_step_scheduled_on_top_of_a_failed_load_saves_nothing(tmp_path: Path) -> None:
    """Asynchronous scheduling plans step N+1 before step N's load errors reach the scheduler: A's next
    chunk (blocks 3..) is computed on top of the block that failed, and must not be saved."""
    w = make_worker(tmp_path)
    _prepare(w, 1)
    w.start_load(_meta(loads=[_span("A", Q, 0, [10, 11, 12])]))
    w.save(_meta(loads=[_span("A", Q, 0, [10, 11, 12])]))
    assert w.take_load_errors() == {11, 12}
    _compute(w, [13], _kv(1, seed=3))
    w.save(_meta(saves=[_span("A", Q, 3, [13], [10, 11, 12])]))
    assert not _holds(w, Q, 3) and w.stats["unsound_save_blocks"] == 1


def test_blocks_computed_from_a_self_checked_load_wait_for_the_check(tmp_path: Path) -> None:
    """A sampled load is reported failed so that vLLM recomputes it for the comparison; until then what the
    forward computed from it is not saved (were the restored blocks wrong, it would be too, and kept)."""
    w = make_worker(tmp_path)
    _prepare(w, 2)
    load = _span("A", Q, 0, [10, 11])
    load.check = True
    w.start_load(_meta(loads=[load]))
    _compute(w, [12], _kv(1, seed=4))
    w.save(_meta(loads=[load], saves=[_span("A", Q, 2, [12], [10, 11])]))
    assert w.take_load_errors() == {10, 11}  # so that vLLM recomputes them
    assert not _holds(w, Q, 2) and {10, 11, 12} <= w.guard.tainted
    # vLLM recomputes blocks 0..2 (A rewound to 0): the check agrees, and then they are saved.
    restored = w.layout.gather(w.caches, torch.tensor([10, 11]))
    _compute(w, [10, 11, 12], torch.cat([restored, _kv(1, seed=4)]))
    w.save(_meta(saves=[_span("A", Q, 0, [10, 11, 12])], checks=[_span("A", Q, 0, [10, 11])]))
    assert w.stats["check_blocks"] == 2 and w.stats["check_mismatch_blocks"] == 0
    assert _holds(w, Q, 2) and not w.guard.tainted and not w.checks.kept


def _step(conn: Any, meta: Any, forward) -> None:
    """One step as vLLM's model runner runs it: its connector context manager (the real one) around
    ``forward``, which writes pages or raises."""
    from types import SimpleNamespace

    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    out = SimpleNamespace(kv_connector_metadata=meta, has_sync_kv_loads=False, finished_req_ids=set())
    with KVConnectorModelRunnerMixin._get_kv_connector_output(out):
        forward()


@pytest.fixture
def connector(tmp_path: Path, monkeypatch) -> Any:
    """The connector (its worker side, ``fake_engine.worker``) installed as vLLM's, as an engine has it."""
    import vllm.v1.worker.kv_connector_model_runner_mixin as mixin
    from vllm.distributed.kv_transfer import kv_transfer_state

    from tierkv.integrations.vllm import TierKVConnector

    conn = TierKVConnector.__new__(TierKVConnector)
    conn._connector_metadata, conn._ambient_exc = None, None
    conn._worker, conn._scheduler = make_worker(tmp_path), None
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", conn)
    monkeypatch.setattr(mixin, "get_forward_context", lambda: None)
    return conn


def test_a_forward_that_raises_saves_nothing_of_its_step_or_after(connector) -> None:
    """vLLM calls wait_for_save in a ``finally`` around the forward: when the forward raises (out of
    memory, a kernel's error) before it wrote A's pages, they hold what an earlier request left there, and
    saving them would serve that under A's keys. Nothing of the step is saved, nor of later steps (a block
    the failed step began is finished by the next); what a whole step saved before stays."""
    w = connector._worker
    kv = _kv(3, seed=7)
    _step(connector, _meta(saves=[_span("A", P, 0, [10])]), lambda: _compute(w, [10], kv[:1]))
    for c in w.caches:
        c[11:13] = 3.0  # an earlier request's KV

    def fails() -> None:
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        _step(connector, _meta(saves=[_span("A", P, 1, [11, 12], [10])]), fails)
    _step(connector, _meta(saves=[_span("B", Q, 3, [13], [10, 11, 12])]), lambda: _compute(w, [13], kv[2:]))
    assert _stored(w, P) == 1 and not _holds(w, Q, 3)
    assert w.stats["save_blocks"] == 1 and w.stats["unsound_save_blocks"] == 3
    assert w.saves_off is not None and "out of memory" in w.saves_off


def test_an_exception_handled_around_the_step_is_not_the_forwards(connector) -> None:
    """vLLM run from inside an ``except`` block (an exception being handled as the step begins): a forward
    that completes saves as usual."""
    w = connector._worker
    try:
        raise KeyError("handled before the step")
    except KeyError:
        _step(connector, _meta(saves=[_span("A", P, 0, [10, 11])]), lambda: _compute(w, [10, 11], _kv(2, 8)))
    assert _stored(w, P) == 2 and w.saves_off is None


def test_a_saved_span_of_blocks_computed_before_its_step_is_not_saved_when_one_is_tainted(
    tmp_path: Path,
) -> None:
    """Blocks of vLLM's own hit that tierkv lacks are saved from vLLM's pages (scheduler.py): computed in an
    earlier step, not by this one, so the scheduler lists them among the span's deps and a tainted one
    keeps the span from being saved; a span the step computed makes its blocks clean instead."""
    w = make_worker(tmp_path)
    _compute(w, [10, 11], _kv(2, seed=5))
    w.guard.tainted = {11}  # a block whose load failed, not recomputed since
    cached = _span("A", P, 0, [10, 11], [10, 11])  # saved from vLLM's cache: not recomputed
    cached.cached = True
    w.save(_meta(saves=[cached]))
    assert _stored(w, P) == 0 and w.stats["unsound_save_blocks"] == 2
    assert w.guard.tainted == {11}  # block 10 is as it was: clean (a refused save taints nothing)
    w.save(_meta(saves=[_span("A", P, 0, [10, 11])]))  # the step computed them: clean, saved
    assert _stored(w, P) == 2 and not w.guard.tainted


def test_a_resave_is_planned_from_this_steps_lookup_only_and_within_what_vllm_computed(
    tmp_path: Path,
) -> None:
    """The save of vLLM's own hit where tierkv lacks it (scheduler.py ``_plan_resave``): a lookup that does
    not answer (paused after a store error) leaves none from an earlier step; a span covers only prompt
    blocks vLLM counted computed before the step, at most a step's worth at a time, and a prefix saved
    this way is not copied again by the next request within ``RESAVE_EVERY_S`` (a cold review: a stale
    one could have saved a block this step's forward only half wrote)."""

    from tierkv.integrations.vllm.meta import TierKVMetadata

    side = scheduler(tmp_path)
    prompt = P[: 3 * B] + [1, 2, 3]
    a = request("A", prompt)
    assert side.num_new_matched_tokens(a, 3 * B) == (0, False)  # vLLM holds 3 blocks, tierkv none
    r = side._reqs["A"]
    assert r.resave == (0, 3)
    side.lookups.paused_until = float("inf")  # lookups paused (a store error): a miss, no answer
    assert side.num_new_matched_tokens(a, 3 * B) == (0, False) and r.resave is None
    side.lookups.paused_until = 0.0

    def plan(req_id: str, computed: int) -> list[tuple[int, int]]:
        meta = TierKVMetadata()
        rr = side._reqs[req_id]
        rr.block_ids = list(range(20, 24))
        side._plan(meta, req_id, rr, computed, scheduled=1)
        return [(s.first, s.end) for s in meta.saves if s.cached]

    side.resaves.blocks_per_step = 2
    assert side.num_new_matched_tokens(a, 3 * B) == (0, False)
    assert plan("A", 2 * B + 5) == [(0, 2)]  # vLLM counted 2 whole blocks computed: not block 2
    other = random.Random(9).choices(range(3, 500), k=3 * B)
    side.num_new_matched_tokens(request("C", other + [7]), 3 * B)
    assert plan("C", 3 * B) == [(0, 2)]  # at most 2 a step ...
    assert plan("C", 3 * B + 1) == [(2, 3)]  # ... the rest at the next
    side.num_new_matched_tokens(request("D", other + [8]), 3 * B)
    assert plan("D", 3 * B) == []  # C saved that prefix just now: not copied again
    side.close()


def test_a_block_loaded_again_is_clean_again(tmp_path: Path) -> None:
    w = make_worker(tmp_path)
    _prepare(w, 1)
    w.start_load(_meta(loads=[_span("A", P, 0, [10, 11])]))
    w.save(_meta(loads=[_span("A", P, 0, [10, 11])]))
    assert w.guard.tainted == {11}
    _prepare(w, 2)
    w.start_load(_meta(loads=[_span("C", P, 0, [10, 11])]))
    w.save(_meta(loads=[_span("C", P, 0, [10, 11])]))
    assert not w.guard.tainted and not w.take_load_errors() - {11}


def test_a_scatter_that_raises_is_a_load_error_not_a_failed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's step must not raise because a scatter did (it was outside the worker's try): every block of
    the span is reported and recomputed, and tainted (its pages may be half written)."""
    w = make_worker(tmp_path)
    _prepare(w, 3)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("view size is not compatible with input tensor's size and stride")

    monkeypatch.setattr(w.layout, "scatter", broken)
    w.start_load(_meta(loads=[_span("A", P, 0, [10, 11, 12])]))
    w.save(_meta(loads=[_span("A", P, 0, [10, 11, 12])]))
    assert w.take_load_errors() == {10, 11, 12} and w.guard.tainted == {10, 11, 12}


def test_a_store_that_raises_on_restore_is_a_load_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make_worker(tmp_path)
    _prepare(w, 3)

    def eio(*args: Any, **kwargs: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(w.store, "restore", eio)
    w.start_load(_meta(loads=[_span("A", P, 1, [11, 12])]))
    w.save(_meta(loads=[_span("A", P, 1, [11, 12])]))
    assert w.take_load_errors() == {11, 12}


def test_a_store_unreadable_for_a_requests_cache_control_serves_it_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler side reads the disk index for a request with cache control (its pin and retention
    budgets), on vLLM's scheduler thread, where any exception ends the engine: an LMDB error there (the
    reader table full, an unreadable page) serves the request without its cache control."""
    import lmdb

    side = scheduler(tmp_path)
    disk = side.store.tier("disk")

    def full(*args: Any, **kwargs: Any) -> None:
        raise lmdb.ReadersFullError("mdb_txn_begin: MDB_READERS_FULL")

    monkeypatch.setattr(disk, "check_retention", full)
    asked = request("B", list(range(300)), kv_transfer_params={"tierkv": {"retention": "2h"}})
    assert side.num_new_matched_tokens(asked, 0) == (0, False)
    assert side._reqs["B"].control.prefixes == ()  # served, without the retention it asked for
    # One that also asked to keep its prompt off disk saves nothing
    private = {
        "prompt_cache_retention": "in_memory",
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    }
    asked = request("P", list(range(300)), kv_transfer_params=private)
    assert side.num_new_matched_tokens(asked, 0) == (0, False)
    assert side._reqs["P"].control.no_store


def test_a_cache_control_not_understood_that_asked_to_keep_the_prompt_off_disk_saves_nothing(
    tmp_path: Path,
) -> None:
    """vLLM cannot refuse a request from the connector, so a cache control it cannot parse is ignored and
    the request served; but one that asked for ``in_memory`` or ``no_store`` beside what failed saves
    nothing, where ignoring it would have written a prompt its client wanted off disk (a cold review: the
    front let such a split request through). Others are served without their control, as before."""
    side = scheduler(tmp_path)
    for n, params in enumerate(
        (
            {"prompt_cache_retention": "in_memory", "tierkv": {"pin": "1h"}},  # refused together
            {"prompt_cache_retention": "in_memory", "tierkv": {"bogus": 1}},
            {"tierkv": {"no_store": True, "bogus": 1}},
            {"tierkv": {"no_store": "yes", "pin": "1h"}},
        )
    ):
        side._request(request(f"R{n}", P, kv_transfer_params=params))
        control = side._reqs[f"R{n}"].control
        assert control.no_store and not control.prefixes, params
    side._request(request("plain", P, kv_transfer_params={"tierkv": {"bogus": 1}}))
    assert not side._reqs["plain"].control.no_store  # (the control ignored, the prompt saved)


def test_a_prefix_vllm_holds_itself_is_kept_recent_for_every_rank(tmp_path: Path) -> None:
    """Each tensor-parallel rank saves its own shard under its own namespace; the scheduler side looks up
    rank 0's, and keeps every rank's blocks of a prefix vLLM serves from its own cache recent."""
    import time

    from tierkv.keys import BlockChain

    side = scheduler(tmp_path, tp=2)
    assert [ns.revision.rsplit("+", 1)[-1] for ns in side.rank_base_ns] == ["tp0of2", "tp1of2"]
    prompt = P[: 2 * B]
    for ns in side.rank_base_ns:
        side.store.save_blocks(ns, prompt, _kv(2, seed=3))
    side.store.flush()
    disk = side.store.tier("disk")
    later = time.time() + 3600.0
    disk.clock = lambda: later
    assert side.num_new_matched_tokens(request("A", prompt + [1, 2, 3]), 2 * B) == (0, False)
    side.lookups.settle()  # (the refresh runs on the lookup thread, after the lookup's answer)
    for ns in side.rank_base_ns:
        assert [disk.times.last(k).t for k in BlockChain.of(ns, prompt).keys] == [later] * 2


def test_a_pin_asked_for_a_prefix_vllm_holds_itself_is_taken(tmp_path: Path) -> None:
    """A prompt sent once without cache control, then again with a pin while vLLM's prefix cache still
    holds it: vLLM loads and saves nothing of it, and the pin was silently lost (from a new user's
    trial). The scheduler side gives the pin to the blocks of vLLM's own hit that tierkv holds."""
    import time

    from tierkv.tiers.disk.schema import Entry

    side = scheduler(tmp_path)
    prompt = P[: 2 * B]
    side.store.save_blocks(side.ns, prompt, _kv(2, seed=3))
    side.store.flush()
    pinned = request("A", prompt + [1, 2, 3], kv_transfer_params={"tierkv": {"pin": "2h"}})
    assert side.num_new_matched_tokens(pinned, 2 * B) == (0, False)  # vLLM holds it all
    side.lookups.settle()  # (the pin is given on the lookup thread, after the lookup's answer)
    side.store.flush()
    disk = side.store.tier("disk")
    entries: list[Entry] = [e for _, e in disk.iter_entries()]
    assert len(entries) == 2 and all(e.pin_until_s > time.time() + 7000 for e in entries)


def test_keeping_held_prefixes_recent_never_holds_a_lookup_and_stays_bounded(tmp_path: Path) -> None:
    """The refresh of what vLLM holds runs beside the lookups, not before them (a cold review measured
    124-186 ms of it at 32K tokens and 8 ranks, each lookup behind it deferred a step): a lookup answers
    at once while that work is stuck; the same prefix is refreshed at most once a second, and a burst
    beyond the queue's bound is dropped and counted. A request's pin or retention, which nothing else
    gives the blocks vLLM holds, is never dropped for a burst of refreshes, goes before them, and is given
    at a stop, where refreshes still queued are not (a second cold review: under load a pin was dropped,
    and a stop waited for every refresh)."""
    import threading

    from tierkv.integrations.vllm import lookups as lookups_mod

    side = scheduler(tmp_path)
    prompt = P[: 2 * B]
    side.store.save_blocks(side.ns, prompt, _kv(2, seed=3))
    side.store.flush()
    stuck, ran = threading.Event(), []
    side.lookups.after(None, stuck.wait)  # the refresh thread is busy
    assert side.num_new_matched_tokens(request("A", prompt + [1]), 0) == (2 * B, False)  # answered at once
    side.lookups.after("k", lambda: ran.append(1))
    side.lookups.after("k", lambda: ran.append(2))  # the same key within a second: skipped
    side.lookups.after("last", lambda: ran.append(3))
    for _ in range(lookups_mod.MAX_AFTER_PENDING):
        side.lookups.after(None, lambda: None)
    assert side.lookups.errors.get("after_dropped", 0) >= 1
    side.lookups.after("k", lambda: ran.append("pin"), control=True)  # past the refreshes' bound: kept
    side.lookups.after("k", lambda: ran.append("pin again"), control=True)  # (never skipped as recent)
    assert "after_control_dropped" not in side.lookups.errors
    stuck.set()
    side.lookups.settle()
    assert ran == ["pin", "pin again", 1, 3]  # the controls first
    # A stop while it is all still queued: the controls given before the store goes, no refresh
    stuck.clear()
    ran.clear()
    side.lookups.after(None, stuck.wait)
    side.lookups.after("r", lambda: ran.append("refresh"))
    side.lookups.after(None, lambda: ran.append("retention"), control=True)
    threading.Timer(0.2, stuck.set).start()
    side.close()
    assert ran == ["retention"]


def test_a_reset_forgets_the_self_check_copies_of_the_requests_it_drops(tmp_path: Path) -> None:
    """A reset drops the scheduler side's requests (their chains were made in the old namespace); the
    workers' self-check copies of their restored blocks are forgotten with them, in the next step's
    metadata, not kept until the copies' memory limit stops all sampling."""
    from types import SimpleNamespace

    side = scheduler(tmp_path)
    r = side._request(request("A", P[: 2 * B] + [1]))
    r.check = (0, 2)  # a sampled load, not yet compared
    side._request(request("C", Q))
    assert side.reset()
    idle = SimpleNamespace(
        total_num_scheduled_tokens=0,
        num_scheduled_tokens={},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )
    meta = side.build_meta(idle)
    assert meta.forget == ["A"]


# ---------------------------------------------------------------------------------------------- two ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, tmp: str, out: Any) -> None:
    try:
        import torch.distributed as dist

        import tierkv.integrations.vllm.worker as worker_module
        from tierkv.integrations.vllm.guard import RankGroup

        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        worker_module.tp_group = lambda size: RankGroup(dist.group.WORLD, 2, rank)
        w = make_worker(Path(tmp), tp=2)
        assert w.ranks.size == 2 and f"tp{rank}of2" in w.ns.revision
        _prepare(w, 3 if rank == 0 else 2)  # rank 1 lost block 2 (each rank evicts on its own)
        load = _span("A", P, 0, [10, 11, 12])
        w.start_load(_meta(loads=[load]))
        _compute(w, [13], _kv(1, seed=9 + rank))  # through the all-reduce, rank 0 read rank 1's garbage
        w.save(_meta(loads=[load], saves=[_span("B", Q, 3, [13], [10, 11, 12])]))
        errors = w.take_load_errors()
        stored = _holds(w, Q, 3)
        _compute(w, [12, 13], _kv(2, seed=20 + rank))  # vLLM recomputes A's block 2 and B's block 3
        w.save(_meta(saves=[_span("B", Q, 3, [13], [10, 11, 12]), _span("A", P, 2, [12], [10, 11])]))
        out.put((rank, sorted(errors), stored, _stored(w, Q), w.stats["unsound_save_blocks"]))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_two_ranks_agree_that_a_load_failed_on_one_of_them(tmp_path: Path) -> None:
    """Tensor parallelism: the scheduler looks up rank 0's namespace only; rank 1's block 2 is gone. Rank 0's
    own load succeeds, but its forward read rank 1's unloaded pages through the all-reduce: neither rank may
    save what this step computed, and vLLM hears of the failed block."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    results = {r[0]: r[1:] for r in got}
    for rank, result in results.items():
        assert len(result) == 4, f"rank {rank} failed:\n{result[0]}"
    assert results[0][0] == [] and results[1][0] == [12]  # vLLM unions the ranks' reports
    for rank in (0, 1):
        _, stored_after_failure, stored_after_recompute, unsound = results[rank]
        assert not stored_after_failure  # B's block 3 saved by neither rank
        assert unsound == 1
        assert stored_after_recompute == 4  # saved once recomputed from sound pages


# ---------------------------------------------------------------------------------------------- lookups


def test_a_lookup_that_fails_is_a_miss_logged_once_with_a_back_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """LMDB's reader table full, a store that cannot reopen, EIO: the scheduler's lookup is on vLLM's
    scheduling loop, where an exception kills the engine. A miss instead, one log line per kind, and no
    lookups for a while after a failure."""
    import lmdb

    side = scheduler(tmp_path)
    calls = []

    def failing(*args: Any) -> None:
        calls.append(1)
        raise lmdb.ReadersFullError("mdb_txn_begin: MDB_READERS_FULL")

    monkeypatch.setattr(side.store, "lookup", failing)
    with caplog.at_level("WARNING", logger="vllm.tierkv"):
        assert side.num_new_matched_tokens(request("A", P), 0) == (0, False)
        assert side.num_new_matched_tokens(request("B", P), 0) == (0, False)  # paused: not even asked
    assert len(calls) == 1 and side.lookups.errors == {"ReadersFullError": 1, "skipped": 1}
    assert sum("lookup failed" in r.message for r in caplog.records) == 1
    monkeypatch.undo()
    side.lookups.paused_until = 0.0  # the back-off is over
    assert side.num_new_matched_tokens(request("C", P), 0) == (0, False)  # a plain miss again
    side.close()


def test_a_vllm_whose_requests_lack_a_field_turns_the_connector_off(tmp_path: Path) -> None:
    """Without ``mm_features`` a request with an image would read as text only (its placeholder tokens do
    not name the image): the connector must not guess."""
    side = scheduler(tmp_path)
    assert side.num_new_matched_tokens(request("A", P, mm_features=...), 0) == (0, False)
    assert side.off and "mm_features" in side.off
    assert side.num_new_matched_tokens(request("B", P), 0) == (0, False)  # and stays off
    side.close()


def _absent_rank(rank: int, port: int, out: Any) -> None:
    try:
        import time

        import torch.distributed as dist

        from tierkv.integrations.vllm.guard import RankGroup, RanksDisagree

        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        if rank == 1:  # its forward raised: it never reaches the agreement
            time.sleep(6)
            out.put((rank, "absent"))
            return
        t0 = time.monotonic()
        try:
            RankGroup(dist.group.WORLD, 2, 0, timeout_s=2.0).union({3})
            out.put((rank, "agreed"))
        except RanksDisagree:
            out.put((rank, f"disagree after {time.monotonic() - t0:.1f} s"))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_a_rank_that_never_comes_is_a_bounded_wait_not_a_hang() -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_absent_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert results[1] == "absent"
    assert results[0].startswith("disagree after"), results[0]
    assert float(results[0].split()[2]) < 5.0


def test_a_rank_lost_between_the_flag_and_the_exchange_is_out_of_step_not_a_crash(monkeypatch) -> None:
    """The failed ids travel in a second collective: a rank gone between the two (the gather raises) is
    the same as one that never came, ``RanksDisagree``, which turns the connector off on this worker,
    not an exception out of vLLM's wait_for_save."""
    import torch.distributed as dist

    from tierkv.integrations.vllm.guard import RankGroup, RanksDisagree

    class Done:
        def wait(self, timeout: Any) -> bool:
            return True

    def all_reduce(flag: torch.Tensor, **kwargs: Any) -> Done:
        flag.fill_(1)  # some rank has failed loads
        return Done()

    def all_gather_object(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    with pytest.raises(RanksDisagree, match="did not exchange"):
        RankGroup(group=object(), size=2, rank=0).union({3})
