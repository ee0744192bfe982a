"""Requests that pass the schema but not the model, errors inside the server, metrics by route, the admin
token and fields, limits on connections and bodies: real HTTP against the real app (uvicorn in a thread of
this process, so a failure can be injected).
"""

import contextlib
import hmac
import json
import socket
import threading
import time

import httpx
import pytest
import torch
import uvicorn
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tierkv.explain import MissLog
from tierkv.server import admin
from tierkv.server.config import ServeConfig
from tierkv.server.startup import uvicorn_config
from tierkv.server.state import load_server

from helpers import free_port, save_byte_tokenizer

MAX_CONTEXT = 512
TOKEN = "sekret"


class LiveServer:
    def __init__(self, config: ServeConfig) -> None:
        self.server = load_server(config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # As tierkv serve runs it: behind the body guard, bounded in connections.
        uv_config = uvicorn_config(self.server, host="127.0.0.1", port=self.port, log_level="critical")
        self.app = uv_config.app.app  # the FastAPI app behind the guard
        self.uv = uvicorn.Server(uv_config)
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        self.http = self.client()  # one kept-alive connection, shared by the fuzzing

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def stop(self) -> None:
        self.http.close()
        self.uv.should_exit = True  # the app's lifespan closes (flushes) the store
        self.thread.join(60)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    # One model thread shares 2 cores with the test client: torch's second thread only spins (10x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    srv = LiveServer(
        ServeConfig(
            model="tiny",
            cache_dir=str(tmp_path_factory.mktemp("cache")),
            host_cache=64 << 20,
            device="cpu",
            max_context=MAX_CONTEXT,
            admin_token=TOKEN,
            debug_prompts=True,
        )
    )
    yield srv
    srv.stop()
    torch.set_num_threads(threads)


def _post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def _complete(client: httpx.Client, **body) -> httpx.Response:
    return _post(client, "/v1/completions", {"max_tokens": 2, **body})


def _chat(client: httpx.Client, **body) -> httpx.Response:
    return _post(
        client,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body},
    )


def _local_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def _assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


# ------------------------------------------------------------------------------------ numeric fields


def test_token_ids_must_be_in_the_vocabulary(live) -> None:
    vocab = live.server.vocab_size
    assert vocab == 259  # the default model: 256 bytes and 3 specials
    with live.client() as c:
        for prompt in ([1, vocab], [1, 2**64], [1, 2**63], [-1], [[1, vocab]], []):
            _assert_400(_complete(c, prompt=prompt), "prompt")
        assert _complete(c, prompt=[0, 1, vocab - 1]).status_code == 200  # both ends of the vocabulary
        assert _complete(c, prompt=[[1, 70, 71]]).status_code == 200  # a batch of one
        _assert_400(_complete(c, prompt=[[1, 70], [1, 71]]), "prompt")  # a batch of several


def test_seed_must_fit_torch_on_both_endpoints(live) -> None:
    with live.client() as c:
        for send in (_complete, _chat):
            kw = {"prompt": "seeded"} if send is _complete else {}
            for seed in (2**64, -(2**63) - 1, 10**30):
                _assert_400(send(c, seed=seed, temperature=1.0, **kw), "seed")
            for seed in (0, 2**64 - 1, -(2**63), -1):
                assert send(c, seed=seed, temperature=1.0, **kw).status_code == 200


def test_extreme_temperature_and_top_p_sample_greedily(live) -> None:
    with live.client() as c:
        greedy = _complete(c, prompt="Once upon a time", temperature=0, max_tokens=4).json()["choices"][0][
            "text"
        ]
        for extreme in (
            {"top_p": 1e-320},
            {"top_p": 5e-324},
            {"top_p": 1e-45},
            {"top_p": 1e-39},
            {"temperature": 5e-324},
            {"temperature": 1e-300},
            {"temperature": 1e-40},
            {"temperature": 1e-6},
        ):
            r = _complete(c, prompt="Once upon a time", max_tokens=4, seed=1, **extreme)
            assert r.status_code == 200, (extreme, r.text)
            assert r.json()["choices"][0]["text"] == greedy, extreme


