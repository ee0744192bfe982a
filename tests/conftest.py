from __future__ import annotations

import pytest
import torch

from tierkv import Namespace


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run soak, crash-loop and benchmark variants")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = pytest.mark.skip(reason="needs --runslow")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def ns() -> Namespace:
    return Namespace(
        model_id="test-model",
        revision="r1",
        dtype="float16",
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_tokens=16,
    )
