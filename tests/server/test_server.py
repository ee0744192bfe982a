"""tierkv serve through real HTTP: the official openai client against a server in a subprocess."""

import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tierkv.default_model import ByteTokenizer
from tierkv.prompts import render_chat

from helpers import ServerProcess, free_port

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in full sentences." for i in range(12))
BLOCK = 64


def _post(url: str, body: bytes | str, headers: dict | None = None) -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:  # closes its response (its socket), as the with above does
            return e.code, {**json.loads(e.read()), "_headers": {k.lower(): v for k, v in e.headers.items()}}


def _get(url: str, headers: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:  # closes its response (its socket), as the with above does
            return e.code, e.read().decode()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        "--admin-token", "sekret", "--max-context", "4096", cache_dir=tmp_path_factory.mktemp("cache")
    )
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def nocache_server():
    srv = ServerProcess("--no-cache")
    yield srv
    assert srv.stop() == 0


def _chat(client, messages, max_tokens=8, **kw):
    return client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=max_tokens, **kw
    )


def _streamed(client, messages, max_tokens: int) -> tuple[str, list]:
    """A greedy chat streamed with its usage: (its text, its chunks)."""
    chunks = list(_chat(client, messages, max_tokens, stream=True, stream_options={"include_usage": True}))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_shared_system_prompt_is_cached_in_whole_blocks(server) -> None:
    client = server.client()
    m1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a KV cache?"}]
    m2 = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Why restore instead of recompute?"},
    ]
    r1 = _chat(client, m1)
    r2 = _chat(client, m2)
    tok = ByteTokenizer()
    shared = _common_prefix(render_chat(tok, m1), render_chat(tok, m2))
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == shared // BLOCK * BLOCK > 0
    extra = r2.model_extra["usage"] if "usage" in (r2.model_extra or {}) else r2.usage.model_extra
    assert extra["prompt_cache_hit_tokens"] == shared // BLOCK * BLOCK
    assert extra["prompt_cache_miss_tokens"] == r2.usage.prompt_tokens - shared // BLOCK * BLOCK
    assert extra["tierkv"]["cached_tokens_by_tier"]["host"] == shared // BLOCK * BLOCK
    # the server's log says so too, one line a request
    hit = shared // BLOCK * BLOCK
    line = f"prompt of {r2.usage.prompt_tokens} tokens: {hit} cached (host {hit}), {r2.usage.prompt_tokens - hit} computed"
    deadline = time.monotonic() + 10
    while line not in server.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert line in server.output()
    assert (
        f"prompt of {r1.usage.prompt_tokens} tokens: 0 cached (none), {r1.usage.prompt_tokens} computed"
        in server.output()
    )


def test_multi_turn_conversation_hits_its_whole_history(server) -> None:
    client = server.client()
    history = [
        {"role": "system", "content": SYSTEM + " (conversation)"},
        {"role": "user", "content": "Hello!"},
    ]
    tok = ByteTokenizer()
    seen = 0  # tokens the previous turn computed
    for turn in range(3):
        r = _chat(client, history, max_tokens=24)
        reply = r.choices[0].message.content
        prompt_ids = render_chat(tok, history)
        assert r.usage.prompt_tokens == len(prompt_ids)
        if turn:
            # Everything the previous turn computed: its prompt and its reply but the reply's last token.
            assert (
                r.usage.prompt_tokens_details.cached_tokens == min(seen, len(prompt_ids) - 1) // BLOCK * BLOCK
            )
        seen = len(prompt_ids) + len(tok.encode(reply, add_bos=False)) - 1
        history += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"Tell me more ({turn})."},
        ]


def test_greedy_output_identical_with_and_without_cache(server, nocache_server) -> None:
    msgs = [
        {"role": "system", "content": SYSTEM + " (greedy)"},
        {"role": "user", "content": "Say something."},
    ]
    cached_client, plain_client = server.client(), nocache_server.client()
    _chat(cached_client, msgs, max_tokens=32)
    hit = _chat(cached_client, msgs, max_tokens=32)
    plain = _chat(plain_client, msgs, max_tokens=32)
    assert hit.usage.prompt_tokens_details.cached_tokens > 0
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    assert _chat(plain_client, msgs, max_tokens=32).usage.prompt_tokens_details.cached_tokens == 0
    assert hit.choices[0].message.content == plain.choices[0].message.content


