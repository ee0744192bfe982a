"""Tenant quotas through a real server (``tierkv keys quota``, real HTTP from the openai client): a tenant
that fills the disk and host tiers evicts only its own blocks once quotas are set. (The same flood without
quotas evicts the quiet tenant's prefix: tests/test_tenant_quotas.py's controls, in the store, where they
cost less than a second server here.)"""

import re
import time
import urllib.request

from click.testing import CliRunner

from tierkv.cli import main

from helpers import ServerProcess

BLOCK = 64  # the tiny model's block tokens (12 KiB a token: 768 KiB a block)


def _prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(f"{tag} clause {i} of the agreement." for i in range(12))


def _cli(*args: str) -> str:
    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 0, r.output
    return r.stdout


def _metrics(srv) -> str:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        return r.read().decode()


def _value(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _settled(srv) -> str:
    """/metrics once the disk writer is idle and the disk's usage stopped changing."""
    last = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = _metrics(srv)
        now = (
            _value(text, 'tierkv_tier_used_bytes{tier="disk"}'),
            _value(text, 'tierkv_tier_write_queue_bytes{tier="disk"}'),
        )
        if now == last and now[1] == 0:
            return text
        last = now
        time.sleep(0.5)
    raise AssertionError("the disk writer did not settle")


def _cached(srv, key: str, prompt: str) -> int:
    with srv.client(api_key=key) as client:  # (closed: a socket left open warns when collected)
        r = client.completions.create(model="default", prompt=prompt, max_tokens=1, temperature=0)
    return r.usage.prompt_tokens_details.cached_tokens


def test_a_noisy_tenant_evicts_only_its_own_blocks(tmp_path) -> None:
    keys = tmp_path / "keys.toml"
    acme, beta = (_cli("keys", "add", t, "--file", str(keys)).strip() for t in ("acme", "beta"))
    _cli("keys", "quota", "beta", "--file", str(keys), "--disk", "6MiB", "--host", "4MiB")
    _cli("keys", "quota", "acme", "--file", str(keys), "--disk", "6MiB", "--host", "4MiB")
    srv = ServerProcess(
        "--api-keys",
        str(keys),
        "--disk-budget",
        "12MiB",
        "--host-cache",
        "8MiB",
        cache_dir=tmp_path / "cache",
    )
    try:
        quiet = _prompt("beta")
        assert _cached(srv, beta, quiet) == 0
        for i in range(6):  # acme: about 30 blocks (22 MiB) through 12 MiB of disk and 8 MiB of host
            _cached(srv, acme, _prompt(f"acme{i}"))
        text = _settled(srv)
        assert _value(text, 'tierkv_tier_used_bytes{tier="disk"}') <= 12 * 2**20
        kept = _cached(srv, beta, quiet)
        assert kept >= 3 * BLOCK
        assert _value(text, 'tierkv_tenant_quota_bytes{tenant="beta",tier="disk"}') == 6 * 2**20
        assert 0 < _value(text, 'tierkv_tenant_bytes{tenant="beta",tier="disk"}') <= 6 * 2**20
        assert _value(text, 'tierkv_tenant_bytes{tenant="acme",tier="disk"}') > 6 * 2**20  # room beyond it
        # a quota is not a cap (slots in use for writes may take a tenant past it for a while)
        assert _value(text, 'tierkv_tenant_bytes{tenant="beta",tier="host"}') > 0
        # A quota changed while the server runs reaches it without a request
        _cli("keys", "quota", "beta", "--file", str(keys), "--disk", "7MiB")
        deadline = time.monotonic() + 15
        while _value(_metrics(srv), 'tierkv_tenant_quota_bytes{tenant="beta",tier="disk"}') != 7 * 2**20:
            assert time.monotonic() < deadline, "the changed quota did not reach the server"
            time.sleep(0.5)
    finally:
        assert srv.stop() == 0
