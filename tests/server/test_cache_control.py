"""Cache control per request through real HTTP: the openai client's own fields (prompt_cache_retention,
prompt_cache_options, prompt_cache_breakpoint), Anthropic-style cache_control parts as raw JSON, and tierkv's
extension, against ``tierkv serve`` in a subprocess. What each did is read from the disk tier itself
(``tierkv stats --json`` beside the live server). The clock-driven behaviour (a 5-minute block expires, a
day-long one stays, a pin outlives budget pressure) is tests/test_retention.py's, with an injected clock."""

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from click.testing import CliRunner

from tierkv.cli import main
from tierkv.default_model import ByteTokenizer
from tierkv.prompts import render_chat

from helpers import ServerProcess

BLOCK = 64
TEXT = " ".join(f"Clause {i}: the answer cites its sources." for i in range(8))  # ~350 bytes: 5+ blocks


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    # One block of the tiny model is 772 KiB on disk: the pin budget holds one 4-block prompt, not two.
    # A TTL shorter than every retention asked below (a retention shorter than the TTL is no ask at all).
    srv = ServerProcess(
        "--disk-budget",
        "256MiB",
        "--pin-budget",
        "4MiB",
        "--ttl",
        "1m",
        "--max-context",
        "4096",
        cache_dir=cache,
    )
    srv.cache_dir = cache
    yield srv
    assert srv.stop() == 0


def _text(tag: str) -> str:
    """A prompt that shares no block with another test's (they share one server)."""
    return f"[{tag}] {TEXT}"


