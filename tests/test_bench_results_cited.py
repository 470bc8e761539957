"""bench/results holds exactly the result files the docs cite: each file there is named by README.md
or a page under docs/, and each result file a page names is there (older runs live in git history).

Names are read from the docs' text after two normalisations: a name wrapped across a line break
(inside a code span, or broken after a hyphen) is joined, and brace patterns such as
``priority-2026-12-04-ab-{base,half}-{1,2}.md`` are expanded.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

# A code span, which may wrap onto the next line.
CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+\n[^`\n]+)`(?!`)")
# A name broken after a hyphen: "priority-2026-12-04-\n  cap128-1.md".
HYPHEN_BREAK = re.compile(r"(?<=[\w])-\n[ \t>]*(?=[\w{])")
# A file name, with brace groups allowed anywhere in it.
NAME = re.compile(r"(?:[\w.-]|\{[\w.,-]*\})+")
EXTENSIONS = (".md", ".json", ".png")
# A dated result file's name: bench/*.py write <name>-<YYYY-MM-DD>[-tag].<ext>; transport <name>-<YYYYMMDD-HHMMSS>.
DATED = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{8}-\d{6})(-|\.)")


def normalise(text: str) -> str:
    """The text with wrapped names joined."""
    text = CODE_SPAN.sub(lambda m: "`" + re.sub(r"\n[ \t>]*", "", m.group(1)) + "`", text)
    return HYPHEN_BREAK.sub("-", text)


def expand(pattern: str) -> list[str]:
    """Every name a brace pattern stands for: "a-{1,2}.md" -> ["a-1.md", "a-2.md"]."""
    parts = re.split(r"(\{[^{}]*\})", pattern)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_names(text: str, present: set[str]) -> set[str]:
    """The result files a doc's text names: present in bench/results, or named like a dated result."""
    found = set()
    for token in NAME.findall(normalise(text)):
        for name in expand(token.strip(".,-")):
            name = name.rstrip(".,")
            if name.endswith(EXTENSIONS) and (name in present or DATED.search(name)):
                found.add(name)
    return found


def test_normalise_joins_wrapped_names_and_expands_braces() -> None:
    text = (
        "see `priority-2026-12-04-ab-{base,half}-{1,2}.md` and\n"
        "`engine-2026-12-06-epyc-\n  x.md`, then step-\n  2026-12-01.md."
    )
    assert cited_names(text, set()) == {
        "priority-2026-12-04-ab-base-1.md",
        "priority-2026-12-04-ab-base-2.md",
        "priority-2026-12-04-ab-half-1.md",
        "priority-2026-12-04-ab-half-2.md",
        "engine-2026-12-06-epyc-x.md",
        "step-2026-12-01.md",
    }
    # Templates and other pages are not result files.
    assert cited_names("`affinity-<date>-<tag>.json`, docs/operations.md", set()) == set()


def test_every_result_file_is_cited_and_every_cited_one_is_there() -> None:
    present = {p.name for p in RESULTS.iterdir() if p.is_file()}
    cited: dict[str, list[str]] = {}
    for doc in DOCS:
        for name in cited_names(doc.read_text(), present):
            cited.setdefault(name, []).append(str(doc.relative_to(REPO)))
    uncited = sorted(present - set(cited))
    missing = sorted(f"{name} (cited in {', '.join(cited[name])})" for name in set(cited) - present)
    assert not uncited, f"in bench/results but cited by no doc (cite it or delete it): {uncited}"
    assert not missing, f"cited but not in bench/results: {missing}"
