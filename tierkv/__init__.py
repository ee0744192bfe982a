"""tierkv: a tiered (host RAM + durable disk) KV-cache store for LLM inference."""

from tierkv.codec import Codec
from tierkv.errors import (
    ConfigError,
    NamespaceConflictError,
    RecordError,
    StoreFormatError,
    StoreOpenError,
    TierKVError,
)
from tierkv.keys import BlockChain, BlockKey, Namespace, NamespaceDigest, block_keys
from tierkv.store import Hit, TieredStore

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
    "RecordError",
    "StoreFormatError",
    "StoreOpenError",
    "TierKVError",
    "TieredStore",
    "block_keys",
]
