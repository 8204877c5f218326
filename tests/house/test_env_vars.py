"""slimckpt.env_vars declares every SLIMCKPT_* variable the code, scripts and tests use, and
docs/configuration.md shows its table as the module renders it."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_every_declared_name_is_used():
    used = used_names()
    for var in env_vars.VARIABLES:
        assert var.kind in env_vars.KINDS and var.type in env_vars.TYPES, var
        # a package variable is read (through env_vars) in patches/; a test one by the suite
        where = "tests/" if var.kind == "test" and not var.name.endswith("_LOG") else "patches/"
        assert any(f.startswith(where) and not f.endswith("env_vars.py") for f in used.get(var.name, ())), (
            f"{var.name} is declared but nothing in {where} names it"
        )
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
        f"docs/configuration.md's variable table is stale: run `{env_vars.COMMAND}`"
    )
    assert env_vars.COMMAND in doc  # the doc records the command that made it


def test_the_generator_rewrites_only_between_the_markers(tmp_path):
    doc = tmp_path / "configuration.md"
    doc.write_text(f"intro\n\n{env_vars.TABLE_BEGIN}\nold\n{env_vars.TABLE_END}\n\nafter\n")
    proc = subprocess.run(  # the generator imports no torch or verl: seconds at most; 120 s is a hang
        [sys.executable, "-m", "slimckpt.env_vars", "--write", str(doc)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert text.startswith(f"intro\n\n{env_vars.TABLE_BEGIN}\nGenerated from ") and text.endswith(
        f"{env_vars.TABLE_END}\n\nafter\n"
    )
    assert env_vars.table_in(text) == env_vars.markdown_table() and "\nold\n" not in text
    assert not (tmp_path / "configuration.md.partial").exists()
    doc.write_text("no markers\n")
    proc = subprocess.run(
        [sys.executable, "-m", "slimckpt.env_vars", "--write", str(doc)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "has no <!-- env-vars:begin -->" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and doc.read_text() == "no markers\n"


# -- the readers: values and defaults from the declarations --------------------------------------


def test_a_default_off_flag_is_on_only_when_set_to_1(monkeypatch):
    name = "SLIMCKPT_MERGE_OVERWRITE"
    assert env_vars.BY_NAME[name].default is None
    for value, on in (("1", True), ("0", False), ("", False), ("yes", False), ("true", False)):
        monkeypatch.setenv(name, value)
        assert env_vars.flag(name) is on, value
    monkeypatch.delenv(name)
    assert env_vars.flag(name) is False


def test_trust_pickle_also_takes_true_and_yes(monkeypatch):
    name = "SLIMCKPT_TRUST_PICKLE"
    for value, on in (("1", True), ("TRUE", True), (" yes ", True), ("0", False), ("on", False)):
        monkeypatch.setenv(name, value)
        assert env_vars.flag(name) is on, value


def test_set_flag_sets_and_unsets(monkeypatch):
    name = "SLIMCKPT_TRUST_PICKLE"
    monkeypatch.delenv(name, raising=False)
    env_vars.set_flag(name, True)
    assert (
        env_vars.flag(name)
        and subprocess.run(
            [sys.executable, "-c", f"import os; print(os.environ.get('{name}'))"],
            capture_output=True,
            text=True,
            # a bare interpreter prints one variable in well under a second; 60 s is a hang
            timeout=60,
        ).stdout.strip()
        == "1"
    )  # child processes see it
    env_vars.set_flag(name, False)
    assert not env_vars.flag(name) and name not in __import__("os").environ
    with pytest.raises(TypeError, match="SLIMCKPT_MERGE_STATS is a path"):
        env_vars.set_flag("SLIMCKPT_MERGE_STATS", True)


def test_integer_and_seconds_default_from_the_declaration_and_name_a_bad_value(monkeypatch):
    for name in ("SLIMCKPT_MERGE_WORKERS", "SLIMCKPT_ROLLOUT_THREADS"):
        monkeypatch.delenv(name, raising=False)
        assert env_vars.integer(name) == int(env_vars.BY_NAME[name].default)
        monkeypatch.setenv(name, "3")
        assert env_vars.integer(name) == 3
        monkeypatch.setenv(name, "three")
        with pytest.raises(env_vars.BadValue) as bad:
            env_vars.integer(name)
        assert str(bad.value).startswith(f"{name}='three': ") and "\n" not in str(bad.value)
    for name in ("SLIMCKPT_MERGE_JOIN_TIMEOUT", "SLIMCKPT_MERGE_PEER_TIMEOUT"):
        default = float(env_vars.BY_NAME[name].default)
        monkeypatch.delenv(name, raising=False)
        assert env_vars.seconds(name) == default
        monkeypatch.setenv(name, "2.5")
        assert env_vars.seconds(name) == 2.5
        for bad_value in ("0", "-1", "soon", "nan"):
            monkeypatch.setenv(name, bad_value)
            with pytest.raises(
                env_vars.BadValue,
                match=f"^{name}='{bad_value}': use a number of seconds > 0 \\(default {default:.0f}\\)$",
            ):
                env_vars.seconds(name)


def test_path_and_text_treat_empty_as_unset(monkeypatch):
    monkeypatch.setenv("SLIMCKPT_MERGE_STATS", "")
    assert env_vars.path("SLIMCKPT_MERGE_STATS") is None
    monkeypatch.setenv("SLIMCKPT_MERGE_STATS", "/x/stats.json")
    assert env_vars.path("SLIMCKPT_MERGE_STATS") == "/x/stats.json"
    monkeypatch.setenv("SLIMCKPT_LOG_LEVEL", "")
    assert env_vars.text("SLIMCKPT_LOG_LEVEL") == env_vars.BY_NAME["SLIMCKPT_LOG_LEVEL"].default
    monkeypatch.setenv("SLIMCKPT_LOG_LEVEL", "debug")
    assert env_vars.text("SLIMCKPT_LOG_LEVEL") == "debug"


def test_a_reader_refuses_an_undeclared_name_or_the_wrong_type():
    UNDECLARED = "SLIMCKPT" + "_NOT_A_THING"  # split: the name scan must not see it
    with pytest.raises(KeyError, match=f"{UNDECLARED} is not declared in slimckpt/env_vars.py"):
        env_vars.flag(UNDECLARED)
    with pytest.raises(TypeError, match="SLIMCKPT_MERGE_WORKERS is a int"):
        env_vars.flag("SLIMCKPT_MERGE_WORKERS")


# -- nothing but env_vars reads a SLIMCKPT_ variable ---------------------------------------------


def _env_key(node: ast.AST) -> ast.AST | None:
    """The key of an `os.environ` / `os.getenv` access at `node`, or None when `node` is not one."""

    def is_environ(n: ast.AST) -> bool:
        return (isinstance(n, ast.Attribute) and n.attr == "environ") or (isinstance(n, ast.Name) and n.id == "environ")

    if isinstance(node, ast.Subscript) and is_environ(node.value):
        return node.slice
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        if node.func.attr in ("get", "pop", "setdefault") and is_environ(node.func.value):
            return node.args[0]
        if node.func.attr == "getenv":
            return node.args[0]
    if isinstance(node, ast.Name) and node.id == "getenv":
        return None
    if (
        isinstance(node, ast.Compare)
        and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
        and any(is_environ(c) for c in node.comparators)
    ):
        return node.left
    return None


def env_reads_outside_env_vars(root: Path) -> list[str]:
    """`file:line key` for every environment access in `root` (but env_vars.py) whose key is a
    SLIMCKPT_ name, a constant holding one, or anything else not a plain literal (a name bound by a
    loop over literals of other variables is fine: `for k in ("RANK", "WORLD_SIZE")`)."""
    files = [p for p in sorted(root.rglob("*.py")) if p.name != "env_vars.py" and "__pycache__" not in p.parts]
    trees = {p: ast.parse(p.read_text()) for p in files}
    constants = set()  # every `NAME = "SLIMCKPT_..."` in the package
    for tree in trees.values():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                and node.value.value.startswith("SLIMCKPT_")
            ):
                constants.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for path, tree in trees.items():
        loop_names = set()  # names a loop binds to literal, non-SLIMCKPT strings
        for node in ast.walk(tree):
            if (
                isinstance(node, (ast.For, ast.comprehension))
                and isinstance(node.target, ast.Name)
                and isinstance(node.iter, (ast.Tuple, ast.List))
                and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) and not e.value.startswith("SLIMCKPT_")
                    for e in node.iter.elts
                )
            ):
                loop_names.add(node.target.id)
        for node in ast.walk(tree):
            key = _env_key(node)
            if key is None:
                continue
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                if not key.value.startswith("SLIMCKPT_"):
                    continue
            elif isinstance(key, ast.Name) and key.id in loop_names and key.id not in constants:
                continue
            found.append((str(path.relative_to(root)), node.lineno, ast.unparse(key)))
    return [f"{f}:{line} {key}" for f, line, key in sorted(found)]


def test_no_slimckpt_variable_is_read_outside_env_vars():
    assert env_reads_outside_env_vars(REPO / "patches" / "slimckpt") == [], (
        "read SLIMCKPT_ variables through slimckpt.env_vars (flag, integer, seconds, path, text)"
    )


def test_the_read_scan_finds_direct_and_indirect_reads(tmp_path):
    PFX = "SLIMCKPT" + "_"  # split: the name scan must not see the planted names
    (tmp_path / "a.py").write_text(
        'import os\nX_ENV = "PFX_X"\n'
        'os.environ.get("PFX_Y", "1")\n'  # 3: a literal
        "os.environ[X_ENV]\n"  # 4: a constant
        "os.getenv(other.X_ENV)\n"  # 5: a constant of another module
        "def f(name):\n    return os.environ.get(name)\n"  # 7: a generic reader
        '"PFX_Z" in os.environ\n'  # 8
        'os.environ.get("RANK"), os.environ["WORLD_SIZE"]\n'
        'for k in ("MASTER_ADDR", "MASTER_PORT"):\n    os.environ[k]\n'.replace("PFX_", PFX)
    )
    assert env_reads_outside_env_vars(tmp_path) == [
        s.replace("PFX_", PFX)
        for s in ["a.py:3 'PFX_Y'", "a.py:4 X_ENV", "a.py:5 other.X_ENV", "a.py:7 name", "a.py:8 'PFX_Z'"]
    ]
