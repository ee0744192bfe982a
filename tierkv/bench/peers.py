"""tierkv beside what a user could pick instead to keep KV on disk, on the same KV in one run.

Every system stores the same prompts (blocks of 64 tokens, the canonical layout) and loads each whole
prompt into one preallocated tensor; GB/s of KV. Stores are durable where the system can be (fsync'ed
files, a synced LMDB; diskcache's SQLite commits). Columns:

  store                 save every prompt, then make it durable
  cold / warm           loads through a dropped page cache / with the files in it
  contiguous            each prompt's blocks written together
  interleaved           block b of every prompt written before block b+1 of any (a server saving many
                        sessions at once); for torch.save, one file per prompt, the layout cannot differ

Systems: tierkv (native reader and writer, no host tier), tierkv's Python path (TIERKV_NATIVE=0 in the
same process), naive LMDB (one value per block, the design tierkv left), torch.save (one file per prompt),
safetensors (one file per block), diskcache (one value per block; when installed).
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tierkv import TieredStore, native
from tierkv.bench.kv_workload import NS
from tierkv.bench.machine import drop_page_cache, warm_page_cache
from tierkv.tiers.target import as_tensor

__all__ = ["markdown", "run"]

B = NS.block_tokens  # the tiers part's namespace: the embedded default model's KV layout


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _order(prompts: int, blocks: int, interleaved: bool) -> list[tuple[int, int]]:
    if interleaved:
        return [(p, b) for b in range(blocks) for p in range(prompts)]
    return [(p, b) for p in range(prompts) for b in range(blocks)]


class _System:
    name = ""

    def store(
        self, root: Path, kvs: list[torch.Tensor], toks: list[list[int]], order: list[tuple[int, int]]
    ) -> None:
        raise NotImplementedError

    def load(self, root: Path, p: int, toks: list[int], out: torch.Tensor) -> None:
        raise NotImplementedError

    def load_tokens(self, root: Path, p: int, toks: list[int], out: torch.Tensor) -> int:
        """``load``, and how many leading tokens it gave (a store that misses gives fewer)."""
        self.load(root, p, toks, out)
        return len(toks)


class _Tierkv(_System):
    def __init__(self, use_native: bool, direct_reads: bool | None = None) -> None:
        # direct_reads None: the default, O_DIRECT or buffered, whichever this disk served faster
        self.use_native, self.direct_reads = use_native, direct_reads
        self.name = "tierkv (native)" if use_native else "tierkv (Python path)"
        if direct_reads is not None:
            self.name = (
                "tierkv (native, O_DIRECT reads)" if direct_reads else "tierkv (native, buffered reads)"
            )
        self._store: TieredStore | None = None

    def store(self, root, kvs, toks, order):
        with native.use(self.use_native), TieredStore.open(root, host_bytes=0) as store:
            for p, b in order:
                store.save(NS, toks[p][: (b + 1) * B], kvs[p][:, :, : (b + 1) * B], start_block=b)
            store.flush()

    def open(self, root: Path) -> None:
        self._store = TieredStore.open(root, host_bytes=0, direct_reads=self.direct_reads)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def load(self, root, p, toks, out):
        n = self.load_tokens(root, p, toks, out)
        assert n == len(toks), (n, len(toks))

    def load_tokens(self, root, p, toks, out):
        assert self._store is not None
        with native.use(self.use_native):
            n, _ = self._store.load(NS, toks, out=out)
        return n


class _Lmdb(_System):
    name = "naive LMDB (a value per block)"

    def store(self, root, kvs, toks, order):
        import lmdb

        total = sum(k.numel() * 4 for k in kvs)
        env = lmdb.open(str(root), map_size=2 * total + (64 << 20))
        with env.begin(write=True) as txn:
            for p, b in order:
                txn.put(f"{p}/{b}".encode(), kvs[p][:, :, b * B : (b + 1) * B].contiguous().numpy().tobytes())
        env.sync(True)
        env.close()

    def open(self, root: Path) -> None:
        import lmdb

        self._env = lmdb.open(str(root), readonly=True, lock=False)

    def close(self) -> None:
        self._env.close()

    def load(self, root, p, toks, out):
        shape = (NS.num_layers, 2, B, NS.num_kv_heads, NS.head_dim)
        with self._env.begin(buffers=True) as txn:
            for b in range(len(toks) // B):
                out[:, :, b * B : (b + 1) * B].copy_(
                    as_tensor(txn.get(f"{p}/{b}".encode()), torch.float32, shape)
                )


class _TorchSave(_System):
    name = "torch.save (a file per prompt)"

    def store(self, root, kvs, toks, order):
        root.mkdir(parents=True, exist_ok=True)
        for p, kv in enumerate(kvs):
            torch.save(kv, root / f"{p}.pt")
        _fsync_tree(root)

    def load(self, root, p, toks, out):
        out.copy_(torch.load(root / f"{p}.pt"))


class _Safetensors(_System):
    name = "safetensors (a file per block)"

    def store(self, root, kvs, toks, order):
        from safetensors.torch import save_file

        root.mkdir(parents=True, exist_ok=True)
        for p, b in order:
            save_file(
                {"kv": kvs[p][:, :, b * B : (b + 1) * B].contiguous()}, str(root / f"{p}-{b}.safetensors")
            )
        _fsync_tree(root)

    def load(self, root, p, toks, out):
        from safetensors.torch import load_file

        for b in range(len(toks) // B):
            out[:, :, b * B : (b + 1) * B].copy_(load_file(str(root / f"{p}-{b}.safetensors"))["kv"])


class _Diskcache(_System):
    name = "diskcache (a value per block)"

    def store(self, root, kvs, toks, order):
        import diskcache

        with diskcache.Cache(str(root), size_limit=1 << 40) as cache:
            for p, b in order:
                cache.set(f"{p}/{b}", kvs[p][:, :, b * B : (b + 1) * B].contiguous().numpy().tobytes())
        _fsync_tree(root)

    def open(self, root: Path) -> None:
        import diskcache

        self._cache = diskcache.Cache(str(root))

    def close(self) -> None:
        self._cache.close()

    def load(self, root, p, toks, out):
        shape = (NS.num_layers, 2, B, NS.num_kv_heads, NS.head_dim)
        for b in range(len(toks) // B):
            data = self._cache.get(f"{p}/{b}")
            out[:, :, b * B : (b + 1) * B].copy_(
                torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape)
            )


def _systems() -> list[_System]:
    out: list[_System] = [
        _Tierkv(True),
        _Tierkv(True, direct_reads=True),
        _Tierkv(True, direct_reads=False),
        _Tierkv(False),
        _Lmdb(),
        _TorchSave(),
        _Safetensors(),
    ]
    try:
        import diskcache  # noqa: F401

        out.append(_Diskcache())
    except ImportError:
        pass
    return out


def run(base: Path, *, prompts: int = 4, prompt_tokens: int = 4096, runs: int = 3) -> dict[str, Any]:
    """Each column's runs alternate the systems (in turn, the order reversed every other run): this disk's
    bandwidth drifts over minutes, and a system measured in a window of its own got that window's disk."""
    gen = torch.Generator().manual_seed(0)
    toks = [[p * 10**6 + t for t in range(prompt_tokens)] for p in range(prompts)]
    kvs = [
        torch.randn(NS.num_layers, 2, prompt_tokens, NS.num_kv_heads, NS.head_dim, generator=gen)
        for _ in toks
    ]
    nbytes = sum(k.numel() * 4 for k in kvs)
    out = torch.zeros_like(kvs[0])  # its pages faulted now, not in the first system's first load
    blocks = prompt_tokens // B
    systems = _systems()
    if not native.enabled():  # no native build here: the row would be the Python path twice
        systems = [s for s in systems if not (isinstance(s, _Tierkv) and s.use_native)]
    speeds: dict[tuple[str, str], list[float]] = {}
    roots = {s.name: base / f"peer-{i}" for i, s in enumerate(systems)}

    def turns(r: int) -> list[_System]:
        return systems if r % 2 == 0 else systems[::-1]

    for layout in ("contiguous", "interleaved"):
        order = _order(prompts, blocks, layout == "interleaved")
        for r in range(runs if layout == "contiguous" else 1):
            for system in turns(r):
                root = roots[system.name]
                shutil.rmtree(root, ignore_errors=True)
                t0 = time.perf_counter()
                system.store(root, kvs, toks, order)
                if layout == "contiguous":
                    speeds.setdefault((system.name, "store"), []).append(nbytes / (time.perf_counter() - t0))
        for temp in ("cold", "warm"):
            for r in range(runs):
                for system in turns(r):
                    root = roots[system.name]
                    if temp == "cold":
                        drop_page_cache([p for p in root.rglob("*") if p.is_file()])
                    else:  # its files in the page cache, as a recent store or load leaves them
                        warm_page_cache([p for p in root.rglob("*") if p.is_file()])
                    if hasattr(system, "open"):
                        system.open(root)
                    try:
                        t0 = time.perf_counter()
                        for p in range(prompts):
                            system.load(root, p, toks[p], out)
                        speed = nbytes / (time.perf_counter() - t0)
                    finally:
                        if hasattr(system, "close"):
                            system.close()
                    assert torch.equal(out, kvs[-1]), f"{system.name}: wrong KV"
                    speeds.setdefault((system.name, f"{temp} {layout}"), []).append(speed)
    flip = blocks // 2  # the block of the first prompt whose stored bytes get one bit flipped
    flipped = {s.name: _flipped_byte(s, roots[s.name], kvs[0], toks[0], out, flip) for s in systems}
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
    rows = {
        s.name: {col: statistics.median(speeds[s.name, col]) for col in COLUMNS if (s.name, col) in speeds}
        for s in systems
    }
    return {
        "config": {
            "kv_nbytes": nbytes,
            "prompts": prompts,
            "prompt_tokens": prompt_tokens,
            "runs": runs,
            "flipped_block": flip,
        },
        "rows_Bps": rows,
        "flipped_byte": flipped,
    }


