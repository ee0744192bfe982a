"""The engine's reused buffers (``tierkv/buffers.py``) and a server's restore buffer reserved at start-up."""

import platform
import sys

import pytest
import torch

from tierkv import TieredStore
from tierkv.buffers import ReusedBuffers
from tierkv.worker import CachedModel

from helpers import resident_nbytes, run_python


def test_a_cpu_buffer_is_kept_and_grown_at_least_twofold() -> None:
    bufs = ReusedBuffers(torch.float32, torch.device("cpu"))
    a = bufs.get("restore", (2, 100, 3), grow_dim=1)
    assert a.shape == (2, 100, 3)
    b = bufs.get("restore", (2, 60, 3), grow_dim=1)
    assert b.shape == (2, 60, 3) and b.data_ptr() == a.data_ptr()  # the same memory, not a new allocation
    c = bufs.get("restore", (2, 130, 3), grow_dim=1)
    assert c.shape == (2, 130, 3) and c.data_ptr() != a.data_ptr()
    d = bufs.get("restore", (2, 200, 3), grow_dim=1)
    assert d.data_ptr() == c.data_ptr()  # grown to twice 100, not to 130: a growing prompt reallocates rarely
    assert bufs.get("save", (4, 5), grow_dim=0).data_ptr() != d.data_ptr()  # each name its own


def test_a_buffer_grows_no_further_than_a_call_can_need() -> None:
    """Twice its length, but never past ``max_len`` (the context) unless the call itself needs more; and
    a view of another shape than the buffer's is refused, not served wrong."""
    bufs = ReusedBuffers(torch.float32, torch.device("cpu"))
    bufs.get("restore", (2, 100, 3), grow_dim=1, max_len=150)
    grown = bufs.get("restore", (2, 120, 3), grow_dim=1, max_len=150)
    assert grown.data_ptr() == bufs.get("restore", (2, 150, 3), grow_dim=1, max_len=150).data_ptr()
    assert bufs._kept["restore"].shape[1] == 150  # not 200
    assert bufs.get("restore", (2, 170, 3), grow_dim=1, max_len=150).shape == (2, 170, 3)
    assert (
        bufs.get("small", (1, 3), grow_dim=0, min_len=16).data_ptr()
        == bufs.get("small", (16, 3), 0).data_ptr()
    )
    with pytest.raises(AssertionError):
        bufs.get("restore", (3, 10, 3), grow_dim=1)


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only (mincore)")
def test_a_reserved_buffer_is_resident_before_reserve_returns() -> None:
    bufs = ReusedBuffers(torch.float32, torch.device("cpu"))
    assert bufs.reserve("restore", (4, 2, 8192, 64), grow_dim=2)  # 16 MiB
    buf = bufs.get("restore", (4, 2, 8192, 64), grow_dim=2)
    assert resident_nbytes(buf) >= (16 << 20) - (8 << 10)  # all but its partial first and last pages


