import pytest
import torch

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
        ({"max_queue": 0}, "at least 1"),  # would refuse every request with a 503
        ({"block_tokens": 0}, "at least 1"),  # found only after the model loaded, before
        ({"remote_admit_after": 0}, "at least 1"),
        ({"max_context": -1}, "at least 0"),
        ({"max_queue": 2.5}, "whole number"),
        ({"drain_timeout": "-1s"}, "drain_timeout"),
        ({"drain_timeout": "soon"}, "duration"),
        ({"device": "cuda:x"}, "cuda"),
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


def test_drain_timeout_and_zero_counts_where_they_mean_something() -> None:
    assert ServeConfig.load({}, None, env={}).drain_timeout == 20.0
    assert ServeConfig.load({"drain_timeout": "2m"}, None, env={}).drain_timeout == 120.0
    assert ServeConfig.load({}, None, env={"TIERKV_DRAIN_TIMEOUT": "0"}).drain_timeout == 0.0
    assert ServeConfig.load({"max_context": 0}, None, env={}).max_context == 0  # the model's own


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA serves --device cuda")
def test_a_cuda_device_without_cuda_is_refused_before_the_model_loads(monkeypatch) -> None:
    from tierkv.server import state

    monkeypatch.setattr(state, "open_store", lambda config: pytest.fail("the store opened"))
    config = ServeConfig.load({"device": "cuda"}, None, env={})  # --engine vllm does not use it
    with pytest.raises(ConfigError, match=r"device cuda: this torch .* has no CUDA .*use --device cpu"):
        state.load_server(config)


def test_the_models_context_comes_from_its_text_config_and_rope_scaling() -> None:
    """--max-context is held to what the model says: a multimodal config keeps it in its text config,
    rope scaling stretches it, and a model that says nothing (ALiBi) holds it to nothing."""
    import transformers

    from tierkv.server.state import model_context

    assert model_context(transformers.LlamaConfig(max_position_embeddings=8192)) == (8192, 8192)
    assert model_context(transformers.Gemma3Config()) == (131072, 131072)  # not at its top level
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert model_context(transformers.Qwen2Config(max_position_embeddings=32768, rope_scaling=yarn)) == (
        32768,
        131072,
    )
    assert model_context(transformers.BloomConfig()) == (None, None)
