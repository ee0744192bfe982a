"""Parse and print human sizes (``512MB``, ``20GiB``) and durations (``90s``, ``24h``, ``7d``); read on/off
environment variables."""

from __future__ import annotations

import os
import re

from tierkv.errors import ConfigError

__all__ = ["env_flag", "format_duration", "format_size", "parse_duration", "parse_flag", "parse_size"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"20GiB"`` -> bytes. Decimal units (MB) are powers of 10, binary ones (MiB, or bare M) of 2."""
    if isinstance(text, int):
        return text
    m = _NUMBER_UNIT.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"bad size {text!r}: expected a number with an optional unit like 512MB or 20GiB")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(text: str | float) -> float:
    """``"24h"`` -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _NUMBER_UNIT.match(text)
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ConfigError(f"bad duration {text!r}: expected a number with a unit like 90s, 30m, 24h or 7d")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def format_size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def parse_flag(text: str) -> bool | None:
    """On (1, true, yes, on) or off (0, false, no, off), any case; None for anything else."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def env_flag(name: str, default: bool) -> bool:
    """An on/off environment variable (``parse_flag``); ``default`` if unset or other."""
    flag = parse_flag(os.environ.get(name, ""))
    return default if flag is None else flag
