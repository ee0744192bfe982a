"""The prompt tools of the ``tierkv`` command: ``explain`` (where a second prompt stops reusing the
first's cache) and ``lint`` (dynamic content placed before stable content). Tokenizers and models are
imported only when a command runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from tierkv.cli.common import fail
from tierkv.errors import ConfigError

__all__ = ["explain", "lint_cmd"]


def _model_name(model_path: str | None) -> str:
    """The model a prompt tool uses: the one given, else ``tierkv serve``'s default (smollm2)."""
    from tierkv import models

    return model_path or models.DEFAULT


def _default_block_tokens(model_path: str | None) -> int:
    """The block size ``tierkv serve`` picks for the model on a CPU (float32), from its config alone."""
    from tierkv import models

    model_path = _model_name(model_path)
    if model_path == models.TINY:
        from tierkv.default_model import default_config

        cfg = default_config()
    else:
        from transformers import AutoConfig

        path = _local_dir(model_path)
        try:
            cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            fail(f"--model {model_path}: cannot read its config: {exc}", 2)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return models.default_block_tokens(2 * cfg.num_hidden_layers * kv_heads * head_dim * 4)


def _local_dir(model_path: str) -> str:
    """A built-in model's converted directory (converting it the first time), or the directory given."""
    from tierkv import models

    if not models.is_builtin(model_path):
        return model_path
    try:
        return str(models.resolve(model_path))
    except ConfigError as exc:
        fail(str(exc), 2)


def _load_tokenizer(model_path: str | None) -> Any:
    from tierkv import models

    model_path = _model_name(model_path)
    if model_path == models.TINY:
        from tierkv.default_model import ByteTokenizer

        return ByteTokenizer()
    from transformers import AutoTokenizer

    path = _local_dir(model_path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        fail(f"--model {model_path}: cannot load its tokenizer: {exc}", 2)


def _describe(model_path: str | None, block_tokens: int, given: bool) -> str:
    """The line that says which model and block size a prompt tool used."""
    how = "given" if given else "as tierkv serve picks it for the model on a CPU"
    return f"model {_model_name(model_path)}; blocks of {block_tokens} tokens ({how})"


def _read_prompt(path: str, tokenizer: Any) -> list[int]:
    """Token ids of an OpenAI request body (chat or completion JSON), or of a plain text file."""
    from tierkv.prompts import encode_request

    try:
        text = Path(path).read_text()
    except OSError as exc:
        fail(f"{path}: {exc.strerror}", 2)
    return encode_request(tokenizer, text)


model_option = click.option(
    "--model",
    "model_path",
    help="Tokenize as this model does: smollm2, tiny or a local Hugging Face directory (the model "
    "tierkv serve runs).  [default: smollm2]",
)


@click.command()
@click.argument("first", type=click.Path(dir_okay=False))
@click.argument("second", type=click.Path(dir_okay=False))
@model_option
@click.option(
    "--block-tokens",
    type=int,
    help="Tokens per cached block.  [default: as tierkv serve picks it for the model on a CPU]",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def explain(first: str, second: str, model_path: str | None, block_tokens: int | None, as_json: bool) -> None:
    """Where SECOND stops reusing FIRST's cache, and why (OpenAI JSON bodies or plain text files)."""
    from tierkv.explain import around, diverge

    given = block_tokens is not None
    if block_tokens is None:
        block_tokens = _default_block_tokens(model_path)
    tok = _load_tokenizer(model_path)
    a, b = _read_prompt(first, tok), _read_prompt(second, tok)
    d = diverge(a, b, block_tokens)
    out = {"model": _model_name(model_path), "block_tokens": block_tokens, **d.to_dict()}
    if d.first_divergent_token is not None:
        mark = ("\x1b[1;31m", "\x1b[0m") if sys.stdout.isatty() and not as_json else ("[[", "]]")
        out["context"] = dict(zip(("first", "second"), around(tok, a, b, d.first_divergent_token, mark=mark)))
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(_describe(model_path, block_tokens, given))
    if d.first_divergent_token is None and d.tokens_a == d.tokens_b:
        click.echo(f"the prompts are identical ({d.tokens_a} tokens)")
    elif d.first_divergent_token is None:
        shorter, longer = ("FIRST", "SECOND") if d.tokens_a < d.tokens_b else ("SECOND", "FIRST")
        click.echo(f"{shorter} is a prefix of {longer} ({d.tokens_a} and {d.tokens_b} tokens)")
    else:
        click.echo(
            f"first divergent token: {d.first_divergent_token} (block {d.block} of {block_tokens} tokens)"
        )
    click.echo(
        f"reused: {d.reused_tokens} tokens ({d.reused_blocks} blocks); recomputed: {d.recomputed_tokens} "
        f"of {d.tokens_b} tokens"
    )
    if "context" in out:
        click.echo(f"first:  ...{out['context']['first']}...")
        click.echo(f"second: ...{out['context']['second']}...")


@click.command(name="lint")
@click.argument("template", type=click.Path(dir_okay=False))
@model_option
@click.option(
    "--min-tokens",
    type=int,
    default=64,
    show_default=True,
    help="Report dynamic content only with at least this many tokens after it.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def lint_cmd(template: str, model_path: str | None, min_tokens: int, as_json: bool) -> None:
    """Flag dynamic-looking content (dates, times, ids, counters) placed before large stable content."""
    from tierkv.explain import lint, suggestion
    from tierkv.prompts import encode_text

    try:
        text = Path(template).read_text()
    except OSError as exc:
        fail(f"{template}: {exc.strerror}", 2)
    block_tokens = _default_block_tokens(model_path)
    tok = _load_tokenizer(model_path)
    findings = lint(text, lambda t: encode_text(tok, t, special=False), min_tokens)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "model": _model_name(model_path),
                    "block_tokens": block_tokens,
                    "findings": [f.to_dict() for f in findings],
                    "suggestion": suggestion(findings),
                }
            )
        )
        return
    click.echo(_describe(model_path, block_tokens, False))
    for f in findings:
        click.echo(
            f"{template}: char {f.char_offset}, token {f.token_offset}: {f.kind} {f.text!r} "
            f"invalidates the {f.invalidated_tokens} tokens after it"
        )
    click.echo(suggestion(findings))
    if findings:
        sys.exit(1)
