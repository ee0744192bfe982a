"""``tierkv export`` / ``tierkv import``: a store moved to another directory serves every prompt exactly; a
damaged archive costs only its damaged records; an interrupted import resumes; a server's
``/admin/export`` warms another server."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tierkv import TieredStore
from tierkv.archive.export import archive_chunks, prefixes_first, read_parents, select
from tierkv.archive.frames import FRAME_HEAD_NBYTES, ArchiveError, FrameReader, Kind, frame_head
from tierkv.archive.load import import_archive
from tierkv.cli import main
from tierkv.keys import BlockChain, Namespace, root_key
from tierkv.tiers.disk import DiskTier

from helpers import ServerProcess, make_kv
from test_worker import prompt, tiny_model

PROMPTS = [prompt(100, salt=s) for s in range(3)]  # 6 full blocks of 16 each


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A store that prefilled PROMPTS with the tiny model (bfloat16: restores are bit-identical)."""
    path = tmp_path_factory.mktemp("source")
    with TieredStore.open(path, host_bytes=0) as store:
        cm = tiny_model(store, torch.bfloat16)
        for ids in PROMPTS:
            cm.prefill(ids)
        store.flush()
    return path


def _export(cache_dir: Path, archive: Path, *args: str) -> dict:
    r = CliRunner().invoke(main, ["export", "--cache-dir", str(cache_dir), *args, "--json", str(archive)])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _import(cache_dir: Path, archive: Path | str, code: int = 0) -> dict:
    r = CliRunner().invoke(main, ["import", "--cache-dir", str(cache_dir), "--json", str(archive)])
    assert r.exit_code == code, r.output
    return json.loads(r.stdout)


def _records(archive: Path) -> list[tuple[int, int]]:
    """(offset of the frame head, body length) of each record frame in a whole archive."""
    data = archive.read_bytes()
    out, pos = [], 16
    while pos < len(data):
        kind, nbytes = data[pos + 4], int.from_bytes(data[pos + 8 : pos + 16], "little")
        if kind == Kind.RECORD:
            out.append((pos, nbytes))
        pos += FRAME_HEAD_NBYTES + nbytes
    return out


def test_imported_store_serves_every_prompt_bit_exact(source, tmp_path) -> None:
    old_umask = os.umask(0o022)  # a usual umask: the archive is still the owner's alone, as the store is
    try:
        report = _export(source, tmp_path / "a.tkv")
    finally:
        os.umask(old_umask)
    assert report["blocks"] == 18 and report["corrupt"] == 0
    assert (tmp_path / "a.tkv").stat().st_mode & 0o777 == 0o600
    got = _import(tmp_path / "copy", tmp_path / "a.tkv")
    assert (got["imported"], got["present"], got["refused"], got["complete"], got["digest_ok"]) == (
        18,
        0,
        0,
        True,
        True,
    )
    with TieredStore.open(source, host_bytes=0) as a, TieredStore.open(tmp_path / "copy", host_bytes=0) as b:
        cm_a, cm_b = tiny_model(a, torch.bfloat16), tiny_model(b, torch.bfloat16)
        for ids in PROMPTS:
            cold = cm_b.prefill(ids, use_cache=False)
            from_a, from_b = cm_a.prefill(ids), cm_b.prefill(ids)
            assert from_b.hit.by_tier["disk"] == 96
            assert torch.equal(from_b.logits, cold.logits) and torch.equal(from_b.logits, from_a.logits)
        assert (
            cm_b.generate(PROMPTS[0], 16).token_ids
            == cm_b.generate(PROMPTS[0], 16, use_cache=False).token_ids
        )
    # Importing again finds everything there.
    again = _import(tmp_path / "copy", tmp_path / "a.tkv")
    assert (again["imported"], again["present"]) == (0, 18)


