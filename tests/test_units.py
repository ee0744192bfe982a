import pytest

from tierkv.errors import ConfigError
from tierkv.units import format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("512MB", 512 * 10**6),
        ("20GiB", 20 * 2**30),
        ("1k", 1024),
        ("7", 7),
        ("1.5KiB", 1536),
        (" 2 TB ", 2 * 10**12),
    ],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("30m", 1800), ("24h", 86400), ("7d", 604800), ("5", 5)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "x", "5x", "-1GB", "1.2.3MB"])
def test_bad_sizes_and_durations_raise_config_error(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad)
    with pytest.raises(ConfigError):
        parse_duration(bad)


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(3 * 2**30) == "3.0 GiB"
