"""TierKVConnector driven by vLLM's own machinery, without a model forward: vLLM's ``KVConnectorFactory``
builds it for both roles, a real v1 ``Scheduler`` (and ``AsyncScheduler``) runs requests through it step
by step on model-runner outputs built here, and vLLM's worker-side lifecycle
(``KVConnectorModelRunnerMixin``) runs its worker role. The store is a real ``TieredStore`` on a tmp dir.

In the spirit of vLLM's ``tests/v1/kv_connector/unit/`` (factory, lifecycle, invalid-block tests), written
for tierkv against the vLLM in ``.venv-vllm`` (0.32): what the scheduler offers, loads and saves, what
vLLM does when a load fails (with ``kv_load_failure_policy`` ``recompute`` and ``fail``, with and without
async scheduling), reset, shutdown, and a connector that turned itself off.
"""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # conftest.py skips the directory's tests; nothing to import
    pytest.skip("needs vLLM", allow_module_level=True)

from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402

from tierkv.integrations.vllm import TierKVConnector  # noqa: E402
from tierkv.keys import BlockChain  # noqa: E402
from tierkv.layout import KVSpec  # noqa: E402
from tierkv.store import TieredStore  # noqa: E402
from tierkv.tenancy import namespace_salt  # noqa: E402

B = 16  # vLLM's block size here (tokens per block, tierkv's block_tokens)
NUM_BLOCKS = 64
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]  # the test model's attention layers
TOKEN = 7  # what the "model" samples


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def _config(
    model_dir: Path,
    cache_dir: Path,
    *,
    policy: str = "recompute",
    batched_tokens: int | None = None,
    async_scheduling: bool = False,
    options: dict[str, Any] | None = None,
) -> VllmConfig:
    """The engine's ``VllmConfig`` as ``LLM(...)`` makes it for the test model, with the connector."""
    extra = {
        "cache_dir": str(cache_dir),
        "host_bytes": "32MiB",
        "disk_bytes": "64MiB",
        "ttl_s": None,
        "sweep_interval_s": 0,
        "sync": False,
        "self_check_rate": 0,  # no sampled self-check: the loads planned here are exactly the hits
        "lookup_wait_s": 5.0,  # lookups answer at once here (a slow one is its own test)
        **(options or {}),
    }
    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        seed=0,
        block_size=B,
        kv_transfer_config=KVTransferConfig(
            kv_connector="TierKVConnector",
            kv_connector_module_path="tierkv.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy=policy,
            kv_connector_extra_config=extra,
        ),
        **({"max_num_batched_tokens": batched_tokens} if batched_tokens else {}),
    )
    config = args.create_engine_config()
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    if async_scheduling:  # vLLM's default on GPUs; the CPU platform turns it off
        config.scheduler_config.async_scheduling = True
    return config


def _kv_cache_config(spec: KVCacheSpec | None = None) -> KVCacheConfig:
    """What the engine core resolves for the test model on CPU (one full-attention group, LBHNC)."""
    spec = spec or FullAttentionSpec(block_size=B, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        kv_cache_layout="LBHNC",
    )


class Engine:
    """A vLLM scheduler built as ``EngineCore`` builds it, stepped by hand: ``schedule`` then ``finish_step``
    with the output a model runner would return (a sampled token for each scheduled request that reaches
    the end of its prompt; no forward runs)."""

    def __init__(self, config: VllmConfig, kv_cache_config: KVCacheConfig | None = None) -> None:
        self.config = config
        self.kv_cache_config = kv_cache_config or _kv_cache_config()
        block_size, hash_block_size = resolve_kv_cache_block_sizes(self.kv_cache_config, config)
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(hash_block_size, hash_fn)
        self.scheduler: Scheduler = config.scheduler_config.get_scheduler_cls()(
            vllm_config=config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=True,
        )
        self.worker: TierKVConnector | None = None
        self._samples: dict[int, set[str]] = {}

    @property
    def connector(self) -> TierKVConnector:
        assert isinstance(self.scheduler.connector, TierKVConnector)
        return self.scheduler.connector

    def make_worker(self, monkeypatch: pytest.MonkeyPatch) -> TierKVConnector:
        """The worker-role connector, installed where vLLM's model runner finds it (``get_kv_transfer_group``)."""
        worker = KVConnectorFactory.create_connector(
            self.config, KVConnectorRole.WORKER, self.kv_cache_config
        )
        assert isinstance(worker, TierKVConnector)
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", worker)
        self.worker = worker
        return worker

    def add(self, rid: str, tokens: list[int], *, max_tokens: int = 2, salt: str | None = None) -> Request:
        request = Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            cache_salt=salt,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(request)
        return request

    def schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        # The requests that sample this step: a prefill chunk that does not reach the prompt's end does not.
        self._samples[id(out)] = {
            rid for rid in out.num_scheduled_tokens if not self.scheduler.requests[rid].is_prefill_chunk
        }
        return out

    def run_worker(self, out: SchedulerOutput) -> KVConnectorOutput | None:
        """vLLM's worker-side connector lifecycle for one step (bind the metadata, load, save, collect the
        load errors, clear), as the model runner runs it around a forward."""
        if self.worker is None:
            return None
        result = KVConnectorModelRunnerMixin.kv_connector_no_forward(out, self.config)
        assert not self.worker.has_connector_metadata()
        return result.kv_connector_output

    def finish_step(
        self,
        out: SchedulerOutput,
        *,
        invalid: set[int] | None = None,
        kv_output: KVConnectorOutput | None = None,
        token: int = TOKEN,
    ) -> dict[str, list[int]]:
        """The model runner's output for ``out`` (one token for each request that samples, the worker's
        ``kv_output`` or the ``invalid`` block ids); returns the tokens vLLM emitted, per request."""
        if kv_output is None and invalid:
            kv_output = KVConnectorOutput(invalid_block_ids=set(invalid))
        ids = list(out.num_scheduled_tokens)
        samples = self._samples.pop(id(out))
        runner_output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[token] if rid in samples else [] for rid in ids],
            kv_connector_output=kv_output,
        )
        emitted: dict[str, list[int]] = {}
        for outputs in self.scheduler.update_from_output(out, runner_output).values():
            for o in outputs.outputs:
                emitted.setdefault(o.request_id, []).extend(o.new_token_ids)
        return emitted

    def step(self) -> tuple[SchedulerOutput, dict[str, list[int]]]:
        out = self.schedule()
        return out, self.finish_step(out, kv_output=self.run_worker(out))

    def run_to_completion(self, max_steps: int = 30) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError("requests still unfinished")

    def block_ids(self, out: SchedulerOutput, rid: str) -> list[int]:
        return next(list(new.block_ids[0]) for new in out.scheduled_new_reqs if new.req_id == rid)

    def assert_idle(self) -> None:
        """vLLM's bookkeeping after every request finished: nothing tracked, every block free."""
        s = self.scheduler
        assert not s.requests and not s.running and len(s.waiting) == 0
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
        manager = s.kv_cache_manager.coordinator.single_type_managers[0]
        assert not manager.req_to_blocks and not manager.num_cached_block
        pool = s.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == NUM_BLOCKS - 1  # all but the null block
        assert all(block.ref_cnt == 0 for block in pool.blocks if block is not pool.null_block)

    def close(self) -> None:
        self.scheduler.shutdown()  # the scheduler-role connector's shutdown
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