def test_damaged_records_are_refused_alone_and_never_served(source, tmp_path) -> None:
    archive = tmp_path / "a.tkv"
    _export(source, archive)
    records = _records(archive)
    data = bytearray(archive.read_bytes())
    data[records[2][0] + FRAME_HEAD_NBYTES + records[2][1] - 5] ^= 0xFF  # one payload byte: that record
    data[records[5][0] + 10] ^= 0xFF  # a frame head's length: scanned past to the next frame
    (tmp_path / "bad.tkv").write_bytes(bytes(data))
    got = _import(tmp_path / "copy", tmp_path / "bad.tkv", code=1)
    assert got["refused"] == 1 and got["damaged_regions"] == 1
    # The blocks after a lost one in its prompt are useless here (never reached from position 0): skipped.
    assert got["imported"] + got["unreachable"] == 16 and got["complete"] is False
    assert got["imported"] >= 6  # two of the three prompts lost a block at most

    # The whole archive afterwards imports just the two missing records (into a second copy: the first
    # is served below as the damaged import left it).
    _import(tmp_path / "copy2", tmp_path / "bad.tkv", code=1)
    fixed = _import(tmp_path / "copy2", archive)
    assert (fixed["imported"], fixed["present"]) == (18 - got["imported"], got["imported"])
    # Whatever was imported verifies, and serves exactly: the prompt that lost a block hits up to it.
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(tmp_path / "copy"), "--check", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["corrupt"] == 0
    with TieredStore.open(tmp_path / "copy", host_bytes=0) as store:
        cm = tiny_model(store, torch.bfloat16)
        hits = []
        for ids in PROMPTS:
            warm, cold = cm.prefill(ids), cm.prefill(ids, use_cache=False)
            hits.append(warm.hit.num_tokens)
            assert torch.equal(warm.logits, cold.logits)
        assert sorted(hits)[0] < 96 and sorted(hits)[1:] == [96, 96] or sorted(hits)[:2] < [96, 96]


def test_not_an_archive_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "x").write_bytes(b"hello, not an archive" * 10)
    r = CliRunner().invoke(main, ["import", "--cache-dir", str(tmp_path / "s"), str(tmp_path / "x")])
    assert r.exit_code == 2 and "not a tierkv archive" in r.output


def test_a_truncated_archive_imports_what_it_holds_then_resumes(source, tmp_path) -> None:
    archive = tmp_path / "a.tkv"
    _export(source, archive)
    records = _records(archive)
    cut = records[9][0] + FRAME_HEAD_NBYTES + 100  # inside the tenth record
    (tmp_path / "cut.tkv").write_bytes(archive.read_bytes()[:cut])
    first = _import(tmp_path / "copy", tmp_path / "cut.tkv", code=1)
    assert first["imported"] == 9 and first["complete"] is False
    second = _import(tmp_path / "copy", archive)
    assert (second["imported"], second["present"], second["complete"]) == (9, 9, True)


