import torch

from tierkv import codec
from tierkv.keys import DTYPES
from tierkv.layout import DTYPE_NAMES, KVSpec
from tierkv.layout import DTYPES as TORCH_DTYPES


def test_the_one_dtype_table_agrees_with_torch_and_keeps_codes_unique() -> None:
    codes = [code for code, _ in DTYPES.values()]
    assert len(set(codes)) == len(codes)
    for name, (code, itemsize) in DTYPES.items():
        assert TORCH_DTYPES[name].itemsize == itemsize and DTYPE_NAMES[TORCH_DTYPES[name]] == name
        assert codec.DTYPE_CODES[name] == code and codec.DTYPE_ITEMSIZE[name] == itemsize


def test_record_dtype_codes_are_the_ones_on_disk() -> None:
    # Records written by earlier versions carry these codes: renumbering one would misread them.
    assert codec.DTYPE_CODES == {
        "float32": 1,
        "float16": 2,
        "bfloat16": 3,
        "float8_e4m3fn": 4,
        "float8_e5m2": 5,
    }


def test_kvspec_sizes() -> None:
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=16, dtype=torch.bfloat16)
    assert spec.token_nbytes == 3 * 2 * 2 * 8 * 2 and spec.block_nbytes == spec.token_nbytes * 16
    assert spec.block_shape == (3, 2, 16, 2, 8)
