"""Every relative link in the project's markdown resolves: the file exists and a #fragment names a
heading of it (GitHub's anchor rule), inside the repository. Docs move between files; a link left
behind is caught here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SKIP = {".git", ".venv", "out", "node_modules"}
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"```.*?```", re.S)


def markdown_files() -> list[Path]:
    # Skip hidden folders (venvs, peer builds) and build output.
    return sorted(p for p in ROOT.rglob("*.md")
                  if not any(part in _SKIP or part.startswith(".") for part in p.relative_to(ROOT).parts[:-1]))


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, -N for repeats."""
    seen: dict[str, int] = {}
    found = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip())
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(_FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto
            continue
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.is_relative_to(ROOT):  # exists on the author's machine, not in a clone
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and (dest.suffix != ".md" or fragment not in anchors(dest)):
            broken.append(f"{target}: no such heading")
    return broken


def test_the_anchor_rule_matches_githubs() -> None:
    assert anchors(ROOT / "docs" / "BENCHMARKS.md") >= {
        "qwen25-coder-05b-against-llamacpp-and-vllm-cpu", "prefilldecode-disaggregation"}


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []
    assert "../shared" not in path.read_text()