@pytest.fixture
def engines(model_dir: Path, tmp_path: Path):  # noqa: ANN201
    made: list[Engine] = []

    def make(**kwargs: Any) -> Engine:
        spec = kwargs.pop("spec", None)
        engine = Engine(_config(model_dir, tmp_path / "cache", **kwargs), _kv_cache_config(spec))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def _store(connector: TierKVConnector, tokens: list[int], n_blocks: int) -> None:
    """Blocks 0..n_blocks-1 of ``tokens`` straight into the connector's store, in the namespace its scheduler
    side looks up (what an earlier engine's worker would have saved)."""
    side = connector._scheduler
    assert side is not None
    ns = side.ns
    chain = BlockChain.of(ns, tokens[: n_blocks * B])
    side.store.save_blocks(ns, chain, torch.randn(n_blocks, *KVSpec.of(ns).block_shape))
    assert side.store.lookup(ns, chain).num_blocks == n_blocks


def _spans(spans: list[Any]) -> list[tuple[str, int, list[int], list[int]]]:
    return [(s.req_id, s.first, list(s.block_ids), list(s.token_ids)) for s in spans]


def _record_request_finished(monkeypatch: pytest.MonkeyPatch, connector: TierKVConnector) -> list[Any]:
    calls: list[Any] = []
    original = connector.request_finished

    def spy(request: Request, block_ids: list[int]) -> Any:
        result = original(request, block_ids)
        calls.append((request.request_id, list(block_ids), result))
        return result

    monkeypatch.setattr(connector, "request_finished", spy)
    return calls


# ---------------------------------------------------------------------------------------------- factory


def test_vllms_factory_builds_tierkv_for_the_scheduler_and_the_worker(engines, monkeypatch) -> None:
    engine = engines()
    config = engine.config
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is TierKVConnector
    # The factory refuses a connector without SupportsHMA while the hybrid KV cache manager is on; vLLM's
    # config turns it off for such a connector.
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is True

    scheduler_side = engine.connector  # the Scheduler built its own through the factory
    worker_side = engine.make_worker(monkeypatch)
    assert scheduler_side.role == KVConnectorRole.SCHEDULER and worker_side.role == KVConnectorRole.WORKER
    assert scheduler_side._scheduler is not None and scheduler_side._worker is None
    assert worker_side._worker is not None and worker_side._scheduler is None
    assert not scheduler_side.requires_kv_delivery and not worker_side.requires_kv_delivery
    # The scheduler role answers the worker's questions with nothing (vLLM may ask either role).
    assert scheduler_side.get_block_ids_with_load_errors() == set()
    assert scheduler_side.build_connector_worker_meta() is None
    # One process, one cache dir: both roles share one store, and the worker saves under the namespace the
    # scheduler looks up (rank 0's).
    assert scheduler_side._scheduler.store is worker_side._worker.store
    assert scheduler_side._scheduler.ns == worker_side._worker.ns
    # The user's kv_load_failure_policy reaches vLLM's scheduler as given.
    assert engine.scheduler.recompute_kv_load_failures is True
    assert not engine.scheduler.defer_block_free  # sync scheduling: one batch in flight


# ---------------------------------------------------------------------------------------------- steps