def _stats(srv) -> dict:
    r = CliRunner().invoke(main, ["stats", "--cache-dir", str(srv.cache_dir), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _wait_for(srv, check, timeout_s: float = 20.0) -> dict:
    """The disk tier's report once ``check(report)`` holds (saves and retention are written behind)."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = _stats(srv)
        if check(report) or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def _retained(report: dict, ttl: str) -> int:
    return report["retention"]["retained"]["by_ttl"].get(ttl, {}).get("blocks", 0)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:  # closes its response (its socket), as the with above does
            return e.code, json.loads(e.read())


def _usage(response) -> dict:
    return response.usage.model_dump()


def _chat(client, messages, **kw):
    return client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=4, **kw
    )


def test_prompt_cache_retention_24h_keeps_the_prompt_a_day(server) -> None:
    client = server.client()
    before = _retained(_stats(server), "1.0d")
    msgs = [{"role": "user", "content": _text("24h")}]
    r = _chat(client, msgs, prompt_cache_retention="24h")
    prompt_blocks = r.usage.prompt_tokens // BLOCK
    report = _wait_for(server, lambda s: _retained(s, "1.0d") >= before + prompt_blocks)
    assert _retained(report, "1.0d") == before + prompt_blocks
    assert _usage(r)["cache_creation_input_tokens"] == prompt_blocks * BLOCK


def test_prompt_cache_retention_in_memory_never_reaches_the_disk(server) -> None:
    client = server.client()
    salt = {"cache_salt": "in-memory"}
    secret = [{"role": "user", "content": _text("only in memory")}]
    _chat(client, secret, prompt_cache_retention="in_memory", extra_body=salt)
    again = _chat(client, secret, prompt_cache_retention="in_memory", extra_body=salt)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # served from the host tier
    # A later plain prompt of the same tenant reaches the disk: the writer has passed the first one's turn
    plain = [{"role": "user", "content": "Another text entirely. " + TEXT}]
    _chat(client, plain, extra_body=salt)
    expected = len(render_chat(ByteTokenizer(), plain)) // BLOCK
    from tierkv.worker import CachedModel

    digest = CachedModel.default(None).namespace("in-memory").digest.hex()
    report = _wait_for(server, lambda s: _namespace_blocks_of(s, digest) >= expected)
    assert _namespace_blocks_of(report, digest) == expected  # the plain prompt's blocks only


def _namespace_blocks_of(report: dict, digest: str) -> int:
    return next((row["blocks"] for row in report["namespaces"] if row["digest"] == digest), 0)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_anthropic_cache_control_keeps_the_prefix_up_to_each_breakpoint(server) -> None:
    system = _text("anthropic")
    body = {
        "model": "default",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": "First question, about sources?"}]},
        ],
    }
    tok = ByteTokenizer()
    full = render_chat(
        tok,
        [
            {"role": "system", "content": system},
            {"role": "user", "content": "First question, about sources?"},
        ],
    )
    upto = _common(full, render_chat(tok, [{"role": "system", "content": system}])) // BLOCK
    before = _retained(_stats(server), "1.0h")
    code, out = _post(server.url + "/v1/chat/completions", body)
    assert code == 200, out
    assert out["usage"]["cache_read_input_tokens"] == 0
    assert out["usage"]["cache_creation_input_tokens"] == len(full) // BLOCK * BLOCK
    report = _wait_for(server, lambda s: _retained(s, "1.0h") >= before + upto)
    assert _retained(report, "1.0h") == before + upto  # the system prompt's blocks, not the question's
    body["messages"][1]["content"][0]["text"] = "A second question, about clauses?"
    code, out = _post(server.url + "/v1/chat/completions", body)
    assert code == 200 and out["usage"]["cache_read_input_tokens"] >= upto * BLOCK > 0


def test_openai_prompt_cache_breakpoints_and_explicit_mode(server) -> None:
    client = server.client()
    system = _text("openai breakpoint")
    messages = [
        {
            "role": "system",
            "content": [
                {
                    "type": "text",
                    "text": system,
                    "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"},
                }
            ],
        },
        {"role": "user", "content": "Which clause?"},
    ]
    tok = ByteTokenizer()
    full = render_chat(
        tok, [{"role": "system", "content": system}, {"role": "user", "content": "Which clause?"}]
    )
    upto = _common(full, render_chat(tok, [{"role": "system", "content": system}])) // BLOCK
    before = _retained(_stats(server), "12.0h")
    _chat(client, messages, prompt_cache_options={"mode": "explicit", "ttl": "30m"})
    report = _wait_for(server, lambda s: _retained(s, "12.0h") >= before + upto)
    assert _retained(report, "12.0h") == before + upto
    # Explicit mode: only the marked prefix is saved, not the rest of the prompt
    blocks_before = _stats(server)["blocks"]
    long_question = {"role": "user", "content": "Which clause, and why? " + _text("question") * 2}
    explicit = [messages[0], long_question]
    r = _chat(client, explicit, prompt_cache_options={"mode": "explicit"})
    assert _usage(r)["cache_creation_input_tokens"] == 0  # the marked prefix was stored by the first request
    assert _usage(r)["prompt_tokens_details"]["cache_write_tokens"] == 0
    time.sleep(2)
    assert _stats(server)["blocks"] == blocks_before
    # A breakpoint on a whole message with text content (as some clients send it)
    system2 = _text("message-level")
    r = _chat(
        client,
        [
            {
                "role": "system",
                "content": system2,
                "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"},
            },
            {"role": "user", "content": "Which clause?"},
        ],
        prompt_cache_options={"mode": "explicit"},
    )
    full = render_chat(
        tok, [{"role": "system", "content": system2}, {"role": "user", "content": "Which clause?"}]
    )
    upto2 = _common(full, render_chat(tok, [{"role": "system", "content": system2}])) // BLOCK
    assert _usage(r)["cache_creation_input_tokens"] == upto2 * BLOCK
    report = _wait_for(server, lambda s: _retained(s, "12.0h") >= before + upto + upto2)
    assert _retained(report, "12.0h") == before + upto + upto2
    # Explicit mode without a breakpoint: the request does not use prompt caching, so nothing is saved
    plain = [{"role": "user", "content": _text("explicit, no breakpoint")}]
    _chat(client, plain, prompt_cache_options={"mode": "explicit"})
    assert _chat(client, plain).usage.prompt_tokens_details.cached_tokens == 0


def test_a_pin_within_the_budget_holds_and_one_past_it_is_refused(server) -> None:
    client = server.client()
    first = [{"role": "user", "content": _text("pinned")[:250]}]  # 4 blocks: 3.0 MiB of the 4 MiB
    r = _chat(client, first, extra_body={"tierkv": {"pin": "1h"}})
    blocks = r.usage.prompt_tokens // BLOCK
    report = _wait_for(server, lambda s: s["retention"]["pinned"]["blocks"] >= blocks)
    assert report["retention"]["pinned"]["blocks"] == blocks == 4
    with pytest.raises(openai.BadRequestError) as err:
        _chat(
            client,
            [{"role": "user", "content": _text("pinned too")[:250]}],
            extra_body={"tierkv": {"pin": "1h"}},
        )
    assert err.value.body["param"] == "tierkv.pin" and err.value.body["code"] == "pin_refused"
    assert "pin budget" in err.value.body["message"]
    # Pinning the same prompt again takes no more room
    _chat(client, first, extra_body={"tierkv": {"pin": "2h"}})
    assert "needs" in err.value.body["message"] and "--pin-budget" in err.value.body["message"]


def test_no_store_saves_nothing(server) -> None:
    client = server.client()
    msgs = [{"role": "user", "content": _text("no store")}]
    r = _chat(client, msgs, extra_body={"tierkv": {"no_store": True}})
    assert _usage(r)["cache_creation_input_tokens"] == 0
    assert _chat(client, msgs).usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt_cache_retention": "1w"}, "prompt_cache_retention"),
        ({"cache_salt": "tenant:abc"}, "cache_salt"),  # reserved for tenants of API keys
        ({"prompt_cache_options": {"ttl": "5m"}}, "prompt_cache_options.ttl"),
        ({"prompt_cache_options": {"mode": "sometimes"}}, "prompt_cache_options.mode"),
        ({"prompt_cache_options": {"ttl": "30m", "when": "now"}}, "prompt_cache_options.when"),
        ({"tierkv": {"retention": "forever"}}, "tierkv.retention"),
        ({"tierkv": {"pin": "90d"}}, "tierkv.pin"),
        ({"tierkv": {"keep": True}}, "tierkv.keep"),
        ({"tierkv": {"no_store": True, "retention": "1h"}}, "tierkv.no_store"),
        ({"prompt_cache_retention": "in_memory", "tierkv": {"pin": "1h"}}, "tierkv.pin"),
        ({"prompt_cache_retention": "in_memory", "tierkv": {"retention": "7d"}}, "tierkv.retention"),
        ({"tierkv": {"no_store": "yes"}}, "tierkv.no_store"),
        ({"message_cc": {"type": "ephemeral", "ttl": "2h"}}, "messages.0.cache_control.ttl"),
        ({"content_cc": {"type": "ephemeral", "ttl": "2h"}}, "messages.0.content.0.cache_control.ttl"),
        ({"content_cc": {"type": "persistent"}}, "messages.0.content.0.cache_control"),
        (
            {"content_bp": {"mode": "explicit", "ttl": "1d"}},
            "messages.0.content.0.prompt_cache_breakpoint.ttl",
        ),
    ],
)
def test_unknown_cache_control_values_are_400_naming_the_field(server, extra, param) -> None:
    part: dict = {"type": "text", "text": "Hello there."}
    if "content_cc" in extra:
        part["cache_control"] = extra.pop("content_cc")
    if "content_bp" in extra:
        part["prompt_cache_breakpoint"] = extra.pop("content_bp")
    message: dict = {"role": "user", "content": [part]}
    if "message_cc" in extra:
        message = {"role": "user", "content": "Hello there.", "cache_control": extra.pop("message_cc")}
    body = {"model": "default", "max_tokens": 2, "messages": [message], **extra}
    code, out = _post(server.url + "/v1/chat/completions", body)
    assert code == 400, out
    assert out["error"]["param"] == param, out


@pytest.mark.slow  # (three servers' starts, 20-30 s: .ci/run runs it with --runslow)
def test_prefetch_then_forget_from_the_shell_across_restarts(tmp_path) -> None:
    """prefetch makes the next request a host hit; forget removes a prompt's own blocks (not the ones
    another prompt extends) from memory and disk, and nothing of it comes back after a restart."""
    cache = tmp_path / "cache"
    system = _text("shell")
    a = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Question A, about the first clause?"},
    ]
    b = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Question B, about all the clauses?"},
    ]
    tok = ByteTokenizer()
    shared = _common(render_chat(tok, a), render_chat(tok, b)) // BLOCK
    for name, msgs in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps({"model": "default", "messages": msgs}))
    srv = ServerProcess(cache_dir=cache)
    try:
        for msgs in (a, b):
            _chat(srv.client(), msgs)
    finally:
        assert srv.stop() == 0
    srv = ServerProcess(cache_dir=cache)  # a new process: the prompts are on disk only
    try:
        r = CliRunner().invoke(main, ["prefetch", "--server", srv.url, str(tmp_path / "a.json")])
        assert r.exit_code == 0, r.output
        assert "now in" in r.output and "host" in r.output
        hit = _chat(srv.client(), a)
        by_tier = _usage(hit)["tierkv"]["cached_tokens_by_tier"]
        assert by_tier["disk"] == 0 and by_tier["host"] == hit.usage.prompt_tokens_details.cached_tokens > 0
        r = CliRunner().invoke(main, ["forget", "--server", srv.url, str(tmp_path / "b.json")])
        assert r.exit_code == 0, r.output
        assert f"kept {shared} shared" in r.output
        assert _chat(srv.client(), b).usage.prompt_tokens_details.cached_tokens == shared * BLOCK
        code, out = _delete(srv.url + "/v1/cache", {"messages": a, "shared": True})
        assert code == 200 and out["kept_shared_blocks"] == 0 and out["removed_blocks"] == out["blocks"]
        assert out["engine_prefix_cache"] == "none"
        assert _chat(srv.client(), [a[0]]).usage.prompt_tokens_details.cached_tokens == 0
        code, out = _delete(srv.url + "/v1/cache", {"prompt": "x", "messages": a})
        assert code == 400 and out["error"]["param"] == "prompt"
    finally:
        assert srv.stop() == 0
    srv = ServerProcess(cache_dir=cache)
    try:
        # Asked again after the restart: the deleted prompt is computed cold (what the last requests
        # saved again before the restart is theirs: b's last request, and a's system prompt, which the
        # request right after the deletion saved; so ask with a question nobody saved)
        fresh = [a[0], {"role": "user", "content": "Question A, about the first clause?"}]
        assert (
            _chat(srv.client(), fresh).usage.prompt_tokens_details.cached_tokens
            <= len(render_chat(tok, [a[0]])) // BLOCK * BLOCK
        )
    finally:
        assert srv.stop() == 0


def _delete(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="DELETE", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:  # closes its response (its socket), as the with above does
            return e.code, json.loads(e.read())
