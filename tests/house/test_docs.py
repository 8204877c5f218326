"""The user documentation as a reader meets it: README short, every relative link (and its #anchor)
lands, every page under docs/ reachable from README, no project-internal wording, and each generated
page saying which command and commit made it."""

import re
from pathlib import Path

from ..conftest import REPO

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
TOP = [REPO / "BENCHMARKS.md", REPO / "RELIABILITY.md"]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# what reads as notes to ourselves, not to a user; verl's own issues ("verl issue #7952") are fine
INTERNAL = [
    re.compile(r"\bthis VM\b", re.I),
    re.compile(r"\bnot met\b", re.I),
    re.compile(r"\bthe issue(?:'s)?\b", re.I),
    re.compile(r"\bissue notes?\b", re.I),
    re.compile(r"\bissue \d+\b", re.I),
    re.compile(r"\bTODO\b"),
]
HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
GENERATED = {  # page -> the command that writes it
    "docs/quickstart.md": "python -m scripts.quickstart",
    "docs/support_matrix.md": "tests/merge/test_coverage_matrix.py",
    "docs/configuration.md": "python -m slimckpt.env_vars --write docs/configuration.md",
    "docs/merge.md": "python -m scripts.bench.merge",
    "docs/compare_grpo.md": "python -m scripts.compare.quality_proof",
    "docs/compare_flowrl.md": "python -m scripts.compare.quality_proof",
    "docs/compare_ppo.md": "python -m scripts.compare.quality_proof",
}


def _prose(text: str) -> str:
    """The text without fenced code blocks (commands and their printed output are not prose)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.+)$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path.read_text())) if not re.match(r"^[a-z]+:", t)]


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move detail into docs/"


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES + TOP:
        for target in links(page):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading in {dest.name})")
    assert broken == []


def test_every_page_under_docs_is_reachable_from_readme():
    seen, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        todo += [(page.parent / t.partition("#")[0]).resolve() for t in links(page) if t.partition("#")[0]]
    assert [str(d.relative_to(REPO)) for d in DOCS if d.resolve() not in seen] == []


def test_no_internal_wording_in_the_user_docs():
    found = [
        f"{page.relative_to(REPO)}: {m.group(0)!r}"
        for page in PAGES
        for pattern in INTERNAL
        for m in pattern.finditer(page.read_text())
    ]
    assert found == []
    # README quotes no commit: the pages it links say which commit measured what
    assert HASH.findall(_prose(README.read_text())) == []


def test_the_checks_catch_what_they_are_for(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "# A `b`: c.d\n\n## A `b`: c.d\n\n[x](q.md#nope) ![i](pic.png) [w](https://e.org)\n"
        "```\n[not a link](gone.md)\n```\nthe issue notes, this VM, goal: not met, commit 1a67425\n"
    )
    assert anchors(page) == {"a-b-cd", "a-b-cd-1"}
    assert links(page) == ["q.md#nope", "pic.png"]
    hits = [m.group(0) for p in INTERNAL for m in p.finditer(page.read_text())]
    assert hits == ["this VM", "not met", "the issue", "issue notes"]
    assert HASH.findall(page.read_text()) == ["1a67425"]


def test_generated_pages_name_their_command_and_commit():
    for rel, command in GENERATED.items():
        text = (REPO / rel).read_text()
        assert command in text, f"{rel} does not name the command that writes it ({command})"
        assert re.search(r"\bcommit [0-9a-f]{7,40}\b", text), f"{rel} does not name the commit it was made at"
