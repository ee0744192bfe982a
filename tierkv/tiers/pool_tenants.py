"""Whose block each slot of a memory pool holds, for tenant quotas (``pool.BlockPool``'s bookkeeping).

Each tenant's keys are kept in their own least-recently-used order, so that finding a victim among the
tenants above their quota walks only those tenants' keys. Every method runs under the pool's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from tierkv.keys import BlockKey
from tierkv.tenancy import Quota

__all__ = ["PoolTenants"]


class PoolTenants:
    def __init__(self) -> None:
        self._of: dict[BlockKey, bytes] = {}
        self._keys: dict[bytes, OrderedDict[BlockKey, None]] = {}  # each tenant's keys, LRU first
        self.quota_nbytes: dict[bytes, int] = {}  # empty: no tenant has a quota here (plain LRU)

    def add(self, key: BlockKey, tenant: bytes) -> None:
        self._of[key] = tenant
        self._keys.setdefault(tenant, OrderedDict())[key] = None

    def forget(self, key: BlockKey) -> None:
        tenant = self._of.pop(key, None)
        if tenant is not None:
            keys = self._keys[tenant]
            del keys[key]
            if not keys:
                del self._keys[tenant]

    def recent(self, key: BlockKey) -> None:
        tenant = self._of.get(key)
        if tenant is not None:
            self._keys[tenant].move_to_end(key)

    def set_quotas(self, quotas: dict[bytes, Quota]) -> None:
        self.quota_nbytes = (
            {t: q.host_nbytes or 0 for t, q in quotas.items()}
            if any(q.host_nbytes is not None for q in quotas.values())
            else {}
        )

    def victim(
        self,
        tenant: bytes | None,
        slot_nbytes: int,
        evictable: Callable[[BlockKey], bool],
        incoming: int = 1,
    ) -> BlockKey | None:
        """The least recently used ``evictable`` block of the tenant furthest above its quota (a tenant
        without one is above it with any block; ``tenant``, whose blocks need the slots, counts with its
        ``incoming`` ones: this one, and those of its run taken and not yet published); None if no tenant
        is above its quota, or none of theirs is evictable."""
        if not self.quota_nbytes:
            return None
        excess = {
            t: (len(keys) + (incoming if t == tenant else 0)) * slot_nbytes - self.quota_nbytes.get(t, 0)
            for t, keys in self._keys.items()
        }
        for t in sorted((t for t, x in excess.items() if x > 0), key=lambda t: -excess[t]):
            for key in self._keys[t]:
                if evictable(key):
                    return key
        return None

    def usage(self, slot_nbytes: int) -> dict[bytes, int]:
        return {t: len(keys) * slot_nbytes for t, keys in self._keys.items()}