def test_a_temperature_or_top_p_that_is_not_a_number_is_400_saying_so(live) -> None:
    """NaN is below no bound and above none: it was refused as "less than or equal to 2"."""
    with live.client() as c:
        for field in ("temperature", "top_p"):
            for value in ("NaN", "Infinity"):
                body = f'{{"prompt": "x", "max_tokens": 1, "{field}": {value}}}'
                r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                _assert_400(r, field)
                assert "finite number" in r.json()["error"]["message"], r.text


def test_max_tokens_past_the_context_is_400_naming_the_field(live) -> None:
    with live.client() as c:
        r = _complete(c, prompt="x", max_tokens=2**64)
        _assert_400(r, "prompt")
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = _chat(c, max_completion_tokens=MAX_CONTEXT)
        _assert_400(r, "messages")
        assert f"and {MAX_CONTEXT} completion tokens" in r.json()["error"]["message"]
        r = _complete(c, prompt=[5] * MAX_CONTEXT, max_tokens=1)
        assert f"asks for {MAX_CONTEXT} prompt tokens and 1 completion token" in r.json()["error"]["message"]


def test_text_that_is_not_unicode_is_400(live) -> None:
    with live.client() as c:
        _assert_400(_complete(c, prompt="lone \ud800 surrogate"), "prompt")
        _assert_400(_chat(c, messages=[{"role": "user", "content": "\udfff"}]), "messages")
        _assert_400(
            _chat(c, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
            "messages.0.content",
        )
        assert _complete(c, prompt="fine é 漢字 🙂").status_code == 200


def test_a_turn_without_content_is_400_unless_it_is_the_assistants(live) -> None:
    """A user's ``"content": null`` was read as an empty turn: a different prompt from the one meant."""
    with live.client() as c:
        for role in ("user", "system", "tool"):
            r = _chat(c, messages=[{"role": role, "content": None}, {"role": "user", "content": "hi"}])
            _assert_400(r, "messages.0")
            message = r.json()["error"]["message"]
            assert message == f"messages.0: a {role} message needs content: a string or a list of parts", (
                r.text
            )
        _assert_400(_chat(c, messages=[{"role": "user"}]), "messages.0")
        # an assistant's turn that made tool calls has none
        ok = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "x"},
        ]
        assert _chat(c, messages=ok).status_code == 200


def test_unsupported_fields_are_400_naming_them(live) -> None:
    with live.client() as c:
        _assert_400(_complete(c, prompt="x", n=2), "n")
        _assert_400(_complete(c, prompt="x", n=1000), "n")
        _assert_400(_complete(c, prompt="x", logprobs=3), "logprobs")
        _assert_400(_complete(c, prompt="x", logprobs=0), "logprobs")
        _assert_400(_complete(c, prompt="x", best_of=2), "best_of")
        _assert_400(_complete(c, prompt="x", echo=True), "echo")
        _assert_400(_chat(c, n=3), "n")
        _assert_400(_chat(c, logprobs=True), "logprobs")
        _assert_400(_chat(c, top_logprobs=2), "top_logprobs")
        _assert_400(_chat(c, stop=["s"] * 65), "stop")
        # A boolean is true or false: "yes" or 1 is not guessed at (it streamed).
        _assert_400(_chat(c, stream="yes"), "stream")
        _assert_400(_complete(c, prompt="x", stream=1), "stream")
        _assert_400(
            _chat(c, stream=True, stream_options={"include_usage": "no"}), "stream_options.include_usage"
        )
        # What asks for what we do is still accepted.
        assert _complete(c, prompt="x", n=1, logprobs=None, best_of=1, echo=False).status_code == 200
        assert _chat(c, n=1, logprobs=False, top_logprobs=0, stop=["s"] * 64).status_code == 200


# ------------------------------------------------------------------------------------ errors inside


def test_an_internal_error_is_a_500_and_the_connection_lives(live, monkeypatch) -> None:
    real = live.server.cm.stream

    def stream(ids, *args, **kwargs):
        if ord("!") + 3 in ids:  # the byte tokenizer: id = byte + 3
            raise RuntimeError("injected failure")
        return real(ids, *args, **kwargs)

    monkeypatch.setattr(live.server.cm, "stream", stream)
    with live.client() as c:
        r = _complete(c, prompt="break!")
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        port = _local_port(r)
        after = _complete(c, prompt="fine")  # on the same kept-alive connection
        assert after.status_code == 200 and _local_port(after) == port
        r = _chat(c, messages=[{"role": "user", "content": "break!"}], stream=True)
        assert r.status_code == 500 and _local_port(r) == port
        assert _chat(c).status_code == 200


