"""Restore or recompute, decided per request: read a cached run of blocks only when that is faster than
computing it.

A slow tier (a busy network disk, a remote store across a congested link) can take longer to read a
prefix than the GPU takes to compute it (SGLang users measured file-backend hits at 8K tokens slower than
recompute: 2,450 ms against 1,725 ms). The planner keeps two moving estimates from real work:

    each tier's read bandwidth     bytes over seconds of every run of blocks a restore read from it
    each model's prefill speed     tokens over seconds of the forwards that computed a prompt's suffix

and cuts a restore's prefix where reading the rest would cost more than computing it. Without both
estimates it reads everything (the optimistic default). A tier judged too slow is read anyway once every
``EXPLORE_EVERY`` cuts, so its estimate recovers when the tier does.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

__all__ = ["RestorePlanner"]

EXPLORE_EVERY = 16  # cuts of a tier between two reads of it anyway (its estimate stays current)
WEIGHT = 0.3  # of a new observation in the moving estimates
MIN_SECONDS = 1e-5  # shorter observations say more about the clock than about the tier


class RestorePlanner:
    def __init__(self) -> None:
        self._read_Bps: dict[str, float] = {}
        self._prefill_tps: dict[str, float] = {}
        self._cuts: dict[str, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _update(table: dict[str, float], key: str, rate: float) -> None:
        old = table.get(key)
        table[key] = rate if old is None else (1 - WEIGHT) * old + WEIGHT * rate

    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds >= MIN_SECONDS:
            with self._lock:
                self._update(self._read_Bps, tier, nbytes / seconds)

    def observe_prefill(self, model: str, tokens: int, seconds: float) -> None:
        """``seconds`` must be the forward's real duration (on a GPU: after a synchronize, not the
        kernels' launch) of ``tokens`` computed after whatever was restored."""
        if tokens > 0 and seconds >= MIN_SECONDS:
            with self._lock:
                self._update(self._prefill_tps, model, tokens / seconds)

    def estimates(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {"read_Bps": dict(self._read_Bps), "prefill_tokens_per_s": dict(self._prefill_tps)}

    def cut(
        self,
        model: str,
        tiers: Sequence[str],
        block_nbytes: int,
        block_tokens: int,
        memory: Collection[str] = (),
    ) -> int:
        """How many leading blocks of a cached prefix to read; block ``i`` would come from ``tiers[i]``.

        Minimises (reading blocks ``0..c-1``) + (computing blocks ``c..``) over ``c``; the whole prefix
        when an estimate is missing. A cut never starts in a ``memory`` tier: copying from RAM beats any
        prefill, and one badly timed prefill report must not switch the memory tiers off.
        """
        n = len(tiers)
        with self._lock:
            tps = self._prefill_tps.get(model)
            bws = [self._read_Bps.get(t) for t in dict.fromkeys(tiers)]
            if not n or tps is None or any(bw is None for bw in bws):
                return n
            compute_s = block_tokens / tps
            read_s = {t: block_nbytes / self._read_Bps[t] for t in dict.fromkeys(tiers)}
            costs, read = [], 0.0
            for c in range(n + 1):  # reading blocks 0..c-1, then computing c..n-1
                costs.append(read + (n - c) * compute_s)
                if c < n:
                    read += read_s[tiers[c]]
            allowed = [c for c in range(n) if tiers[c] not in memory] + [n]
            best = min(allowed, key=lambda c: (costs[c], -c))  # a tie reads
            if best == n:
                return n
            skipped = tiers[best]  # the tier the cut starts in is the one judged too slow
            self._cuts[skipped] = self._cuts.get(skipped, 0) + 1
            if self._cuts[skipped] % EXPLORE_EVERY == 0:
                return n  # read it anyway: a fresh measurement of that tier
            return best