def _flip_stored_bit(root: Path, pattern: bytes) -> bool:
    """Flip one bit in the middle of ``pattern`` where a file under ``root`` holds it (its first
    occurrence, in the file's own bytes: written through, then the file synced). False: not found."""
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.stat().st_size >= len(pattern)):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            at = m.find(pattern)
        if at < 0:
            continue
        fd = os.open(path, os.O_RDWR)
        try:
            where = at + len(pattern) // 2
            byte = os.pread(fd, 1, where)
            os.pwrite(fd, bytes([byte[0] ^ 0x10]), where)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True
    return False


def _flipped_byte(
    system: _System, root: Path, kv: torch.Tensor, toks: list[int], out: torch.Tensor, block: int
) -> str:
    """What ``system`` does with one bit flipped in the stored bytes of ``block`` of the first prompt,
    loading the prompt through a dropped page cache: refuses it (an error, or a load that stops before
    the block) or serves it."""
    row = kv[0, 0, block * B : (block + 1) * B].contiguous()
    pattern = row.numpy().tobytes()[:4096]
    assert pattern, "the prompt has no such block"
    if not _flip_stored_bit(root, pattern):
        return "not found"
    drop_page_cache([p for p in root.rglob("*") if p.is_file()])
    out.zero_()
    if hasattr(system, "open"):
        system.open(root)
    try:
        n = system.load_tokens(root, 0, toks, out)
    except Exception as exc:  # noqa: BLE001 - whichever error the system raises is its refusal
        return f"refused: {type(exc).__name__}"
    finally:
        if hasattr(system, "close"):
            system.close()
    if not torch.equal(out[:, :, :n], kv[:, :, :n]):
        return "served it"
    return f"refused: served the {n // B} blocks before it" if n < len(toks) else "not read"


