"""Micro-benchmarks (pytest-benchmark). In the test suite each runs once, only to prove it runs;
``scripts/bench_micro.sh`` times them for real."""

import pytest
import torch

from tierkv import TieredStore, block_keys, codec
from tierkv.bench import tiers as tiers_bench
from tierkv.keys import root_key, tokens_to_bytes
from tierkv.layout import KVSpec

NS = tiers_bench.NS  # the embedded model's KV layout, as the tiers benchmark uses it
SPEC = KVSpec.of(NS)


@pytest.fixture(scope="module")
def block() -> torch.Tensor:
    return torch.randn(SPEC.block_shape)


def test_hash_32k_tokens(benchmark) -> None:
    toks = list(range(32768))
    keys = benchmark(block_keys, NS, toks)
    assert len(keys) == 512


@pytest.mark.parametrize("codec_", list(codec.Codec))
def test_encode_decode_block(benchmark, block, codec_) -> None:
    toks = tokens_to_bytes(range(64))
    key = block_keys(NS, range(64))[0]
    payload = block.view(-1).view(torch.uint8).numpy().data
    expected = codec.Expected(NS.digest, key, toks, NS.dtype, SPEC.block_shape)

    def roundtrip() -> int:
        rec = codec.encode(
            ns_digest=NS.digest,
            parent_key=root_key(NS.digest),
            key=key,
            token_bytes=toks,
            dtype=NS.dtype,
            shape=SPEC.block_shape,
            payload=payload,
            created_s=0.0,
            codec=codec_,
        )
        return len(codec.decode(rec, expected))

    assert benchmark(roundtrip) == SPEC.block_nbytes


def test_disk_put_flush_and_get(benchmark, tmp_path) -> None:
    kv = torch.randn(SPEC.shape(1024))
    counter = iter(range(10**6))

    def put_get() -> int:
        toks = [next(counter) * 10**5 + t for t in range(1024)]
        with TieredStore.open(tmp_path, host_bytes=0) as store:
            store.save(NS, toks, kv)
            store.flush()
            return store.load(NS, toks)[0]

    assert benchmark(put_get) == 1024


def test_host_tier_put_get(benchmark) -> None:
    kv = torch.randn(SPEC.shape(1024))
    toks = list(range(1024))
    with TieredStore.open(None, host_bytes=64 * SPEC.block_nbytes) as store:
        out = torch.empty_like(kv)
        host = store.tier("host")
        assert host is not None

        def put_get() -> int:
            host.clear()
            store.save(NS, toks, kv)
            return store.load(NS, toks, out=out)[0]

        assert benchmark(put_get) == 1024