def test_a_server_reserves_the_restore_buffer_its_restores_then_use(tmp_path) -> None:
    """``reserve_restore`` sizes the buffer for the model's context, within the byte cap, in whole blocks;
    a prefill's restore then lands in that memory (no fresh pages on the request's path)."""
    with TieredStore.open(tmp_path, host_bytes=64 << 20) as store:
        cm = CachedModel.default(store)
        ns = cm.base_namespace
        token_nbytes = 2 * ns.num_layers * ns.num_kv_heads * ns.head_dim * 4
        tokens = cm.reserve_restore(max_nbytes=300 * token_nbytes)
        assert tokens == 300 // ns.block_tokens * ns.block_tokens
        reserved = cm._buffers.get("restore", (ns.num_layers, 2, tokens, ns.num_kv_heads, ns.head_dim), 2)
        if sys.platform == "linux":  # faulted in already, by reserve_restore
            assert resident_nbytes(reserved) >= reserved.numel() * 4 - (8 << 10)
        prompt = list(range(1, 3 * ns.block_tokens + 5))
        cm.prefill(prompt)
        store.flush()
        seen = []
        real = store.restore

        def spying(*args, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(kwargs["out"].data_ptr())
            return real(*args, **kwargs)

        store.restore = spying  # type: ignore[method-assign]
        pre = cm.prefill(prompt)
        assert pre.hit.num_tokens == 3 * ns.block_tokens
        assert seen == [reserved.data_ptr()]
        cap = cm.model.config.max_position_embeddings
        assert cm.reserve_restore(max_nbytes=1 << 40) == cap // ns.block_tokens * ns.block_tokens
        # A server's --max-context bounds it (and what a restore buffer later grows to).
        assert (
            cm.reserve_restore(context_tokens=100, max_nbytes=1 << 40)
            == 100 // ns.block_tokens * ns.block_tokens
        )
        assert cm.context_tokens == 100
    assert CachedModel.default(None).reserve_restore() == 0  # no store: nothing to restore into


def test_a_warm_up_forwards_through_the_model_and_touches_no_store(tmp_path) -> None:
    with TieredStore.open(tmp_path, host_bytes=16 << 20) as store:
        cm = CachedModel.default(store)
        calls = []
        cm.model.register_forward_hook(lambda module, args, out: calls.append(1))
        assert cm.warm_up() > 0
        assert calls == [1, 1, 1]  # a short prefill, a step after it, a few tokens after a restored prefix
        stats = store.stats()
        assert stats["store"]["miss_blocks"] == stats["store"]["hit_blocks"] == 0  # no lookup
        assert stats["disk"]["used_nbytes"] == 0 and stats["host"]["blocks"] == 0  # nothing saved


def test_a_repeated_prompt_reports_no_cache_write_for_the_block_it_recomputes(tmp_path) -> None:
    """The last full block of a prompt made of whole blocks is computed again (a token must be), and saved
    again: the store already holds it, so no tokens are written (``cache_write_tokens``)."""
    with TieredStore.open(tmp_path, host_bytes=16 << 20) as store:
        cm = CachedModel.default(store)
        B = cm.base_namespace.block_tokens
        prompt = list(range(1, 4 * B + 1))
        first = cm.prefill(prompt)
        store.flush()
        again = cm.prefill(prompt)
        assert first.saved_tokens == 4 * B
        assert again.hit.num_tokens == 3 * B and again.saved_tokens == 0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_server_process_keeps_what_it_frees_for_its_next_requests(monkeypatch) -> None:
    """``keep_freed_memory``: a freed 24 MiB allocation (a request's KV cache, a few MiB a layer) stays
    with the process, its pages faulted already, where glibc would otherwise unmap it."""
    code = (
        "import sys\n"
        "from tierkv.server.startup import keep_freed_memory\n"
        "if sys.argv[1] == 'keep': assert keep_freed_memory()\n"
        "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "b = bytearray(24 << 20)\n"  # zero-filled: every page touched
        "before = rss(); del b; print(before - rss())\n"
    )
    given_back = {how: int(run_python(code, how).stdout.split()[-1]) for how in ("keep", "default")}
    assert given_back["default"] > 20 << 20  # unmapped on free
    assert given_back["keep"] < 4 << 20  # kept
    from tierkv.server.startup import keep_freed_memory

    monkeypatch.setenv("TIERKV_KEEP_FREED_MEMORY", "0")
    assert not keep_freed_memory()  # the operator's way out


def test_the_http_warm_up_loads_what_the_first_streamed_answer_would() -> None:
    """``warm_up_http``: anyio's asyncio backend, which the HTTP stack imports on its first streamed
    answer, is loaded before the first request (in a fresh process: this one may have loaded it already)."""
    code = (
        "import sys\n"
        "from tierkv.server.startup import warm_up_http\n"
        "name = 'anyio._backends._asyncio'\n"
        "before = name in sys.modules\n"
        "warm_up_http()\n"
        "print(before, name in sys.modules)\n"
    )
    assert run_python(code).stdout.split()[-2:] == ["False", "True"]


def test_a_prefill_holds_paced_populators_back_and_a_decoding_step_does_not() -> None:
    """A prefill on CPU counts as foreground work (``prefault.foreground``), as a restore does: a host tier
    populated behind pauses while it runs, and resumes after. A decoding step does not: steps follow each
    other, and the populator would starve."""
    from tierkv.tiers import prefault

    cm = CachedModel.default(None)
    seen: list[int] = []
    cm.model.register_forward_hook(lambda module, args, out: seen.append(prefault._foreground))
    cm.generate(list(range(1, 40)), 3)
    assert seen == [1, 0, 0]  # the prefill, then two steps
    assert prefault._foreground == 0
