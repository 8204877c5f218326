"""The package's layout (docs/ARCHITECTURE.md): every module imports in a fresh interpreter, no
import circles, no private name imported from another module, and arrows between wings point
down only. Imports are read from the source (module- and function-level, relative and absolute)."""

import ast
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

from ..conftest import REPO

PKG = REPO / "patches" / "slimckpt"

# The wings as a DAG: each names the wings it may import directly (and, through them, everything below).
# `ground` (log, env_vars, internals, cli_flags, the package's __init__) is what every wing stands on. The packages
# outside the checkpoint stack (the CPU shims, FlowRL, the test tools) sit on top: the stack never imports them.
WINGS: dict[str, set[str]] = {
    "ground": set(),
    "storage": {"ground"},
    "dist": {"ground"},
    "options": {"ground"},
    "verl_files": {"ground"},
    "layout": {"storage"},
    "engine": {"layout", "dist"},
    "observe": {"engine", "options"},
    "verify": {"engine"},
    "hf": {"engine", "verl_files"},
    "merge": {"hf", "dist"},
    "save": {"merge", "options", "observe"},
    "resume": {"save", "verify"},
    "convert": {"save"},
    "verl": {"resume", "convert"},
    "plan": {"verl"},
    "cli": {"plan"},
    "slimckpt_cpu": {"verl"},
    "slimckpt_flowrl": {"verl"},
    "slimckpt_testing": {"cli", "slimckpt_cpu", "slimckpt_flowrl"},
}
OUTSIDE = ("slimckpt_cpu", "slimckpt_flowrl", "slimckpt_testing")


def _below(wing: str) -> set[str]:
    """Every wing `wing` may import: its own and those its arrows reach."""
    seen, todo = {wing}, [wing]
    while todo:
        for nxt in WINGS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ("slimckpt", *OUTSIDE):
        for path in (PKG.parent / top).rglob("*.py"):
            name = ".".join((top,) + path.relative_to(PKG.parent / top).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _wing(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "slimckpt":
        return parts[0]
    if len(parts) == 1 or parts[1] in ("log", "env_vars", "internals", "cli_flags"):
        return "ground"
    assert parts[1] in WINGS, f"{module} belongs to no wing: add it to WINGS and docs/ARCHITECTURE.md"
    return parts[1]


def _edges() -> tuple[dict[str, set[str]], list[str]]:
    """module -> modules of ours it imports; and `A imports B._name` for private names."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    private = []
    for mod, path in MODULES.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[tuple[str, str | None]] = []
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append((sub, None) if sub in MODULES else (source, alias.name))
            for target, name in targets:
                while target not in MODULES and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in MODULES and target != mod and target.split(".")[0].startswith("slimckpt"):
                    edges[mod].add(target)
                    if name and name.startswith("_") and not name.startswith("__"):
                        private.append(f"{mod} imports {target}.{name}")
    return edges, private


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_imports_in_a_fresh_interpreter():
    code = (
        "import importlib, json, pkgutil\n"
        "bad = {}\n"
        f"for top in {('slimckpt', *OUTSIDE)!r}:\n"
        "  pkg = importlib.import_module(top)\n"
        "  for m in pkgutil.walk_packages(pkg.__path__, top + '.'):\n"
        "    try:\n"
        "      importlib.import_module(m.name)\n"
        "    except Exception as exc:\n"
        "      bad[m.name] = repr(exc)\n"
        "print(json.dumps(bad))\n"
    )
    # one interpreter imports every slimckpt module, torch and verl with them: under a minute; 300 s is a hang
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


def test_no_import_circles_and_no_private_names_across_modules():
    edges, private = _edges()
    assert sum(len(v) for v in edges.values()) > 100  # the walk sees the package's imports
    assert _circles(edges) == []
    assert private == []


def test_the_wings_form_a_dag_and_every_arrow_follows_it():
    assert set(_wing(m) for m in MODULES) <= set(WINGS)
    assert _circles({w: set(targets) for w, targets in WINGS.items()}) == []
    edges, _ = _edges()
    against = [
        f"{a} ({_wing(a)}) -> {b} ({_wing(b)})"
        for a, targets in sorted(edges.items())
        for b in sorted(targets)
        if _wing(b) not in _below(_wing(a))
    ]
    assert against == []
    assert not any(_wing(b) in OUTSIDE for a in edges if _wing(a) not in OUTSIDE for b in edges[a])


def test_save_and_merge_meet_only_in_the_hf_wing():
    """The HF naming, plan and lay-out both exports use live in hf/; the one save module that
    reaches the merge is the intermediate tier's export, which runs the merge itself."""
    edges, _ = _edges()
    wing = lambda m: m.split(".")[1] if m.count(".") else ""  # noqa: E731
    across = sorted(
        f"{a} -> {b}" for a, targets in edges.items() for b in targets if {wing(a), wing(b)} == {"save", "merge"}
    )
    assert across == [
        "slimckpt.save.export.intermediate -> slimckpt.merge.pipeline",
        "slimckpt.save.export.intermediate -> slimckpt.merge.plan",
    ]


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_walk_sees_function_level_and_private_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "slimckpt"
    (pkg / "w").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "w" / "__init__.py").write_text("")
    (pkg / "w" / "a.py").write_text("def f():\n    from .b import _secret\n")
    (pkg / "w" / "b.py").write_text("from . import a\n_secret = 1\n")
    monkeypatch.setattr(
        sys.modules[__name__],
        "MODULES",
        {
            "slimckpt": pkg / "__init__.py",
            "slimckpt.w": pkg / "w" / "__init__.py",
            "slimckpt.w.a": pkg / "w" / "a.py",
            "slimckpt.w.b": pkg / "w" / "b.py",
        },
    )
    edges, private = _edges()
    assert edges["slimckpt.w.a"] == {"slimckpt.w.b"} and edges["slimckpt.w.b"] == {"slimckpt.w.a"}
    assert private == ["slimckpt.w.a imports slimckpt.w.b._secret"]
    assert _circles(edges) == [["slimckpt.w.a", "slimckpt.w.b"]]


def test_patches_are_applied_only_by_switching_a_feature_on():
    """Only verl/features.py asks the registry to apply patches; configs and the plugin call switch_on."""
    callers = set()
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("apply_feature", "apply_on_import", "apply")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "REGISTRY"
            ):
                callers.add(mod)
    assert callers == {"slimckpt.verl.features"}


