"""``TierKVConnector``: tierkv's durable, verified, bounded store under vLLM (KV connector API v1).

    LLM(model, kv_transfer_config={
        "kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cache_dir": ..., "host_bytes": ..., "disk_bytes": ..., "ttl_s": ...,
                                      "remote": ..., "revision": ...}})   # each optional

One class, two roles (vLLM makes one instance per role): the scheduler side (``scheduler.py``) looks
prompts up and plans each step's loads and saves, the worker side (``worker.py``) moves the blocks
between vLLM's paged cache and the store. ``kv_role`` ``kv_consumer`` only loads, ``kv_producer`` only
saves.

A block that fails verification or cannot be read is reported to vLLM as a load error, never used. What
vLLM then does is its ``kv_load_failure_policy``, honoured as given: ``recompute`` (recommended for a
cache: the request computes those blocks itself) or ``fail`` (vLLM's default: the request fails). vLLM
cannot tell an explicit ``fail`` from its default, so the connector says at start-up what ``fail`` means
and how to ask for ``recompute``; the sampled self-check needs ``recompute`` and is off without it.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.integrations.vllm.meta import TierKVMetadata
from tierkv.integrations.vllm.metrics import TierKVPromMetrics, TierKVStats
from tierkv.integrations.vllm.options import ConnectorOptions
from tierkv.integrations.vllm.scheduler import SchedulerSide
from tierkv.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.tierkv")

__all__ = ["TierKVConnector"]


class TierKVConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = self._kv_transfer_config
        self.options = ConnectorOptions.from_extra(config.kv_connector_extra_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._ambient_exc: BaseException | None = None  # see bind_connector_metadata
        if role == KVConnectorRole.SCHEDULER:
            recompute = config.kv_load_failure_policy == "recompute"
            if not recompute:
                log.warning(
                    "tierkv: kv_load_failure_policy is %r: a request whose cached blocks fail verification "
                    "or cannot be read fails instead of computing them; for a cache, set "
                    '"kv_load_failure_policy": "recompute" in --kv-transfer-config (the self-check is off '
                    "without it)",
                    config.kv_load_failure_policy,
                )
            self._scheduler = SchedulerSide(
                vllm_config,
                kv_cache_config,
                self.options,
                load=config.is_kv_consumer,
                save=config.is_kv_producer,
                self_check=recompute,
            )
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, self.options)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save lost to a preemption is a future miss

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierKVMetadata)
        self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-step, done in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves are whole-step, done in wait_for_save

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # An exception being handled already as the step begins (vLLM run from an ``except``) is not the
        # step's own: wait_for_save tells the forward's failure from it.
        self._ambient_exc = sys.exc_info()[1]

    def wait_for_save(self) -> None:
        assert self._worker is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, TierKVMetadata)
            # vLLM calls this in a ``finally`` around the forward (kv_connector_model_runner_mixin): an
            # exception on its way up now, and not already before the step, is the forward's.
            failing, self._ambient_exc = sys.exc_info()[1], self._ambient_exc
            self._worker.save(meta, None if failing is self._ambient_exc else failing)
        self._ambient_exc = None  # not kept alive, with its frames, past the step

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(no asynchronous saves, the requests whose asynchronous loads are done)."""
        if self._worker is None:
            return None, None
        return None, self._worker.finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.report() if self._worker is not None else None

    # ------------------------------------------------------------------ metrics (both sides)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.metrics_payload()
        return self._scheduler.metrics_payload() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TierKVStats(data=data) if data is not None else TierKVStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return TierKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        split = self._scheduler.hit_sources(request, num_external_tokens)
        return {CacheHitSource(source): n for source, n in split.items()}

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        ids = blocks.get_block_ids() if num_external_tokens > 0 else ((),)
        self._scheduler.update_state_after_alloc(request, list(ids[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:  # blocks that did not load leave its prefix cache (scheduler.py)
            self._scheduler.kv_cache_manager = kv_cache_manager

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset() if self._scheduler is not None else None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.request_finished(request)
        return False, None  # saves are synchronous in the step: the blocks may be freed now
