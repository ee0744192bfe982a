"""Explaining misses: where prompts diverge, what in a template breaks caching, the server's miss log."""

import json

from click.testing import CliRunner

from tierkv.cli import main
from tierkv.default_model import ByteTokenizer
from tierkv.explain import MAX_LABEL, MissLog, diverge, lint
from tierkv.prompts import render_chat

from helpers import ServerProcess

TOK = ByteTokenizer()
RULES = "Rules:\n" + "\n".join(
    f"{i}. Always cite the section you rely on, and keep answers short." for i in range(12)
)
TOOLS = [
    f"tool {name}: {desc}"
    for name, desc in (
        ("search", "find documents by keyword " * 3),
        ("calc", "evaluate arithmetic expressions " * 3),
        ("mail", "send an email to a colleague " * 3),
    )
]


def _ids(system: str, user: str = "What changed?") -> list[int]:
    return render_chat(TOK, [{"role": "system", "content": system}, {"role": "user", "content": user}])


def test_date_at_the_top_misses_everything_at_the_end_one_block() -> None:
    top_a, top_b = _ids("Today is 2026-09-07.\n" + RULES), _ids("Today is 2026-09-08.\n" + RULES)
    d = diverge(top_a, top_b, 64)
    assert d.first_divergent_token == len(TOK.encode("<|system|>\nToday is 2026-09-0")) and d.block == 0
    assert d.reused_tokens == 0 and d.recomputed_tokens == len(top_b)
    end_a, end_b = _ids(RULES + "\nToday is 2026-09-07."), _ids(RULES + "\nToday is 2026-09-08.")
    d = diverge(end_a, end_b, 64)
    assert d.recomputed_tokens < 64 + 32 and d.reused_tokens == d.first_divergent_token // 64 * 64 > 500


def test_reordered_tools_break_the_prefix_at_the_first_moved_tool() -> None:
    a = _ids(RULES + "\n" + "\n".join(TOOLS))
    b = _ids(RULES + "\n" + "\n".join(TOOLS[1:] + TOOLS[:1]))
    d = diverge(a, b, 64)
    assert d.first_divergent_token == len(TOK.encode("<|system|>\n" + RULES + "\ntool "))
    assert d.reused_tokens == d.first_divergent_token // 64 * 64


def test_retrieved_text_before_the_rules_reuses_nothing() -> None:
    docs = ["Retrieved: the disk tier punches holes. " * 5, "Retrieved: host slots are preallocated. " * 5]
    before = [_ids(doc + "\n" + RULES) for doc in docs]
    after = [_ids(RULES + "\n" + doc) for doc in docs]
    assert diverge(*before, 64).reused_tokens == 0
    assert diverge(*after, 64).reused_tokens >= len(TOK.encode(RULES)) // 64 * 64


def test_rewritten_history_turn_stops_reuse_at_that_turn() -> None:
    turns = [
        {"role": "system", "content": RULES},
        {"role": "user", "content": "Summarise section 3. " * 4},
        {"role": "assistant", "content": "Section 3 says to cite sections. " * 4},
        {"role": "user", "content": "And section 4?"},
    ]
    rewritten = [*turns[:2], {"role": "assistant", "content": "(summary) cite sections. " * 4}, turns[3]]
    a, b = render_chat(TOK, turns), render_chat(TOK, rewritten)
    d = diverge(a, b, 64)
    # render_chat ends with the generation prompt "<|assistant|>\n": where the rewritten reply begins.
    assert d.first_divergent_token == len(render_chat(TOK, turns[:2]))


def test_prefix_prompt_has_no_divergent_token() -> None:
    a = _ids(RULES)
    d = diverge(a, a + TOK.encode("more", False), 64)
    assert d.first_divergent_token is None and d.block is None


