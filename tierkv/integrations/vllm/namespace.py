"""The tierkv namespace of a vLLM engine: everything besides the tokens that decides its KV.

Both roles compute it from the same configuration (the scheduler never sees the model's weights), so it
is built from what both have: the ``VllmConfig`` and the ``KVCacheConfig``.

    model_id    the served model name (``stats`` and ``explain`` show it)
    revision    w:<xxh3-128 over the checkpoint files> (or the revision the user vouches for)
                +cfg:<hash of the model config> +q:<weight quantization> (+load:<load_format> unless auto)
                +vllm:<device>/<KV cache layout>/<cache spec> (the layout tag: a different one never hits)
                +tp<rank>of<size> (each tensor-parallel rank holds its own heads)
    dtype, layers, kv heads, head dim, block tokens    from the KV cache spec (vLLM's block size)
    tenant_salt the request's ``cache_salt``

What the connector cannot keep exactly is refused up front (``unsupported``): then it neither loads nor
saves, and vLLM runs as without it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import xxhash

from tierkv.fingerprint import stable_config
from tierkv.keys import Namespace

log = logging.getLogger("vllm.tierkv")

__all__ = ["checkpoint_fingerprint", "kv_namespace", "layout_tag", "unsupported", "with_epoch"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack")
_ALSO_VOLATILE = ("_attn_implementation",)  # beside fingerprint.VOLATILE_CONFIG_KEYS


def _kv_group(kv_cache_config: Any) -> Any:
    return kv_cache_config.kv_cache_groups[0]


def unsupported(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """Why this engine's KV cannot go through tierkv, or None when it can."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from tierkv.layout import DTYPE_NAMES

    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return "no KV cache configuration"
    if len(kv_cache_config.kv_cache_groups) != 1:
        return (
            f"{len(kv_cache_config.kv_cache_groups)} KV cache groups (a hybrid model): only models whose "
            "attention layers share one full-attention cache are supported"
        )
    spec = _kv_group(kv_cache_config).kv_cache_spec
    if type(spec) is not FullAttentionSpec or isinstance(spec, MLAAttentionSpec):
        return f"KV cache spec {type(spec).__name__}: only FullAttentionSpec (plain K and V) is supported"
    if spec.sliding_window is not None or spec.attention_chunk_size is not None:
        return "sliding-window or chunked-local attention"
    if spec.head_size_v != spec.head_size:
        return f"K and V head sizes differ ({spec.head_size}, {spec.head_size_v})"
    if spec.dtype not in DTYPE_NAMES or vllm_config.cache_config.cache_dtype != "auto":
        return f"KV cache dtype {vllm_config.cache_config.cache_dtype} ({spec.dtype}): only unquantized KV"
    if spec.num_head_slots is not None or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
        return "a packed KV cache page"
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        return "pipeline parallelism (each stage would need its own namespace; not done yet)"
    if parallel.decode_context_parallel_size != 1:
        return "decode context parallelism (tokens sharded across ranks)"
    if parallel.prefill_context_parallel_size != 1:
        return "prefill context parallelism (tokens sharded across ranks)"
    if _load_format(vllm_config) == "dummy":
        return "load_format dummy (random weights: their KV is no checkpoint's)"
    return None


def _load_format(vllm_config: Any) -> str:
    return str(vllm_config.load_config.load_format).lower()


@functools.lru_cache(maxsize=8)
def _hash_files(files: tuple[tuple[str, int, int, int], ...]) -> str:
    h = xxhash.xxh3_128()
    for path, size, _mtime, _inode in files:
        h.update(f"{Path(path).name}|{size}\n".encode())
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