def test_concurrent_requests_sharing_a_prefix_answer_as_the_uncached_server_does(
    server, nocache_server
) -> None:
    """Eight clients at once, two per question, half of them streaming, all behind one system prompt that
    none has sent before: the first ones save its blocks while the others look them up or restore them.
    Every answer is the uncached server's, token for token (greedy), and the prefix is hit."""
    system = SYSTEM + " (concurrent)"
    questions = [f"Question {q}: what follows {q * 7}?" for q in range(4)]

    def ask(client, question: str, stream: bool) -> tuple[str, int]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        if not stream:
            r = _chat(client, msgs, max_tokens=24)
            return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens
        text, chunks = _streamed(client, msgs, 24)
        return text, chunks[-1].usage.prompt_tokens_details.cached_tokens

    plain = {q: ask(nocache_server.client(), q, False)[0] for q in questions}
    jobs = [(q, i % 2 == 1) for i, q in enumerate(questions * 2)]
    results: dict[int, tuple[str, int]] = {}
    errors: list[BaseException] = []

    def run(i: int, q: str, stream: bool) -> None:
        try:
            results[i] = ask(server.client(), q, stream)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, q, s)) for i, (q, s) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(results) == len(jobs), errors
    for i, (q, _) in enumerate(jobs):
        assert results[i][0] == plain[q], (i, q)
    assert max(cached for _, cached in results.values()) >= BLOCK  # the shared prefix was restored
    # Once they are all done, a question none asked hits the whole shared prefix (a byte per token).
    assert ask(server.client(), "A fifth question.", False)[1] >= len(system) // BLOCK * BLOCK


def test_streaming_matches_non_streaming_and_reports_usage(server) -> None:
    client = server.client()
    msgs = [
        {"role": "system", "content": SYSTEM + " (stream)"},
        {"role": "user", "content": "Stream please."},
    ]
    full = _chat(client, msgs, max_tokens=20)
    text, chunks = _streamed(client, msgs, 20)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    completion = list(
        client.completions.create(
            model="default", prompt="Once upon a time", max_tokens=6, temperature=0, stream=True
        )
    )
    assert completion[-1].choices[0].finish_reason == "length"


