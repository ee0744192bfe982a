"""The README and docs/: their generated tables match the committed results, and their links lead somewhere."""

import re
from pathlib import Path

import pytest

from tierkv.bench import docs

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("rel", docs.DOCUMENTS)
def test_generated_tables_match_the_committed_results(rel: str) -> None:
    text = (ROOT / rel).read_text()
    assert "<!-- bench: " in text, f"{rel} has no generated table"
    assert docs.render(text) == text, f"{rel} is out of date: run python -m tierkv.bench.docs"


def test_every_generated_block_is_in_a_listed_document() -> None:
    """A block in a page the generator does not rewrite would silently go stale."""
    for page in PAGES:
        if page.relative_to(ROOT).as_posix() not in docs.DOCUMENTS:
            assert "<!-- bench: " not in page.read_text(), page


def test_a_stale_table_is_found_and_an_unknown_one_is_an_error() -> None:
    text = (ROOT / "docs" / "measured.md").read_text()
    stale = text.replace("| tierkv (native) |", "| tierkv (native, edited) |", 1)
    assert stale != text and docs.render(stale) == text
    with pytest.raises(KeyError, match="nonesuch"):
        docs.render("<!-- bench: nonesuch -->\n<!-- /bench -->")


def test_the_vllm_table_takes_each_length_at_its_latest_run() -> None:
    import json

    folder = docs.RESULTS / "cpu-2c-vllm"
    latest: dict[int, tuple[str, dict]] = {}
    for path in [folder / "results.json", *sorted(folder.glob("rerun-*.json"))]:
        run = json.loads(path.read_text())
        for row in run["vllm"]["rows"]:
            if path.name != "results.json" and "limits" in run["vllm"]:  # a rerun's row keeps its limits
                row = {**row, "limits": run["vllm"]["limits"]}
            if row["tokens"] not in latest or run["when"] > latest[row["tokens"]][0]:
                latest[row["tokens"]] = (run["when"], row)
    res, runs = docs.vllm_rows()
    assert res["rows"] == [latest[t][1] for t in sorted(latest)]
    assert all(any(str(t) in line for line in runs) for t in latest)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    missing = []
    for target, _anchor in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.name} links to what does not exist: {missing}"


def test_the_readme_first_screen_says_where_each_way_is_documented() -> None:
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:90])
    for page in ("server", "vllm", "several-workers", "shell", "python", "measured", "metrics"):
        assert f"(docs/{page}.md)" in first_screen, page