def test_explain_cli_json(tmp_path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, day in ((a, "07"), (b, "08")):
        path.write_text(
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": f"Date: 2026-09-{day}\n" + RULES},
                        {"role": "user", "content": "hi"},
                    ]
                }
            )
        )
    r = CliRunner().invoke(main, ["explain", "--model", "tiny", str(a), str(b), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["first_divergent_token"] == len(TOK.encode("<|system|>\nDate: 2026-09-0"))
    assert out["reused_tokens"] == 0 and out["recomputed_tokens"] == out["tokens_b"]
    assert "[[8" in out["context"]["second"] and "[[7" in out["context"]["first"]
    text = tmp_path / "c.txt"
    text.write_text(RULES)
    r = CliRunner().invoke(main, ["explain", "--model", "tiny", str(text), str(text), "--json"])
    assert json.loads(r.output)["first_divergent_token"] is None
    assert (
        "the prompts are identical"
        in CliRunner().invoke(main, ["explain", "--model", "tiny", str(text), str(text)]).output
    )
    longer = tmp_path / "d.txt"
    longer.write_text(RULES + " And one more rule.")
    assert (
        "FIRST is a prefix of SECOND"
        in CliRunner().invoke(main, ["explain", "--model", "tiny", str(text), str(longer)]).output
    )
    assert (
        "SECOND is a prefix of FIRST"
        in CliRunner().invoke(main, ["explain", "--model", "tiny", str(longer), str(text)]).output
    )
    r = CliRunner().invoke(main, ["explain", "--model", "tiny", str(a), str(b)])
    assert "first divergent token" in r.output and "recomputed" in r.output
    # It says which model and block size it counted with (the tiny model's blocks: 64 tokens).
    assert (
        r.output.splitlines()[0]
        == "model tiny; blocks of 64 tokens (as tierkv serve picks it for the model on a CPU)"
    )
    r = CliRunner().invoke(
        main, ["explain", "--model", "tiny", "--block-tokens", "16", str(a), str(b), "--json"]
    )
    assert json.loads(r.output)["model"] == "tiny" and json.loads(r.output)["block_tokens"] == 16


def test_lint_flags_dynamic_content_before_stable_content(tmp_path) -> None:
    enc = lambda t: TOK.encode(t, False)  # noqa: E731
    bad = "Request id: 9f1c2e7a-1b2c-4d5e-8f90-123456789abc\nGenerated at 2026-09-07 10:15 UTC\n" + RULES
    kinds = {f.kind for f in lint(bad, enc)}
    assert {"uuid", "date"} <= kinds
    worst = lint(bad, enc)[0]
    assert worst.invalidated_tokens > len(enc(RULES))
    assert lint(RULES + "\nGenerated at 2026-09-07 10:15 UTC", enc) == []  # at the end: harmless
    path = tmp_path / "template.txt"
    path.write_text(bad)
    r = CliRunner().invoke(main, ["lint", "--model", "tiny", str(path)])
    assert r.exit_code == 1 and "Move the dynamic parts" in r.output
    assert r.output.startswith("model tiny; blocks of 64 tokens")
    path.write_text(RULES + "\nToday: {{ date }}")
    assert CliRunner().invoke(main, ["lint", "--model", "tiny", str(path)]).exit_code == 0


def test_server_miss_log_explains_where_a_prompt_diverged(tmp_path) -> None:
    srv = ServerProcess("--admin-token", "t", "--debug-prompts", cache_dir=tmp_path / "cache")
    try:
        client = srv.client()
        for day in ("07", "08"):
            client.chat.completions.create(
                model="m",
                max_tokens=1,
                user="support-bot",
                messages=[
                    {"role": "system", "content": f"Today is 2026-09-{day}.\n" + RULES},
                    {"role": "user", "content": "hi"},
                ],
            )
        import urllib.request

        req = urllib.request.Request(srv.url + "/admin/misses", headers={"Authorization": "Bearer t"})
        with urllib.request.urlopen(req) as r:
            report = json.loads(r.read())
        miss = report["misses"][0]
        assert miss["cached_tokens"] == 0 and miss["diverged_in_block"] == 0
        assert "'2026-09-08.' against '2026-09-07.'" in miss["explanation"]
        (tmpl,) = report["templates"]
        assert tmpl["template"] == "support-bot" and tmpl["requests"] == 2 and tmpl["hit_rate"] == 0.0
    finally:
        assert srv.stop() == 0


def _log_ids(text: str, add_bos: bool = True) -> list[int]:
    return TOK.encode(text, add_bos=add_bos)


def test_miss_log_never_explains_a_miss_by_another_tenants_prompt(ns) -> None:
    log = MissLog(debug_prompts=True)
    tenant_a, tenant_b = ns.with_salt("a"), ns.with_salt("b")
    log.record(tenant_b, _log_ids("SECRET plans of tenant b. " + RULES), 0, "bot", TOK)
    log.record(tenant_a, _log_ids("Hello from tenant a. " + RULES), 0, "bot", TOK)
    assert log.report()["misses"] == []  # nothing of a's own to compare with: a cold prompt, not a miss
    log.record(tenant_a, _log_ids("Hello from tenant A. " + RULES), 0, "bot", TOK)
    (miss,) = log.report()["misses"]
    assert "SECRET" not in json.dumps(log.report())
    assert "from tenant a" in miss["snippets"]["earlier"] and "from tenant A" in miss["snippets"]["this"]


def test_miss_log_picks_the_earlier_prompt_sharing_the_most_blocks(ns) -> None:
    log = MissLog(debug_prompts=True)
    B = ns.block_tokens
    base = _log_ids(RULES)
    log.record(ns, base[: 3 * B] + _log_ids("first branch " * 8, add_bos=False), 0, None, TOK)
    log.record(ns, base[:B] + _log_ids("other branch " * 8, add_bos=False), 0, None, TOK)
    log.record(ns, base[: 3 * B] + _log_ids("third branch " * 8, add_bos=False), B, None, TOK)
    misses = log.report()["misses"]  # latest first
    assert (
        misses[0]["closest_earlier_shared_blocks"] == 3 and "first branch" in misses[0]["snippets"]["earlier"]
    )
    # A prompt sharing no block with anything earlier, of no known template: not a miss to explain.
    log.record(ns, _log_ids("entirely new " * 20), 0, None, TOK)
    assert log.report()["misses"] == misses


def test_miss_log_template_table_is_bounded_least_recent_out(ns) -> None:
    log = MissLog(max_templates=8)
    for i in range(20):
        log.record(ns, _log_ids(f"prompt {i} " * 10), 0, f"user-{i}", TOK)
    log.record(ns, _log_ids("again " * 10), 0, "user-19", TOK)
    log.record(ns, _log_ids("long " * 10), 0, "u" * 10_000, TOK)  # labels are cut
    rows = log.report()["templates"]
    assert len(rows) == 8
    assert {r["template"] for r in rows} == {f"user-{i}" for i in range(13, 20)} | {"u" * MAX_LABEL}
    assert next(r for r in rows if r["template"] == "user-19")["requests"] == 2
