"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tierkv import Namespace
from tierkv.layout import KVSpec

REPO = Path(__file__).resolve().parents[1]


def make_kv(ns: Namespace, num_tokens: int, seed: int = 0) -> torch.Tensor:
    spec = KVSpec.of(ns)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(spec.shape(num_tokens), generator=g).to(spec.dtype)


def block_write(ns: Namespace, tokens: list[int], kv: torch.Tensor) -> Any:
    """The ``BlockWrite`` of the first block of ``tokens`` with KV ``kv`` (one block's), as a save makes."""
    from tierkv.keys import BlockChain
    from tierkv.tiers.base import BlockWrite

    chain = BlockChain.of(ns, tokens)
    payload = kv.contiguous().view(-1).view(torch.uint8)
    return BlockWrite(ns, chain.keys[0], chain.parent(0), chain.tokens(0), 0.0, payload)


@contextlib.contextmanager
def writer_held(store: Any) -> Iterator[None]:
    """The disk writer waits (in a barrier) until the block ends: what is saved meanwhile stays queued, and
    is then taken as one batch (it takes whatever is queued when it wakes)."""
    from tierkv.tiers.disk.write_items import Barrier

    batches = store.tier("disk").writer._batches
    gate, taken, handle = threading.Event(), threading.Event(), batches._handle

    def held(batch: list[Any]) -> None:
        if any(isinstance(i, Barrier) for i in batch):
            taken.set()
            gate.wait(30)
        handle(batch)

    batches._handle = held
    try:
        batches.put(Barrier())
        # The writer must hold the barrier's batch before anything is saved: a writer slow to wake would
        # otherwise take the barrier with the first save, and the next save as a batch of its own.
        assert taken.wait(30), "the disk writer did not take the barrier"
        yield
    finally:
        gate.set()
        batches._handle = handle


def save_byte_tokenizer(path: Path | str, chat_template: str | None = None) -> int:
    """A byte-level BPE tokenizer (``<s>`` 0, ``</s>`` 1, then the 256 byte symbols) saved as a Hugging Face
    tokenizer in ``path``, with ``chat_template`` if given; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return len(vocab)


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (a real second process), failing loudly on error."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A throwaway redis: no snapshots, no append-only file, loopback only.
REDIS_EPHEMERAL = ("--save", "", "--appendonly", "no", "--protected-mode", "yes")


class ServerProcess:
    """``tierkv serve`` in a subprocess on a free loopback port; ``stop()`` sends SIGTERM.

    The tests' server runs ``model`` (``--model tiny``, the random-weight test model, unless ``args`` name a
    model or a config file): ``tierkv serve``'s own default is smollm2."""

    def __init__(self, *args: str, cache_dir: Path | None = None, model: str = "tiny") -> None:
        import time
        import urllib.request

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._clients: list[Any] = []
        cmd = [
            sys.executable,
            "-m",
            "tierkv.cli",
            "serve",
            "--port",
            str(self.port),
            "--host-cache",
            "64MiB",
            *args,
        ]
        if not any(a.split("=")[0] in ("--model", "--config") for a in args):
            cmd += ["--model", model]
        if cache_dir is not None:
            cmd += ["--cache-dir", str(cache_dir)]
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"tierkv-serve-{self.port}.log", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not come up:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def client(self, **kwargs):  # noqa: ANN201
        """An OpenAI client of this server, closed by ``stop``: a client dropped with a kept-alive
        connection is closed by the cycle collector at any later point, and its ResourceWarning (an
        error here) then fails whichever test runs then (seen once, in test_cache_control)."""
        import openai

        client = openai.OpenAI(
            **{"base_url": self.url + "/v1", "api_key": "unused", "max_retries": 0, **kwargs}
        )
        self._clients.append(client)
        return client

    def stop(self, timeout: float = 60) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        # After the exit: a request in flight on another thread has had its answer (the server finishes
        # what it runs before it exits), and closing its client under it would fail it.
        for client in self._clients:
            client.close()
        self._clients.clear()
        return code


