"""Which of vLLM's blocks may hold wrong KV, and so which saves must not happen.

A load that fails leaves vLLM blocks holding whatever they held before. vLLM recomputes them (with
``kv_load_failure_policy`` ``recompute``), but not before this step's forward has read them: the request
that loaded them, any other request of the step that hit them in vLLM's prefix cache (vLLM registers a
loading block at allocation), and, with tensor parallelism, every rank (a rank whose own load succeeded
still computes from the failed rank's pages through the all-reduce). With asynchronous scheduling, the
next step may already be planned on top of them. What such a forward computes is wrong, and a tier never
overwrites a block it holds: saving it would serve it to every later request with that prefix.

So the worker keeps a taint set of vLLM block ids:
    a block whose load failed on any rank (the ranks agree on the union, ``RankGroup.union``) is tainted;
    a block loaded on every rank is clean;
    a block a save span computed is clean if none of its request's earlier blocks (``BlockSpan.deps``) is
    tainted, and tainted otherwise (it attended to them) - and then it is not saved.
Blocks recomputed in the same step count as clean for the other spans of that step (vLLM writes every
block's KV before attention reads it, layer by layer). Nothing else clears a taint: a block rewritten by
a path the connector does not see stays tainted and only costs a save, never correctness.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tierkv.integrations.vllm.meta import BlockSpan

log = logging.getLogger("vllm.tierkv")

__all__ = ["LoadGuard", "RankGroup", "RanksDisagree", "tp_group"]


class RanksDisagree(RuntimeError):
    """Another rank did not reach the agreement in time (its step failed): nothing of this step is sound."""


class RankGroup:
    """The tensor-parallel ranks of one engine, over a CPU (gloo) process group; one rank needs none."""

    def __init__(self, group: Any = None, size: int = 1, rank: int = 0, timeout_s: float = 120.0) -> None:
        self.group = group
        self.size = size
        self.rank = rank
        self.timeout_s = timeout_s

    def union(self, ids: set[int]) -> set[int]:
        """The union of every rank's ``ids`` (a collective: every rank calls it at the same point). Costs one
        all-reduce of a flag; the sets themselves travel only when some rank has one. Raises
        ``RanksDisagree`` when a rank does not come (a forward that raised on it still runs wait_for_save,
        in a ``finally``, while the others wait in theirs): bounded, not a hang."""
        if self.size == 1:
            return set(ids)
        import datetime

        import torch.distributed as dist

        flag = torch.tensor([1 if ids else 0], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise RanksDisagree(
                f"the tensor-parallel ranks did not agree in {self.timeout_s:.0f} s: {exc}"
            ) from exc
        if not int(flag.item()):
            return set()
        every: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(every, sorted(ids), group=self.group)
        except RuntimeError as exc:  # a rank gone between the two collectives: as out of step
            raise RanksDisagree(
                f"the tensor-parallel ranks did not exchange their failed loads: {exc}"
            ) from exc
        return set().union(*(set(x) for x in every))


def tp_group(tp_size: int) -> RankGroup:
    """This worker's tensor-parallel group as vLLM set it up; raises ``RuntimeError`` when that cannot be
    told for certain (then every rank would share rank 0's keys: the connector must turn off)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        size, rank, cpu_group = int(group.world_size), int(group.rank_in_group), group.cpu_group
    except Exception as exc:
        if tp_size == 1:  # no distributed state (one worker in the engine process, a unit test)
            return RankGroup()
        raise RuntimeError(
            f"cannot tell this worker's tensor-parallel rank ({type(exc).__name__}: {exc})"
        ) from exc
    if size != tp_size or not 0 <= rank < size:
        raise RuntimeError(f"tensor-parallel group of {size} (rank {rank}) where the engine has {tp_size}")
    return RankGroup(cpu_group if size > 1 else None, size, rank)


class LoadGuard:
    def __init__(self) -> None:
        self.tainted: set[int] = set()
        self._failed: set[int] = set()  # this step, this rank
        self._loaded: set[int] = set()

    def loaded(self, block_ids: Iterable[int]) -> None:
        self._loaded.update(block_ids)

    def failed(self, block_ids: Iterable[int]) -> None:
        self._failed.update(block_ids)

    def settle(self, ranks: RankGroup, agree: bool) -> set[int]:
        """After the step's forward: the blocks whose load failed on any rank (tainted from now on).
        ``agree``: the step had loads (the same on every rank: it comes from the scheduler's metadata), so
        the ranks exchange their failures; a step without loads needs no collective."""
        failed = ranks.union(self._failed) if agree else set(self._failed)
        self.tainted -= self._loaded - failed
        self.tainted |= failed
        self._failed.clear()
        self._loaded.clear()
        return failed

    def split(self, spans: Sequence[BlockSpan]) -> tuple[list[BlockSpan], list[BlockSpan]]:
        """``spans`` (this step's saves) as (those whose KV is sound, those computed from a tainted block).
        Updates the taint set: the first kind's blocks are clean, the second's tainted."""
        pending = list(spans)
        if not self.tainted:
            return pending, []
        sound: list[BlockSpan] = []
        recomputed: set[int] = set()
        progress = True
        while progress and pending:  # a span whose deps another sound span of this step recomputes
            progress = False
            for span in list(pending):
                if self.tainted.isdisjoint(set(span.deps) - recomputed):
                    sound.append(span)
                    pending.remove(span)
                    if not span.cached:  # (a span of blocks computed before the step recomputes none)
                        recomputed.update(span.block_ids)
                    progress = True
        self.tainted -= recomputed
        for span in pending:
            if not span.cached:  # (its blocks are as they were: not computed from a tainted one now)
                self.tainted.update(span.block_ids)
        return sound, pending
