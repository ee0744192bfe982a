"""The store's side of tenant quotas (``TieredStore`` inherits it): handing quotas to the tiers, adopting
those another process stored in the disk tier, and usage per tenant across the tiers."""

from __future__ import annotations

import logging
import time

from tierkv.open_calls import while_open
from tierkv.tenancy import Quota
from tierkv.tiers.base import Tier
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.pool import BlockPool

__all__ = ["QUOTA_REFRESH_S", "TenantQuotas"]

log = logging.getLogger("tierkv.store")

QUOTA_REFRESH_S = 10.0  # how often a process adopts the tenants' quotas another process stored


class TenantQuotas:
    tiers: list[Tier]  # (``TieredStore``'s)
    _quotas_read_s: float  # when the disk tier's stored quotas were last adopted

    @while_open
    def set_quotas(self, quotas: dict[bytes, Quota]) -> None:
        """The tenants' quotas, by tenant id (``tenancy``): the tiers that hold blocks of several tenants
        evict from those above their quota first; the disk tier stores them for every process on its
        directory."""
        for tier in self.tiers:
            tier.set_quotas(quotas)

    def _adopt_quotas(self) -> None:
        """The quotas stored in the disk tier by another process (the front before vLLM, a server on the
        same directory), for the memory tiers here too: read at most every ``QUOTA_REFRESH_S``, on a
        tenant's save (one LMDB read)."""
        now = time.monotonic()
        if now - self._quotas_read_s < QUOTA_REFRESH_S:
            return
        self._quotas_read_s = now
        disk = next((t for t in self.tiers if isinstance(t, DiskTier)), None)
        if disk is None:
            return
        try:
            quotas = disk.stored_quotas()
        except Exception as exc:  # (an LMDB read error): the quotas wait, the save goes on
            log.warning("the tenants' quotas could not be read from the disk tier: %s", exc)
            return
        for tier in self.tiers:
            if isinstance(tier, BlockPool):
                tier.set_quotas(quotas)

    @while_open
    def tenant_usage(self) -> dict[bytes, dict[str, int]]:
        """Per tenant id: ``disk_nbytes``, ``pinned_nbytes`` (disk) and ``host_nbytes``, where held."""
        out: dict[bytes, dict[str, int]] = {}
        for tier in self.tiers:
            for tid, row in tier.tenant_usage().items():
                out.setdefault(tid, {}).update(row)
        return out
