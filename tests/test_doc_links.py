"""Every relative link in the README and docs/ reaches a file that exists, and, where it names a section, a heading
of that section (GitHub's anchors); the lab notebook's index (docs/benchmarks.md) is made of such links."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\n]+)\)")


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # headings only, not shell comments
    return {anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.*)$", text, flags=re.M)}


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that reach no file, or no heading of the file they name."""
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, section = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        shown = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
        if not file.exists():
            bad.append(f"{target} (no file {shown})")
        elif section and file.suffix == ".md" and section not in anchors(file):
            bad.append(f"{target} (no heading #{section} in {shown})")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(page):
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path):
    """The negative control: a missing file and a missing heading are both reported."""
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Title\n\n## A section (issue 1)\n")
    page.write_text("[ok](other.md#a-section-issue-1) [gone](missing.md) [no heading](other.md#nothing)\n"
                    "[web](https://example.com/x.md)\n")
    assert [b.split(" ")[0] for b in broken_links(page)] == ["missing.md", "other.md#nothing"]
