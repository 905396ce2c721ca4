"""Every relative link and every repository path the docs name resolves: files exist, anchors are headings."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md"),
               *(ROOT / "docs" / "results").rglob("NOTES.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# A path into the repository written in prose or code: examples/x.yaml, bench/x.py, docs/x.md, docs/results/...
NAMED_PATH = re.compile(r"(?<![\w/.-])((?:examples|bench|docs)/[\w./-]*[\w/])")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip()).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        match = None if in_fence else re.match(r"^#+ (.+)$", line)
        if match:
            slug = github_anchor(match.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_links(doc: Path) -> list[str]:
    text = doc.read_text(encoding="utf-8")
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: {path.name} has no heading with anchor #{anchor}")
    for match in NAMED_PATH.finditer(text):
        named = match.group(1).rstrip(".")
        # A pattern, not a path: a glob or brace follows, or a segment holds a placeholder (batch-N, seed-K, NAME).
        if re.match(r"[-\w]*[*{<…]", text[match.end():]) or re.search(r"(?<![a-z])[A-Z]{1,4}(?![a-z])", named):
            continue
        if not (ROOT / named).exists():
            broken.append(f"{named}: named in the text, no such path in the repository")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_named_path_exists(doc):
    broken = broken_links(doc)
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_anchor_rule_matches_githubs(tmp_path):
    assert github_anchor("The demo: `bash dev.sh demo`") == "the-demo-bash-devsh-demo"
    assert github_anchor("Table 3: layer, merge, position and side") == "table-3-layer-merge-position-and-side"
    assert github_anchor("Japanese→English: fused `e5-small-multilingual`, 3,000 updates") == \
        "japaneseenglish-fused-e5-small-multilingual-3000-updates"
    doc = tmp_path / "a.md"
    doc.write_text("# A\n\n[ok](#a) [gone](#b) [file](missing.md) and examples/none.yaml\n", encoding="utf-8")
    problems = broken_links(doc)
    assert any("#b" in p for p in problems) and any("missing.md" in p for p in problems)
    assert any("examples/none.yaml" in p for p in problems) and not any("(#a)" in p for p in problems)


def test_the_readme_reads_in_ten_minutes():
    """README stays short: at most 250 lines, its first command within the first 40, no table cell over 200
    characters; results.md opens with a summary of at most 60 lines."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250
    first_command = next(i for i, line in enumerate(lines) if line.startswith("```bash")) + 2
    assert first_command <= 40, f"README's first command is at line {first_command}"
    cells = [cell.strip() for line in lines if line.startswith("|") for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
    assert max(map(len, cells)) <= 200
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert re.match(r"# Results\n\n## Summary\n", results)
    summary = results[results.index("## Summary"):results.index("\n## ", results.index("## Summary"))]
    assert summary.count("\n") + 1 <= 60
