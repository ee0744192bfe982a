"""tierkv: a tiered (host RAM + durable disk) KV-cache store for LLM inference.

The heavy names (the store pulls in torch) are imported on first use, so ``tierkv --help`` and the
shell commands start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tierkv.errors import (
    ConfigError,
    NamespaceConflictError,
    PinBudgetError,
    RecordError,
    StoreClosedError,
    StoreFormatError,
    StoreOpenError,
    TierKVError,
)

if TYPE_CHECKING:
    from tierkv.codec import Codec
    from tierkv.config import StoreConfig
    from tierkv.keys import BlockChain, BlockKey, Namespace, NamespaceDigest, block_keys
    from tierkv.retention import Retention
    from tierkv.store import Hit, TieredStore

_LAZY = {
    "Codec": "tierkv.codec",
    "BlockChain": "tierkv.keys",
    "BlockKey": "tierkv.keys",
    "Namespace": "tierkv.keys",
    "NamespaceDigest": "tierkv.keys",
    "block_keys": "tierkv.keys",
    "Hit": "tierkv.store",
    "Retention": "tierkv.retention",
    "TieredStore": "tierkv.store",
    "StoreConfig": "tierkv.config",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"
__all__ = [
    "BlockChain",
    "BlockKey",
    "Codec",
    "ConfigError",
    "Hit",
    "Namespace",
    "NamespaceConflictError",
    "NamespaceDigest",
    "PinBudgetError",
    "RecordError",
    "Retention",
    "StoreClosedError",
    "StoreFormatError",
    "StoreConfig",
    "StoreOpenError",
    "TierKVError",
    "TieredStore",
    "block_keys",
]
