"""``tierkv bench --engine vllm``: TTFT through vLLM's OpenAI server, cold against tierkv and ExampleConnector.

Each row is one prompt length; every column is measured in the same run, on the same random-token
prompts, the same model and the same disk. vLLM's own prefix cache is off in every server
(``--no-enable-prefix-caching``), so a repeated prompt is computed again or loaded by the connector:

    cold              a server without a connector, each prompt new
    tierkv, saving    tierkv's connector, each prompt new: computed, and saved behind (its overhead)
    tierkv disk cold  the server restarted, the page cache dropped: each saved prompt loaded from disk
    tierkv host       the same prompt again in that process: loaded from tierkv's host tier
    example saving    vLLM's ExampleConnector, each prompt new: computed, and saved
    example disk cold vLLM's ExampleConnector (safetensors files per layer), saved by one server, loaded
                      by a new one after the page cache was dropped
    example warm      the same prompt again: ExampleConnector reads its files from the page cache

TTFT is measured at the client: a streamed completion of ``max_tokens=1`` from request to its first
chunk (the prefill, the load, the first token and HTTP). ``cached`` is vLLM's own count
(``prompt_tokens_details.cached_tokens``), to show each load hit: a connector never offers the last
block's last token, so a whole-block prompt leaves a block to compute.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierkv.bench import vllm_loads
from tierkv.bench.machine import drop_page_cache
from tierkv.bench.serving import free_port
from tierkv.bench.table import md_table
from tierkv.errors import ConfigError

__all__ = ["COLUMNS", "LENGTHS", "SAME_CPUS_ENV", "markdown", "run"]

LENGTHS = (1024, 2048, 4096, 8064)  # 8K: SmolLM2's context is 8192 tokens

# vLLM-CPU reserves one core for its other processes, and one more when a KV connector is configured
# (vllm/utils/ompmultiprocessing.py, for NIXL); on a machine with no more cores than that, it reserves
# none. So on 2 cores a server without a connector computed on one core and a server with any connector
# on two: every "cold" column before 2026-12-04 was about 2x too slow. Every server gets the same cores.
SAME_CPUS_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}

COLUMNS = {
    "cold": "cold prefill",
    "tierkv_saving": "tierkv on, saving",
    "tierkv_disk_cold": "tierkv disk (cold page cache)",
    "tierkv_host": "tierkv host",
    "example_saving": "ExampleConnector on, saving",
    "example_disk_cold": "ExampleConnector (cold page cache)",
    "example_warm": "ExampleConnector (warm page cache)",
}
COLD_COLUMNS = ("cold", "tierkv_saving", "example_saving")  # each prompt computed
# The loads again through a buffer and torch's copies (TIERKV_PAGED_COPY=0: the connector's path before
# its native copy into the pages), for the load table's before and after in one run.
BUFFER_COLUMNS = {
    "tierkv_disk_cold_buffer": "tierkv disk, through a buffer",
    "tierkv_host_buffer": "tierkv host, through a buffer",
    # and with the disk read buffered (TIERKV_DIRECT_READS=0: the connector's default before 2026-12-04)
    "tierkv_disk_cold_buffered_reads": "tierkv disk, buffered reads",
    "tierkv_host_buffered_reads": "tierkv host, after buffered reads",
}
HEALTH_TIMEOUT_S = 900.0


class VllmServer:
    """vLLM's OpenAI server in a subprocess on a free loopback port, once it answers /health."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM did not start in {HEALTH_TIMEOUT_S:.0f} s")

    def complete(self, model: str, tokens: list[int]) -> dict[str, Any]:
        body = json.dumps(
            {
                "model": model,
                "prompt": tokens,
                "max_tokens": 1,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        req = urllib.request.Request(
            self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        ttft, usage, text = None, None, []
        with urllib.request.urlopen(req, timeout=900) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - t0
                    text.append(chunk["choices"][0].get("text") or "")
                if chunk.get("usage"):
                    usage = chunk["usage"]
        if ttft is None or usage is None:
            raise RuntimeError("vLLM's stream had no token or no usage")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return {"ttft_s": ttft, "cached": int(cached), "text": "".join(text)}

    def stop(self) -> None:
        """SIGTERM (the connector's store is closed and its write-behind flushed on shutdown)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(180)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def _prompt(kind: str, length: int, i: int, vocab: int) -> list[int]:
    """Random token ids (no special tokens at the low end), one list per (kind, length, i)."""
    rng = random.Random(f"{kind}/{length}/{i}")
    return [rng.randrange(100, vocab) for _ in range(length)]


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def run(
    base: Path,
    *,
    python: str,
    model: str = "smollm2",
    lengths: tuple[int, ...] = LENGTHS,
    runs: int = 3,
    kv_space_gib: int = 4,
    log_dir: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Every column of ``COLUMNS`` at each length, ``runs`` prompts each (medians). ``python`` runs vLLM;
    the servers' logs go to ``log_dir`` (default: ``base``)."""
    from tierkv.integrations.vllm.serve import _model, vllm_command

    model_dir, served = _model({"model": model})
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(model_config["vocab_size"])
    token_nbytes = vllm_loads.token_nbytes(model_config, 4 if not vllm_loads.on_cuda() else 2)
    context = int(model_config.get("max_position_embeddings", 4096))
    if max(lengths) >= context:
        raise ConfigError(f"--lengths: {max(lengths)} tokens do not fit the model's context ({context})")
    max_len = min(max(lengths) + 128, context)
    tierkv_cache, example_store = base / "vllm-tierkv-cache", base / "vllm-example-store"
    # float32 on CPU: vLLM's default there is bfloat16, which CPUs without AVX-512 BF16 emulate (1K tokens
    # of SmolLM2 took 30 s here, against about 1 s in float32)
    import torch

    dtype = "auto" if torch.cuda.is_available() else "float32"
    common = {"model": model, "max_context": max_len, "dtype": dtype}
    # One prefill step per prompt in every server: ExampleConnector keeps only the last chunk of a chunked
    # prefill (vLLM's default chunk here is 2,048 tokens) and its worker crashed loading a 4K prompt.
    vllm_args = ["--no-enable-prefix-caching", "--max-num-batched-tokens", str(max_len)]
    env = dict(
        os.environ,
        **SAME_CPUS_ENV,
        VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )

    def server(name: str, cmd: list[str]) -> VllmServer:
        t0 = time.perf_counter()
        # The connector's default, O_DIRECT reads, set explicitly: a caller's TIERKV_DIRECT_READS=0 would
        # otherwise make both load columns buffered
        own = dict(env, TIERKV_DIRECT_READS="0" if name.endswith("-buffered-reads") else "1")
        if name.endswith("-buffer"):
            own["TIERKV_PAGED_COPY"] = "0"
        s = VllmServer(cmd, own, (log_dir or base) / f"vllm-{name}.log")
        startup_s[name] = time.perf_counter() - t0
        # vLLM's first request pays one-time costs (6.5 s here); a prompt of its own, saved by nobody
        s.complete(served, _prompt(f"warmup-{name}", 256, 0, vocab))
        progress(f"{name}: vLLM up in {startup_s[name]:.0f} s")
        return s

    plain = vllm_command({**common, "no_cache": True}, vllm_args, python)
    with_tierkv = vllm_command(
        {**common, "cache_dir": str(tierkv_cache), "host_cache": 4 << 30, "disk_budget": 64 << 30},
        vllm_args,
        python,
    )
    example_cfg = {  # ExampleConnector with its load timed (``integrations.vllm.timed_example``)
        "kv_connector": "TimedExampleConnector",
        "kv_connector_module_path": "tierkv.integrations.vllm.timed_example",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(example_store)},
    }
    example_loads = base / "example-loads.jsonl"
    example_loads.unlink(missing_ok=True)
    env["TIERKV_BENCH_LOAD_LOG"] = str(example_loads)
    with_example = [*plain, "--kv-transfer-config", json.dumps(example_cfg)]
    startup_s: dict[str, float] = {}
    calls: dict[str, dict[int, list[dict[str, Any]]]] = {
        c: {n: [] for n in lengths} for c in (*COLUMNS, *BUFFER_COLUMNS)
    }
    saved = {n: [_prompt("saved", n, i, vocab) for i in range(runs)] for n in lengths}

    def each(column: str, s: VllmServer, prompts: dict[int, list[list[int]]]) -> None:
        for n in lengths:
            for p in prompts[n]:
                calls[column][n].append(s.complete(served, p))
            progress(f"{column} {n}: {statistics.median(c['ttft_s'] for c in calls[column][n]):.3f} s")

    def timed(s: VllmServer, p: list[int]) -> dict[str, Any]:
        """A request with its load: the seconds and KV bytes the connector's load took (tierkv's counters on
        /metrics; ExampleConnector's log, whose bytes are its tokens' KV)."""
        before, lines = vllm_loads.load_counters(s.url), vllm_loads.logged_loads(example_loads)
        call = s.complete(served, p)
        after, logged = vllm_loads.load_counters(s.url), vllm_loads.logged_loads(example_loads)[len(lines) :]
        if after:
            call["load_s"] = after["load_s"] - before.get("load_s", 0.0)
            call["load_nbytes"] = after["load_nbytes"] - before.get("load_nbytes", 0.0)
        elif logged:
            call["load_s"] = sum(e["s"] for e in logged)
            call["load_nbytes"] = sum(e["tokens"] for e in logged) * token_nbytes
        return call

    def loads(disk: str, warm: str) -> Callable[[VllmServer], None]:
        def run_loads(s: VllmServer) -> None:
            for n in lengths:  # first from disk (cold page cache), then the same prompt again
                for p in saved[n]:
                    calls[disk][n].append(timed(s, p))
                    calls[warm][n].append(timed(s, p))
            progress(f"{disk}, {warm} done")

        return run_loads

    cold = {n: [_prompt("cold", n, i, vocab) for i in range(runs)] for n in lengths}
    # Cold prefills with and without tierkv saving, once at the start and again (reversed) at the end, each
    # time in a new server: one server's prompts spread by +-8% here, and a server's speed drifts.
    cold_b = {n: [_prompt("cold-b", n, i, vocab) for i in range(runs)] for n in lengths}
    saved_b = {n: [_prompt("saved-b", n, i, vocab) for i in range(runs)] for n in lengths}
    phases: list[tuple[str, list[str], Path | None, Callable[[VllmServer], None]]] = [
        ("cold", plain, None, lambda s: each("cold", s, cold)),
        ("tierkv-save", with_tierkv, None, lambda s: each("tierkv_saving", s, saved)),
        ("tierkv-load", with_tierkv, tierkv_cache, loads("tierkv_disk_cold", "tierkv_host")),
        (
            "tierkv-load-buffer",
            with_tierkv,
            tierkv_cache,
            loads("tierkv_disk_cold_buffer", "tierkv_host_buffer"),
        ),
        (
            "tierkv-load-buffered-reads",
            with_tierkv,
            tierkv_cache,
            loads("tierkv_disk_cold_buffered_reads", "tierkv_host_buffered_reads"),
        ),
        ("example-save", with_example, None, lambda s: each("example_saving", s, saved)),
        ("example-load", with_example, example_store, loads("example_disk_cold", "example_warm")),
        ("tierkv-save-again", with_tierkv, None, lambda s: each("tierkv_saving", s, saved_b)),
        ("cold-again", plain, None, lambda s: each("cold", s, cold_b)),
    ]
    errors: dict[str, str] = {}
    drop_method = ""
    for name, cmd, cold_dir, action in phases:
        try:
            if cold_dir is not None:
                drop_method = drop_page_cache(_files(cold_dir))
            s = server(name, cmd)
            try:
                action(s)
            finally:
                s.stop()
        except Exception as exc:  # one engine's failure (a crash of its connector) is reported, not fatal
            errors[name] = f"{type(exc).__name__}: {exc}"[:500]
            progress(f"{name} failed: {errors[name]} (log: vllm-{name}.log)")

    limits = vllm_loads.limits(base, max(lengths) * token_nbytes, progress)
    rows = []
    for n in lengths:
        # cold and saving columns from two servers each (rows of earlier runs, without it, had one)
        row: dict[str, Any] = {"tokens": n, "cold_and_saving_servers": 2}
        for column in (*COLUMNS, *BUFFER_COLUMNS):
            cs = calls[column][n]
            if len(cs) < runs * (2 if column in ("cold", "tierkv_saving") else 1):  # an engine failed
                continue
            row[column] = {
                "ttft_s": statistics.median(c["ttft_s"] for c in cs),
                "all_s": [c["ttft_s"] for c in cs],
                "cached": min(c["cached"] for c in cs),
            }
            timed_calls = [c for c in cs if c.get("load_s")]
            if len(timed_calls) == len(cs):  # the load itself: seconds and KV bytes per second into the pages
                row[column]["load_s"] = statistics.median(c["load_s"] for c in cs)
                row[column]["load_all_s"] = [c["load_s"] for c in cs]
                row[column]["load_gbps"] = statistics.median(c["load_nbytes"] / c["load_s"] / 1e9 for c in cs)
        # the saved prompts' first token: computed, loaded by tierkv from disk and host, by ExampleConnector
        row["same_first_token"] = all(
            len({calls[c][n][i]["text"] for c in (*COLUMNS, *BUFFER_COLUMNS) if c != "cold" and c in row})
            == 1
            for i in range(runs)
        )
        rows.append(row)
    return {
        "config": {
            "model": model,
            "model_dir": model_dir,
            "dtype": dtype,
            "lengths": list(lengths),
            "runs": runs,
            "block_tokens": "vLLM's (CPU: 128)",
            "page_cache": drop_method,
            "vllm_args": vllm_args,
            "kv_space_gib": kv_space_gib,
        },
        "startup_s": startup_s,
        "limits": limits,
        "errors": errors,
        "rows": rows,
    }


def _cell(column: dict[str, Any] | None, *, with_cached: bool) -> str:
    if column is None:
        return "failed"
    ms = f"{column['ttft_s'] * 1e3:.0f} ms"
    return f"{ms} ({column['cached']})" if with_cached else ms


def markdown(res: dict[str, Any]) -> str:
    cfg = res["config"]
    head = [
        f"vLLM's OpenAI server, model `{cfg['model']}` ({cfg.get('dtype', 'auto')}), its prefix cache off; "
        f"TTFT medians of {cfg['runs']} prompts per length (a streamed completion of one token); page cache dropped by {cfg['page_cache']}.",
        "",
    ]
    header = ["tokens", *COLUMNS.values(), "tierkv disk vs cold", "Example disk / tierkv disk"]
    table = []
    for r in res["rows"]:
        cells = [_cell(r.get(c), with_cached=c != "cold") for c in COLUMNS]
        # the baseline is the fastest of the cold prefills (without a connector, with each of them)
        colds = [r[c]["ttft_s"] for c in COLD_COLUMNS if c in r]
        disk = r.get("tierkv_disk_cold", {}).get("ttft_s")
        example = r.get("example_disk_cold", {}).get("ttft_s")
        vs_cold = f"{min(colds) / disk:.1f}x" if colds and disk else "-"
        vs_example = f"{example / disk:.1f}x" if example and disk else "-"
        table.append([r["tokens"], *cells, vs_cold, vs_example])
    same = all(r["same_first_token"] for r in res["rows"])
    saving = [
        f"- {r['tokens']} tokens: "
        + "; ".join(
            f"{COLUMNS[c]} / cold prefill {r[c]['ttft_s'] / r['cold']['ttft_s']:.2f} "
            f"({min(r[c]['all_s']):.2f}-{max(r[c]['all_s']):.2f} s against "
            f"{min(r['cold']['all_s']):.2f}-{max(r['cold']['all_s']):.2f} s)"
            for c in ("tierkv_saving", "example_saving")
            if c in r
        )
        for r in res["rows"]
        if "cold" in r and r.get("cold_and_saving_servers") == 2
    ]
    note = [
        "",
        "In brackets: the tokens vLLM counted as cached (the least of the prompts). 'vs cold' divides the "
        "fastest of the three cold prefills (without a connector, with each connector saving) by the tierkv "
        "disk restore. "
        "First token of every "
        f"saved prompt the same computed and loaded (each connector, each tier): {'yes' if same else 'NO'}. "
        "vLLM start-up: " + ", ".join(f"{k} {v:.0f} s" for k, v in res["startup_s"].items()) + ".",
        *(f"- {name} failed: {err}" for name, err in res.get("errors", {}).items()),
        *(
            [
                "",
                "The cost of saving: the median cold prefill with the connector saving over the median "
                "without a connector (each prompt computed; tierkv's and the plain server's prompts from two "
                "servers each, the first and the last of the run):",
                "",
                *saving,
            ]
            if saving
            else []
        ),
    ]
    return "\n".join(head + md_table(header, "r" * len(header), table) + note + vllm_loads.load_table(res))