def test_an_empty_store_offers_nothing_and_each_chunk_plans_the_saves_of_the_blocks_it_completes(
    engines, monkeypatch
) -> None:
    engine = engines(batched_tokens=32)  # chunked prefill: 32 tokens a step
    finished = _record_request_finished(monkeypatch, engine.connector)
    prompt = _tokens(1, 4 * B + 5)
    engine.add("A", prompt, max_tokens=2)

    out, emitted = engine.step()
    ids = engine.block_ids(out, "A")
    assert out.num_scheduled_tokens == {"A": 32} and not out.has_sync_kv_loads
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # no hit, local or external
    meta = out.kv_connector_metadata
    assert meta.loads == []
    assert _spans(meta.saves) == [("A", 0, ids[0:2], prompt[: 2 * B])]
    assert emitted == {}

    out, emitted = engine.step()  # the second chunk: a cached request, its new blocks appended
    assert out.num_scheduled_tokens == {"A": 32}
    added = out.scheduled_cached_reqs.new_block_ids[0]
    ids += list(added[0]) if added else []
    assert _spans(out.kv_connector_metadata.saves) == [("A", 2, ids[2:4], prompt[: 4 * B])]
    assert out.kv_connector_metadata.loads == []

    out, emitted = engine.step()  # the last 5 prompt tokens: no block completed, the first token
    assert out.num_scheduled_tokens == {"A": 5}
    assert out.kv_connector_metadata.saves == [] and out.kv_connector_metadata.loads == []
    assert emitted == {"A": [TOKEN]}

    held = list(engine.scheduler.kv_cache_manager.get_block_ids("A")[0])
    assert held[:4] == ids
    out, emitted = engine.step()  # a decode step (the last): output tokens are never saved
    assert out.num_scheduled_tokens == {"A": 1} and out.kv_connector_metadata.saves == []
    assert emitted == {"A": [TOKEN]}

    # request_finished returned (False, None): vLLM freed the blocks at once, nothing waits on tierkv.
    assert finished == [("A", held, (False, None))]
    engine.assert_idle()


def test_stored_blocks_are_offered_beyond_vllms_own_prefix_hit_leaving_one_token_to_compute(
    engines, monkeypatch
) -> None:
    engine = engines()
    connector = engine.connector
    finished = _record_request_finished(monkeypatch, connector)
    shared = _tokens(2, 2 * B)
    first = shared + _tokens(3, 2 * B + 5)
    engine.add("A", first, max_tokens=1)
    engine.run_to_completion()  # vLLM's prefix cache now holds A's blocks (freed, still cached)

    prompt = shared + _tokens(4, 3 * B + 3)  # 5 whole blocks and 3 tokens; blocks 0-1 are A's
    _store(connector, prompt, 5)
    request = engine.add("C", prompt, max_tokens=2)
    out = engine.schedule()
    ids = engine.block_ids(out, "C")
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 5 * B  # 2 blocks from vLLM's cache, 3 loaded from tierkv
    assert out.num_scheduled_tokens == {"C": 3}
    assert out.has_sync_kv_loads  # the model runner loads before the forward
    meta = out.kv_connector_metadata
    assert _spans(meta.loads) == [("C", 2, ids[2:5], prompt[: 5 * B])]
    assert meta.saves == []  # no block completed this step: the 3 computed tokens are a partial block
    stats = engine.scheduler.connector_prefix_cache_stats
    assert stats.hits == 3 * B
    assert engine.finish_step(out) == {"C": [TOKEN]}
    assert request.num_computed_tokens == len(prompt)

    # A prompt of whole blocks, all stored: every token but the last is offered (vLLM computes at least
    # one). vLLM's own cache holds its first 4 blocks (C's) and leaves it the last: tierkv loads that one.
    aligned = engine.add("D", prompt[: 5 * B])
    assert connector.get_num_new_matched_tokens(aligned, 0) == (5 * B - 1, False)
    assert connector.get_num_new_matched_tokens(aligned, 2 * B) == (3 * B - 1, False)
    assert connector.get_num_new_matched_tokens(aligned, 4 * B) == (B - 1, False)
    out = engine.schedule()
    assert out.num_scheduled_tokens["D"] == 1  # (C decodes its second token beside it)
    d_ids = engine.block_ids(out, "D")
    assert _spans(out.kv_connector_metadata.loads) == [("D", 4, d_ids[4:5], prompt[: 5 * B])]
    engine.finish_step(out)
    # Another tenant's salt is another namespace: nothing of the unsalted blocks.
    salted = engine.add("E", prompt, salt="tenant-b")
    assert connector.get_num_new_matched_tokens(salted, 0) == (0, False)

    engine.run_to_completion()
    assert sorted(rid for rid, _, _ in finished) == ["A", "C", "D", "E"]
    assert {result for _, _, result in finished} == {(False, None)}
    engine.assert_idle()


def test_a_prefix_vllm_serves_from_its_own_cache_stays_recent_in_every_tier(engines) -> None:
    """vLLM never asks tierkv for blocks its own prefix cache holds: without a refresh the prefix used most
    (a system prompt vLLM keeps) would be the first to leave the host tier (LRU) and expire on disk (its
    sliding TTL), and miss after a restart. The scheduler's lookup keeps such blocks recent, as a restore
    does; blocks tierkv lacks stay missing."""
    engine = engines()
    connector = engine.connector
    prompt = _tokens(8, 4 * B + 5)
    _store(connector, prompt, 3)
    engine.add("A", prompt, max_tokens=1)
    engine.run_to_completion()  # A loaded blocks 0-2, computed block 3: vLLM's prefix cache holds 0-3
    side = connector._scheduler
    host, disk = side.store.tier("host"), side.store.tier("disk")
    later = time.time() + 3600.0
    host.clock = disk.clock = lambda: later  # an hour on
    b = engine.add("B", prompt[: 4 * B] + _tokens(9, 5), max_tokens=1)
    assert connector.get_num_new_matched_tokens(b, 4 * B) == (0, False)  # vLLM holds it all
    side.lookups.settle()  # (the refresh runs on the lookup thread, after the lookup's answer)
    keys = BlockChain.of(side.ns, prompt).keys
    assert [disk.times.last(k).t for k in keys[:3]] == [later] * 3
    assert [host._atime.get(k) for k in keys[:3]] == [later] * 3
    # Block 3, which A computed (no worker here saves it), is not in the store: nothing to refresh.
    assert disk.times.last(keys[3]) is None and keys[3] not in host._atime
    engine.run_to_completion()
    engine.assert_idle()


