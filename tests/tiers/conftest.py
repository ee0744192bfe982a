"""Fixtures of the tier tests (the suite's own, ``ns`` and the options, are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers import RedisServer


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port (the test is skipped where none is installed)."""
    srv = RedisServer()
    yield srv
    srv.kill()