def test_legacy_completions_and_models(server) -> None:
    client = server.client()
    r = client.completions.create(model="default", prompt=SYSTEM, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert [m.id for m in client.models.list().data] == ["tierkv-default-llama-35m"]


def test_cache_salt_isolates_tenants(server) -> None:
    msgs = [{"role": "system", "content": SYSTEM + " (tenant)"}, {"role": "user", "content": "hi"}]
    client = server.client()
    _chat(client, msgs, extra_body={"cache_salt": "tenant-a"})
    assert (
        _chat(client, msgs, extra_body={"cache_salt": "tenant-a"}).usage.prompt_tokens_details.cached_tokens
        > 0
    )
    assert (
        _chat(client, msgs, extra_body={"cache_salt": "tenant-b"}).usage.prompt_tokens_details.cached_tokens
        == 0
    )


def test_metrics_move(server) -> None:
    def value(text: str, name: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    _, before = _get(server.url + "/metrics")
    msgs = [{"role": "system", "content": SYSTEM + " (metrics)"}, {"role": "user", "content": "x"}]
    _chat(server.client(), msgs)
    _chat(server.client(), msgs)
    _, after = _get(server.url + "/metrics")
    assert value(after, 'tierkv_prompt_tokens_total{source="host"}') > value(
        before, 'tierkv_prompt_tokens_total{source="host"}'
    )
    assert value(after, "tierkv_ttft_seconds_count") == value(before, "tierkv_ttft_seconds_count") + 2
    assert value(after, 'tierkv_requests_total{endpoint="/v1/chat/completions",status="200"}') >= 2
    assert value(after, 'tierkv_tier_used_bytes{tier="host"}') > 0
    # the second request's hit was read from the host tier: its bytes are counted there, where they moved
    assert value(after, 'tierkv_tier_read_bytes_total{tier="host"}') > value(
        before, 'tierkv_tier_read_bytes_total{tier="host"}'
    )
    assert 0 < value(after, 'tierkv_hit_ratio{tier="host"}') <= 1  # a dashboard's hit rate, as exported
    # the sampled self-check's series (counted by tests/test_self_check.py) and read errors are exported
    for series in (
        'tierkv_selfcheck_blocks_total{outcome="checked"}',
        'tierkv_selfcheck_blocks_total{outcome="differed"}',
        'tierkv_tier_read_errors_total{tier="disk"}',
        'tierkv_tier_writeback_lost_blocks_total{tier="disk"}',
        'tierkv_tier_cold_read_direct_bytes_per_second{tier="disk"}',
        'tierkv_tier_cold_read_buffered_bytes_per_second{tier="disk"}',
        'tierkv_tier_cold_reads_direct{tier="disk"}',
    ):
        assert any(line.startswith(series + " ") for line in after.splitlines()), series
    # how the disk tier reads what the page cache lacks: O_DIRECT 1, buffered 0, still measuring -1
    assert value(after, 'tierkv_tier_cold_reads_direct{tier="disk"}') in (-1, 0, 1)


def test_the_grafana_dashboard_reads_only_series_the_server_exports(server) -> None:
    """dashboards/tierkv.json: every series a panel queries is on a running server's /metrics (after the
    requests above), so no panel stays empty from a renamed metric; and the file is a dashboard Grafana loads."""
    from prometheus_client.parser import text_string_to_metric_families

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "dashboards" / "tierkv.json").read_text())
    assert dashboard["uid"] and dashboard["panels"]
    _, text = _get(server.url + "/metrics")
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(re.findall(r"\btierkv_\w+", target["expr"]))
    assert {"tierkv_hit_ratio", "tierkv_tier_read_bytes_total", "tierkv_tier_write_queue_bytes"} <= queried
    assert not queried - exported, (
        f"the dashboard queries series /metrics lacks: {sorted(queried - exported)}"
    )


def test_admin_api_needs_the_token(server) -> None:
    assert _get(server.url + "/admin/stats")[0] == 401
    assert _get(server.url + "/admin/stats", {"Authorization": "Bearer wrong"})[0] == 401
    assert _post(server.url + "/admin/gc", "{}")[0] == 401
    code, body = _get(server.url + "/admin/stats", {"Authorization": "Bearer sekret"})
    report = json.loads(body)
    assert code == 200 and report["policy"]["ttl_s"] == 86400
    assert report["live"]["host"]["capacity_nbytes"] > 0 and "hit_tokens" in report["live"]["disk"]
    code, out = _post(
        server.url + "/admin/gc", '{"all": true, "dry_run": true}', {"Authorization": "Bearer sekret"}
    )
    assert code == 200 and out["dry_run"] is True
    code, out = _post(server.url + "/admin/gc", '{"ttl": "soon"}', {"Authorization": "Bearer sekret"})
    assert code == 400 and "duration" in out["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("{not json", None),
        ('{"messages": "hi"}', "messages"),
        ('{"messages": []}', "messages"),
        ('{"messages": [{"role": "wizard", "content": "x"}]}', None),
        ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}', "max_tokens"),
        ('{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        ("[1, 2, 3]", None),
    ],
)
def test_malformed_requests_are_4xx_and_the_server_lives(server, body, param) -> None:
    code, out = _post(server.url + "/v1/chat/completions", body)
    assert 400 <= code < 500 and out["error"]["type"] == "invalid_request_error"
    if param:
        assert out["error"]["param"].startswith(param)
    assert _get(server.url + "/health")[0] == 200


