"""The documents' links lead somewhere: every relative link in the README, docs/ and the
folders' READMEs names a file or folder of the checkout, and every #anchor a heading of
the page it points at.

Links inside code (fenced blocks, `inline code`) are text, not links, and are skipped; so
are URLs with a scheme (https:, mailto:). The committed benchmark reports under
bench/results/ are generated, and are not checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Folders whose READMEs are documents (bench/results/ holds generated reports).
README_FOLDERS = ("server", "client", "croupier", "bench", "examples", "docker", "protos", "tests")


def _documents() -> list[Path]:
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for folder in README_FOLDERS:
        docs += sorted(p for p in (REPO / folder).rglob("README.md") if "results" not in p.relative_to(REPO).parts)
    return docs


DOCUMENTS = _documents()

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
#: [text](target "title") and reference definitions [label]: target
_INLINE_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose(text: str) -> str:
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def relative_links(doc: Path) -> list[str]:
    """The relative link targets of a Markdown file, in order (anchors included)."""
    text = _prose(doc.read_text(encoding="utf-8"))
    targets = [m.group(1) for m in _INLINE_LINK.finditer(text)] + [m.group(1) for m in _REFERENCE.finditer(text)]
    return [t for t in targets if not _SCHEME.match(t)]


def heading_anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (a repeated one gets -1, -2, ...)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", doc.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _id(doc: Path) -> str:
    return str(doc.relative_to(REPO))


def test_the_documents_checked_include_the_readme_and_the_design_notes() -> None:
    names = {_id(d) for d in DOCUMENTS}
    assert {"README.md", "docs/DESIGN.md", "bench/README.md", "examples/README.md"} <= names


@pytest.mark.parametrize("doc", DOCUMENTS, ids=_id)
def test_every_relative_link_names_a_file_that_exists(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        path = target.split("#", 1)[0]
        if path and not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{_id(doc)} links to files that do not exist: {broken}"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=_id)
def test_every_anchor_names_a_heading_of_its_page(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        path, _, anchor = target.partition("#")
        page = (doc.parent / path) if path else doc
        if anchor and page.suffix == ".md" and page.is_file() and anchor not in heading_anchors(page):
            broken.append(target)
    assert not broken, f"{_id(doc)} links to headings that do not exist: {broken}"


def test_a_broken_link_and_a_broken_anchor_are_caught(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading: `with code`\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md#a-heading-with-code) [gone](missing.md) [web](https://example.org/x.md)\n"
        "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n[bad anchor](there.md#nope)\n"
    )
    assert relative_links(doc) == ["there.md#a-heading-with-code", "missing.md", "there.md#nope"]
    assert heading_anchors(tmp_path / "there.md") == {"a-heading-with-code"}
