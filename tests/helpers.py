"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tierkv import Namespace
from tierkv.layout import KVSpec

REPO = Path(__file__).resolve().parents[1]


def make_kv(ns: Namespace, num_tokens: int, seed: int = 0) -> torch.Tensor:
    spec = KVSpec.of(ns)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(spec.shape(num_tokens), generator=g).to(spec.dtype)


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (a real second process), failing loudly on error."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)
