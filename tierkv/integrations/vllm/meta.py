"""What the scheduler side tells the workers each step (``KVConnectorMetadata``), and back."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from tierkv.retention import CacheControl

__all__ = ["BlockSpan", "TierKVMetadata", "TierKVWorkerMetadata"]


@dataclasses.dataclass
class BlockSpan:
    """Blocks ``first .. first + len(block_ids)`` of a request's prompt, in vLLM blocks ``block_ids``.

    ``token_ids`` are the prompt's tokens up to the span's end (its chain of keys runs from block 0);
    ``salt`` is the request's ``cache_salt``. ``deps``: the vLLM blocks of the request's blocks before
    ``first`` (a computed block's KV depends on them: see ``guard.py``). ``check``: a load the sampled
    self-check will compare with vLLM's recomputation of the same blocks."""

    req_id: str
    token_ids: list[int]
    salt: str
    first: int
    block_ids: list[int]
    deps: list[int] = dataclasses.field(default_factory=list)
    check: bool = False
    control: CacheControl | None = None  # the request's cache control (retention, memory only)
    # Blocks computed before this step (vLLM's own prefix hit, saved where tierkv lacks it): its ``deps``
    # include its own blocks, and a refused one taints nothing (guard.py)
    cached: bool = False

    @property
    def end(self) -> int:
        return self.first + len(self.block_ids)


@dataclasses.dataclass
class TierKVMetadata(KVConnectorMetadata):
    loads: list[BlockSpan] = dataclasses.field(default_factory=list)  # into vLLM's cache before the forward
    # loads of requests vLLM holds back until the worker reports them finished (``load_async``)
    async_loads: list[BlockSpan] = dataclasses.field(default_factory=list)
    saves: list[BlockSpan] = dataclasses.field(default_factory=list)  # out of it after the forward
    # blocks of a self-checked load that this step recomputed: compared after the forward, before saves
    checks: list[BlockSpan] = dataclasses.field(default_factory=list)
    forget: list[str] = dataclasses.field(default_factory=list)  # finished: drop their self-check copies
    epoch: str = ""  # set by a reset of the connector's cache (see namespace.with_epoch)
    idle: bool = False  # no tokens scheduled this step: vLLM runs it only to hear of asynchronous loads


@dataclasses.dataclass
class TierKVWorkerMetadata(KVConnectorWorkerMetadata):
    """A worker that found the backend's layout unsupported says so once: the scheduler stops offering hits
    (each would cost a failed load and a recompute)."""

    disabled: str | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, TierKVWorkerMetadata) and other.disabled and not self.disabled:
            return other
        return self
