"""One source per figure: every number with a unit of size, speed, time or ratio in README.md, docs/*.md and
recipes/*.yaml either sits inside a block a script writes from the bench or campaign JSON, or says on its
line what kind of number it is, so no measurement is copied by hand and left to go stale.

Generated blocks: `<!-- NAME:begin -->` ... `<!-- NAME:end -->`, where NAME is written by a script under
scripts/ or by the package (the test checks that some writer names it).

Labels (the whole set; one on the figure's line, or on the header row of its Markdown table, on the opening
fence of its code block, or on a Markdown heading, which then covers the table, the block, or the section up
to the next heading of the same or a higher level):
- `(plan)`: a prediction, by `slimckpt plan` or by the arithmetic it does, never a measurement;
- `(example)`: a value a user picks, or an illustration of a setting;
- `(default)`: a setting's default or a constant in the code;
- `(history)`: a past measurement kept as the record of one run or decision (its page says which run);
  the current figures are in BENCHMARKS.md and RELIABILITY.md.

Out of scope: BENCHMARKS.md and RELIABILITY.md (reports the bench and fault scripts write whole), and the
pages under docs/ that a script writes whole (GENERATED_WHOLE), which name their command and
commit."""

import re
from pathlib import Path

from ..conftest import REPO

GENERATED_WHOLE = {"quickstart.md", "compare_grpo.md", "compare_ppo.md", "compare_flowrl.md", "support_matrix.md"}
PAGES = [
    REPO / "README.md",
    *(p for p in sorted((REPO / "docs").glob("*.md")) if p.name not in GENERATED_WHOLE),
    *sorted((REPO / "recipes").glob("*.yaml")),
]
WRITERS = [*(REPO / "scripts").rglob("*.py"), *(REPO / "patches").rglob("*.py")]

NUMBER = r"~?\d[\d,]*(?:\.\d+)?(?:\s?[-–]\s?~?\d[\d,]*(?:\.\d+)?)?"
UNIT = r"(?:\s?(?:[KMGT]iB|[KMGT]B/s|[KMGT]B|min|ms|s)|x)"
FIGURE = re.compile(rf"(?<![\w.#/-]){NUMBER}{UNIT}(?![\w/])")
LABEL = re.compile(r"\((?:plan|example|default|history)\b")
BEGIN = re.compile(r"<!-- ([\w.-]+):begin -->")
LINK_TARGET = re.compile(r"\]\([^)]*\)")


def figures(line: str) -> list[str]:
    """The figures with a unit on one line (link targets, which hold anchors like `verl-091s`, left out)."""
    return FIGURE.findall(LINK_TARGET.sub("]()", line))


def unlabelled(path: Path) -> list[str]:
    """`file:line: figures` for each line whose figures are neither generated nor labelled."""
    out, block, covered, fence, section = [], None, False, False, 0
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    for n, line in enumerate(path.read_text().splitlines(), 1):
        begin = BEGIN.search(line)
        if block is None and begin:
            block = begin.group(1)
        heading = re.match(r"^(#{1,6}) ", line) if not fence else None
        if heading and section and len(heading.group(1)) <= section:
            section = 0
        if heading and not section and LABEL.search(line):
            section = len(heading.group(1))
        if line.lstrip().startswith("```"):
            fence = not fence
            covered = fence and bool(LABEL.search(line))
        elif not fence:
            is_table = line.lstrip().startswith("|")
            if not is_table:
                covered = False
            elif not covered and LABEL.search(line) and not re.match(r"^\s*\|[-| :]+\|\s*$", line):
                covered = True  # a labelled header row covers its table
        if block is None and not section and not covered and not LABEL.search(line) and (found := figures(line)):
            out.append(f"{rel}:{n}: {', '.join(found)}")
        if block is not None and f"<!-- {block}:end -->" in line:
            block = None
    return out


def block_names(path: Path) -> set[str]:
    return set(BEGIN.findall(path.read_text()))


def test_every_figure_is_generated_or_labelled():
    found = [hit for page in PAGES for hit in unlabelled(page)]
    assert found == [], "figures neither in a generated block nor labelled (see this test's docstring):\n" + "\n".join(
        found
    )


def test_every_block_in_scope_has_a_writer():
    code = "\n".join(p.read_text() for p in WRITERS)
    orphans = sorted(f"{p.relative_to(REPO)}: {name}" for p in PAGES for name in block_names(p) if name not in code)
    assert orphans == []


def test_the_scan_catches_what_it_is_for(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "a save took 4,282 MiB and 16.6 s, 1.5x, 2-3 s, ~564 s at 2 GB/s\n"  # 1: caught
        "a prediction: 263 GiB (plan)\n"  # 2: labelled
        "<!-- x:begin -->\n9 MiB\n<!-- x:end -->\n"  # 3-5: generated
        "| size (plan) | bytes |\n|---|---|\n| 70B | 920 GiB |\n"  # 6-8: labelled table
        "\n| a | b |\n|---|---|\n| 70B | 8 MiB |\n"  # 9-12: caught
        "```text (example)\n2 MiB\n```\n```\n3 MiB\n```\n"  # 13-18: one labelled fence, one caught
        "verl 0.9.1, [a](B.md#verl-091s-x), 8B, 4 x 8 GPUs, world size 8, 2.5M parameters\n"  # 19: none
        "## Runs (history)\n20 min\n### deeper\n21 min\n## next\n22 min\n"  # 20-25: a labelled section
    )
    assert unlabelled(page) == [
        f"{page}:1: 4,282 MiB, 16.6 s, 1.5x, 2-3 s, ~564 s, 2 GB/s",
        f"{page}:12: 8 MiB",
        f"{page}:17: 3 MiB",
        f"{page}:25: 22 min",
    ]
