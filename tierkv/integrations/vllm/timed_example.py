"""vLLM's ExampleConnector with its load timed, for ``tierkv bench --engine vllm``: loaded by vLLM
(``kv_connector_module_path``) in the benchmark's ExampleConnector servers only.

ExampleConnector loads a step's requests whole in ``start_load_kv`` (a safetensors file per layer, then an
index copy into the pages); each such call with loads appends ``{"s": seconds, "tokens": tokens}`` to the
file ``TIERKV_BENCH_LOAD_LOG`` names, which the benchmark reads after each request.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

__all__ = ["TimedExampleConnector"]


class TimedExampleConnector(ExampleConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        loads = [r for r in self._get_connector_metadata().requests if not r.is_store]
        t0 = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)
        seconds = time.perf_counter() - t0
        path = os.environ.get("TIERKV_BENCH_LOAD_LOG")
        if loads and path:
            with open(path, "a") as f:
                f.write(json.dumps({"s": seconds, "tokens": sum(len(r.slot_mapping) for r in loads)}) + "\n")