def test_a_prefix_vllm_holds_that_tierkv_lacks_is_saved_by_the_next_request_that_uses_it(engines) -> None:
    """A request that kept its prompt out of tierkv (``no_store``), or blocks tierkv lost, leave a prefix
    only vLLM's own cache holds: the next request that uses it, and saves normally, saves it from vLLM's
    pages (the worker's write-behind skips what a tier holds already). Here no worker runs: A's blocks
    reach vLLM's cache only."""
    engine = engines()
    prompt = _tokens(21, 3 * B + 5)
    engine.add("A", prompt, max_tokens=1)
    engine.run_to_completion()  # vLLM's prefix cache holds A's 3 blocks; tierkv none of them
    engine.add("B", prompt[: 3 * B] + _tokens(22, 5), max_tokens=1)
    out = engine.schedule()
    b_ids = engine.block_ids(out, "B")
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * B  # vLLM's own hit
    assert _spans(out.kv_connector_metadata.saves) == [("B", 0, b_ids[:3], prompt[: 3 * B])]
    # computed before this step: its own blocks are among its deps (a tainted one is not saved)
    assert list(out.kv_connector_metadata.saves[0].deps) == b_ids[:3]
    engine.finish_step(out)
    _store(engine.connector, prompt, 3)  # once tierkv holds them, a request using them saves nothing more
    engine.add("C", prompt[: 3 * B] + _tokens(23, 5), max_tokens=1)
    out = engine.schedule()
    assert [s for s in out.kv_connector_metadata.saves if s.req_id == "C"] == []
    engine.finish_step(out)
    engine.run_to_completion()
    engine.assert_idle()


def test_a_cache_salt_in_the_reserved_tenant_space_is_neither_loaded_nor_saved(engines) -> None:
    """A bare vLLM's client may not name the space of a tenant of ``tierkv serve --api-keys`` sharing the
    directory; an ordinary salt (the control) loads what is stored under it."""
    engine = engines()
    connector = engine.connector
    side = connector._scheduler
    assert side is not None
    prompt = _tokens(7, 4 * B + 5)
    for rid, salt in (("plain", "client-salt"), ("reserved", namespace_salt("s" * 32, ""))):
        ns = side.ns.with_salt(salt)
        side.store.save_blocks(
            ns, BlockChain.of(ns, prompt[: 2 * B]), torch.randn(2, *KVSpec.of(ns).block_shape)
        )
        request = engine.add(rid, prompt, salt=salt)
        expected = (0, False) if rid == "reserved" else (2 * B, False)
        assert connector.get_num_new_matched_tokens(request, 0) == expected
        out = engine.schedule()
        meta = out.kv_connector_metadata
        if rid == "reserved":
            assert meta.loads == [] and meta.saves == []
        else:
            assert meta.loads and meta.saves
        engine.finish_step(out)
        engine.run_to_completion()
    engine.assert_idle()


def test_a_slow_lookup_never_holds_the_scheduler_and_its_request_loads_at_a_later_step(
    engines, monkeypatch
) -> None:
    """A lookup that has not answered within ``lookup_wait_s`` (a cold index page, a remote tier) tells vLLM
    to ask again: the step goes on without the request, and a later step schedules it with its load."""
    import time

    engine = engines()
    connector = engine.connector
    side = connector._scheduler
    assert side is not None
    prompt = _tokens(8, 4 * B + 5)
    _store(connector, prompt, 4)
    slow = side.store.lookup

    def lookup(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)
        return slow(*args, **kwargs)

    monkeypatch.setattr(side.store, "lookup", lookup)
    side.lookups.wait_s = 0.01
    engine.add("S", prompt)
    t0 = time.monotonic()
    out = engine.schedule()
    assert time.monotonic() - t0 < 0.4  # the scheduler did not wait for the lookup
    assert "S" not in out.num_scheduled_tokens
    assert side._metrics.reduce().get("tierkv_connector_lookups:deferred", 0) >= 1  # on /metrics
    engine.finish_step(out)
    assert side.lookups.errors.get("deferred", 0) >= 1
    time.sleep(0.6)
    out = engine.schedule()
    ids = engine.block_ids(out, "S")
    assert out.num_scheduled_tokens == {"S": 5}
    assert _spans(out.kv_connector_metadata.loads) == [("S", 0, ids[0:4], prompt[: 4 * B])]
    engine.finish_step(out)
    engine.run_to_completion()
    engine.assert_idle()


# ---------------------------------------------------------------------------------------------- failed loads


def _shared_prefix_pair(engine: Engine) -> tuple[Request, Request, SchedulerOutput, list[int], list[int]]:
    """A loads 4 stored blocks; B, added after it, shares A's first 3 blocks through vLLM's prefix cache
    in the same step (vLLM caches A's blocks when it allocates them, before they are loaded)."""
    prompt = _tokens(5, 4 * B + 5)
    _store(engine.connector, prompt, 4)
    a = engine.add("A", prompt, max_tokens=2)
    b = engine.add("B", prompt[: 3 * B] + _tokens(6, B + 4), max_tokens=2)
    out = engine.schedule()
    a_ids, b_ids = engine.block_ids(out, "A"), engine.block_ids(out, "B")
    assert out.num_scheduled_tokens == {"A": 5, "B": B + 4}
    assert b_ids[:3] == a_ids[:3]
    computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    assert computed == {"A": 4 * B, "B": 3 * B}
    meta = out.kv_connector_metadata
    assert [(s.req_id, s.first, list(s.block_ids)) for s in meta.loads] == [("A", 0, a_ids[:4])]
    # B completes its block 3 this step, from a forward that reads A's blocks 0-2 as they load.
    assert [(s.req_id, s.first, list(s.block_ids)) for s in meta.saves] == [("B", 3, [b_ids[3]])]
    return a, b, out, a_ids, b_ids


