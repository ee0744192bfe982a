"""Namespaces and chained block keys.

``key_i = blake2b-256(key_{i-1} || uint32-LE token ids of block i)``, ``key_{-1} = blake2b-256(digest)``.
The key of block i names the whole prefix 0..i, so a hit on block i implies hits on every block before
it, and changing one token renames every later block. blake2b needs no seed: keys are identical in every
process (never Python's ``hash()``).
"""

from __future__ import annotations

import array
import dataclasses
import functools
import hashlib
import json
import numbers
import sys
from collections.abc import Mapping, Sequence
from typing import NewType

import numpy as np

from tierkv.errors import ConfigError

__all__ = [
    "BlockChain",
    "BlockKey",
    "DTYPES",
    "KEY_NBYTES",
    "LAYOUT_VERSION",
    "Namespace",
    "NamespaceDigest",
    "TOKEN_NBYTES",
    "token_sequence",
    "block_keys",
    "chain_key",
    "root_key",
    "tokens_to_bytes",
]

BlockKey = NewType("BlockKey", bytes)  # 32 bytes
NamespaceDigest = NewType("NamespaceDigest", bytes)  # 32 bytes

KEY_NBYTES = 32
LAYOUT_VERSION = 1  # bump when the canonical block layout changes: old blocks then never match
# The one table of KV dtypes: name (as torch spells it) -> (its code in a record's header, bytes per element).
# The codes are on disk: never renumber one. codec and layout derive their views from this.
DTYPES: dict[str, tuple[int, int]] = {
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
    "float8_e4m3fn": (4, 1),
    "float8_e5m2": (5, 1),
}


def _blake(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=KEY_NBYTES).digest()


