import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierkv import Namespace, block_keys
from tierkv.errors import ConfigError
from tierkv.keys import BlockChain, chain_key, root_key, tokens_to_bytes

NS = Namespace(
    model_id="m", revision="r", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=4
)
tokens = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=64)


@given(tokens, tokens)
def test_same_prefix_gives_same_keys(prefix: list[int], tail: list[int]) -> None:
    a = block_keys(NS, prefix)
    b = block_keys(NS, prefix + tail)
    assert b[: len(a)] == a


@given(st.lists(st.integers(0, 50000), min_size=4, max_size=64), st.data())
def test_changing_token_p_changes_exactly_blocks_from_p(toks: list[int], data: st.DataObject) -> None:
    p = data.draw(st.integers(0, len(toks) - 1))
    changed = toks.copy()
    changed[p] = toks[p] + 1
    a, b = block_keys(NS, toks), block_keys(NS, changed)
    first = p // NS.block_tokens
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))


@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=32),
    st.sampled_from(
        [
            "model_id",
            "revision",
            "dtype",
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "block_tokens",
            "tenant_salt",
            "layout_version",
        ]
    ),
)
def test_two_namespaces_never_share_a_key(toks: list[int], field: str) -> None:
    other_value = {"dtype": "float16", "model_id": "m2", "revision": "r2", "tenant_salt": "t"}.get(
        field, getattr(NS, field) + 1 if isinstance(getattr(NS, field), int) else None
    )
    other = dataclasses.replace(NS, **{field: other_value})
    assert other.digest != NS.digest
    assert not set(block_keys(NS, toks)) & set(block_keys(other, toks))


def test_classic_prefix_cases() -> None:
    A, B, C, D, E = ([i] * 4 for i in range(1, 6))
    cached = set(block_keys(NS, A + B + C + D))

    def hits(req: list[int]) -> int:
        n = 0
        for k in block_keys(NS, req):
            if k not in cached:
                break
            n += 1
        return n

    assert hits(A + B + C + E) == 3
    assert hits(D + B + C + A) == 0
    assert hits(A + B + C + D) == 4


def test_partial_trailing_block_has_no_key() -> None:
    assert len(block_keys(NS, list(range(11)))) == 2


def test_chain_definition() -> None:
    toks = list(range(8))
    k0 = chain_key(root_key(NS.digest), tokens_to_bytes(toks[:4]))
    assert block_keys(NS, toks) == [k0, chain_key(k0, tokens_to_bytes(toks[4:]))]
    assert tokens_to_bytes([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_keys_identical_across_processes_whatever_the_hash_seed() -> None:
    code = (
        "from tierkv import Namespace, block_keys; ns = Namespace(model_id='m', revision='r', dtype='bfloat16', "
        "num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=4); print(block_keys(ns, list(range(12)))[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert outs == {block_keys(NS, list(range(12)))[-1].hex() + "\n"}


def test_namespace_validation() -> None:
    with pytest.raises(ConfigError):
        dataclasses.replace(NS, dtype="int3")
    with pytest.raises(ConfigError):
        dataclasses.replace(NS, block_tokens=0)
    with pytest.raises(ConfigError):
        tokens_to_bytes([-1])


def test_namespace_json_roundtrip() -> None:
    assert Namespace.from_json(NS.to_json()) == NS


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=200))
def test_a_list_of_token_ids_is_encoded_as_numpy_encodes_it(toks: list[int]) -> None:
    """Lists and tuples take array's fast path; numpy's stays the reference (and serves arrays)."""
    want = np.asarray(toks, dtype=np.int64).astype("<u4").tobytes()
    assert tokens_to_bytes(toks) == want == tokens_to_bytes(tuple(toks))
    assert tokens_to_bytes(np.asarray(toks, dtype=np.int64)) == want
    assert BlockChain.of(NS, toks) == BlockChain.of(NS, np.asarray(toks, dtype=np.int64))


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["7"]])
def test_token_ids_out_of_range_or_not_integers_are_refused(bad: list) -> None:
    with pytest.raises(ConfigError):
        tokens_to_bytes(bad * 64)
