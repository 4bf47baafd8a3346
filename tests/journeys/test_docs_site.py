"""The docs as a site: the README stays a front page (at most 20 KB, with its contents linking
every page of the user guide), and the user guide with the design notes (docs/, mkdocs.yml)
builds with ``mkdocs build --strict``, as CI builds it (.ci/run): a link to a missing page or
heading fails the build. The guide's commands run in tests/journeys/test_readme.py (its
``bash`` blocks) and test_guide_text_blocks.py (its ``text`` blocks)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import yaml

from tests.conftest import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"


def build(root) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
               str(root / "mkdocs.yml"), "-d", str(root / "_site")]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=root)


def nav_pages(nav: list) -> set[str]:
    pages: set[str] = set()
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages |= nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_the_readme_is_a_front_page_whose_contents_link_every_guide_page():
    text = README.read_text()
    assert len(text.encode()) <= 20_000, len(text.encode())
    contents = text.split("## Contents\n", 1)[1].split("\n## ", 1)[0]
    linked = set(re.findall(r"\]\((docs/[\w/.-]+\.md)\)", contents))
    guide = {f"docs/{p.relative_to(DOCS)}" for p in (DOCS / "guide").glob("*.md")}
    assert guide | {"docs/site.md", "docs/api.md", "docs/README.md"} <= linked, linked
    assert "## Set up (two commands)" in text and "## A short tour" in text
    development = (DOCS / "guide" / "development.md").read_text()
    assert re.search(r"took \d+ to \d+ minutes", development)  # the suite's time, kept


def test_the_guide_builds_strictly_and_a_broken_link_fails_the_build(tmp_path):
    """Under 5 s: two mkdocs builds of about 20 pages."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert nav_pages(nav) == pages  # every page is in the site's navigation
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path)
    built = build(tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "_site" / "guide" / "training" / "index.html").is_file()
    home = tmp_path / "docs" / "README.md"
    home.write_text(home.read_text().replace("(guide/sweeps.md)", "(guide/sweeps.md#no-such)", 1))
    broken = build(tmp_path)
    assert broken.returncode != 0 and "#no-such" in broken.stderr, broken.stderr[-3000:]