def test_a_failed_load_rewinds_to_the_first_invalid_block_and_reschedules_the_request_that_shared_it(
    engines,
) -> None:
    engine = engines(policy="recompute")
    a, b, out, a_ids, b_ids = _shared_prefix_pair(engine)

    emitted = engine.finish_step(out, invalid={a_ids[2]})  # the worker: A's block 2 did not load
    assert emitted == {}  # neither request's token of this step is used
    assert a.num_computed_tokens == 2 * B  # rewound to before its first invalid block
    # B read the invalid block too: vLLM takes its token back and reschedules it from its own prefix hit,
    # counting the invalid block as computed (A recomputes it in the next step, which B runs in as well).
    assert b.num_computed_tokens == 3 * B
    assert a.status == b.status == RequestStatus.RUNNING and engine.scheduler.running == [a, b]
    assert not a.output_token_ids and not b.output_token_ids
    # "recompute" keeps it cached for A to rewrite; the connector takes it, and the blocks after it in each
    # request, out of the prefix cache (no later request is served from them before A recomputed it).
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[i].block_hash for i in (a_ids[2], a_ids[3], b_ids[3])] == [None] * 3
    assert pool.blocks[a_ids[1]].block_hash is not None  # what loaded stays

    out = engine.schedule()
    assert out.num_scheduled_tokens == {"A": len(a.prompt_token_ids) - 2 * B, "B": B + 4}
    cached = out.scheduled_cached_reqs
    assert dict(zip(cached.req_ids, cached.num_computed_tokens)) == {"A": 2 * B, "B": 3 * B}
    meta = out.kv_connector_metadata
    assert meta.loads == []  # what failed is computed, not offered again
    assert [(s.req_id, s.first, list(s.block_ids)) for s in meta.saves] == [
        ("A", 2, a_ids[2:4]),
        ("B", 3, [b_ids[3]]),
    ]
    assert engine.finish_step(out) == {"A": [TOKEN], "B": [TOKEN]}
    engine.run_to_completion()
    engine.assert_idle()


def test_a_request_admitted_while_a_failed_load_is_recomputed_never_hits_its_blocks(engines) -> None:
    """Synchronous loads under "recompute": A's blocks 1-3 fail and A is rewound, but its next chunk is
    capped at one block (another request runs: ``long_prefill_token_threshold``). C, admitted in that
    step with A's prompt, must not take blocks 1-3 from vLLM's prefix cache, which hold no KV of theirs
    until A recomputes them: vLLM would send C's tokens, computed from them, to the user. (Found by a
    cold review; vLLM 0.32 evicts such blocks itself only under "fail".)"""
    engine = engines(policy="recompute", batched_tokens=256)
    engine.scheduler.scheduler_config.long_prefill_token_threshold = B
    prompt = _tokens(5, 4 * B + 5)
    _store(engine.connector, prompt, 4)
    a = engine.add("A", prompt, max_tokens=2)
    engine.add("X", _tokens(99, 3), max_tokens=50)  # another request, so that the threshold applies
    out = engine.schedule()
    a_ids = engine.block_ids(out, "A")
    assert [(s.req_id, s.first) for s in out.kv_connector_metadata.loads] == [("A", 0)]
    engine.finish_step(out, invalid=set(a_ids[1:4]))
    assert a.num_computed_tokens == B

    engine.add("C", prompt[: 4 * B] + _tokens(7, 5), max_tokens=2)
    out = engine.schedule()
    assert out.num_scheduled_tokens["A"] == B  # A recomputes block 1 only, this step
    (c,) = [new for new in out.scheduled_new_reqs if new.req_id == "C"]
    assert c.block_ids[0][0] == a_ids[0]  # what loaded, from vLLM's prefix cache
    assert not set(c.block_ids[0]) & set(a_ids[1:4])  # none of the blocks that did not
    # (C loads blocks 1-3 from tierkv into blocks of its own instead)
    assert [(s.req_id, s.first, list(s.block_ids)) for s in out.kv_connector_metadata.loads] == [
        ("C", 1, c.block_ids[0][1:4])
    ]
    engine.finish_step(out)
    engine.run_to_completion(max_steps=80)
    engine.assert_idle()


def test_a_worker_that_cannot_load_reports_every_planned_block_through_vllms_lifecycle(
    engines, monkeypatch
) -> None:
    engine = engines(policy="recompute")
    worker = engine.make_worker(monkeypatch)  # no KV caches registered: it cannot load anything
    prompt = _tokens(7, 4 * B + 5)
    _store(engine.connector, prompt, 4)
    a = engine.add("A", prompt)
    out = engine.schedule()
    a_ids = engine.block_ids(out, "A")
    assert out.has_sync_kv_loads and a.num_computed_tokens == len(prompt)

    kv_output = engine.run_worker(out)  # bind, start_load_kv, wait_for_save, errors, clear
    assert kv_output is not None and kv_output.invalid_block_ids == set(a_ids[:4])
    assert worker.get_block_ids_with_load_errors() == set()  # taken once
    assert engine.finish_step(out, kv_output=kv_output) == {}
    assert a.num_computed_tokens == 0  # its first loaded block failed: everything is computed

    out, emitted = engine.step()
    assert out.num_scheduled_tokens == {"A": len(prompt)} and out.kv_connector_metadata.loads == []
    assert emitted == {"A": [TOKEN]}
    engine.run_to_completion()
    engine.assert_idle()