def test_paths_that_configs_and_commands_name_work():
    from omegaconf import OmegaConf

    from slimckpt.save.driver.tracker import is_incremental

    assert is_incremental(
        OmegaConf.create({"_target_": "slimckpt.verl.checkpoint_config.SlimCheckpointConfig", "incremental_save": True})
    )
    code = (
        "import importlib.metadata as md, slimckpt.verl.plugin as p; "
        "print([e.value for e in md.entry_points(group='verl.plugins') if e.name == 'slimckpt'])"
    )
    # one interpreter imports slimckpt's verl plugin module: seconds; 300 s is a hang
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "['slimckpt.verl.plugin']"
    for command in (
        ["slimckpt.cli", "recipes"],
        ["slimckpt.cli", "diskspeed", "--help"],
        ["slimckpt.cli", "dryrun", "--help"],
        ["slimckpt.plan", "--help"],
    ):
        # each command imports slimckpt and prints its help or list: seconds; 300 s is a hang
        proc = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=300, cwd=REPO)
        assert proc.returncode == 0 and proc.stdout.strip(), (command, proc.stderr[-2000:])


# -- no issue numbers in code ------------------------------------------------------------------
# The project's issues are no reader's business: a comment or string says why, not which ticket.
# Upstream references stay ("verl #7952", "verl has no such option, its issue #4553"). A `#` must
# touch its digits (`# 63 bits` is a comment, not a reference); a six-digit colour is not matched.
ISSUE_REF = re.compile(r"\bissues?\s*#?\d{1,5}\b|(?<![\w&/#])#\d{1,5}\b", re.I)
UPSTREAM = re.compile(r"\b(verl|torch|pytorch|transformers|its)\b[^.;:]{0,20}$", re.I)
CODE_TREES = ("patches", "scripts", "tests")


