"""Half-precision forwards on a CPU that give the same numbers whatever the batch's shape.

A restore is exact only if the tokens computed after it get the logits a cold prefill gives them, and
those tokens are computed in a forward of another shape (the tail alone, against the whole prompt). On
a CPU with AMX (Sapphire Rapids and later), oneDNN's bfloat16 and float16 matmuls round differently for
different numbers of rows: SmolLM2 in bfloat16 differed by up to 0.25 on logits between one prefill and
a prefix-then-suffix one, with no cache at all. Below AMX (AVX-512 BF16) the same forwards are bit for
bit equal; a 1K-token prefill of SmolLM2 took 2.8 s there against 1.1 s with AMX and 1.3 s in float32.

So a CPU model in half precision pins oneDNN below AMX for the process (``ONEDNN_MAX_CPU_ISA``, which
oneDNN reads once, at its first primitive) unless the user chose an ISA, and ``shape_invariant`` probes
whether that took (a process whose oneDNN already ran a half-precision matmul keeps what it chose).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("tierkv.worker")

__all__ = ["pin_exact_isa", "shape_invariant"]

ISA_VAR = "ONEDNN_MAX_CPU_ISA"
EXACT_ISA = "AVX512_CORE_BF16"  # the highest level without AMX; lower ones are capped at what the CPU has


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def pin_exact_isa() -> None:
    """Keep oneDNN below AMX in this process, where the CPU has it and the user chose no ISA."""
    if _has_amx() and ISA_VAR not in os.environ:
        os.environ[ISA_VAR] = EXACT_ISA
        log.info("CPU half precision: oneDNN kept below AMX (%s=%s) for exact restores", ISA_VAR, EXACT_ISA)


@functools.cache
def shape_invariant(dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` matmul on this CPU gives a row the same numbers in a batch of one row as in a
    batch of many (probed once per process)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 576, generator=gen).to(dtype)
    w = torch.randn(1536, 576, generator=gen).to(dtype)
    with torch.no_grad():
        whole = torch.nn.functional.linear(x, w)
        rows = torch.cat([torch.nn.functional.linear(x[i : i + 8], w) for i in range(0, 96, 8)])
    same = torch.equal(whole, rows)
    if not same:
        log.warning(
            "this CPU's %s matmuls round by the batch's shape (oneDNN with AMX, chosen before tierkv could "
            "keep it below): restores differ from a cold prefill by a few units in the last place; set "
            "%s=%s before the process starts, or serve in float32",
            str(dtype).removeprefix("torch."),
            ISA_VAR,
            EXACT_ISA,
        )
    return same
