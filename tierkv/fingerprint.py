"""Fingerprints that make a namespace: the model's config and its exact weights.

The weights fingerprint is xxh3-128 over every parameter and buffer (name, dtype, shape, bytes) in
``state_dict`` order, computed from the loaded model in memory: it changes when any weight changes
(fine-tunes, re-quantisations, a different seed), and costs one pass over the weights at memory
bandwidth (about 10 ms for the 35M default, about a second per 10 GB). Pass ``revision`` to skip it.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import xxhash

__all__ = ["VOLATILE_CONFIG_KEYS", "config_hash", "stable_config", "weights_fingerprint"]


# Config entries that do not change the KV: where the model was loaded from, library versions, the load
# dtype (the namespace has its own), how attention was picked.
VOLATILE_CONFIG_KEYS = (
    "_name_or_path",
    "transformers_version",
    "_commit_hash",
    "torch_dtype",
    "dtype",
    "_attn_implementation_autoset",
    "_attn_implementation_internal",
)


def stable_config(config: dict[str, Any], also: tuple[str, ...] = ()) -> dict[str, Any]:
    """``config`` without ``VOLATILE_CONFIG_KEYS`` (and ``also``)."""
    return {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS and k not in also}


def config_hash(model: Any) -> str:
    cfg = stable_config(model.config.to_dict())
    return xxhash.xxh3_128_hexdigest(json.dumps(cfg, sort_keys=True, default=str).encode())


def weights_fingerprint(model: Any) -> str:
    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
            data = t.detach().contiguous()
            if data.device.type != "cpu":
                data = data.cpu()
            h.update(data.view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()