def test_an_error_mid_stream_ends_the_stream_and_the_connection_lives(live, monkeypatch) -> None:
    real = live.server.cm.stream

    def stream(*args, **kwargs):
        events = real(*args, **kwargs)
        yield next(events)  # the prefill: the response starts
        raise RuntimeError("injected failure while generating")

    monkeypatch.setattr(live.server.cm, "stream", stream)
    with live.client() as c:
        r = _complete(c, prompt="stream", stream=True)
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        monkeypatch.setattr(live.server.cm, "stream", real)
        after = _complete(c, prompt="fine")
        assert after.status_code == 200 and _local_port(after) == _local_port(r)


# ------------------------------------------------------------------------------------ metrics, admin


def test_metrics_label_requests_by_route_not_by_path(live) -> None:
    with live.client() as c:
        for i in range(5):
            assert c.get(f"/probe-{i}/../../etc/passwd?x={i}").status_code == 404
        assert c.get("/v1/models").status_code == 200
        assert c.get("/admin/stats").status_code == 401
        text = c.get("/metrics").text
    series = [line for line in text.splitlines() if line.startswith("tierkv_requests_total{")]
    assert not [s for s in series if "probe" in s or "passwd" in s], series
    unmatched = [s for s in series if 'endpoint="unmatched",status="404"' in s]
    assert unmatched and float(unmatched[0].split()[-1]) >= 5
    assert any('endpoint="/v1/models",status="200"' in s for s in series)
    assert any('endpoint="/admin/stats",status="401"' in s for s in series)
    endpoints = {s.split('endpoint="')[1].split('"')[0] for s in series}
    assert endpoints <= {route.path for route in live.app.routes} | {"unmatched"}, endpoints


