"""What may be logged or printed of a URL: never its credentials."""

from __future__ import annotations

import re

__all__ = ["redact_url"]

_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s]+@")  # to the last @: a password may hold one


def redact_url(text: str) -> str:
    """``text`` with the userinfo of every URL in it (``redis://user:pass@host``) replaced by ``***``:
    for anything logged or printed, which others may read."""
    return _USERINFO.sub(r"\1***@", text)
