"""Tenants from credentials through real HTTP: API keys (``tierkv keys add``) map requests to tenants that
share no block, whatever ``cache_salt`` they send; keys are checked, the keys file is reloaded, and
``tierkv stats`` never prints a salt."""

import json
import urllib.error
import urllib.request

import openai
import pytest
from click.testing import CliRunner

from tierkv.cli import main

from helpers import ServerProcess

PROMPT = "Tenant isolation: " + " ".join(f"clause {i} of the shared contract." for i in range(12))


def _key(path, tenant: str) -> str:
    r = CliRunner().invoke(main, ["keys", "add", tenant, "--file", str(path)])
    assert r.exit_code == 0, r.output
    return r.stdout.strip().splitlines()[0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    work = tmp_path_factory.mktemp("tenants")
    keys = work / "keys.toml"
    k = {"a1": _key(keys, "acme"), "a2": _key(keys, "acme"), "b": _key(keys, "beta")}
    srv = ServerProcess("--api-keys", str(keys), cache_dir=work / "cache")
    yield srv, keys, k, work
    assert srv.stop() == 0


def _cached(srv, key: str, prompt: str = PROMPT, **extra) -> int:
    with srv.client(api_key=key) as client:  # (closed: a socket left open warns when collected)
        r = client.completions.create(
            model="default", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )
    return r.usage.prompt_tokens_details.cached_tokens


def test_tenants_share_no_block_whatever_salt_they_send(setup) -> None:
    srv, keys, k, _ = setup
    assert _cached(srv, k["a1"]) == 0
    assert _cached(srv, k["a2"]) > 0  # the tenant's other key: the same space
    assert _cached(srv, k["b"]) == 0  # another tenant: nothing of acme's, no timing to tell
    assert _cached(srv, k["b"]) > 0
    # A cache_salt only subdivides the tenant's own space, even one shaped like another tenant's
    acme_salt = next(line for line in keys.read_text().splitlines() if line.startswith("salt"))
    assert _cached(srv, k["b"], cache_salt="tenant:" + acme_salt.split('"')[1]) == 0


def test_a_missing_or_unknown_key_is_401_and_health_needs_none(setup) -> None:
    srv, _, k, _ = setup
    with srv.client(api_key="tk-not-a-key") as client, pytest.raises(openai.AuthenticationError) as err:
        client.completions.create(model="default", prompt=PROMPT, max_tokens=1)
    assert err.value.body["code"] == "invalid_api_key"
    for route in ("/v1/completions", "/v1/cache/prefetch"):  # no Authorization header at all
        req = urllib.request.Request(
            srv.url + route,
            data=json.dumps({"prompt": PROMPT}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=30)
        code, challenge = http.value.code, http.value.headers["WWW-Authenticate"]
        http.value.close()
        assert code == 401 and challenge == "Bearer"
    with urllib.request.urlopen(srv.url + "/health", timeout=10) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as http:  # the models too, as OpenAI's API
        urllib.request.urlopen(srv.url + "/v1/models", timeout=10)
    code = http.value.code
    http.value.close()
    assert code == 401
    models = urllib.request.Request(srv.url + "/v1/models", headers={"Authorization": f"Bearer {k['b']}"})
    with urllib.request.urlopen(models, timeout=10) as r:
        assert json.loads(r.read())["data"]


def test_keys_added_while_the_server_runs_are_taken(setup) -> None:
    srv, keys, _, _ = setup
    new = _key(keys, "gamma")  # the file changes under the running server
    assert _cached(srv, new, "a prompt of gamma's own " * 8) == 0


def test_stats_never_print_a_tenant_salt(setup) -> None:
    srv, keys, _, work = setup
    salts = [line.split('"')[1] for line in keys.read_text().splitlines() if line.startswith("salt")]
    text = CliRunner().invoke(main, ["stats", "--cache-dir", str(work / "cache")]).output
    assert "salted #" in text
    assert not any(s in text for s in salts)


def test_the_keys_file_is_written_safely_and_checked(tmp_path) -> None:
    from tierkv.errors import ConfigError
    from tierkv.server.tenants import Tenants, add_key, key_hash

    path = tmp_path / "keys.toml"
    stale = tmp_path / ".keys.toml.tmp"  # a file someone placed where a fixed temporary name would be
    stale.write_text("x")
    stale.chmod(0o666)
    keys = [add_key(path, "acme"), add_key(path, "acme"), add_key(path, "beta")]
    assert path.stat().st_mode & 0o777 == 0o600 and stale.read_text() == "x"
    tenants = Tenants(path)
    assert [tenants.tenant(f"Bearer {k}").name for k in keys] == ["acme", "acme", "beta"]
    assert tenants.tenant("Bearer tk-nope") is None and tenants.tenant(None) is None
    assert key_hash(keys[0]) in path.read_text() and keys[0] not in path.read_text()
    # Two tenants with one salt would share a cache space: refused
    text = path.read_text()
    salt = text.split('salt = "')[1].split('"')[0]
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace(text.split('salt = "')[2].split('"')[0], salt))
    with pytest.raises(ConfigError, match="another tenant's salt"):
        Tenants(bad)
    with pytest.raises(ConfigError):
        add_key(bad, "gamma")  # a file that does not load is not rewritten
    # A removed keys file refuses every key (a revocation must not leave old keys working)
    path.unlink()
    assert tenants.tenant(f"Bearer {keys[0]}") is None


def test_keys_quota_list_and_revoke_from_the_shell(tmp_path) -> None:
    path = tmp_path / "keys.toml"
    acme = _key(path, "acme")
    _key(path, "beta")
    runner = CliRunner()

    def keys(*args: str, stdin: str | None = None):  # noqa: ANN202
        return runner.invoke(main, ["keys", *args, "--file", str(path)], input=stdin)

    r = keys("quota", "acme", "--disk", "20XB")
    assert r.exit_code == 2 and "--disk: '20XB' is not a size" in r.output and ".keys.toml." not in r.output
    r = runner.invoke(
        main, ["keys", "quota", "acme", "--file", str(tmp_path / "none.toml"), "--disk", "1MiB"]
    )
    assert r.exit_code == 2 and "does not exist" in r.output and "--file" in r.output
    assert keys("quota", "nobody", "--disk", "1MiB").exit_code == 2
    assert keys("quota", "acme", "--disk", "20GiB", "--pin", "1GiB").exit_code == 0
    assert keys("quota", "acme", "--pin", "none").exit_code == 0
    listed = json.loads(keys("list", "--json").stdout)
    assert listed == [
        {"tenant": "acme", "keys": 1, "disk_quota": "20GiB", "host_quota": None, "pin_quota": None},
        {"tenant": "beta", "keys": 1, "disk_quota": None, "host_quota": None, "pin_quota": None},
    ]
    assert "salt" not in keys("list").stdout
    r = keys("revoke", stdin=acme + "\n")
    assert r.exit_code == 0 and "tenant 'acme'" in r.output
    assert keys("revoke", stdin=acme).exit_code == 2  # gone already
    from tierkv.server.tenants import Tenants

    assert Tenants(path).tenant(f"Bearer {acme}") is None
    assert (tmp_path / "keys.toml.lock").stat().st_mode & 0o077 == 0


def test_engine_vllm_checks_the_keys_file_first_and_passes_the_remote_secret_file_to_the_connector(
    monkeypatch, capsys, tmp_path
) -> None:
    from tierkv.integrations.vllm import serve

    monkeypatch.setattr(serve, "vllm_python", lambda: "/bin/true")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    missing = tmp_path / "keys.toml"
    assert serve.serve_vllm({"api_keys": str(missing), "model": str(model)}) == 2  # before vLLM starts
    assert f"api keys file {missing}" in capsys.readouterr().err
    assert serve.serve_vllm({"api_keys": str(missing), "model": str(model), "no_cache": True}) == 2
    assert "--api-keys needs the cache" in capsys.readouterr().err
    extra = serve.connector_config({"api_keys": str(missing)})["kv_connector_extra_config"]
    assert extra["front"] is True  # the connector takes the front's reserved salts
    monkeypatch.chdir(tmp_path)
    extra = serve.connector_config({"remote": "redis://h:1", "remote_secret_file": "s.secret"})[
        "kv_connector_extra_config"
    ]
    assert extra["remote_secret_file"] == str(tmp_path / "s.secret")  # a path for vLLM's workers


def _raw_post(app, path: str, body: bytes, headers: dict[str, str]) -> int:
    """POST ``path`` to an ASGI app exactly as written (an HTTP client would remove dot segments first; a
    raw request to uvicorn keeps them)."""
    import asyncio

    status: list[int] = []

    async def run() -> None:
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        await app(scope, receive, send)

    asyncio.run(run())
    return status[0]


def test_the_vllm_front_salts_every_request_it_forwards_and_forwards_nothing_else(tmp_path) -> None:
    """The front's routing (tierkv/integrations/vllm/front.py), against a recording upstream in place of
    vLLM (tests/vllm/test_vllm_serve.py runs it in front of a real vLLM): only exact routes go through,
    each with the tenant's salt and the engine's token, never the client's key."""
    import httpx
    from fastapi.testclient import TestClient

    from tierkv.integrations.vllm.front import create_front_app
    from tierkv.server.tenants import Tenants, add_key, namespace_salt

    keys = tmp_path / "keys.toml"
    key = add_key(keys, "acme")
    tenants = Tenants(keys)
    seen: list[httpx.Request] = []

    class Body(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'{"ok": true}'

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=Body())

    app = create_front_app(tenants, httpx.MockTransport(upstream), "engine-token")
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    raw = json.dumps({"prompt": "x", "cache_salt": "raw"}).encode()
    for path in (
        "/v1/./completions",
        "/v1/../v1/completions",
        "/v1//completions",
        "/v1/embeddings",
        "/tokenize",
    ):
        assert _raw_post(app, path, raw, auth) in (307, 404, 405)
    with TestClient(app, follow_redirects=False) as client:
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert client.post("/v1/completions", json={"cache_salt": 3}, headers=auth).status_code == 400
        assert client.post("/v1/completions", json=["x"], headers=auth).status_code == 400
        assert not seen  # none of those reached the engine
        r = client.post("/v1/completions", json={"prompt": "x", "cache_salt": "team"}, headers=auth)
        assert r.status_code == 200 and r.json() == {"ok": True}
        assert client.get("/v1/models", headers=auth).status_code == 200
        assert client.get("/v1/models").status_code == 401
    sent = json.loads(seen[0].content)
    tenant = tenants.tenant(f"Bearer {key}")
    assert sent["cache_salt"] == namespace_salt(tenant, "team") and sent["prompt"] == "x"
    assert seen[0].url.path == "/v1/completions" and seen[1].url.path == "/v1/models"
    assert {r.headers["authorization"] for r in seen} == {"Bearer engine-token"}
    assert len(seen) == 2


def test_the_vllm_front_moves_cache_control_into_kv_transfer_params_and_refuses_what_it_does_not_know(
    tmp_path,
) -> None:
    """vLLM drops request fields it does not know: a ``prompt_cache_retention: "in_memory"`` sent at the
    top level was written to disk all the same (a new user's trial). The front checks the fields as
    tierkv's own engine does (a 400 naming the field) and moves them where the connector reads them. What
    reaches the connector is checked whole, however the client split it (a cold review: ``in_memory`` at
    the top level and a pin inside reached it, which ignored the control and saved the prompt to disk),
    and nothing else goes in ``kv_transfer_params`` (vLLM reads some of its keys itself: a remote
    prefill's cached tokens, reported as the client's)."""
    import httpx
    from fastapi.testclient import TestClient

    from tierkv.integrations.vllm.front import create_front_app
    from tierkv.server.tenants import Tenants, add_key

    keys = tmp_path / "keys.toml"
    key = add_key(keys, "acme")
    seen: list[dict] = []

    class Body(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'{"ok": true}'

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=Body())

    app = create_front_app(Tenants(keys), httpx.MockTransport(upstream), "engine-token")
    auth = {"Authorization": f"Bearer {key}"}
    with TestClient(app) as client:

        def post(**fields) -> httpx.Response:
            return client.post("/v1/chat/completions", json={"messages": [], **fields}, headers=auth)

        r = post(
            prompt_cache_retention="24h",
            tierkv={"pin": "2h"},
            kv_transfer_params={"prompt_cache_options": {"mode": "implicit"}},
        )
        assert r.status_code == 200
        assert seen[-1]["kv_transfer_params"] == {
            "prompt_cache_options": {"mode": "implicit"},
            "prompt_cache_retention": "24h",
            "tierkv": {"pin": "2h"},
        }
        assert "prompt_cache_retention" not in seen[-1] and "tierkv" not in seen[-1]
        assert post(messages=[{"role": "user", "content": "hi"}]).status_code == 200
        assert "kv_transfer_params" not in seen[-1]  # nothing asked, nothing added
        count = len(seen)
        for fields, param in (
            ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
            ({"prompt_cache_retention": "in_memory", "tierkv": {"pin": "2h"}}, "tierkv.pin"),
            ({"tierkv": {"pin": "soon"}}, "tierkv"),
            ({"tierkv": "pin"}, "tierkv"),
            ({"tierkv": {"pin": "2h"}, "kv_transfer_params": {"tierkv": {}}}, "tierkv"),
            ({"tierkv": {"pin": "2h"}, "kv_transfer_params": "x"}, "kv_transfer_params"),
            # split between the top level and kv_transfer_params, or only in the latter
            (
                {"prompt_cache_retention": "in_memory", "kv_transfer_params": {"tierkv": {"pin": "1h"}}},
                "tierkv.pin",
            ),
            ({"kv_transfer_params": {"tierkv": {"bogus": 1}}}, "tierkv.bogus"),
            # keys vLLM itself reads
            ({"kv_transfer_params": {"x": 1}}, "kv_transfer_params.x"),
            (
                {"kv_transfer_params": {"do_remote_prefill": True, "remote_prefill_cached_tokens": 10**6}},
                "kv_transfer_params.do_remote_prefill",
            ),
            # explicit mode with breakpoints vLLM does not pass on: it would save nothing
            (
                {
                    "prompt_cache_options": {"mode": "explicit"},
                    "messages": [
                        {"role": "system", "content": [{"type": "text", "text": "x", "cache_control": {}}]}
                    ],
                },
                "messages.0",
            ),
        ):
            r = post(**fields)
            assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (fields, r.json())
        # A key the schema does not have is named, as tierkv's own engine names it.
        r = post(tierkv={"bogus": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tierkv.bogus"
        assert r.json()["error"]["message"] == "tierkv.bogus: Extra inputs are not permitted"
        assert len(seen) == count  # none of those reached the engine
