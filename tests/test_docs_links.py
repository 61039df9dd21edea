"""Every relative link of the top documents (and of the history files they link to) names a
file of the repository, and every `#anchor` a heading of the page it points at, so a reader
of a clone never meets a dead link. Links to other sites are citations and are not followed."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.repo import ROOT

DOCUMENTS = ["README.md", "ARCHITECTURE.md", "BENCHMARKS.md", "RELIABILITY.md"]

# [text](target) and ![alt](target), the target up to its closing parenthesis or a title.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one numbered from -1."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page: Path, root: Path) -> list[str]:
    """Each relative link of `page` that names no file under `root`, or an anchor its target
    page lacks, as `page: target (why)`. Links inside code are not links."""
    text = page.read_text()
    wrong = []
    for target in LINK.findall(CODE.sub("", FENCE.sub("", text))):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.is_relative_to(root.resolve()):
            wrong.append(f"{page.name}: {target} (outside the repository)")
        elif not resolved.exists():
            wrong.append(f"{page.name}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            wrong.append(f"{page.name}: {target} (no such heading)")
    return wrong


def linked_pages(root: Path) -> list[Path]:
    """The top documents and every Markdown page of the repository they link to."""
    pages = [root / name for name in DOCUMENTS]
    for page in list(pages):
        for target in LINK.findall(CODE.sub("", FENCE.sub("", page.read_text()))):
            path_part = target.partition("#")[0]
            if path_part.endswith(".md") and not target.startswith(EXTERNAL):
                linked = (page.parent / path_part).resolve()
                if linked.exists() and linked.is_relative_to(root.resolve()) and linked not in pages:
                    pages.append(linked)
    return pages


def test_every_relative_link_of_the_documents_resolves():
    wrong = [problem for page in linked_pages(ROOT) for problem in broken_links(page, ROOT)]
    assert not wrong, "\n".join(wrong)


def test_a_dead_link_a_missing_heading_and_a_link_outside_are_each_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# Here it is\n")
    page = tmp_path / "README.md"
    page.write_text("# Top\n[ok](docs/there.md#here-it-is) [self](#top) [cite](https://example.org/x)\n"
                    "`[code](not/a/link.md)`\n[dead](docs/gone.md) [no heading](docs/there.md#elsewhere)\n"
                    "[out](../outside.md)\n")
    assert broken_links(page, tmp_path) == [
        "README.md: docs/gone.md (no such file)",
        "README.md: docs/there.md#elsewhere (no such heading)",
        "README.md: ../outside.md (outside the repository)",
    ]