def _prose_of(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string of a Python file; of every line of a shell script."""
    text = path.read_text()
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    kinds = {tokenize.COMMENT, tokenize.STRING} | (
        {tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set()
    )
    return [
        (tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type in kinds
    ]


def issue_references(root: Path) -> list[str]:
    found = []
    for tree in CODE_TREES:
        for path in sorted((root / tree).rglob("*")):
            if path.suffix not in (".py", ".sh") or ".venv" in path.parts or "__pycache__" in path.parts:
                continue
            for line, text in _prose_of(path):
                for m in ISSUE_REF.finditer(text):
                    if not UPSTREAM.search(text[: m.start()]):
                        found.append(f"{path.relative_to(root)}:{line} {m.group(0)!r}")
    return found


def test_no_issue_numbers_in_code():
    assert issue_references(REPO) == [], "say why in the comment, not which issue (upstream: 'verl #1234')"


def test_the_issue_scan_finds_a_reference_and_spares_upstream_ones(tmp_path):
    n = "19"  # the planted numbers are put together at run time: the scan of this file must not see them
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "a.py").write_text(
        f"x = 1  # fixed in issue {n}\n"
        f'"""Docstring (Issue {n[0]}, item 3)."""\n'
        f'y = f"{{x}} see #{n}7"\n'
        "# verl #7952; verl has no such option, its issue #4553\n"
        "# 63 bits, colour #1f77b4, #a1b2c3\n"
    )
    (tmp_path / "scripts" / "b.sh").write_text(f'# after #{n}1\necho "#x"\n')
    assert issue_references(tmp_path) == [
        f"scripts/a.py:1 'issue {n}'",
        f"scripts/a.py:2 'Issue {n[0]}'",
        f"scripts/a.py:3 '#{n}7'",
        f"scripts/b.sh:1 '#{n}1'",
    ]


# A module that imports inside functions says why, once, near the top: torch-free until a merge
# runs, verl patched while it imports, a cycle broken. Everywhere else imports stand at the top.
LAZY_MARK = re.compile(r"^# lazy imports: \S", re.M)
LAZY_TREES = ("patches/slimckpt", "scripts")


def function_level_imports(root: Path) -> list[str]:
    """`path:line` of every import inside a function of a module without the lazy-imports line."""
    found = []
    for tree in LAZY_TREES:
        for path in sorted((root / tree).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            source = path.read_text()
            if LAZY_MARK.search(source):
                continue
            lines = {
                sub.lineno
                for node in ast.walk(ast.parse(source))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                for sub in ast.walk(node)
                if isinstance(sub, (ast.Import, ast.ImportFrom))
            }
            found += [f"{path.relative_to(root)}:{n}" for n in sorted(lines)]
    return found


def test_function_level_imports_only_in_modules_that_say_why():
    assert function_level_imports(REPO) == [], (
        "move the import to the top, or add one line '# lazy imports: <why>' near the top of the module"
    )


def test_the_lazy_import_scan_finds_an_unmarked_module(tmp_path):
    pkg = tmp_path / "patches" / "slimckpt"
    pkg.mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (pkg / "a.py").write_text("import os\n\ndef f():\n    import json\n    return json\n")
    (pkg / "b.py").write_text("# lazy imports: torch only when asked\n\ndef g():\n    import torch\n")
    (tmp_path / "scripts" / "c.py").write_text("class C:\n    def m(self):\n        from x import y\n")
    assert function_level_imports(tmp_path) == ["patches/slimckpt/a.py:4", "scripts/c.py:3"]


VERL_STACK = ("verl", "omegaconf", "hydra", "ray")


def _stack_imports(path: Path) -> list[str]:
    """The verl-stack packages a module imports, at any level of the module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in VERL_STACK]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in VERL_STACK:
            found.append(node.module)
    return found


def test_only_the_verl_wings_import_verls_stack():
    """The engine runs where verl cannot be installed (a GPU image with torch alone): verl, omegaconf,
    hydra and Ray are imported only in the verl wings (verl/, verl_files/) and the packages outside the stack."""
    outside = {
        mod: names
        for mod, path in MODULES.items()
        if _wing(mod) not in ("verl", "verl_files", *OUTSIDE) and (names := _stack_imports(path))
    }
    assert outside == {}
    assert _stack_imports(PKG / "verl" / "checkpoint_config.py")  # the walk sees a verl import
