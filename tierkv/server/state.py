"""What the app serves: the store, the model, the executor, the metrics and the miss log, built from a ServeConfig."""

from __future__ import annotations

import logging
from typing import Any

import torch

from tierkv.errors import ConfigError
from tierkv.server.config import ServeConfig, check_device
from tierkv.server.engine import Engine
from tierkv.server.metrics import Metrics
from tierkv.server.responses import JSON, error, unauthorized
from tierkv.server.tenants import RESERVED, Tenants, namespace_salt
from tierkv.store import TieredStore
from tierkv.tenancy import Quota
from tierkv.tiers.gpu import gpu_budget_nbytes
from tierkv.units import format_size
from tierkv.worker import CachedModel

log = logging.getLogger("tierkv.server")


class Unauthorized(Exception):
    """A request without a valid API key on a server with keys (HTTP 401)."""


class Server:
    """What the app serves: the store, the model, the executor and the metrics."""

    def __init__(self, config: ServeConfig, cm: CachedModel, store: TieredStore | None) -> None:
        self.config = config
        self.cm = cm
        self.store = store
        trained, scaled = model_context(cm.model.config)
        if scaled is not None and config.max_context > scaled:  # positions it never saw: answers degrade
            raise ConfigError(
                f"max_context {config.max_context} is beyond the model's context of {scaled} tokens "
                f"(its max_position_embeddings, times any rope scaling); give at most that, or 0 for its "
                f"trained context ({trained})"
            )
        max_context = config.max_context or trained or 4096
        self.engine = Engine(
            cm,
            max_queue=config.max_queue,
            max_context=max_context,
            use_cache=not config.no_cache and store is not None,
        )
        self.metrics = Metrics(self)
        self.model_name = cm.base_namespace.model_id
        # Token ids the model's embedding can look up: any other id is an IndexError on CPU and a
        # device-side assert on a GPU (which poisons the CUDA context for every later request).
        self.vocab_size = int(cm.model.get_input_embeddings().num_embeddings)
        from tierkv.explain import MissLog

        self.misses = MissLog(debug_prompts=config.debug_prompts)
        self.tenants = Tenants(config.api_keys, self._set_quotas) if config.api_keys else None

    def _set_quotas(self, quotas: dict[bytes, Quota]) -> None:
        if self.store is None:
            return
        self.store.set_quotas(quotas)
        for tier_name, field in (("disk", "disk_nbytes"), ("host", "host_nbytes")):
            tier = self.store.tier(tier_name)
            size = tier.stats()["capacity_nbytes"] if tier is not None else 0
            reserved = sum(getattr(q, field) or 0 for q in quotas.values())
            if size and reserved > size:
                log.warning(
                    "api keys: the tenants' %s quotas (%s) add up to more than the %s tier (%s): a "
                    "tenant within its quota may lose blocks to another",
                    tier_name,
                    format_size(reserved),
                    tier_name,
                    format_size(size),
                )

    def request_salt(self, authorization: str | None, cache_salt: str | None) -> str | JSON:
        """``salt_of``, or the error response to send instead (401 without a valid key, 400 for a
        reserved ``cache_salt``)."""
        try:
            return self.salt_of(authorization, cache_salt)
        except Unauthorized as exc:
            return unauthorized(str(exc))
        except ConfigError as exc:
            return error(400, str(exc), param="cache_salt")

    def salt_of(self, authorization: str | None, cache_salt: str | None) -> str:
        """The namespace salt of a request: its tenant's (from its API key) and its ``cache_salt``.
        ``Unauthorized`` when the server has keys and the request's is missing or unknown."""
        if self.tenants is None:
            if (cache_salt or "").startswith(RESERVED):  # a keyed server's tenant space, on a shared store
                raise ConfigError(f"cache_salt: the prefix {RESERVED!r} is reserved for tenants of API keys")
            return cache_salt or ""
        tenant = self.tenants.tenant(authorization)
        if tenant is None:
            raise Unauthorized("a valid API key is needed: Authorization: Bearer <key>")
        return namespace_salt(tenant, cache_salt or "")

    def close(self) -> None:
        self.engine.close()
        if self.store is not None:
            self.store.flush()
            self.store.close()


def load_server(config: ServeConfig) -> Server:
    device = check_device(config.device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        dtype = getattr(torch, config.dtype)
    store = None if config.no_cache else open_store(config)
    try:
        return _serving(config, store, dtype, device)
    except BaseException:  # the model failed to load, say: the store is closed, its files and lock left clean
        if store is not None:
            store.close()
        raise


def _serving(config: ServeConfig, store: TieredStore | None, dtype: torch.dtype, device: str) -> Server:
    if config.model:
        cm = CachedModel.from_pretrained(
            config.model,
            store,
            dtype=dtype,
            device=device,
            block_tokens=config.block_tokens,
            revision=config.revision,
        )
    else:
        cm = CachedModel.default(store, dtype=dtype, device=device, block_tokens=config.block_tokens)
    cm.self_check_rate = config.self_check_rate
    if store is not None:  # sized after the model is loaded, so a fraction sees its weights as used
        gpu_nbytes = gpu_budget_nbytes(config.gpu_cache, cm.device)
        if gpu_nbytes:
            store.add_gpu_tier(gpu_nbytes, cm.device)
    return Server(config, cm, store)


def model_context(model_config: Any) -> tuple[int | None, int | None]:
    """The context a model was trained at (its text config's max_position_embeddings: a multimodal
    config keeps it there) and the most its rope scaling stretches that to; None where it does not say
    (ALiBi models have no such field: nothing to hold a --max-context to)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    trained = getattr(text, "max_position_embeddings", None)
    if not isinstance(trained, int) or trained <= 0:
        return None, None
    scaling = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None)
    if isinstance(scaling, dict):
        factor = scaling.get("factor")
        if isinstance(factor, (int, float)) and factor > 1:
            base = scaling.get("original_max_position_embeddings") or trained
            return trained, max(trained, int(base * factor))
    return trained, trained


def open_store(config: ServeConfig) -> TieredStore:
    return TieredStore.from_config(config.store_config())


__all__ = ["Server", "Unauthorized", "load_server", "open_store"]
