"""Every path a user types or a config names keeps working when a module moves: each `_target_` in
recipes/ and overrides/, the entry points in pyproject.toml, every `python -m slimckpt...` or
`-m scripts...`, every `slimckpt <subcommand>`, `pkg://` module and other dotted `slimckpt.x.y` named
in the docs, README, scripts/*.sh and the Makefile. They are collected from those files (not listed
here) and resolved in this process: a module by its spec, an attribute by importing its module. A
failure names the file, the line and the dotted path; fix the name there or leave an alias behind.
`tests/house/test_house.py` runs a few of the commands for real."""

import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from slimckpt.cli import OWN_PARSER, SUBCOMMANDS

from ..conftest import REPO

try:
    import tomllib  # the cross-check of the pyproject reading below; Python 3.11+
except ImportError:
    tomllib = None

DOC_GLOBS = ("*.md", "docs/**/*.md")
SHELL_GLOBS = ("scripts/**/*.sh", "Makefile")
YAML_GLOBS = ("recipes/**/*.yaml", "overrides/**/*.yaml")
OURS = ("slimckpt_testing", "slimckpt_cpu", "slimckpt_flowrl", "slimckpt", "scripts")  # what a `-m` here may name

TARGET = re.compile(r"\b_target_:[ \t]*['\"]?([\w.]+)")
RUN_MODULE = re.compile(r"(?<![\w-])-m[ \t]+((?:" + "|".join(OURS) + r")\b(?:\.\w+)*)")
CLI_MODULE = re.compile(r"(?<![\w-])-m[ \t]+slimckpt\.cli[ \t]+([a-z][\w-]*)")
PKG_URL = re.compile(r"\bpkg://([\w.]+)")
DOTTED = re.compile(r"(?<![\w./-])slimckpt(?:_(?:testing|cpu|flowrl))?(?:\.[A-Za-z_]\w*)+")
# `slimckpt <word>` is a command only where a command starts: a line or code span, or after `&&`,
# `|`, `;`, `(`, `$(`, a quote, `exec`, `time`, `# `, `torchrun ... `, or a label's `:  `. In prose
# ("merged by slimckpt and by verl") or output ("slimckpt formats: 120/120") it is not one.
COMMAND_START = r"(?:^|&&|\|\||[;|(\"']|\$\(|\bexec|\btime|#|\.\.\.|:[ \t]{2,})"
SUBCOMMAND = re.compile(
    COMMAND_START + r"[ \t]*(?:\$ )?(?:[A-Z_]+=\S*[ \t]+)*slimckpt[ \t]+([a-z][\w-]*)(?![\w:.-])", re.M
)
FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)([^`]+?)\1")
MAIN_GUARD = re.compile(r"""^if __name__ == ["']__main__["']:""", re.M)
ENTRY_SECTION = re.compile(r"^project\.(scripts|gui-scripts|entry-points\..+)$")


@dataclass(frozen=True)
class Ref:
    file: str  # relative to the repository root
    line: int
    kind: str  # "_target_", "entry point", "python -m", "subcommand", "pkg://", "dotted"
    name: str  # the dotted path (module[:attr] for an entry point), or the subcommand

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.kind} {self.name}"


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _code_regions(path: Path, text: str) -> list[tuple[int, str]]:
    """(offset, text) of what may hold a command: a whole script or YAML file; a page's fenced blocks
    and code spans (spans inside fenced blocks too: a tree drawn with `slimckpt merge` in it)."""
    if path.suffix != ".md":
        regions = [(0, text)]
    else:
        regions = [(m.start(2), m.group(2)) for m in FENCE.finditer(text)]
    return regions + [(m.start(2), m.group(2)) for m in CODE_SPAN.finditer(text)]


def _entry_points(root: Path) -> list[Ref]:
    """pyproject.toml's console scripts and entry points, with their lines; checked against tomllib."""
    path = root / "pyproject.toml"
    if not path.exists():
        return []
    refs, section = [], ""
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line.startswith("["):
            section = line.strip("[]").replace('"', "").replace("'", "")
        elif "=" in line and ENTRY_SECTION.match(section):
            value = line.split("=", 1)[1].strip().strip("\"'")
            refs.append(Ref("pyproject.toml", n, "entry point", value))
    if tomllib is None:
        return refs
    project = tomllib.loads(path.read_text()).get("project", {})
    groups = [project.get("scripts", {}), project.get("gui-scripts", {}), *project.get("entry-points", {}).values()]
    assert sorted(r.name for r in refs) == sorted(v for g in groups for v in g.values()), "pyproject.toml misread"
    return refs


def collect(root: Path) -> list[Ref]:
    """Every reference to a module, attribute or subcommand of ours in the files users read and run."""
    refs = _entry_points(root)
    files = sorted({p for globs in (DOC_GLOBS, SHELL_GLOBS, YAML_GLOBS) for g in globs for p in root.glob(g)})
    for path in files:
        text, rel = path.read_text(), str(path.relative_to(root))
        found: dict[tuple[int, str], Ref] = {}

        def add(kind: str, name: str, pos: int, text: str = text, rel: str = rel, found: dict = found) -> None:
            found.setdefault((_line(text, pos), name), Ref(rel, _line(text, pos), kind, name))

        if path.suffix == ".yaml":
            for m in TARGET.finditer(text):
                add("_target_", m.group(1), m.start(1))
        for m in RUN_MODULE.finditer(text):
            add("python -m", m.group(1), m.start(1))
        for m in CLI_MODULE.finditer(text):
            add("subcommand", m.group(1), m.start(1))
        for start, body in _code_regions(path, text):
            for m in SUBCOMMAND.finditer(body):
                add("subcommand", m.group(1), start + m.start(1))
        for m in PKG_URL.finditer(text):
            add("pkg://", m.group(1), m.start(1))
        for m in DOTTED.finditer(text):
            add("dotted", m.group(0), m.start())  # after the kinds above: one line's path is checked once
        refs += sorted(found.values(), key=lambda r: r.line)
    return refs


def _spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent is missing, or is a module rather than a package
        return None


def resolve(dotted: str) -> tuple[object, str | None]:
    """(what `dotted` names, None), or (None, why not), read as verl and Hydra read a class path:
    `a.b.c` is the module a.b.c, or the attribute c of the module a.b (an attribute of a package's
    __init__ does not stand in for a module). A module is found by its spec, not imported (importing
    verl's plugin module would patch verl in this process); for an attribute its module is imported."""
    spec = _spec(dotted)
    if spec is not None:
        return spec, None
    module, _, attr = dotted.rpartition(".")
    parent = _spec(module) if module else None
    if parent is None:
        return None, f"no module {module or dotted}"
    try:
        obj = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - said in the failure line
        return None, f"{module} does not import ({type(exc).__name__}: {exc})"
    if not hasattr(obj, attr):
        if parent.submodule_search_locations is not None:
            return None, f"no module {dotted}, and package {module} has no attribute {attr!r}"
        return None, f"module {module} has no attribute {attr!r}"
    return getattr(obj, attr), None


def runnable(module: str) -> str | None:
    """Why `python -m module` would not run it, or None."""
    spec = _spec(module)
    if spec is None:
        return f"no module {module}"
    if spec.submodule_search_locations is not None:
        return None if _spec(module + ".__main__") else f"{module} is a package without __main__.py"
    if spec.origin and not MAIN_GUARD.search(Path(spec.origin).read_text()):
        return f'{module} has no `if __name__ == "__main__":`, so python -m runs nothing'
    return None


def problem(ref: Ref) -> str | None:
    """Why `ref` no longer works, or None."""
    if ref.kind == "subcommand":
        return None if ref.name in SUBCOMMANDS else f"not a subcommand of slimckpt ({', '.join(SUBCOMMANDS)})"
    if ref.kind == "python -m":
        return runnable(ref.name)
    if ref.kind == "entry point":
        module, _, attr = ref.name.partition(":")
        return resolve(f"{module}.{attr}" if attr else module)[1]
    obj, why = resolve(ref.name)
    if why is None and ref.kind == "_target_" and not callable(obj):
        why = "names a module, not a class or function Hydra can call"
    return why


def _failures(refs: list[Ref]) -> list[str]:
    return [f"{ref}: {why}" for ref in refs if (why := problem(ref))]


def test_every_named_path_resolves():
    refs = collect(REPO)
    kinds = {r.kind for r in refs}
    # the collection sees each kind (a regex that stopped matching would pass silently)
    assert kinds == {"_target_", "entry point", "python -m", "subcommand", "pkg://", "dotted"}, kinds
    assert any(r.name == "slimckpt.verl.plugin" and r.kind == "entry point" for r in refs)
    assert len([r for r in refs if r.kind == "_target_"]) >= 7
    failures = _failures(refs)
    assert not failures, "rename the path where it is named, or keep an alias at the old one:\n" + "\n".join(failures)


def test_each_subcommand_module_has_what_cli_calls():
    cli = REPO / "patches" / "slimckpt" / "cli.py"
    lines = cli.read_text().splitlines()
    bad = []
    for name, module_name in SUBCOMMANDS.items():
        line = next(n for n, text in enumerate(lines, 1) if f'"{name}": "{module_name}"' in text)
        module, why = resolve(module_name)
        if why is None:
            module = importlib.import_module(module_name)
            wants = ("HELP", "build_parser", "main") if name in OWN_PARSER else ("HELP", "add_arguments", "run")
            missing = [w for w in wants if not hasattr(module, w)]
            why = f"has no {', '.join(missing)}" if missing else None
        if why:
            bad.append(f"patches/slimckpt/cli.py:{line}: subcommand {name} -> {module_name}: {why}")
    assert not bad, "\n".join(bad)


def test_a_moved_module_fails_with_its_file_line_and_path(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "r.yaml").write_text(
        "# Check it:  slimckpt dryrun +recipe=r\n"
        "actor:\n"
        "  checkpoint:\n"
        "    _target_: slimckpt.verl.checkpoint_config.SlimCheckpointConfig\n"
        "  loss:\n"
        "    _target_: slimckpt.flowrl.gone.FlowRLLossConfig\n"
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "Run `python -m slimckpt_testing.tiny` then `slimckpt frobnicate DIR`; merged by slimckpt and by verl.\n"
        "```\n"
        "torchrun --nproc_per_node 2 -m slimckpt.cli merge --local_dir x\n"
        "python -m slimckpt.layout\n"
        "```\n"
        "Set `trainer.checkpoint_callback_class=slimckpt.observe.nowhere.Callback`.\n"
    )
    (tmp_path / "Makefile").write_text("x:\n\t$(PY) -m scripts.nowhere --json y\n\tslimckpt verify out\n")
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[project.scripts]\nslimckpt = "slimckpt.cli:entry"\n\n'
        '[project.entry-points."verl.plugins"]\nslimckpt = "slimckpt.verl.moved"\n'
    )
    refs = collect(tmp_path)
    assert [str(r) for r in refs if r.kind == "subcommand"] == [
        "Makefile:3: subcommand verify",
        "docs/a.md:1: subcommand frobnicate",
        "docs/a.md:3: subcommand merge",
        "recipes/r.yaml:1: subcommand dryrun",
    ]
    assert _failures(refs) == [
        "pyproject.toml:8: entry point slimckpt.verl.moved: no module slimckpt.verl.moved, "
        "and package slimckpt.verl has no attribute 'moved'",
        "Makefile:2: python -m scripts.nowhere: no module scripts.nowhere",
        "docs/a.md:1: subcommand frobnicate: not a subcommand of slimckpt (" + ", ".join(SUBCOMMANDS) + ")",
        "docs/a.md:4: python -m slimckpt.layout: slimckpt.layout is a package without __main__.py",
        "docs/a.md:6: dotted slimckpt.observe.nowhere.Callback: no module slimckpt.observe.nowhere",
        "recipes/r.yaml:6: _target_ slimckpt.flowrl.gone.FlowRLLossConfig: no module slimckpt.flowrl.gone",
    ]


def test_the_resolver_tells_modules_attributes_and_missing_names_apart():
    assert resolve("slimckpt_testing.launch.launch")[1] is None
    assert resolve("slimckpt_testing.launch")[1] is None
    assert resolve("nowhere_at_all.x") == (None, "no module nowhere_at_all")
    assert resolve("slimckpt_testing.launch.nope") == (None, "module slimckpt_testing.launch has no attribute 'nope'")
    # a.b.c.d needs the module a.b.c, as verl's import_module of it does: an attribute there is not one
    assert resolve("slimckpt_testing.launch.launch.x") == (None, "no module slimckpt_testing.launch.launch")
    assert runnable("slimckpt.env_vars") is None
    assert runnable("slimckpt.log") == 'slimckpt.log has no `if __name__ == "__main__":`, so python -m runs nothing'
