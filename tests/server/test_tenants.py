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
    client = srv.client(api_key=key)
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
    srv, _, _, _ = setup
    with pytest.raises(openai.AuthenticationError) as err:
        srv.client(api_key="tk-not-a-key").completions.create(model="default", prompt=PROMPT, max_tokens=1)
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
        assert http.value.code == 401 and http.value.headers["WWW-Authenticate"] == "Bearer"
    with urllib.request.urlopen(srv.url + "/health", timeout=10) as r:
        assert r.status == 200


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
