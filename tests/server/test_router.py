"""Prefix-aware routing: the ring, and a real router in front of two real workers."""

import json
import urllib.request

import pytest

from tierkv.bench.serving import start_router
from tierkv.server.router import Ring, Router, routing_key

from helpers import ServerProcess


def test_ring_is_stable_and_moves_only_a_failed_workers_share() -> None:
    workers = [f"http://w{i}" for i in range(4)]
    ring = Ring(workers)
    keys = [f"prefix {i}".encode() for i in range(2000)]
    before = {k: ring.owner(k) for k in keys}
    counts = {w: sum(1 for o in before.values() if o == w) for w in workers}
    assert all(300 < c < 700 for c in counts.values()), counts  # a fair spread
    ring.set_health("http://w2", False)
    after = {k: ring.owner(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "http://w2" for k in moved) and "http://w2" not in after.values()
    ring.set_health("http://w2", True)
    assert {k: ring.owner(k) for k in keys} == before


def test_routing_key_uses_the_prompt_start_and_the_tenant() -> None:
    a = {"messages": [{"role": "system", "content": "S" * 3000}, {"role": "user", "content": "one"}]}
    b = {"messages": [{"role": "system", "content": "S" * 3000}, {"role": "user", "content": "two"}]}
    assert routing_key(a, 1024) == routing_key(b, 1024)
    assert routing_key(a, 1024) != routing_key({**a, "cache_salt": "t2"}, 1024)
    short_a = {"messages": [{"role": "system", "content": "short"}, {"role": "user", "content": "one"}]}
    short_b = {"messages": [{"role": "system", "content": "short"}, {"role": "user", "content": "two"}]}
    assert routing_key(short_a, 1024) == routing_key(short_b, 1024)  # the newest message is left out


def test_a_prompt_cache_key_routes_by_the_key_within_the_tenant() -> None:
    a = {"messages": [{"role": "user", "content": "one document"}], "prompt_cache_key": "project-7"}
    b = {"messages": [{"role": "user", "content": "another one"}], "prompt_cache_key": "project-7"}
    assert routing_key(a, 1024) == routing_key(b, 1024)
    assert routing_key(a, 1024) != routing_key({**a, "prompt_cache_key": "project-8"}, 1024)
    assert routing_key(a, 1024) != routing_key({**a, "cache_salt": "t2"}, 1024)
    assert routing_key({**a, "prompt_cache_key": ""}, 1024) != routing_key(
        {**b, "prompt_cache_key": ""}, 1024
    )


def test_saturated_owner_spills_to_the_least_loaded() -> None:
    router = Router(["http://a", "http://b"], max_inflight=2)
    key = b"same prefix"
    owner = router.choose(key)
    router.inflight[owner] = 2
    other = "http://b" if owner == "http://a" else "http://a"
    assert router.choose(key) == other and router.spilled == 1


def _post(url: str, body: dict) -> tuple[dict, str]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()), r.headers["x-tierkv-worker"]


@pytest.mark.slow  # (three servers' starts, 20-30 s: .ci/run runs it with --runslow)
def test_router_sends_same_prefix_requests_to_one_worker_and_survives_a_dead_worker(tmp_path) -> None:
    a, b = ServerProcess(cache_dir=tmp_path / "a"), ServerProcess(cache_dir=tmp_path / "b")
    proc, url = start_router([a.url, b.url])
    try:
        # Three prefixes each worker owns (by the router's own ring: the ports, hence the owners, change
        # from run to run, and six random prefixes all land on one worker about one run in thirty).
        ring, owned = Ring([a.url, b.url]), {a.url: [], b.url: []}
        for i in range(100):
            system = f"System prompt number {i}: " + "be brief and exact. " * 60
            key = routing_key(
                {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}]}, 1024
            )
            if len(owned[ring.owner(key)]) < 3:
                owned[ring.owner(key)].append(system)
        systems = owned[a.url] + owned[b.url]
        assert len(systems) == 6
        first_worker = {}
        for round_ in range(2):  # the second round hits the first's KV
            for i, system in enumerate(systems):
                body = {
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"q{round_}"},
                    ],
                    "max_tokens": 2,
                    "temperature": 0,
                }
                out, worker = _post(url + "/v1/chat/completions", body)
                first_worker.setdefault(i, worker)
                assert worker == first_worker[i]  # same prefix, same worker
                if round_:
                    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its KV was there
        assert len(set(first_worker.values())) == 2  # and the prefixes spread over both
        # DELETE /v1/cache goes where the prompt is routed: the worker that holds its blocks
        forget = urllib.request.Request(
            url + "/v1/cache",
            data=json.dumps(
                {"messages": [{"role": "system", "content": systems[1]}], "shared": True}
            ).encode(),
            method="DELETE",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(forget, timeout=60) as r:
            gone, worker = json.loads(r.read()), r.headers["x-tierkv-worker"]
        assert worker == first_worker[1] and gone["removed_blocks"] > 0
        victim = a if a.url == first_worker[0] else b
        victim.stop()
        body = {
            "messages": [{"role": "system", "content": systems[0]}, {"role": "user", "content": "again"}],
            "max_tokens": 2,
        }
        out, worker = _post(url + "/v1/chat/completions", body)  # rerouted, not failed
        assert worker != victim.url and out["choices"]
        stream_req = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(
                {"prompt": "stream through the router", "max_tokens": 3, "stream": True}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(stream_req, timeout=60) as r:
            assert r.read().decode().rstrip().endswith("data: [DONE]")
    finally:
        proc.terminate()
        proc.wait(30)
        for s in (a, b):
            if s.proc.poll() is None:
                assert s.stop() == 0