def test_an_import_killed_midway_resumes_and_leaves_nothing_bad(source, tmp_path) -> None:
    """SIGKILL while records are being written: what was committed verifies and is skipped on the rerun."""
    archive = tmp_path / "a.tkv"
    _export(source, archive)
    data = archive.read_bytes()
    records = _records(archive)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierkv.cli", "import", "--cache-dir", str(tmp_path / "copy"), "-"],
        stdin=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdin is not None
    proc.stdin.write(data[: records[12][0]])  # twelve records, then the stream stalls
    proc.stdin.flush()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until some are indexed (its writer commits in batches)
        if (tmp_path / "copy" / "index" / "data.mdb").exists():
            with DiskTier(tmp_path / "copy", writer=False) as d:
                if len(d.snapshot_entries()) > 0:
                    break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdin.close()
    with DiskTier(tmp_path / "copy", writer=False) as d:
        committed = len(d.snapshot_entries())
    assert 0 < committed <= 12
    again = _import(tmp_path / "copy", archive)
    assert again["present"] == committed and again["imported"] == 18 - committed
    r = CliRunner().invoke(main, ["gc", "--cache-dir", str(tmp_path / "copy"), "--check", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["checked"] == 18


def test_ctrl_c_writes_what_was_read_says_so_and_exits_130(source, tmp_path) -> None:
    archive = tmp_path / "a.tkv"
    _export(source, archive)
    records = _records(archive)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierkv.cli", "import", "--cache-dir", str(tmp_path / "copy"), "--json", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None
    proc.stdin.write(archive.read_bytes()[: records[7][0]])  # seven records, then the stream stalls
    proc.stdin.flush()
    time.sleep(3)  # read and queued by now (a slow machine: the count below says what was)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    got = json.loads(out)
    assert got["interrupted"] and got["imported"] == 7 and b"run it again to resume" in err
    with DiskTier(tmp_path / "copy", writer=False) as d:
        assert len(d.snapshot_entries()) == 7


def test_model_names_as_the_server_and_stats_give_them() -> None:
    from tierkv.archive.export import _is_model

    ns = Namespace("SmolLM2-135M-Instruct", "w:abc", "float32", 30, 3, 64, block_tokens=16)
    for name in (
        "smollm2",
        "SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct@w:abc",
        "/m/SmolLM2-135M-Instruct/",
    ):
        assert _is_model(ns, name), name
    assert not _is_model(ns, "SmolLM2") and not _is_model(
        Namespace("org/m", "r", "float32", 1, 1, 8), "smollm2"
    )
    assert _is_model(Namespace("org/m", "r", "float32", 1, 1, 8), "org/m")


def test_nothing_is_created_or_read_where_nothing_is(tmp_path) -> None:
    r = CliRunner().invoke(main, ["export", "--cache-dir", str(tmp_path / "none"), str(tmp_path / "a.tkv")])
    assert r.exit_code == 2 and "no tierkv store" in r.output
    (tmp_path / "x").write_bytes(b"not an archive")
    r = CliRunner().invoke(main, ["import", "--cache-dir", str(tmp_path / "new"), str(tmp_path / "x")])
    assert r.exit_code == 2 and not (tmp_path / "new").exists()


def test_a_wrong_secret_creates_nothing_and_two_secrets_are_refused(source, tmp_path) -> None:
    (tmp_path / "s").write_text("right")
    (tmp_path / "w").write_text("wrong")
    _export(source, tmp_path / "a.tkv", "--secret-file", str(tmp_path / "s"))
    args = ["import", "--cache-dir", str(tmp_path / "new"), str(tmp_path / "a.tkv")]
    r = CliRunner().invoke(main, [*args, "--secret-file", str(tmp_path / "w")])
    assert r.exit_code == 2 and "another secret" in r.output and not (tmp_path / "new").exists()
    r = CliRunner().invoke(main, [*args, "--secret-file", str(tmp_path / "s"), "--token", "t"])
    assert r.exit_code == 2 and "not both" in r.output


def test_import_stays_within_the_budget_and_evicts_nothing(source, tmp_path, ns) -> None:
    from tierkv.tiers.disk.segments import aligned

    dest, budget = tmp_path / "small", 100 << 10
    with TieredStore.open(dest, host_bytes=0, disk_bytes=budget) as store:
        store.save(ns, list(range(32)), make_kv(ns, 32))
        store.flush()
    with DiskTier(source, writer=False) as d:
        footprint = aligned(d.snapshot_entries()[0][1].nbytes)
    with DiskTier(dest, writer=False) as d, d.index.read() as txn:
        used = d.index.total_nbytes(txn)
    archive = tmp_path / "a.tkv"
    _export(source, archive)
    got = _import(dest, archive, code=1)  # exit 1: something was left out
    fits = (budget - used) // footprint
    assert 0 < fits < 18 and (got["imported"], got["no_room"]) == (fits, 18 - fits)
    with DiskTier(dest, writer=False) as d:
        entries = d.snapshot_entries()
        keys = {bytes(k) for k, _ in entries}
        assert all(bytes(k) in keys for k in BlockChain.of(ns, list(range(32))).keys)  # still there
        with d.index.read() as txn:
            assert d.index.total_nbytes(txn) <= budget
        # What fitted is whole prefixes: every imported block's parent is its prompt's start or imported.
        for (_, e), parent in zip(entries, read_parents(d, [e for _, e in entries])):
            assert bytes(parent) in keys or parent == root_key(e.ns_digest)


def test_export_sends_prefixes_before_their_continuations(tmp_path) -> None:
    """A prompt's continuation saved later is newer than its prefix, yet goes out after it."""
    with TieredStore.open(tmp_path / "s", host_bytes=0) as store:
        cm = tiny_model(store, torch.bfloat16)
        cm.prefill(PROMPTS[0][:64])  # blocks 0-3
        store.flush()
        time.sleep(0.05)
        cm.prefill(PROMPTS[1])  # another prompt, blocks 0-5: more recent than the first's prefix
        store.flush()
        time.sleep(0.05)
        cm.prefill(PROMPTS[0])  # hits blocks 0-3 (touched), saves 4-5: the newest
        store.flush()
        chain = BlockChain.of(cm.namespace(), PROMPTS[0][:96])
    with DiskTier(tmp_path / "s", writer=False) as disk:
        order = [bytes(k) for k, _ in prefixes_first(disk, select(disk).entries)]
    first = [order.index(bytes(k)) for k in chain.keys]
    assert first == sorted(first) and first[:4] == [0, 1, 2, 3]  # the hottest prompt, from its start


def test_signed_archives(source, tmp_path) -> None:
    """With a secret both sides hold, a record nobody with the secret wrote is refused, though its own
    checksums are right (a forger recomputes them)."""
    from tierkv import codec

    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    archive = tmp_path / "a.tkv"
    _export(source, archive, "--secret-file", str(secret))
    r = CliRunner().invoke(main, ["import", "--cache-dir", str(tmp_path / "x"), str(archive)])
    assert r.exit_code == 2 and "signed" in r.output
    (tmp_path / "other").write_text("other")
    r = CliRunner().invoke(
        main,
        [
            "import",
            "--cache-dir",
            str(tmp_path / "x"),
            "--secret-file",
            str(tmp_path / "other"),
            str(archive),
        ],
    )
    assert r.exit_code == 2 and "another secret" in r.output
    # Forge the last record: other KV, its checksums recomputed, its frame head (and MAC) kept.
    data = bytearray(archive.read_bytes())
    at, nbytes = _records(archive)[-1]
    body = bytes(data[at + FRAME_HEAD_NBYTES : at + FRAME_HEAD_NBYTES + nbytes])
    header = codec.check_stored(body, codec.decode_header(body)[0].key)
    forged = codec.unseal(body, header)
    payload = bytearray(forged.payload)
    payload[:64] = bytes(64)
    resealed = b"".join(
        bytes(p) for p in codec.seal(codec.Unsealed(forged.head, forged.token_bytes, bytes(payload)))
    )
    assert len(resealed) == nbytes and codec.check_stored(resealed, header.key)  # it verifies on its own
    data[at + FRAME_HEAD_NBYTES : at + FRAME_HEAD_NBYTES + nbytes] = resealed
    (tmp_path / "forged.tkv").write_bytes(bytes(data))
    r = CliRunner().invoke(
        main,
        [
            "import",
            "--cache-dir",
            str(tmp_path / "y"),
            "--secret-file",
            str(secret),
            "--json",
            str(tmp_path / "forged.tkv"),
        ],
    )
    got = json.loads(r.stdout)
    assert r.exit_code == 1 and (got["imported"], got["refused"], got["signed"]) == (17, 1, True)


def test_export_selects_by_namespace_and_model_and_leaves_corrupt_records_out(source, tmp_path, ns) -> None:
    path = tmp_path / "mixed"
    with TieredStore.open(path, host_bytes=0) as store:
        store.save(ns, list(range(48)), make_kv(ns, 48))
        other = Namespace("other-model", "r1", "float16", 2, 2, 8, block_tokens=16)
        store.save(other, list(range(32)), make_kv(other, 32))
        store.flush()
    assert _export(path, tmp_path / "m.tkv", "--model", "other-model")["blocks"] == 2
    assert _export(path, tmp_path / "n.tkv", "--namespace", ns.digest.hex()[:10])["blocks"] == 3
    r = CliRunner().invoke(main, ["export", "--cache-dir", str(path), "--model", "nope", str(tmp_path / "x")])
    assert r.exit_code == 2 and "nope" in r.output and not (tmp_path / "x").exists()
    # Damage one record on disk: the export leaves it out, says so, and exits 1.
    with DiskTier(path, writer=False) as d:
        _, e = d.snapshot_entries()[0]
    seg = next((path / "segments").glob(f"{e.seg_id}.seg"), None) or next((path / "segments").iterdir())
    with open(seg, "r+b") as f:
        f.seek(e.offset + e.nbytes - 3)
        b = f.read(1)
        f.seek(e.offset + e.nbytes - 3)
        f.write(bytes([b[0] ^ 0xFF]))
    r = CliRunner().invoke(main, ["export", "--cache-dir", str(path), "--json", str(tmp_path / "all.tkv")])
    assert r.exit_code == 1, r.output
    report = json.loads(r.stdout)
    assert report["corrupt"] == 1 and report["blocks"] == 4
    got = _import(tmp_path / "copy", tmp_path / "all.tkv")
    assert got["imported"] + got["unreachable"] == 4 and got["imported"] >= 1


def test_a_spec_that_does_not_hash_to_its_namespace_refuses_its_records(source, tmp_path) -> None:
    """A head frame rewritten to claim another model for the records' namespace (its frame checksum
    recomputed, as a forger would): the spec fails its digest and the records are refused."""
    with DiskTier(source, writer=False) as disk:
        chunks = list(archive_chunks(disk, select(disk)))
    head_body = json.loads(bytes(chunks[1][FRAME_HEAD_NBYTES:]))
    for row in head_body["namespaces"].values():
        row["spec"] = row["spec"].replace('"tiny"', '"forged"')
    body = json.dumps(head_body).encode()
    chunks[1] = frame_head(Kind.HEAD, bytes(32), len(body)) + body
    with DiskTier(tmp_path / "copy") as dest:
        got = import_archive(dest, io.BytesIO(b"".join(bytes(c) for c in chunks)))
    assert got.refused == 18 and got.imported == 0


def test_frame_reader_skips_garbage_and_oversized_bodies(monkeypatch) -> None:
    from tierkv.archive import frames

    monkeypatch.setattr(frames, "MAX_RECORD_NBYTES", 8)  # a body above it is skipped unread
    good = frame_head(Kind.RECORD, b"k" * 32, 3) + b"abc"
    huge = frame_head(Kind.RECORD, b"h" * 32, 10) + b"0123456789"
    stream = frames.file_head() + good + b"TKVF-garbage" * 7 + good + huge + good
    reader = FrameReader(io.BytesIO(stream))
    reader.read_file_head()
    got = [(f.key[:1], f.body) for f in reader.frames()]
    assert got == [(b"k", b"abc"), (b"k", b"abc"), (b"h", None), (b"k", b"abc")]
    assert reader.damaged_regions == 1 and not reader.truncated
    reader = FrameReader(io.BytesIO(stream[:-2]))  # ends inside the last body
    reader.read_file_head()
    assert len(list(reader.frames())) == 3 and reader.truncated
    with pytest.raises(ArchiveError, match="version"):
        FrameReader(io.BytesIO(b"TKVARCH\0" + (9).to_bytes(2, "little") + bytes(6))).read_file_head()


def test_an_export_stream_abandoned_mid_draw_is_closed_after_it_and_counted_done() -> None:
    """The client goes away while a chunk is being drawn: the generator is closed once that draw is done
    (on the same thread: closing a running generator raises), and only then is the export counted done."""
    import asyncio
    import threading

    from tierkv.server.admin import _Export, _Exports

    drawing, closed = threading.Event(), threading.Event()

    def chunks():
        try:
            yield b"head"
            drawing.set()
            time.sleep(0.5)  # a batch being read when the client leaves
            yield b"batch"
        finally:
            closed.set()

    running = _Exports(running=1)
    export = _Export(chunks(), running, "test")

    async def client_leaves() -> None:
        stream = export.stream()
        assert await stream.__anext__() == b"head"
        pending = asyncio.ensure_future(stream.__anext__())
        await asyncio.to_thread(drawing.wait, 5)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await stream.aclose()
        await export.finish()  # the response's background task: nothing more to do

    asyncio.run(client_leaves())
    assert closed.wait(5)
    deadline = time.monotonic() + 5
    while running.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running.running == 0
    never = _Export(chunks(), running := _Exports(running=1), "test")
    asyncio.run(never.finish())  # a response that never started
    assert running.running == 0


def test_read_ahead_never_reads_a_file_that_reused_its_descriptor(tmp_path) -> None:
    """An import abandoned without closing its reader (an error on the way out): its read-ahead thread must
    not go on reading through a descriptor number the process gave to the next file it opened."""
    from tierkv.archive.streams import PrefetchReader

    (tmp_path / "a").write_bytes(b"a" * (16 << 20))
    (tmp_path / "b").write_bytes(b"b" * (16 << 20))
    fa = open(tmp_path / "a", "rb")  # noqa: SIM115
    PrefetchReader(fa, chunk_nbytes=1 << 20, depth=1).read1(10)
    fa.close()
    with open(tmp_path / "b", "rb") as fb:  # most likely the number fa had
        time.sleep(0.2)
        assert fb.read() == b"b" * (16 << 20)


@pytest.mark.slow  # (two servers' starts, about 19 s: .ci/run runs it with --runslow)
def test_a_server_export_warms_another_server(tmp_path) -> None:
    """Node to node: server A's /admin/export streams into B's directory (while B runs), and B's first
    requests hit, with A's answers."""
    a = ServerProcess("--admin-token", "secret", cache_dir=tmp_path / "a")
    b = ServerProcess(cache_dir=tmp_path / "b")
    try:
        text = "You are a careful assistant. Answer briefly and exactly. " * 4
        messages = [{"role": "system", "content": text}, {"role": "user", "content": "hello"}]
        first = a.client().chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0
        )
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        time.sleep(0.5)  # the save is written behind the answer
        r = CliRunner().invoke(main, ["import", "--cache-dir", str(tmp_path / "b"), a.url + "/admin/export"])
        assert r.exit_code == 2 and "401" in r.output  # no token
        deadline = time.monotonic() + 30
        while True:
            r = CliRunner().invoke(
                main,
                [
                    "import",
                    "--cache-dir",
                    str(tmp_path / "b"),
                    "--token",
                    "secret",
                    "--json",
                    a.url + "/admin/export",
                ],
            )
            assert r.exit_code == 0, r.output
            if json.loads(r.stdout)["imported"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        # The same stream saved to a file first: the token still verifies it.
        import urllib.request

        req = urllib.request.Request(a.url + "/admin/export", headers={"Authorization": "Bearer secret"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            (tmp_path / "a.tkv").write_bytes(resp.read())
        r = CliRunner().invoke(main, ["import", "--cache-dir", str(tmp_path / "c"), str(tmp_path / "a.tkv")])
        assert r.exit_code == 2 and "signed" in r.output  # without the token: refused whole
        r = CliRunner().invoke(
            main,
            [
                "import",
                "--cache-dir",
                str(tmp_path / "c"),
                "--token",
                "secret",
                "--json",
                str(tmp_path / "a.tkv"),
            ],
        )
        assert r.exit_code == 0 and json.loads(r.stdout)["signed"] is True, r.output
        hit = b.client().chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        assert hit.usage.prompt_tokens_details.cached_tokens >= 16 * (first.usage.prompt_tokens // 16 - 1)
        assert hit.choices[0].message.content == first.choices[0].message.content
    finally:
        a.stop()
        b.stop()
