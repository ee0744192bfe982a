import pytest

from tierkv.errors import ConfigError
from tierkv.server.config import ServeConfig


def test_precedence_cli_over_env_over_file(tmp_path) -> None:
    f = tmp_path / "tierkv.toml"
    f.write_text('port = 9000\nttl = "2h"\nhost_cache = "1GiB"\nblock_tokens = 32\n')
    env = {"TIERKV_PORT": "9100", "TIERKV_DISK_BUDGET": "5GB", "TIERKV_NO_CACHE": "true"}
    cfg = ServeConfig.load({"port": 9200}, str(f), env=env)
    assert cfg.port == 9200  # command line wins
    assert cfg.disk_budget == 5 * 10**9 and cfg.no_cache is True  # environment
    assert cfg.ttl == 7200 and cfg.host_cache == 2**30 and cfg.block_tokens == 32  # file
    assert cfg.host == "127.0.0.1"  # loopback unless told otherwise


@pytest.mark.parametrize(
    ("cli", "text"),
    [
        ({"dtype": "int4"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"ttl": "soon"}, "duration"),
        ({"bogus": 1}, "unknown"),
        ({"threads": -1}, "threads"),
        ({"threads": 2.7}, "whole number"),
        ({"threads": True}, "whole number"),
        ({"port": 99999}, "1 to 65535"),
        ({"port": 0}, "1 to 65535"),
        ({"port": "http"}, "port"),
    ],
)
def test_bad_options_are_config_errors(cli, text) -> None:
    with pytest.raises(ConfigError, match=text):
        ServeConfig.load(cli, None, env={})


def test_bad_toml_is_a_config_error(tmp_path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("port = = 1")
    with pytest.raises(ConfigError, match="--config"):
        ServeConfig.load({}, str(f), env={})


def test_threads_from_each_source_and_0_is_torchs_choice(tmp_path) -> None:
    f = tmp_path / "tierkv.toml"
    f.write_text("threads = 3\n")
    assert ServeConfig.load({}, None, env={}).threads == 0
    assert ServeConfig.load({}, str(f), env={}).threads == 3
    assert ServeConfig.load({}, str(f), env={"TIERKV_THREADS": "2"}).threads == 2
    assert ServeConfig.load({"threads": 1}, str(f), env={"TIERKV_THREADS": "2"}).threads == 1
