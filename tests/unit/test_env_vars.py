"""slimckpt.env_vars declares every SLIMCKPT_* variable the code, scripts and tests use, and
docs/configuration.md shows its table as the module renders it."""

import re
import subprocess
import sys
from pathlib import Path

from slimckpt import env_vars

from ..conftest import REPO

NAME = re.compile(r"\bSLIMCKPT_[A-Z0-9_]*[A-Z0-9]\b")
SCANNED = ("patches", "scripts", "tests", "recipes", "overrides")
SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".toml"}


def used_names(root: Path = REPO) -> dict[str, set[str]]:
    """Every SLIMCKPT_ name in the scanned trees (and the Makefile), with the files naming it."""
    files = [p for d in SCANNED for p in (root / d).rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    files += [p for p in (root / "Makefile", root / ".ci" / "run") if p.is_file()]
    found: dict[str, set[str]] = {}
    for path in files:
        if ".venv" in path.parts or "__pycache__" in path.parts:
            continue
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, set()).add(str(path.relative_to(root)))
    return found


def test_every_name_used_is_declared():
    used = used_names()
    assert len(used) >= 20  # the scan sees the package's variables
    undeclared = {name: sorted(files) for name, files in used.items() if name not in env_vars.BY_NAME}
    assert undeclared == {}, f"declare these in patches/slimckpt/env_vars.py: {undeclared}"


def test_every_declared_name_is_read_where_it_says():
    for var in env_vars.VARIABLES:
        assert var.kind in env_vars.KINDS and var.type in env_vars.TYPES, var
        assert var.read_in, var.name
        for rel in var.read_in:
            text = (REPO / rel).read_text()
            # the module names it, literally or as the constant it reads through
            assert var.name in text, f"{var.name}: not in {rel}"
    assert len(env_vars.BY_NAME) == len(env_vars.VARIABLES)  # no name declared twice


def test_the_scan_finds_a_name_nobody_declared(tmp_path):
    name = "SLIMCKPT_" + "NOBODY_DECLARED_THIS"
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "x.py").write_text(f'os.environ.get("{name}")\n')
    found = used_names(tmp_path)
    assert found == {name: {"scripts/x.py"}} and name not in env_vars.BY_NAME


def test_the_docs_table_is_up_to_date():
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert env_vars.table_in(doc) == env_vars.markdown_table(), (
        f"docs/configuration.md's variable table is stale: run `{env_vars.COMMAND}`")
    assert env_vars.COMMAND in doc  # the doc records the command that made it


def test_the_generator_rewrites_only_between_the_markers(tmp_path):
    doc = tmp_path / "configuration.md"
    doc.write_text(f"intro\n\n{env_vars.TABLE_BEGIN}\nold\n{env_vars.TABLE_END}\n\nafter\n")
    proc = subprocess.run([sys.executable, "-m", "slimckpt.env_vars", "--write", str(doc)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert text.startswith(f"intro\n\n{env_vars.TABLE_BEGIN}\nGenerated from ") and text.endswith(
        f"{env_vars.TABLE_END}\n\nafter\n")
    assert env_vars.table_in(text) == env_vars.markdown_table() and "\nold\n" not in text
    assert not (tmp_path / "configuration.md.partial").exists()
    doc.write_text("no markers\n")
    proc = subprocess.run([sys.executable, "-m", "slimckpt.env_vars", "--write", str(doc)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "has no <!-- env-vars:begin -->" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and doc.read_text() == "no markers\n"