def test_fail_policy_fails_the_loading_request_and_the_request_that_shared_its_blocks(engines) -> None:
    engine = engines(policy="fail")
    assert engine.scheduler.recompute_kv_load_failures is False  # honoured as given
    a, b, out, a_ids, b_ids = _shared_prefix_pair(engine)
    blocks = engine.scheduler.kv_cache_manager.block_pool.blocks

    emitted = engine.finish_step(out, invalid={a_ids[2]})
    assert emitted == {"A": [], "B": []}  # each finishes with an error, no token
    assert a.status == b.status == RequestStatus.FINISHED_ERROR
    # "fail" evicts the invalid block and the blocks after it from vLLM's prefix cache (A's), so no later
    # request hits them; the blocks before it stay cached.
    assert all(blocks[i].block_hash is None for i in a_ids[2:])
    assert all(blocks[i].block_hash is not None for i in a_ids[:2])
    engine.assert_idle()


def test_async_scheduling_schedules_a_step_on_a_failed_load_and_vllm_0_32_emits_its_tokens(engines) -> None:
    """What vLLM 0.32 does, not what tierkv wants: with async scheduling (vLLM's default on GPUs), step N+1
    is scheduled before step N's load failure is known, runs on the blocks that did not load, and its
    sampled tokens are emitted to the user after vLLM rewound the requests for step N."""
    engine = engines(policy="recompute", async_scheduling=True, options={"load_async": False})
    assert isinstance(engine.scheduler, AsyncScheduler)
    # Which is why the connector offers no synchronous loads under async scheduling (it still saves) ...
    side = engine.connector._scheduler
    assert not side.load_enabled and side.save_enabled
    side.load_enabled = True  # ... and what would happen if it did:
    a, b, out_n, a_ids, b_ids = _shared_prefix_pair(engine)

    out_next = engine.schedule()  # while step N runs: both requests decode on top of A's loaded blocks
    assert out_next.num_scheduled_tokens == {"A": 1, "B": 1}
    assert out_next.kv_connector_metadata.loads == []

    assert engine.finish_step(out_n, invalid={a_ids[2]}) == {}
    assert a.num_computed_tokens == 2 * B
    # B is rewound to its count at N's output less N's tokens, which already includes step N+1's decode:
    # one token past its prefix hit, a token computed in step N from the invalid block and never redone.
    assert b.num_computed_tokens == 3 * B + 1

    emitted = engine.finish_step(out_next, token=TOKEN + 1)
    assert emitted == {"A": [TOKEN + 1], "B": [TOKEN + 1]}  # sampled on top of the failed load, emitted
    assert list(a.output_token_ids) == [TOKEN + 1] and list(b.output_token_ids) == [TOKEN + 1]

    out = engine.schedule()  # A recomputes from its invalid block; B from one token past its hit
    cached = out.scheduled_cached_reqs
    assert dict(zip(cached.req_ids, cached.num_computed_tokens)) == {"A": 2 * B, "B": 3 * B + 1}


# ---------------------------------------------------------------------------------------------- async loads


def _step_until_scheduled(engine: Engine, rid: str, max_steps: int = 1000) -> SchedulerOutput:
    """Steps (schedule, the worker's lifecycle, the model runner's output) until ``rid`` is scheduled;
    returns that step's output, not yet finished."""
    import time

    for _ in range(max_steps):
        out = engine.schedule()
        if rid in out.num_scheduled_tokens:
            return out
        engine.finish_step(out, kv_output=engine.run_worker(out))
        time.sleep(0.01)  # the loader thread runs
    raise AssertionError(f"{rid} was never scheduled")


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async-scheduling", "sync-scheduling"])
def test_an_async_load_holds_its_request_until_reported_and_its_failed_blocks_are_computed_first(
    engines, monkeypatch, async_scheduling
) -> None:
    """With asynchronous loads (the default under vLLM's async scheduling, its GPU default) vLLM computes
    nothing of a request until the workers reported its load, failed blocks with it: a worker that cannot
    load anything makes the request compute its whole prompt, and no token is ever emitted from a block
    that did not load (what synchronous loads under async scheduling do: the test above)."""
    options = {} if async_scheduling else {"load_async": True}
    engine = engines(policy="recompute", async_scheduling=async_scheduling, options=options)
    side = engine.connector._scheduler
    assert side is not None and side.load_enabled and side.load_async
    engine.make_worker(monkeypatch)  # no KV caches registered: every load fails
    prompt = _tokens(9, 4 * B + 5)
    _store(engine.connector, prompt, 4)
    a = engine.add("A", prompt)

    out = engine.schedule()
    assert out.num_scheduled_tokens == {}  # held back for its load
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = out.kv_connector_metadata
    assert meta.idle  # nothing computed this step: the worker may wait a little for the load
    ids = list(engine.scheduler.kv_cache_manager.get_block_ids("A")[0])
    assert meta.loads == [] and _spans(meta.async_loads) == [("A", 0, ids[:4], prompt[: 4 * B])]
    engine.finish_step(out, kv_output=engine.run_worker(out))

    out = _step_until_scheduled(engine, "A")
    assert [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs] == [("A", 0)]
    assert out.num_scheduled_tokens == {"A": len(prompt)} and not out.kv_connector_metadata.idle
    assert out.kv_connector_metadata.loads == out.kv_connector_metadata.async_loads == []
    # not offered again (its blocks were freed and taken anew): computed, and saved again
    assert [s.block_ids for s in out.kv_connector_metadata.saves] == [engine.block_ids(out, "A")[:4]]
    assert engine.worker is not None and engine.worker._worker is not None
    assert engine.worker._worker.stats["load_failed_blocks"] == 4
    engine.finish_step(out, kv_output=engine.run_worker(out))
    engine.run_to_completion()
    engine.assert_idle()


