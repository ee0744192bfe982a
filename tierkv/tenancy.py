"""Tenants as the store sees them: an id read off a namespace's salt, and each tenant's quotas.

A tenant's namespaces have the salt ``tenant:<HMAC of its secret salt>\\x1f<cache_salt>``
(``namespace_salt``): the server derives it from the request's API key (``server/tenants.py``). Every
process on a cache directory can tell a block's tenant from its namespace alone, with no secret: the id
is the first 16 bytes of the derived part. Quotas are configured by name in the keys file; the server
hands the store ``{tenant id: Quota}``, and the disk tier persists them, so that ``tierkv gc`` and other
processes evict by the same rules, and ``tierkv stats`` can name tenants without knowing their secrets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from typing import Any

__all__ = [
    "RESERVED",
    "TENANT_ID_NBYTES",
    "Quota",
    "derived_salt",
    "namespace_salt",
    "quotas_from_json",
    "quotas_to_json",
    "tenant_id",
]

RESERVED = "tenant:"  # namespace salts of tenants start so: a client's own cache_salt may not
TENANT_ID_NBYTES = 16
_DERIVED_HEX = 64  # hex digits of the derived salt (HMAC-SHA256)


def derived_salt(secret_salt: str) -> str:
    """What a tenant's namespaces carry in place of its secret salt (which is never stored: namespaces
    are written to the index, stats and archives)."""
    return hmac.new(secret_salt.encode(), b"tierkv namespace", hashlib.sha256).hexdigest()


def namespace_salt(secret_salt: str | None, cache_salt: str) -> str:
    """The namespace salt of a request of a tenant (None: no tenant); its ``cache_salt`` cannot reach
    another tenant's space (the separator is not in the derived part)."""
    if secret_salt is None:
        return cache_salt
    return f"{RESERVED}{derived_salt(secret_salt)}\x1f{cache_salt}"


def tenant_id(salt: str) -> bytes | None:
    """The tenant id of a namespace salt; None for a namespace of no tenant."""
    if not salt.startswith(RESERVED) or len(salt) < len(RESERVED) + _DERIVED_HEX + 1:
        return None
    derived = salt[len(RESERVED) : len(RESERVED) + _DERIVED_HEX]
    if salt[len(RESERVED) + _DERIVED_HEX] != "\x1f":
        return None
    try:
        return bytes.fromhex(derived)[:TENANT_ID_NBYTES]
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class Quota:
    """One tenant's shares. A byte quota is what the tenant keeps when a tier must evict: eviction takes
    first from tenants above theirs (a tenant without one is above it with any block), oldest first. It
    does not cap a tenant while there is room. ``pin_nbytes`` caps the tenant's pins (within the store's
    pin budget)."""

    name: str
    disk_nbytes: int | None = None
    host_nbytes: int | None = None
    pin_nbytes: int | None = None


def quotas_to_json(quotas: dict[bytes, Quota]) -> bytes:
    return json.dumps(
        {tid.hex(): dataclasses.asdict(q) for tid, q in sorted(quotas.items())}, sort_keys=True
    ).encode()


def quotas_from_json(raw: bytes | None) -> dict[bytes, Quota]:
    """The stored quotas; ValueError for anything but what ``quotas_to_json`` writes (fields a later
    build adds are ignored)."""
    if not raw:
        return {}
    data: Any = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not an object")
    out: dict[bytes, Quota] = {}
    for h, q in data.items():
        tid = bytes.fromhex(h)
        if len(tid) != TENANT_ID_NBYTES or not isinstance(q, dict) or not isinstance(q.get("name"), str):
            raise ValueError(f"bad tenant entry {h!r}")
        sizes = {}
        for field in ("disk_nbytes", "host_nbytes", "pin_nbytes"):
            v = q.get(field)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"tenant {h!r}: {field} {v!r}")
            sizes[field] = v
        out[tid] = Quota(q["name"], **sizes)
    return out