def _requests_count(c: httpx.Client, endpoint: str, status: int) -> float:
    pattern = f'tierkv_requests_total{{endpoint="{endpoint}",status="{status}"}} '
    lines = [x for x in c.get("/metrics").text.splitlines() if x.startswith(pattern)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_bodies_refused_before_the_app_are_counted_and_answered_as_the_app_answers(live) -> None:
    """A body over --max-body (413) or not UTF-8 (400) is answered by the guard in front of the app: it
    was missing from tierkv_requests_total, and its JSON spaced unlike every other error's."""
    path = "/v1/completions"
    with live.client() as c:
        too_large, not_utf8 = _requests_count(c, path, 413), _requests_count(c, path, 400)
        r = c.post(path, content=b"x" * ((8 << 20) + 1), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.content.startswith(b'{"error":{"message":"request body of'), r.text
        r = c.post(path, content=b'{"prompt": "\xff"}', headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]["message"]
        assert _requests_count(c, path, 413) == too_large + 1
        assert _requests_count(c, path, 400) == not_utf8 + 1


def test_a_body_sent_without_a_json_content_type_is_told_so(live) -> None:
    """curl -d without -H 'Content-Type: application/json' sends a form: the error says what to send
    (it said "body: Input should be a valid dictionary"), with or without a body."""
    with live.client() as c:
        for content in (json.dumps({"prompt": "hi", "max_tokens": 1}), ""):
            r = c.post(
                "/v1/completions",
                content=content,
                headers={"Content-Type": "application/x-www-form-urlencoded"},
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (
                err["code"] == "invalid_content_type" and "Content-Type: application/json" in err["message"]
            )
            assert "application/x-www-form-urlencoded" in err["message"]


def test_admin_token_is_compared_in_constant_time(live, monkeypatch) -> None:
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(admin.hmac, "compare_digest", spy)
    with live.client() as c:
        assert c.get("/admin/stats", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        assert c.get("/admin/stats", headers={"Authorization": "Bearer wrong"}).status_code == 401
        # Bytes that are not ASCII (compare_digest refuses non-ASCII str): still a 401, not a 500.
        r = c.get("/admin/stats", headers={"Authorization": "Bearer s\xe9kret".encode("latin-1")})
        assert r.status_code == 401
    assert len(calls) == 3 and all(isinstance(a, bytes) for a, _ in calls)


def test_miss_log_of_one_tenant_never_shows_another_tenants_prompt(live, monkeypatch) -> None:
    monkeypatch.setattr(live.server, "misses", MissLog(debug_prompts=True))  # only this test's requests
    rules = " ".join(f"Rule {i}: be exact." for i in range(15))
    with live.client() as c:
        assert (
            _complete(c, prompt="SECRET of tenant b. " + rules, cache_salt="b", user="bot").status_code == 200
        )
        for day in ("07", "08"):
            assert (
                _complete(
                    c, prompt=f"Today is 2026-09-{day}. " + rules, cache_salt="a", user="bot"
                ).status_code
                == 200
            )
        report = c.get("/admin/misses", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert "SECRET" not in json.dumps(report)
    (miss,) = [
        m for m in report["misses"] if m["user"] == "bot"
    ]  # a's second request, explained by a's first
    assert "'2026-09-08.' against '2026-09-07.'" in miss["explanation"]
    rows = [t for t in report["templates"] if t["template"] == "bot"]
    assert sorted(t["requests"] for t in rows) == [1, 2]  # one row per tenant


def _admin(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    return client.post(
        path,
        content=json.dumps(body),  # NaN as JSON's NaN, which json.loads (and so the server) accepts
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )


def _assert_field_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/admin/purge", {"all": "false"}, "all"),  # a truthy string: it purged everything
        ("/admin/purge", {"all": "true"}, "all"),
        ("/admin/purge", {"all": 1}, "all"),
        ("/admin/purge", {"all": [False]}, "all"),
        ("/admin/purge", {"namespace": ["ab"]}, "namespace"),
        ("/admin/purge", {"namespace": 12}, "namespace"),
        ("/admin/gc", {"all": "false"}, "all"),
        ("/admin/gc", {"dry_run": "false", "all": True}, "dry_run"),
        ("/admin/gc", {"check": "yes"}, "check"),
        ("/admin/gc", {"compact": 0}, "compact"),
        ("/admin/gc", {"ttl": -1}, "ttl"),
        ("/admin/gc", {"ttl": float("nan")}, "ttl"),
        ("/admin/gc", {"ttl": float("inf")}, "ttl"),
        ("/admin/gc", {"ttl": [3600]}, "ttl"),
        ("/admin/gc", {"ttl": 10**400}, "ttl"),
        ("/admin/gc", {"ttl": True}, "ttl"),
        ("/admin/gc", {"max_age": -0.5}, "max_age"),
        ("/admin/gc", {"max_age": {"h": 1}}, "max_age"),
        ("/admin/gc", {"budget": -1}, "budget"),
        ("/admin/gc", {"budget": float("nan")}, "budget"),
        ("/admin/gc", {"budget": 1.5}, "budget"),
        ("/admin/gc", {"budget": [1024]}, "budget"),
        ("/admin/gc", {"budget": "lots"}, "budget"),
        ("/admin/gc", {"namespace": ["ab"]}, "namespace"),
    ],
)
def test_admin_fields_of_a_wrong_type_or_range_are_400_and_purge_nothing(live, path, body, param) -> None:
    with live.client() as c:
        assert _complete(c, prompt="Kept unless a purge is asked for. " * 4).status_code == 200
        live.server.store.flush()
        blocks = c.get("/admin/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()["blocks"]
        assert blocks > 0
        _assert_field_400(_admin(c, path, body), param)
        assert c.get("/admin/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()["blocks"] == blocks


def test_admin_fields_of_the_right_type_are_accepted(live) -> None:
    with live.client() as c:
        r = _admin(c, "/admin/gc", {"ttl": "24h", "max_age": 0, "budget": "1GiB", "dry_run": True})
        assert r.status_code == 200 and r.json()["dry_run"] is True, r.text
        r = _admin(c, "/admin/gc", {"all": False, "check": False, "compact": False, "budget": 1 << 30})
        assert r.status_code == 200, r.text
        r = _admin(c, "/admin/purge", {"all": False})  # neither a namespace nor all: true
        assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
        assert _admin(c, "/admin/purge", {"namespace": "ffffffffffff"}).status_code == 400  # no such one


# ------------------------------------------------------------------------------------ chat templates, limits

# Gemma's chat template (as its tokenizer_config.json ships it, less the BOS): no system role, and the roles
# must alternate; Llama-2's and Mistral's refuse the same orders the same way, with raise_exception.
GEMMA_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


def _save_templated_model(path) -> None:
    """A tiny Llama with a byte-level tokenizer and Gemma's chat template, as a Hugging Face directory."""
    from tierkv.default_model import build_default_model

    vocab_size = save_byte_tokenizer(path, GEMMA_TEMPLATE)
    model = build_default_model(
        torch.float32,
        seed=3,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=vocab_size,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    model.save_pretrained(path)


MAX_CONNECTIONS = 2
MAX_BODY = 256 << 10
MAX_BODY_TOTAL = 384 << 10  # one largest body and half of another


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    """A server on a Hugging Face model with Gemma's chat template, with tight connection and body limits."""
    model = tmp_path_factory.mktemp("model") / "gemma-like"
    _save_templated_model(model)
    srv = LiveServer(
        ServeConfig(
            model=str(model),
            cache_dir=str(tmp_path_factory.mktemp("cache")),
            host_cache=16 << 20,
            device="cpu",
            max_context=MAX_CONTEXT,
            max_connections=MAX_CONNECTIONS,
            max_body=MAX_BODY,
            max_body_total=MAX_BODY_TOTAL,
        )
    )
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    ("roles", "words"),
    [
        (["system", "user"], "System role not supported"),
        (["user", "user"], "Conversation roles must alternate"),
        (["assistant"], "Conversation roles must alternate"),
        (["user", "assistant", "assistant"], "Conversation roles must alternate"),
    ],
)
def test_a_chat_template_that_refuses_the_messages_is_400(strict, roles, words) -> None:
    with strict.client() as c:
        r = _chat(c, messages=[{"role": role, "content": f"a {role} message"} for role in roles])
        _assert_400(r, "messages")
        assert "chat template" in r.json()["error"]["message"] and words in r.json()["error"]["message"]
        # The same connection serves what the template accepts.
        ok = _chat(c, messages=[{"role": r, "content": "hi"} for r in ("user", "assistant", "user")])
        assert ok.status_code == 200 and _local_port(ok) == _local_port(r), ok.text


def _wait_until(check, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_connections_past_the_limit_are_503_and_served_once_one_closes(strict) -> None:
    held = [strict.client() for _ in range(MAX_CONNECTIONS)]
    try:
        for c in held:  # each now holds a kept-alive connection
            assert c.get("/health").status_code == 200
        with strict.client() as extra:
            assert extra.get("/health").status_code == 503
        held.pop().close()
        with strict.client() as extra:
            _wait_until(lambda: extra.get("/health").status_code == 200)
    finally:
        for c in held:
            c.close()


def _start_upload(port: int, length: int | None, first: bytes) -> socket.socket:
    """A POST whose body has only begun to arrive: ``length`` declared, or chunked when None."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(10)
    framing = b"Transfer-Encoding: chunked" if length is None else b"Content-Length: %d" % length
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s\r\n\r\n" % framing
    )
    if first:
        s.sendall(first if length is not None else b"%x\r\n%s\r\n" % (len(first), first))
    return s


def _status(s: socket.socket) -> tuple[int, bytes]:
    reply = b""
    with contextlib.suppress(OSError):
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    return int(reply.split(b" ", 2)[1]), reply


def test_bodies_received_at_once_are_bounded_in_total(strict) -> None:
    body = json.dumps({"prompt": "z" * (MAX_BODY - 64), "max_tokens": 1}).encode()
    assert len(body) <= MAX_BODY < len(body) * 2 and MAX_BODY_TOTAL < 2 * len(body)
    slow = _start_upload(strict.port, len(body), body[:100])  # holds its declared length
    try:
        time.sleep(0.3)  # the guard has seen its headers
        second = _start_upload(strict.port, len(body), b"")  # refused from the header, before its body
        status, reply = _status(second)
        second.close()
        assert status == 503 and b"--max-body-total" in reply and b"retry-after: 1" in reply.lower(), reply
        chunked = _start_upload(strict.port, None, body[: MAX_BODY // 2])  # counted as it arrives
        with contextlib.suppress(OSError):
            for i in range(MAX_BODY // 2, len(body), 16 << 10):
                piece = body[i : i + (16 << 10)]
                chunked.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        status, reply = _status(chunked)
        chunked.close()
        assert status == 503 and b"--max-body-total" in reply, reply
        slow.sendall(body[100:])  # the first upload was never disturbed: it is answered (too long: 400)
        status, reply = _status(slow)
        assert status == 400 and b"context_length_exceeded" in reply, reply
    finally:
        slow.close()
    # Once it is received, its bytes are given back: a body as large is taken again.
    again = _start_upload(strict.port, len(body), body)
    status, reply = _status(again)
    again.close()
    assert status == 400 and b"context_length_exceeded" in reply, reply


# ------------------------------------------------------------------------------------ fuzzing the engine

VOCAB = 259
# Mostly values the schema and the model accept, at their extremes, so that most requests reach the model;
# now and then one just past what the model or torch takes (a 400).
valid_id = st.integers(0, VOCAB - 1) | st.sampled_from([0, 1, 2, VOCAB - 1])
invalid_id = st.sampled_from([VOCAB, VOCAB + 1, 2**31, 2**63, 2**64, 2**80, -1, -(2**63) - 1])
ids = st.lists(valid_id, min_size=1, max_size=24)
ids_with_a_bad_one = st.tuples(ids, invalid_id, st.integers(0, 24)).map(
    lambda t: t[0][: t[2]] + [t[1]] + t[0][t[2] :]
)
tiny_floats = st.sampled_from(
    [
        5e-324,
        1e-320,
        1e-310,
        1.4e-45,
        1e-45,
        1.1754943508222875e-38,
        1e-38,
        1e-30,
        1e-6,
        1e-5,
        1.0000001e-5,
        0.0,
        1.0,
        2.0,
        1 - 1e-16,
    ]
)
text = st.text(st.characters(codec="utf-8"), max_size=40)
bad_text = st.tuples(text, st.sampled_from(["\ud800", "\udfff", "\udbff\udbff"])).map("".join)
prompt = st.one_of(
    text,
    text,
    ids,
    ids,
    st.lists(ids, min_size=1, max_size=1),
    st.lists(text, min_size=1, max_size=1),
    ids_with_a_bad_one,
    bad_text,
    st.lists(ids, min_size=2, max_size=2),
)
content = st.one_of(
    text, text, bad_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": content}
)
bodies = st.fixed_dictionaries(
    {
        # Within the context (the model's work stays short) or past it (a 400).
        "max_tokens": st.sampled_from([1, 1, 2, 2, 3, 3, MAX_CONTEXT, 2**64 + 1]),
    },
    optional={
        "temperature": st.floats(0, 2, allow_subnormal=True) | tiny_floats,
        "top_p": st.floats(0, 1, exclude_min=True, allow_subnormal=True) | tiny_floats,
        "seed": st.integers(-(2**63), 2**64 - 1)
        | st.sampled_from([-(2**63), -1, 0, 2**63, 2**64 - 1, 2**64, -(2**63) - 1]),
        "stop": st.one_of(text, st.lists(text, max_size=8), st.lists(text, min_size=64, max_size=65)),
        "stream": st.booleans(),
        "user": text | bad_text,
        "cache_salt": st.text(max_size=8),
        "n": st.sampled_from([1, 1, 1, 2]),
        "logprobs": st.sampled_from([None, False, None, True]),
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, chat=st.booleans(), data=st.data())
def test_fuzzed_bodies_that_pass_the_schema_never_give_5xx(live, body, chat, data) -> None:
    if chat:
        body["messages"] = data.draw(st.lists(message, min_size=1, max_size=3))
    else:
        body["prompt"] = data.draw(prompt)
    r = _post(live.http, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert r.status_code < 500, r.text
    assert "server_error" not in r.text  # a stream's error event too
    if r.status_code >= 400:
        assert r.json()["error"]["type"] == "invalid_request_error"
    # With --hypothesis-show-statistics: how many reached the model, and the 400s by field.
    event(f"status {r.status_code} {r.json()['error']['param'] if r.status_code >= 400 else ''}")
    # The server, and this kept-alive connection, still serve a normal request.
    assert _complete(live.http, prompt=[1, 72, 105], max_tokens=1).status_code == 200
