import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import codec
from tierkv.codec import Codec, Expected
from tierkv.errors import RecordError
from tierkv.keys import block_keys, root_key, tokens_to_bytes
from tierkv.layout import KVSpec

from helpers import make_kv


def _record(ns, codec_=Codec.RAW, seed=0):
    spec = KVSpec.of(ns)
    toks = list(range(100, 100 + ns.block_tokens))
    key = block_keys(ns, toks)[0]
    kv = make_kv(ns, ns.block_tokens, seed)
    rec = codec.encode(
        ns_digest=ns.digest,
        parent_key=root_key(ns.digest),
        key=key,
        token_bytes=tokens_to_bytes(toks),
        dtype=ns.dtype,
        shape=spec.block_shape,
        payload=kv.contiguous().view(-1).view(torch.uint8).numpy().data,
        created_s=1.0,
        codec=codec_,
    )
    expected = Expected(ns.digest, key, tokens_to_bytes(toks), ns.dtype, spec.block_shape)
    return rec, expected, kv


@pytest.mark.parametrize("codec_", list(Codec))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
def test_roundtrip_is_bit_exact(ns, codec_: Codec, dtype: str) -> None:
    import dataclasses

    ns = dataclasses.replace(ns, dtype=dtype)
    rec, expected, kv = _record(ns, codec_)
    payload = codec.decode(rec, expected)
    got = torch.frombuffer(bytearray(payload), dtype=kv.dtype).view(kv.shape)
    assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))


@pytest.mark.parametrize("codec_", list(Codec))
def test_a_record_unsealed_and_sealed_again_is_the_same_bytes(ns, codec_: Codec) -> None:
    """What import relies on to hand verified records to the native writer, which seals as it writes."""
    from tierkv import native

    rec, expected, _ = _record(ns, codec_)
    header = codec.check_stored(rec, expected.key)
    unsealed = codec.unseal(rec, header)
    assert b"".join(bytes(p) for p in codec.seal(unsealed)) == rec
    if native.enabled():  # the native sealer: the same bytes (written into a file at offset 0)
        import os
        import tempfile

        with tempfile.TemporaryFile() as f:
            native.module().write_run(
                f.fileno(), 0, [(unsealed.head, unsealed.token_bytes, unsealed.payload)], 0, 0, -1
            )
            f.seek(0)
            assert os.read(f.fileno(), len(rec) + 10)[: len(rec)] == rec


def test_a_zstd_payload_declaring_more_than_its_shape_is_refused_unallocated(ns) -> None:
    """zstd decompresses a frame that states its size into that many bytes, whatever the cap: a record
    (its checksums right, as a forger makes them) declaring 1 GiB is refused before any allocation."""
    import dataclasses

    import xxhash
    import zstandard

    rec, expected, _ = _record(ns, Codec.ZSTD)
    header, _, _ = codec.decode_header(rec)
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 30))  # about 32 KiB, stating 1 GiB
    forged = dataclasses.replace(
        header, payload_nbytes=len(bomb), payload_checksum=xxhash.xxh3_64_intdigest(bomb)
    )
    with pytest.raises(RecordError, match="declares 1073741824 bytes"):
        codec.decode_payload(forged, memoryview(bomb))


def test_raw_record_is_header_tokens_payload(ns) -> None:
    rec, _, kv = _record(ns)
    assert len(rec) == codec.HEADER_NBYTES + 4 * ns.block_tokens + kv.numel() * kv.element_size()


@pytest.mark.parametrize("field", ["ns_digest", "key", "token_bytes", "dtype", "shape"])
def test_mismatch_against_request_is_a_record_error(ns, field: str) -> None:
    import dataclasses

    rec, expected, _ = _record(ns)
    wrong = {
        "ns_digest": b"\1" * 32,
        "key": b"\2" * 32,
        "token_bytes": b"\0" * len(expected.token_bytes),
        "dtype": "float32",
        "shape": (1, 2, 3),
    }[field]
    with pytest.raises(RecordError):
        codec.decode(rec, dataclasses.replace(expected, **{field: wrong}))


def test_wrong_version_is_a_record_error(ns) -> None:
    rec, expected, _ = _record(ns)
    bad = bytearray(rec)
    bad[4] = codec.FORMAT_VERSION + 1
    with pytest.raises(RecordError, match="version"):
        codec.decode(bytes(bad), expected)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_only_ever_raise_record_error(data: bytes) -> None:
    ns_ = _ns()
    _, expected, _ = _record(ns_)
    with pytest.raises(RecordError):
        codec.decode(data, expected)


def _ns():
    from tierkv import Namespace

    return Namespace(
        model_id="f", revision="r", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=4
    )


@pytest.mark.parametrize("codec_", list(Codec))
def test_every_truncation_is_a_record_error(codec_: Codec) -> None:
    rec, expected, _ = _record(_ns(), codec_)
    for n in range(len(rec)):
        with pytest.raises(RecordError):
            codec.decode(rec[:n], expected)


@pytest.mark.parametrize("codec_", list(Codec))
def test_every_single_bit_flip_is_a_record_error(codec_: Codec) -> None:
    rec, expected, _ = _record(_ns(), codec_)
    for i in range(len(rec)):
        for bit in (0, 3, 7):
            bad = bytearray(rec)
            bad[i] ^= 1 << bit
            with pytest.raises(RecordError):
                codec.decode(bytes(bad), expected)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_splices_only_ever_raise_record_error(data: st.DataObject) -> None:
    rec, expected, _ = _record(_ns(), data.draw(st.sampled_from(list(Codec))))
    i = data.draw(st.integers(0, len(rec) - 1))
    patch = data.draw(st.binary(min_size=1, max_size=16))
    bad = rec[:i] + patch + rec[i + len(patch) :]
    if bad == rec:
        return
    with pytest.raises(RecordError):
        codec.decode(bad, expected)