@pytest.mark.parametrize("checked", [True, False], ids=["self-checked", "failed"])
def test_a_self_checked_async_load_is_recomputed_once_then_its_hit_is_offered_again(
    engines, monkeypatch, checked
) -> None:
    """A sampled self-check reports the blocks it restored invalid, so that vLLM recomputes them and the
    worker compares: the request is computed whole (not offered the same hit again, which would load the
    blocks instead of checking them). Once the check span went out, a later lookup of the request (after
    a preemption) finds its hit again. The scheduler cannot tell those invalid blocks from a checked load
    that really failed (as here: the worker has no KV caches), so such a load costs one more attempt per
    preemption at most; a load that failed unchecked stays computed for good (no loop)."""
    options = {"load_async": True, "self_check_rate": 1.0 if checked else 0.0}
    engine = engines(policy="recompute", options=options)
    side = engine.connector._scheduler
    assert side is not None
    engine.make_worker(monkeypatch)  # no KV caches registered: every load comes back invalid
    prompt = _tokens(11, 4 * B + 5)
    _store(engine.connector, prompt, 4)
    a = engine.add("A", prompt)

    out = engine.schedule()
    (span,) = out.kv_connector_metadata.async_loads
    assert span.check is checked
    engine.finish_step(out, kv_output=engine.run_worker(out))
    out = _step_until_scheduled(engine, "A")
    assert out.num_scheduled_tokens == {"A": len(prompt)}  # computed whole, whatever the reason
    checks = out.kv_connector_metadata.checks
    assert [(c.req_id, c.first, len(c.block_ids)) for c in checks] == ([("A", 0, 4)] if checked else [])
    # What a preemption would ask next: the stored prefix again, only if the failure was the check's.
    assert side.num_new_matched_tokens(a, 0) == ((4 * B, True) if checked else (0, False))
    engine.finish_step(out, kv_output=engine.run_worker(out))
    engine.run_to_completion()