@dataclasses.dataclass(frozen=True)
class Namespace:
    """Everything besides the tokens that decides the KV values. Two namespaces never share a block."""

    model_id: str
    revision: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int = 64
    layout_version: int = LAYOUT_VERSION
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        for name in ("model_id", "revision", "dtype", "tenant_salt"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "layout_version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # (a numpy integer hashes as the int it is)
        if self.dtype not in DTYPES:
            raise ConfigError(f"unsupported KV dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.block_tokens <= 4096:
            raise ConfigError(f"block_tokens must be in 1..4096, got {self.block_tokens}")

    def to_json(self) -> str:
        # Sorted keys: the digest must not depend on field order.
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Namespace:
        return cls(**json.loads(text))

    @functools.cached_property
    def spec_bytes(self) -> bytes:
        """``to_json()`` encoded; cached, as the save path stores it with a namespace's first block."""
        return self.to_json().encode()

    @functools.cached_property
    def digest(self) -> NamespaceDigest:
        # Cached: the hot paths ask for it on every call (a frozen dataclass never changes).
        return NamespaceDigest(_blake(b"tierkv-namespace\0" + self.spec_bytes))

    @functools.cached_property
    def tenant_id(self) -> bytes | None:
        """The tenant of API keys whose namespace this is (``tenancy.tenant_id``); None for none."""
        from tierkv.tenancy import tenant_id

        return tenant_id(self.tenant_salt)

    def with_salt(self, tenant_salt: str) -> Namespace:
        return dataclasses.replace(self, tenant_salt=tenant_salt)


def root_key(digest: NamespaceDigest) -> BlockKey:
    return BlockKey(_blake(digest))


TOKEN_NBYTES = 4  # uint32 little-endian: the one encoding hashed and stored (the only place that knows)


_ARRAY_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"  # array("I") is the encoding


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """uint32 little-endian, the one encoding hashed and stored."""
    if _ARRAY_U32 and isinstance(token_ids, (list, tuple, range)):  # 4x faster than numpy's conversion
        try:
            return array.array("I", token_ids).tobytes()
        except OverflowError:
            raise ConfigError("token ids must be in 0..2**32-1") from None
        except TypeError:
            raise ConfigError("token ids must be integers") from None
    arr = np.asarray(token_ids)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ConfigError("token ids must be in 0..2**32-1")
    return arr.astype("<u4", copy=False).tobytes()


def token_sequence(token_ids: object) -> Sequence[int] | np.ndarray:
    """One prompt's token ids as given where they are a list, tuple or range (their values are checked as
    they are encoded), else as a 1-D integer array (a numpy array, a tensor); ConfigError for anything else.
    A tokenizer's ``[1, T]`` batch would otherwise read as a prompt of one token, and float ids as the
    integers they round down to: another prompt's blocks."""
    if isinstance(token_ids, (list, tuple, range)):
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            raise ConfigError(f"token ids must be one prompt's, 1-D; got a list of {len(token_ids)} lists")
        return token_ids
    if isinstance(token_ids, (str, bytes, bytearray, memoryview, Mapping)) or not hasattr(
        token_ids, "__len__"
    ):
        hint = " (a tokenizer's encoding: pass its input_ids)" if isinstance(token_ids, Mapping) else ""
        raise ConfigError(
            f"token ids must be a list, or a 1-D array or tensor, of integers; got {type(token_ids).__name__}"
            + hint
        )
    if hasattr(token_ids, "detach"):  # a tensor, on any device
        token_ids = token_ids.detach().cpu()
    try:
        arr = np.asarray(token_ids)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"token ids must be integers: {exc}") from None
    if arr.ndim != 1:
        raise ConfigError(f"token ids must be one prompt's, 1-D; got shape {list(arr.shape)}")
    if arr.size == 0:
        return arr.astype(np.int64)  # (np.array([]) is float64: no ids to mistake)
    if arr.dtype.kind == "O" and all(isinstance(t, numbers.Integral) for t in arr):
        return [int(t) for t in arr]  # (Python ints in an object array: checked as they are encoded)
    if arr.dtype.kind not in "iu":
        raise ConfigError(f"token ids must be integers, got {arr.dtype}")
    return arr


def chain_key(parent: BlockKey, block_token_bytes: bytes) -> BlockKey:
    return BlockKey(_blake(parent + block_token_bytes))


@dataclasses.dataclass(frozen=True)
class BlockChain:
    """A prompt's full blocks, named once: made once per prompt and passed to lookup, restore and save.

    ``keys[i]`` names blocks 0..i (a trailing partial block has none); ``token_bytes`` holds the full
    blocks' tokens as they are hashed and stored."""

    ns: Namespace
    keys: tuple[BlockKey, ...]
    token_bytes: bytes

    @classmethod
    def of(cls, ns: Namespace, token_ids: Sequence[int] | np.ndarray) -> BlockChain:
        token_ids = token_sequence(token_ids)
        n_blocks = len(token_ids) // ns.block_tokens
        data = tokens_to_bytes(token_ids[: n_blocks * ns.block_tokens])
        step = ns.block_tokens * TOKEN_NBYTES
        keys: list[bytes] = []
        parent: bytes = root_key(ns.digest)
        blake2b = hashlib.blake2b  # chain_key inline: two calls less per block (a 32K-token prompt has 512)
        for start in range(0, len(data), step):
            parent = blake2b(parent + data[start : start + step], digest_size=KEY_NBYTES).digest()
            keys.append(parent)
        return cls(ns, tuple(keys), data)  # type: ignore[arg-type]  # BlockKey is bytes

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self.ns.block_tokens

    @property
    def block_token_nbytes(self) -> int:
        return self.ns.block_tokens * TOKEN_NBYTES

    def tokens(self, i: int) -> bytes:
        """Block ``i``'s token ids, encoded."""
        step = self.block_token_nbytes
        return self.token_bytes[i * step : (i + 1) * step]

    def parent(self, i: int) -> BlockKey:
        return self.keys[i - 1] if i else root_key(self.ns.digest)

    def prefix(self, n_blocks: int) -> BlockChain:
        return BlockChain(
            self.ns, self.keys[:n_blocks], self.token_bytes[: n_blocks * self.block_token_nbytes]
        )


def block_keys(ns: Namespace, token_ids: Sequence[int] | np.ndarray) -> list[BlockKey]:
    """Keys of every full block of ``token_ids`` (a trailing partial block has none)."""
    return list(BlockChain.of(ns, token_ids).keys)
