"""Where tierkv keeps its files by default."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "TIERKV_CACHE_DIR"
DEFAULT_CACHE_DIR_HELP = "$TIERKV_CACHE_DIR or ~/.cache/tierkv"  # what default_cache_dir() resolves, in words


def default_cache_dir() -> str:
    """The store's directory when none is given: ``$TIERKV_CACHE_DIR``, else ``~/.cache/tierkv``."""
    return os.environ.get(CACHE_DIR_ENV) or str(Path.home() / ".cache" / "tierkv")


__all__ = ["CACHE_DIR_ENV", "DEFAULT_CACHE_DIR_HELP", "default_cache_dir"]