def test_too_long_prompt_is_400(server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="default", prompt="x" * 5000, max_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded"


def test_health_answers_during_a_long_prefill_and_queue_overflow_is_503(tmp_path) -> None:
    srv = ServerProcess("--max-queue", "1", "--no-cache")
    try:
        long_prompt = " ".join(f"word{i}" for i in range(700))  # ~4.5K tokens: seconds of prefill on CPU
        results: dict = {}
        t = threading.Thread(
            target=lambda: results.update(
                long=_post(srv.url + "/v1/completions", json.dumps({"prompt": long_prompt, "max_tokens": 2}))
            )
        )
        t.start()
        time.sleep(0.8)  # the long request is on the model thread now
        t0 = time.perf_counter()
        assert _get(srv.url + "/health")[0] == 200
        assert time.perf_counter() - t0 < 0.5
        code, out = _post(srv.url + "/v1/completions", '{"prompt": "hi", "max_tokens": 1}')
        assert code == 503 and out["_headers"].get("retry-after") == "1"
        t.join()
        assert results["long"][0] == 200
    finally:
        assert srv.stop() == 0


def test_restart_serves_disk_hits_and_sigterm_finishes_the_running_request(tmp_path) -> None:
    cache = tmp_path / "cache"
    msgs = [
        {"role": "system", "content": SYSTEM + " (restart) " + "x " * 1000},
        {"role": "user", "content": "hi"},
    ]
    srv = ServerProcess(cache_dir=cache)
    # the start-up log says what the disk tier holds: here, nothing yet
    assert "disk tier: 0 blocks (0 B) cached, 0 of them for this model (0 namespaces in all)" in srv.output()
    results: dict = {}
    t = threading.Thread(target=lambda: results.update(r=_chat(srv.client(), msgs, max_tokens=4)))
    t.start()
    time.sleep(1.0)  # mid-prefill
    assert srv.stop() == 0  # SIGTERM: finishes the request, flushes the write-behind queue, exits 0
    t.join()
    assert results["r"].usage.completion_tokens == 4
    srv = ServerProcess(cache_dir=cache)
    try:
        # the start-up log says the cache survived, before any request
        (line,) = [x for x in srv.output().splitlines() if "disk tier: " in x and " cached, " in x]
        blocks, mine = re.search(r"disk tier: ([\d,]+) blocks .* cached, ([\d,]+) of them", line).groups()
        assert int(mine.replace(",", "")) == int(blocks.replace(",", "")) > 0, line
        r = _chat(srv.client(), msgs, max_tokens=4)
        by_tier = r.usage.model_extra["tierkv"]["cached_tokens_by_tier"]
        assert by_tier["disk"] == r.usage.prompt_tokens_details.cached_tokens > 1000
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("second_signal", [False, True], ids=["drain-1s", "default-drain-then-ctrl-c"])
def test_sigterm_cancels_a_request_longer_than_the_drain_then_flushes_and_exits_0(
    tmp_path, second_signal
) -> None:
    """A request still running when the drain ends is cancelled (generation stops after its token), and
    the store is flushed: before, the server waited 60 s with no word, past a container manager's SIGKILL
    (which loses the flush). A second signal cancels at once, and never skips the flush (uvicorn's forced
    exit did). What the request's prefill saved is served after a restart."""
    import contextlib
    import signal
    import subprocess

    cache = tmp_path / "cache"
    msgs = [
        {"role": "system", "content": SYSTEM + " (drain) " + "y " * 600},
        {"role": "user", "content": "go"},
    ]
    srv = ServerProcess(*([] if second_signal else ["--drain-timeout", "1s"]), cache_dir=cache)
    client = srv.client()
    try:
        stream = client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=4000, temperature=0, stream=True
        )
        chunks = iter(stream)
        next(chunks)  # the role's chunk: the prefill is done
        time.sleep(0.5)  # generating, its prefill saved
    finally:
        t0 = time.monotonic()
        if second_signal:
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            srv.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                srv.proc.wait(60)  # (stop's own SIGTERM would be a third signal: an exit without the flush)
        code = srv.stop(timeout=60)
        stop_s = time.monotonic() - t0
    finished = [
        c.choices[0].finish_reason for c in _until_cut(chunks) if c.choices and c.choices[0].finish_reason
    ]
    stream.close()  # its socket (the server cut it), and the client's
    client.close()
    out = Path(srv.log.name).read_text()  # stop() closed it
    assert code == 0, out
    assert stop_s < 15, (stop_s, out)  # 1 s of drain, a token, the flush
    assert not finished  # cut: its last chunk (a finish_reason) never came
    drain = (
        "second signal: cancelling the running requests now" if second_signal else "get up to 1s to finish"
    )
    assert drain in out and "flushed the store; bye" in out, out
    if not second_signal:
        return  # (the restart once, where a forced exit used to skip the flush: the suite's time)
    srv = ServerProcess(cache_dir=cache)
    try:
        r = _chat(srv.client(), msgs, max_tokens=1)
        assert r.usage.model_extra["tierkv"]["cached_tokens_by_tier"]["disk"] > 1000
    finally:
        assert srv.stop() == 0


