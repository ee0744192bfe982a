from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

from tierkv import Namespace, native
from tierkv.cpu_exactness import pin_exact_isa

from helpers import ReadFaults

# As `tierkv serve` does for a CPU model in half precision before its first forward: oneDNN below AMX,
# whose bfloat16 matmuls round by the batch's shape. One pytest process runs many models, and oneDNN picks
# its kernels once, at the first matmul of any: so here, before all of them (tests/test_real_model.py
# checks the pin itself in a fresh process).
pin_exact_isa()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run soak, crash-loop and benchmark variants")
    parser.addoption(
        "--switch-interval",
        type=float,
        default=None,
        metavar="S",
        help="the GIL's switch interval (sys.setswitchinterval; Python's default 0.005): 1e-5 makes threads "
        "take turns mid-call, as a loaded machine does, and shows tests that assume one thread runs first",
    )


def pytest_configure(config: pytest.Config) -> None:
    interval = config.getoption("--switch-interval")
    if interval is not None:
        sys.setswitchinterval(interval)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = pytest.mark.skip(reason="needs --runslow")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(params=["python", "native"])
def data_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with each disk data path (reader and writer): the Python one (the reference) and the
    native one. Where the
    native module is not built the native case is skipped, unless TIERKV_REQUIRE_NATIVE=1 (the test
    command sets it): then it fails."""
    if request.param == "native" and native.reason() is not None:
        if os.environ.get("TIERKV_REQUIRE_NATIVE") == "1":
            pytest.fail(f"the native reader is required here but unavailable: {native.reason()}")
        pytest.skip(f"native reader unavailable: {native.reason()}")
    with native.use(request.param == "native"):
        yield request.param


@pytest.fixture
def read_faults() -> Iterator[ReadFaults]:
    with pytest.MonkeyPatch.context() as own:  # its own: clear() undoes only the faults' patches
        faults = ReadFaults(own)
        yield faults
        faults.clear()


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