def _held_async_load(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, gate: Any, restore: Any, seed: int
) -> Request:
    """Request "A" admitted with an asynchronous load of 4 stored blocks that ``restore`` runs once ``gate``
    is set (held until then, on the loader thread)."""
    assert engine.worker is not None and engine.worker._worker is not None

    def held(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(10)
        return restore(*args, **kwargs)

    monkeypatch.setattr(engine.worker._worker, "_restore", held)
    prompt = _tokens(seed, 4 * B + 5)
    _store(engine.connector, prompt, 4)
    a = engine.add("A", prompt)
    engine.step()
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return a


@pytest.mark.parametrize("how", ["store-gone", "off-from-start"])
def test_a_worker_without_a_store_reports_every_async_load_done_and_failed(engines, monkeypatch, how) -> None:
    """A worker that turned off (its ranks disagreed, or it could not tell its tensor-parallel rank when it
    was made, while the scheduler side is on) must still report a load vLLM admitted, or the request would
    wait forever; every block of it is failed, so vLLM computes it."""
    from tierkv.integrations.vllm import worker as worker_module

    engine = engines(policy="recompute", options={"load_async": True})
    if how == "off-from-start":

        def no_rank(tp_size: int) -> Any:
            raise RuntimeError("cannot tell this worker's tensor-parallel rank (test)")

        monkeypatch.setattr(worker_module, "tp_group", no_rank)
    worker = engine.make_worker(monkeypatch)
    assert worker._worker is not None
    assert bool(worker._worker.off) is (how == "off-from-start")
    prompt = _tokens(12, 4 * B + 5)
    _store(engine.connector, prompt, 4)
    engine.add("A", prompt)
    if how == "store-gone":
        monkeypatch.setattr(worker._worker, "store", None)
    out = engine.schedule()
    ids = list(engine.scheduler.kv_cache_manager.get_block_ids("A")[0])
    kv_output = engine.run_worker(out)
    assert kv_output is not None and kv_output.finished_recving == {"A"}
    assert kv_output.invalid_block_ids == set(ids[:4])
    engine.finish_step(out, kv_output=kv_output)
    out = _step_until_scheduled(engine, "A")
    assert [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs] == [("A", 0)]
    engine.finish_step(out, kv_output=engine.run_worker(out))
    engine.run_to_completion()
    engine.assert_idle()


def test_a_request_aborted_while_its_async_load_runs_keeps_its_blocks_until_the_load_ends(
    engines, monkeypatch
) -> None:
    """The loader thread writes into the request's vLLM blocks: they must not go to another request before
    it is done. vLLM frees an aborted WAITING_FOR_REMOTE_KVS request's blocks only once the workers report
    its load finished, which the worker does only when its thread has left them. A load that long is
    logged, once."""
    import logging
    import threading

    from tierkv.integrations.vllm import loader

    monkeypatch.setattr(loader, "SLOW_LOAD_S", 0.0)
    engine = engines(policy="recompute", options={"load_async": True})
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    loader.log.addHandler(handler)  # (vLLM's logging set-up keeps its loggers' records from pytest's)
    worker = engine.make_worker(monkeypatch)
    assert worker._worker is not None
    gate = threading.Event()
    _held_async_load(engine, monkeypatch, gate, worker._worker._restore, seed=10)
    pool = engine.scheduler.kv_cache_manager.block_pool
    free_while_loading = pool.get_num_free_blocks()
    assert free_while_loading < NUM_BLOCKS - 1

    engine.scheduler.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        out, _ = engine.step()
        assert out.kv_connector_metadata.async_loads == []
    assert pool.get_num_free_blocks() == free_while_loading  # still the loader's
    assert "A" in engine.scheduler.requests
    loader.log.removeHandler(handler)
    slow = [r for r in records if "has run for" in r.getMessage()]
    assert len(slow) == 1 and "asynchronous load of A" in slow[0].getMessage()

    gate.set()
    for _ in range(1000):
        if not engine.scheduler.requests:
            break
        engine.step()
        threading.Event().wait(0.01)
    engine.assert_idle()


def test_an_async_load_that_ends_after_a_cache_reset_is_reported_failed(engines, monkeypatch) -> None:
    """A reset of the connector's cache (vLLM's, e.g. before new weights) while a load runs: what it read is
    of the old epoch, so every block of it is reported failed and vLLM computes the request. Its restore is
    made to succeed here (the unit worker has no pages), so only the epoch check fails it."""
    import threading

    from tierkv.integrations.vllm.loader import Loaded

    engine = engines(policy="recompute", options={"load_async": True})
    worker = engine.make_worker(monkeypatch)
    assert worker._worker is not None
    gate = threading.Event()

    def restored(span: Any, *args: Any, **kwargs: Any) -> Any:
        return Loaded(span, len(span.block_ids))  # as if every block had loaded

    _held_async_load(engine, monkeypatch, gate, restored, seed=11)
    ids = list(engine.scheduler.kv_cache_manager.get_block_ids("A")[0])
    assert engine.connector.reset_cache()  # the scheduler side moves to a new epoch ...
    out = engine.schedule()
    kv_output = engine.run_worker(out)  # ... which the worker follows with this step's metadata
    assert kv_output is None or not kv_output.finished_recving  # still loading
    assert worker._worker.epoch == engine.connector._scheduler.epoch != ""
    engine.finish_step(out, kv_output=kv_output)
    gate.set()
    for _ in range(1000):
        out = engine.schedule()
        kv_output = engine.run_worker(out)
        if kv_output is not None and kv_output.finished_recving:
            break
        engine.finish_step(out, kv_output=kv_output)
        threading.Event().wait(0.01)
    assert kv_output is not None and kv_output.finished_recving == {"A"}
    assert kv_output.invalid_block_ids == set(ids[:4])  # every block of the old epoch's load
    engine.finish_step(out, kv_output=kv_output)
    engine.run_to_completion()
    engine.assert_idle()


# ---------------------------------------------------------------------------------------------- lifecycle


def test_reset_cache_moves_the_connector_to_a_new_namespace_and_shutdown_keeps_what_was_stored(
    engines, monkeypatch, tmp_path
) -> None:
    engine = engines()
    worker = engine.make_worker(monkeypatch)
    side = engine.connector._scheduler
    before = side.ns
    prompt = _tokens(8, 4 * B + 5)
    _store(engine.connector, prompt, 4)

    assert engine.scheduler.reset_prefix_cache(reset_connector=True) is True
    assert side.ns != before
    engine.add("A", prompt)
    out, _ = engine.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # nothing saved before the reset is offered
    assert out.kv_connector_metadata.loads == []
    assert worker._worker.ns == side.ns  # the worker followed the reset with the step's metadata
    engine.run_to_completion()
    engine.assert_idle()

    engine.close()  # the scheduler's shutdown, then the worker's: the last one closes the store
    with TieredStore.open(str(tmp_path / "cache")) as store:  # nothing holds the directory any more
        assert store.lookup(before, BlockChain.of(before, prompt)).num_blocks == 4


SLIDING_WINDOW_SPECS = {
    # a model whose layers all slide (a Mistral): its own spec
    "sliding_window_spec": SlidingWindowSpec(
        block_size=B, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=2 * B
    ),
    # sliding and full layers with the hybrid manager off (Gemma 2/3): full attention with a window
    "full_attention_with_window": FullAttentionSpec(
        block_size=B, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=2 * B
    ),
}


@pytest.mark.parametrize("spec", list(SLIDING_WINDOW_SPECS))
def test_off_connector_for_a_sliding_window_model_never_raises_epoch_defect(
    engines, monkeypatch, spec: str
) -> None:
    """A connector that turned itself off (``namespace.unsupported``) must leave vLLM running as without it:
    no method of either role raises (issue 23, defect 7: ``AttributeError: ... 'epoch'``)."""
    engine = engines(spec=SLIDING_WINDOW_SPECS[spec])
    connector = engine.connector
    worker = engine.make_worker(monkeypatch)
    assert connector._scheduler.off and worker._worker.off  # both roles refused the model

    prompt = _tokens(9, 3 * B + 5)
    engine.add("A", prompt)
    engine.add("B", prompt[: 2 * B] + _tokens(10, B))
    out, _ = engine.step()  # the scheduler's calls, and vLLM's worker lifecycle, on a real step
    assert out.kv_connector_metadata.loads == [] and out.kv_connector_metadata.saves == []
    engine.run_to_completion()
    engine.assert_idle()

    # Each method directly, scheduler role then worker role.
    probe = engine.add("C", prompt)
    assert connector.get_num_new_matched_tokens(probe, 0) == (0, False)
    connector.update_state_after_alloc(probe, engine.scheduler.kv_cache_manager.empty_kv_cache_blocks, 0)
    out = engine.schedule()
    meta = connector.build_connector_meta(out)
    assert meta.loads == [] and meta.saves == []
    assert connector.request_finished(probe, engine.block_ids(out, "C")) == (False, None)
    connector.update_connector_output(KVConnectorOutput())
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker.get_block_ids_with_load_errors() == set()
    worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    assert connector.reset_cache() in (True, None)
    assert worker.reset_cache() in (True, None)
    engine.finish_step(out)
    engine.run_to_completion()
    engine.close()  # shutdown of both roles