def test_a_client_that_closes_its_stream_stops_the_generation(tmp_path) -> None:
    """The model thread is free again within moments of a stream's client going away, not after its
    4,000 tokens, also while the text of its tokens is held back (here by a stop string longer than any
    text it makes): the generation used to look for a cancellation only when text went out."""
    srv = ServerProcess("--no-cache")
    client = srv.client()
    try:
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "go on"}],
            max_tokens=4000,
            temperature=0,
            stream=True,
            stop=["~" * 1000],
        )
        next(iter(stream))  # the role's chunk: the request is on the model thread
        time.sleep(1.0)  # generating (its prefill takes a fraction of that)
        stream.close()
        deadline = time.monotonic() + 10
        while json.loads(_get(srv.url + "/health")[1])["queue_depth"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert json.loads(_get(srv.url + "/health")[1])["queue_depth"] == 0
    finally:
        client.close()
        assert srv.stop() == 0


def test_a_third_signal_exits_at_once_without_the_flush(monkeypatch, capfd) -> None:
    """An operator's way out of a flush that hangs, short of SIGKILL: said on stderr, exit status 1. (The
    handler's logic alone: in a real server the first two signals may end the shutdown before a third.)"""
    import uvicorn

    from tierkv.server import startup

    exits: list[int] = []
    monkeypatch.setattr(startup.os, "_exit", exits.append)
    server = startup._GracefulServer(uvicorn.Config(app=lambda scope, receive, send: None))
    server.handle_exit(15, None)
    server.handle_exit(2, None)
    assert server.should_exit and not exits  # a drain, then its cancellation: both flush
    server.handle_exit(15, None)
    assert exits == [1] and "third signal: exiting without finishing the flush" in capfd.readouterr().err


def _until_cut(chunks):
    """The rest of a stream, until it ends or its connection is cut."""
    try:
        yield from chunks
    except (openai.APIError, OSError):
        return


def test_a_context_beyond_the_models_own_is_refused_before_serving(tmp_path) -> None:
    """--max-context past the model's max_position_embeddings would generate at positions it was never
    trained at: refused at start-up, one line, exit 2 (it was accepted silently)."""
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierkv.cli",
            "serve",
            "--model",
            "tiny",
            "--port",
            str(free_port()),
            "--no-cache",
        ]
        + ["--max-context", "1000000"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 2, r.stderr
    assert "max_context 1000000 is beyond the model's context of" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_the_start_log_shows_no_remote_password(tmp_path, monkeypatch) -> None:
    # Given as the help advises (not in argv); nothing listens there: the remote tier would only fail.
    monkeypatch.setenv("TIERKV_REMOTE", "redis://tenant:hunter2@127.0.0.1:9/0")
    srv = ServerProcess(cache_dir=tmp_path)
    try:
        out = srv.output()
    finally:
        assert srv.stop() == 0
    assert "hunter2" not in out and "remote redis://***@127.0.0.1:9/0" in out, out
