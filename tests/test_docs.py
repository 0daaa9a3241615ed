"""The manual holds together: every relative link between README.md, docs/, bench/ and
CHANGELOG.md reaches a file, every #anchor a heading, each command's page is linked from README
and the index, and the package index shows what pyproject.toml says of the project."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        ROOT / "bench" / "README.md",
        *ROOT.glob("docs/*.md"),
    ]
)
COMMANDS = ("params", "tied", "neighbors", "addr", "lens", "tune", "vocab")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside code: fenced blocks and inline code spans removed."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor (a repeated heading gets -1, -2, ... as on GitHub)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path, text: str) -> list[str]:
    """The page's relative links whose file or #anchor does not exist."""
    broken = []
    for target in _LINK.findall(prose(text)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if path and not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md":
            there = file.read_text(encoding="utf-8") if path else text
            if anchor not in anchors(there):
                broken.append(f"{target}: no heading #{anchor} in {file.name}")
    return broken


def test_slugs_are_githubs():
    assert slug("Many prompts: `--prompts`") == "many-prompts---prompts"
    assert slug("Set-up (two commands)") == "set-up-two-commands"
    assert slug("Installing torch's CPU build") == "installing-torchs-cpu-build"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n")
    page = tmp_path / "page.md"
    text = (
        "[ok](other.md) [ok](other.md#other-page) [ok](#here) [web](https://x.org/y)\n"
        "# Here\n`[code](nowhere.md)` [gone](nowhere.md) [bad](other.md#nope) [bad](#nope)\n"
    )
    assert broken_links(page, text) == [
        "nowhere.md: no such file",
        "other.md#nope: no heading #nope in other.md",
        "#nope: no heading #nope in page.md",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_pages_resolve(page):
    text = page.read_text(encoding="utf-8")
    assert broken_links(page, text) == []


def test_every_page_is_reachable_from_the_index():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for page in (ROOT / "docs").glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, page.name
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/README.md)" in readme
    for name in COMMANDS:
        assert f"](docs/{name}.md)" in readme, name


def test_the_package_index_shows_the_project():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["readme"] == "README.md"
    assert project["keywords"] and project["classifiers"]
    assert {"Documentation", "Source", "Issues"} <= set(project["urls"])
    assert all(
        url.startswith("https://github.com/embedlens/embedlens") for url in project["urls"].values()
    )
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## {project['version']}" in changelog
    for name in COMMANDS:
        assert f"`{name}`" in changelog, name
