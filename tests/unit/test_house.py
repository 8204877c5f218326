"""The package's layout (docs/ARCHITECTURE.md): every module imports in a fresh interpreter, no
import circles, no private name imported from another module, and arrows between wings point
down only. Imports are read from the source (module- and function-level, relative and absolute)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from ..conftest import REPO

PKG = REPO / "patches" / "slimckpt"

# Wings from the top down: a module may import its own wing and the wings below it, never one above.
# `log`, `env_vars`, `internals` and the package's own __init__ are the ground every wing stands on.
LAYERS = [
    ("tools", {"slimckpt.cli", "slimckpt.plan", "slimckpt.tiny", "slimckpt.gpu_check", "slimckpt.testing",
               "slimckpt.gpu_check_stream", "slimckpt.stream_model", "slimckpt.plan_node", "slimckpt.dryrun_plan",
               "slimckpt.gpu_check_fsdp",
               # the `python -m` commands README gives, whose code lives in a wing
               "slimckpt.dryrun", "slimckpt.recipes", "slimckpt.diskspeed",
               # kept old paths (deprecated, see their docstrings)
               "slimckpt.config", "slimckpt.ckpt_metrics", "slimckpt.plugin"}),
    ("convert", {"slimckpt.convert"}),
    ("save", {"slimckpt.save"}),
    ("merge", {"slimckpt.merge"}),
    ("verify", {"slimckpt.verify"}),
    ("write", {"slimckpt.write"}),
    ("observe", {"slimckpt.observe"}),
    ("read", {"slimckpt.read"}),
    ("format", {"slimckpt.format"}),
    ("flowrl", {"slimckpt.flowrl"}),
    ("cpu", {"slimckpt.cpu"}),
    ("verl", {"slimckpt.verl"}),
    ("collective", {"slimckpt.collective"}),
    ("ground", {"slimckpt.log", "slimckpt.env_vars", "slimckpt.internals", "slimckpt"}),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(("slimckpt",) + path.relative_to(PKG).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _layer(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    assert best is not None, f"{module} belongs to no wing: add it to LAYERS and docs/ARCHITECTURE.md"
    return best[0]


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
                if target in MODULES and target != mod and target.split(".")[0] == "slimckpt":
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
        "import importlib, json, pkgutil, slimckpt\n"
        "bad = {}\n"
        "for m in pkgutil.walk_packages(slimckpt.__path__, 'slimckpt.'):\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except Exception as exc:\n"
        "        bad[m.name] = repr(exc)\n"
        "print(json.dumps(bad))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


def test_no_import_circles_and_no_private_names_across_modules():
    edges, private = _edges()
    assert sum(len(v) for v in edges.values()) > 100  # the walk sees the package's imports
    assert _circles(edges) == []
    assert private == []


def test_arrows_between_wings_point_down():
    edges, _ = _edges()
    upward = [f"{a} ({LAYERS[_layer(a)][0]}) -> {b} ({LAYERS[_layer(b)][0]})"
              for a, targets in sorted(edges.items()) for b in sorted(targets) if _layer(b) < _layer(a)]
    assert upward == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_walk_sees_function_level_and_private_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "slimckpt"
    (pkg / "w").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "w" / "__init__.py").write_text("")
    (pkg / "w" / "a.py").write_text("def f():\n    from .b import _secret\n")
    (pkg / "w" / "b.py").write_text("from . import a\n_secret = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {
        "slimckpt": pkg / "__init__.py", "slimckpt.w": pkg / "w" / "__init__.py",
        "slimckpt.w.a": pkg / "w" / "a.py", "slimckpt.w.b": pkg / "w" / "b.py"})
    edges, private = _edges()
    assert edges["slimckpt.w.a"] == {"slimckpt.w.b"} and edges["slimckpt.w.b"] == {"slimckpt.w.a"}
    assert private == ["slimckpt.w.a imports slimckpt.w.b._secret"]
    assert _circles(edges) == [["slimckpt.w.a", "slimckpt.w.b"]]


def test_patches_are_applied_only_by_switching_a_feature_on():
    """Only verl/features.py asks the registry to apply patches; configs and the plugin call switch_on."""
    callers = set()
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("apply_feature", "apply_on_import", "apply") and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "REGISTRY":
                callers.add(mod)
    assert callers == {"slimckpt.verl.features"}


def test_old_paths_that_configs_and_commands_name_still_work():
    from omegaconf import OmegaConf

    import slimckpt.ckpt_metrics
    import slimckpt.config
    from slimckpt.observe.ckpt_metrics import CheckpointMetricsCallback
    from slimckpt.save.tracker import is_incremental
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    assert slimckpt.config.SlimCheckpointConfig is SlimCheckpointConfig
    assert slimckpt.ckpt_metrics.CheckpointMetricsCallback is CheckpointMetricsCallback
    for target in ("slimckpt.config.SlimCheckpointConfig", "slimckpt.verl.checkpoint_config.SlimCheckpointConfig"):
        assert is_incremental(OmegaConf.create({"_target_": target, "incremental_save": True}))
    code = ("import importlib.metadata as md, slimckpt.plugin, slimckpt.verl.plugin as p; "
            "print([e.value for e in md.entry_points(group='verl.plugins') if e.name == 'slimckpt'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "['slimckpt.verl.plugin']"
    for command in (["slimckpt.recipes"], ["slimckpt.diskspeed", "--help"], ["slimckpt.dryrun", "--help"]):
        proc = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=300, cwd=REPO)
        assert proc.returncode == 0 and proc.stdout.strip(), (command, proc.stderr[-2000:])