COLUMNS = ("store", "cold contiguous", "cold interleaved", "warm contiguous", "warm interleaved")


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    rows = res["rows_Bps"]
    lines = [
        f"The same {c['kv_nbytes'] / 2**20:.0f} MiB of KV ({c['prompts']} prompts of {c['prompt_tokens']} tokens, "
        f"blocks of {B} tokens) stored and loaded whole by each system; medians of {c['runs']} runs, GB/s. Bold: "
        "the best of the column. Last column: what the system did with one bit flipped in the stored bytes of"
        f" block {c.get('flipped_block')} of a prompt, loading that prompt through a dropped page cache.",
        "",
        "| system | " + " | ".join(COLUMNS) + " | one bit flipped |",
        "|---|" + "---:|" * len(COLUMNS) + "---|",
    ]
    flipped = res.get("flipped_byte", {})
    best = {col: max(r.get(col, 0.0) for r in rows.values()) for col in COLUMNS}
    for name, r in rows.items():
        cells = []
        for col in COLUMNS:
            v = r.get(col, 0.0) / 1e9
            cells.append(f"**{v:.2f}**" if r.get(col, 0.0) == best[col] else f"{v:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {flipped.get(name, '')} |")
    if not any(name.startswith("diskcache") for name in rows):
        lines += [
            "",
            "diskcache was not installed for this run: its row is missing (pip install 'tierkv[bench]'; in a clone, pip install -e '.[bench]').",
        ]
    others = {name: r for name, r in rows.items() if not name.startswith("tierkv")}
    if others:
        lines += [
            "",
            "Bold marks each column's best row, tierkv's own variants included; below, each tierkv variant "
            f"against the other systems ({', '.join(n.split(' (')[0] for n in others)}).",
        ]
    for name in ("tierkv (native)", "tierkv (native, O_DIRECT reads)", "tierkv (native, buffered reads)"):
        lead = rows.get(name)
        if lead and others:
            ahead = [col for col in COLUMNS if all(lead[col] >= r.get(col, 0.0) for r in others.values())]
            lines += [
                "",
                f"{name} is ahead of every other system in {len(ahead)} of {len(COLUMNS)} columns"
                + (f": {', '.join(ahead)}." if ahead else "."),
            ]
    return "\n".join(lines)
