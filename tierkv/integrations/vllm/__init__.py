"""tierkv as a vLLM KV connector.

    kv_transfer_config={"kv_connector": "TierKVConnector",
                        "kv_connector_module_path": "tierkv.integrations.vllm",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cache_dir": "/var/cache/tierkv", "disk_bytes": "100GiB"}}

    connector.py  TierKVConnector: the class vLLM loads, one instance per role
    scheduler.py  lookups and each step's plan of loads and saves
    worker.py     blocks between vLLM's paged KV and the store
    layout.py     a backend's paged block <-> tierkv's canonical block, learned from the backend
    namespace.py  the namespace (model fingerprint, dtype, layout tag, block size, tenant salt)
    options.py    kv_connector_extra_config, and the one store a process opens
    meta.py       what the scheduler side sends the workers

Importing this package needs nothing; ``TierKVConnector`` (loaded on first access) needs vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TierKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierKVConnector":
        try:
            module = importlib.import_module("tierkv.integrations.vllm.connector")
        except ImportError as exc:
            raise ImportError(
                f"TierKVConnector needs vLLM ({exc}); install it with "
                "`scripts/setup.sh vllm` (CPU) or `pip install vllm`"
            ) from exc
        return module.TierKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