def checkpoint_fingerprint(model: str) -> str | None:
    """xxh3-128 over the weight files of a local checkpoint (a directory, or one file such as a GGUF):
    names, sizes and every byte. None when ``model`` is not a local path. About a second per 10 GB from
    the page cache; computed once per process (both roles share it)."""
    path = Path(model).expanduser()
    if path.is_file():
        paths = [path]
    elif path.is_dir():
        paths = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    else:
        return None
    if not paths:
        return None
    files = tuple(
        (str(p), (st := p.stat()).st_size, st.st_mtime_ns, st.st_ino) for p in paths
    )  # the memo's key
    t0 = time.perf_counter()
    digest = _hash_files(files)
    log.debug("checkpoint fingerprint of %s: %s (%.2f s)", model, digest, time.perf_counter() - t0)
    return digest


def _config_hash(hf_config: Any) -> str:
    cfg = stable_config(
        hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config)), _ALSO_VOLATILE
    )
    return xxhash.xxh3_64_hexdigest(json.dumps(cfg, sort_keys=True, default=str).encode())


def layout_tag(vllm_config: Any, kv_cache_config: Any) -> str:
    """The KV layout as far as both roles can tell it: device type, the resolved ``KVCacheLayout`` and the
    cache spec. (How the backend places K and V inside a block is learned by the worker; see layout.py.)"""
    device = str(getattr(vllm_config.device_config, "device_type", "") or "unknown")
    layout = kv_cache_config.kv_cache_layout or "default"
    spec = type(_kv_group(kv_cache_config).kv_cache_spec).__name__
    return f"{device}/{layout}/{spec}"


def _weights(vllm_config: Any, revision: str | None) -> str:
    model_config = vllm_config.model_config
    if revision:
        return f"rev:{revision}"
    digest = checkpoint_fingerprint(model_config.model)
    if digest is not None:
        return f"w:{digest}"
    if model_config.revision:
        return f"hub:{model_config.revision}"
    commit = getattr(model_config.hf_config, "_commit_hash", None)
    if commit:
        return f"hub:{commit}"
    log.warning(
        "tierkv: cannot fingerprint %s (not a local checkpoint, no revision): its KV is keyed by "
        "name only; pass kv_connector_extra_config={'revision': ...} or a pinned --revision",
        model_config.model,
    )
    return "unversioned"


def kv_namespace(
    vllm_config: Any, kv_cache_config: Any, *, revision: str | None = None, tp_rank: int = 0
) -> Namespace:
    """The namespace of tensor-parallel rank ``tp_rank`` (the scheduler looks up rank 0's)."""
    from tierkv.layout import DTYPE_NAMES

    model_config = vllm_config.model_config
    group = _kv_group(kv_cache_config)
    spec = group.kv_cache_spec
    served = model_config.served_model_name
    model_id = (served[0] if isinstance(served, list) else served) or model_config.model
    model_id = os.path.basename(str(model_id).rstrip("/")) or str(model_id)
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    parts = [
        _weights(vllm_config, revision),
        f"cfg:{_config_hash(model_config.hf_config)}",
        f"q:{model_config.quantization or 'none'}",
        *([] if _load_format(vllm_config) == "auto" else [f"load:{_load_format(vllm_config)}"]),
        f"vllm:{layout_tag(vllm_config, kv_cache_config)}",
        f"tp{tp_rank}of{tp_size}",
    ]
    return Namespace(
        model_id=model_id,
        revision="+".join(parts),
        dtype=DTYPE_NAMES[spec.dtype],
        num_layers=len(group.layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        block_tokens=spec.block_size,
    )


def with_epoch(ns: Namespace, epoch: str) -> Namespace:
    """``ns`` after a reset of vLLM's external cache (``reset_prefix_cache(reset_connector=True)``, which vLLM
    also cascades after updating weights in place): a namespace of its own, so nothing saved before the
    reset is served after it, while the blocks on disk stay for the next engine that loads the weights
    from the checkpoint files again (the epoch is random: no other process ever shares it)."""
    return dataclasses.replace(ns, revision=f"{ns.revision}+reset:{epoch}") if epoch else ns