class RedisServer:
    """A real redis-server on a free loopback port, persistence off; ``kill()`` / ``start()`` for outages."""

    def __init__(self, *extra: str) -> None:
        import shutil

        if shutil.which("redis-server") is None:
            import pytest

            pytest.skip("redis-server is not installed (.ci/run installs it)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.extra = extra
        self.start()

    def start(self) -> None:
        import time

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", *REDIS_EPHEMERAL, *self.extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                client.ping()
                client.close()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def gc_beside(proc: subprocess.Popen[str], cache_dir: Path, options: list[list[str]]) -> tuple[int, str]:
    """Run ``tierkv gc`` with each of ``options`` in turn, in other processes, until ``proc`` (a writer)
    ends; every run must succeed and find nothing corrupt. Returns (gc runs, the writer's stdout)."""
    import json

    runs = 0
    while proc.poll() is None:
        for args in options:
            r = subprocess.run(
                [sys.executable, "-m", "tierkv.cli", "gc", "--cache-dir", str(cache_dir), *args, "--json"],
                capture_output=True,
                text=True,
                check=False,
            )
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["corrupt"] == 0
            runs += 1
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    return runs, out


class ReadFaults:
    """Reads of chosen records fail as a bad sector would (EIO by default), in both readers: through
    ``os.preadv`` (the Python reader) and the native reader's fault hook, at the same file ranges."""

    def __init__(self, monkeypatch: Any) -> None:
        self._monkeypatch = monkeypatch
        self._ranges: list[tuple[str, int, int, int]] = []  # (segment file name, start, end, errno)

    def fail(self, store: Any, chain: Any, blocks: list[int], err: int = errno.EIO) -> None:
        disk = store.tier("disk")
        entries = disk.locate(chain.keys)
        for i in blocks:
            seg_id, offset, nbytes = entries[i].location
            self._add(disk.segments.file(seg_id), offset, offset + nbytes, err)

    def fail_all(self, store: Any, err: int) -> None:
        """Every read of every segment fails, and so does opening one (a process out of descriptors)."""
        import tierkv.tiers.disk.segments as segments_mod

        for path in sorted(store.tier("disk").segments.path.glob("*.seg")):
            self._add(path, 0, 1 << 62, err)

        class FailingOpens:
            def __getattr__(self, name: str) -> Any:
                return getattr(os, name)

            @staticmethod
            def open(path: Any, *args: Any, **kw: Any) -> int:
                if str(path).endswith(".seg"):
                    raise OSError(err, os.strerror(err))
                return os.open(path, *args, **kw)

        self._monkeypatch.setattr(segments_mod, "os", FailingOpens())

    def _add(self, path: Path, start: int, end: int, err: int) -> None:
        from tierkv import native

        self._ranges.append((path.name, start, end, err))
        if native.reason() is None:
            st = os.stat(path)
            native.module().inject_fault(st.st_dev, st.st_ino, start, end, err)
        real = getattr(self, "_real", None) or os.preadv
        self._real = real
        ranges = self._ranges

        def preadv(fd: int, buffers: list[memoryview], offset: int, *args: int) -> int:
            size = sum(memoryview(b).nbytes for b in buffers)
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
            for seg, a, b, e in ranges:
                if name == seg and offset < b and a < offset + size:
                    raise OSError(e, os.strerror(e))
            return real(fd, buffers, offset, *args)

        self._monkeypatch.setattr(os, "preadv", preadv)

    def clear(self) -> None:
        from tierkv import native

        self._ranges.clear()
        if native.reason() is None:
            native.module().clear_faults()
        self._monkeypatch.undo()


def uncache(path: Path) -> None:
    """Drop a store's segment files' pages from the page cache (synced first: dirty pages are not dropped)."""
    for seg in sorted(Path(path).glob("**/*.seg")):
        fd = os.open(seg, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_nbytes(t: torch.Tensor) -> int:
    """How many bytes of ``t``'s own whole pages are resident (mincore): unlike the process's RSS, not moved
    by another test's pool that the garbage collector frees meanwhile (a pool of the same size freed while
    this one was populated once left the RSS exactly unchanged)."""
    import ctypes
    import ctypes.util
    import mmap

    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end <= start:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec)
    assert rc == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page
