"""The native data path (``tierkv._native``, built from ``native/records.c`` by the package's own build):
whether it runs here, and why not.

It is optional: without a C compiler at install time, or without the system's libxxhash at run time, the
disk tier reads through its Python path, which stays the reference the tests compare the native one with.
``TIERKV_NATIVE=0`` turns it off (to compare the two, or to rule it out).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType

__all__ = ["READ_THREADS", "describe", "enabled", "module", "reason", "use"]

# Reads in flight per restore: an NVMe device needs a deep queue, a virtual disk at least several.
READ_THREADS = 8

_module: ModuleType | None = None
_why: str | None
try:
    import tierkv._native

    _module = tierkv._native
    _why = _module.why_unavailable()
except ImportError as exc:  # not built: no compiler at install time
    _why = f"not built ({exc})"
if _why is None and os.environ.get("TIERKV_NATIVE", "1") == "0":
    _why = "off (TIERKV_NATIVE=0)"
_forced: bool | None = None


def reason() -> str | None:
    """None if the native path is usable, else why not."""
    return _why


def enabled() -> bool:
    if _forced is not None:
        return _forced and _why is None
    return _why is None


def module() -> ModuleType:
    assert _module is not None and _why is None, _why
    return _module


@contextlib.contextmanager
def use(on: bool) -> Iterator[None]:
    """Force the native path on (where it is usable) or off, for the tests that compare the two."""
    global _forced
    before, _forced = _forced, on
    try:
        yield
    finally:
        _forced = before


def describe() -> str:
    if enabled():
        return f"native ({READ_THREADS} reads in flight)"
    return f"python ({_why or 'off in this process'})"
