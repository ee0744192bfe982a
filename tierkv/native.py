"""The native data path (``tierkv._native``, built from ``native/*.c`` by the package's own build):
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

ABI = 14  # native/native.h's: a build of another version (stale, in place) is not used

_module: ModuleType | None = None
_why: str | None
try:
    import tierkv._native

    _module = tierkv._native
    _why = _module.why_unavailable()
except ImportError:  # not built: no C compiler at install time
    _why = "not built: no C compiler at install time (install gcc, then rerun scripts/setup.sh)"


def _check(mod: ModuleType) -> str | None:
    """The build is this version's, and the system's xxh3 is the one records are written with (XXH3's
    output was frozen only in xxHash 0.8.0; an older libxxhash would make every record look damaged)."""
    import xxhash

    if getattr(mod, "ABI", None) != ABI:
        return f"stale build (ABI {getattr(mod, 'ABI', None)}, want {ABI}): rerun scripts/setup.sh"
    for data in (b"", b"tierkv", bytes(range(256)) * 5):
        if mod.xxh3_64(data) != xxhash.xxh3_64_intdigest(data):
            return "the system's libxxhash computes another XXH3 (older than xxHash 0.8.0)"
    return None


if _why is None and _module is not None:
    _why = _check(_module)


def spread_helpers() -> None:
    """Have the native helper threads run on every CPU of the process (``tierkv.cpus``), not on the pin
    of the thread that calls in; where that cannot be done, they keep their creator's."""
    from tierkv.cpus import process_cpus

    if _module is not None and hasattr(_module, "set_work_cpus"):
        try:
            _module.set_work_cpus(sorted(process_cpus()))
        except (ValueError, TypeError, OSError):
            pass


if _why is None:
    spread_helpers()
    if hasattr(os, "register_at_fork"):  # a forked child takes its own threads' CPUs
        os.register_at_fork(after_in_child=spread_helpers)
if _why is None and os.environ.get("TIERKV_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
    _why = f"off by TIERKV_NATIVE={os.environ['TIERKV_NATIVE']}"
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
        vector = "dispatched" if getattr(module(), "XXH3_DISPATCHED", 0) else "plain"
        return f"native ({READ_THREADS} reads in flight, xxh3 {vector})"
    return f"python ({_why or 'off in this process'})"
