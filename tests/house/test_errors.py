"""One root for every exception class the package defines: `except slimckpt.SlimckptError` catches any
of them, and each keeps the builtin type its callers (and verl) catch it by. The classes are found in
the source, so a new one without the root fails here; a few one-line messages are pinned as well."""

import ast
import builtins
import errno
import importlib
from pathlib import Path

import pytest

from slimckpt import SlimckptError

from ..conftest import REPO

PKG = REPO / "patches" / "slimckpt"

SUFFIXES = ("Error", "Exception", "Warning")
BUILTIN = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def exception_classes(pkg: Path) -> tuple[dict[str, tuple[str, int]], list[str]]:
    """`module:Class` -> (path, line) of every exception class defined at module level under `pkg`
    (a base named like an exception, a builtin one, or one of these classes); and `path:line Class`
    of any defined inside a function or class, which no import can reach to check."""
    defs: list[tuple[str, str, str, int, list[str], bool]] = []  # module, path, class, line, bases, top level
    for path in sorted(pkg.rglob("*.py")):
        parts = ("slimckpt",) + path.relative_to(pkg).with_suffix("").parts
        module = ".".join(parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                rel = str(path.relative_to(pkg.parent))
                defs.append((module, rel, node.name, node.lineno, bases, id(node) in top))
    ours: set[str] = set()
    while True:
        more = {
            name
            for _, _, name, _, bases, _ in defs
            if name not in ours and any(b.endswith(SUFFIXES) or b in BUILTIN or b in ours for b in bases)
        }
        if not more:
            break
        ours |= more
    found, nested = {}, []
    for module, path, name, line, _, top_level in defs:
        if name not in ours:
            continue
        if top_level:
            found[f"{module}:{name}"] = (path, line)
        else:
            nested.append(f"{path}:{line} {name}")
    return found, nested


def test_every_exception_class_derives_from_the_root():
    found, nested = exception_classes(PKG)
    assert len(found) >= 26, sorted(found)  # the walk sees the package's classes
    assert nested == [], "define exception classes at module level (and on SlimckptError)"
    bad = []
    for target, (path, line) in sorted(found.items()):
        module, name = target.split(":")
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, SlimckptError)):
            bad.append(f"{path}:{line} {name}")
    assert not bad, "derive these from slimckpt.SlimckptError (keep their builtin parent as a second base):\n" + (
        "\n".join(bad)
    )


# The builtin type callers catch each by (`except ValueError` around a parse, `except RuntimeError` in
# verl's loops); `Exception` where it never had one. A class missing here is checked by the test above.
BUILTIN_PARENT = {
    "AssignError": ValueError,
    "BadValue": ValueError,
    "CheckpointError": RuntimeError,
    "CommitError": RuntimeError,
    "CommitFailed": RuntimeError,
    "ConfigMismatch": ValueError,
    "ConvertError": RuntimeError,
    "DryRunError": Exception,
    "ExportError": RuntimeError,
    "HistoryError": Exception,
    "InternalMissing": RuntimeError,
    "LayoutError": ValueError,
    "LockBusy": RuntimeError,
    "MergeError": RuntimeError,
    "NeedsVerlMerger": Exception,
    "NotACheckpoint": RuntimeError,
    "NotATorchFile": ValueError,
    "NothingToDrop": Exception,
    "OutputError": RuntimeError,
    "PickleRefused": RuntimeError,
    "RankLost": RuntimeError,
    "S3AccessDenied": PermissionError,
    "S3BadCredentials": OSError,
    "S3Error": OSError,
    "UnknownStorage": ValueError,
    "S3Failed": OSError,
    "S3NoBucket": OSError,
    "S3NoConditionalWrites": OSError,
    "S3NoCredentials": OSError,
    "S3NotFound": FileNotFoundError,
    "S3Unreachable": OSError,
    "S3WrongRegion": OSError,
    "SaveFailed": RuntimeError,
    "StoreSilent": RuntimeError,
    "StreamMutationError": RuntimeError,
    "UncommittedCheckpoint": RuntimeError,
    "UnsupportedVerlVersion": RuntimeError,
}


def test_each_class_keeps_the_builtin_type_its_callers_catch():
    found, _ = exception_classes(PKG)
    classes = {t.split(":")[1]: getattr(importlib.import_module(t.split(":")[0]), t.split(":")[1]) for t in found}
    missing = sorted(set(BUILTIN_PARENT) - set(classes))
    assert missing == [], f"renamed or removed (callers may catch them by name): {missing}"
    lost = [f"{n} is no longer a {p.__name__}" for n, p in BUILTIN_PARENT.items() if not issubclass(classes[n], p)]
    assert lost == []


def test_the_walk_finds_exception_classes_by_their_bases(tmp_path):
    pkg = tmp_path / "slimckpt"
    (pkg / "w").mkdir(parents=True)
    (pkg / "__init__.py").write_text("class Root(Exception):\n    pass\n")
    (pkg / "w" / "a.py").write_text(
        "import torch\n"
        "class A(ValueError): pass\n"
        "class B(A): pass\n"
        "class C(torch.distributed.DistStoreError): pass\n"
        "class D(KeyboardInterrupt): pass\n"
        "class E: pass\n"
        "class F(B, dict): pass\n"
        "def f():\n"
        "    class G(OSError): pass\n"
    )
    found, nested = exception_classes(pkg)
    assert sorted(found) == ["slimckpt.w.a:A", "slimckpt.w.a:B", "slimckpt.w.a:C", "slimckpt.w.a:D"] + [
        "slimckpt.w.a:F",
        "slimckpt:Root",
    ]
    assert found["slimckpt.w.a:B"] == ("slimckpt/w/a.py", 3)
    assert nested == ["slimckpt/w/a.py:9 G"]


# -- the one-line messages, as they were before the root ------------------------------------------


def test_messages_are_unchanged(monkeypatch):
    from slimckpt import env_vars
    from slimckpt.engine.out_files import os_error
    from slimckpt.engine.pickle_policy import PickleRefused
    from slimckpt.hf.naming import ConfigMismatch
    from slimckpt.layout.safetensors_layout import LayoutError, parse_size

    with pytest.raises(LayoutError) as raised:
        parse_size("5XB")
    assert str(raised.value) == "size '5XB': use one of the units TB, GB, MB, KB (e.g. '5GB')"

    monkeypatch.setenv("SLIMCKPT_ROLLOUT_THREADS", "two")
    with pytest.raises(env_vars.BadValue) as raised:
        env_vars.integer("SLIMCKPT_ROLLOUT_THREADS")
    assert str(raised.value) == "SLIMCKPT_ROLLOUT_THREADS='two': use a whole number (default 1)"

    assert str(PickleRefused("/ckpt/model_world_size_2_rank_0.pt", "os.system", "data.pkl")) == (
        "/ckpt/model_world_size_2_rank_0.pt (data.pkl): refused: pickle global os.system, which verl and torch "
        "never write (unpickling it could run code), so nothing was loaded from it; pass --trust-pickle "
        "(trainer: checkpoint.trust_pickle=true) only if you trust who made it"
    )
    assert str(ConfigMismatch("experts.gate_up_proj", (8, 4, 2), (4, 4, 2), "/hf/config.json")) == (
        "'experts.gate_up_proj' is [8, 4, 2], but /hf/config.json makes it [4, 4, 2] (another number of experts "
        "or other sizes): that config.json does not belong to this checkpoint; copy the training run's "
        "huggingface/ dir along"
    )
    full = os_error(OSError(errno.ENOSPC, "No space left on device"), "/out/model-00001.safetensors", 1 << 30)
    assert str(full) == (
        "/out/model-00001.safetensors: no space left (No space left on device) (this output needs 1.07 GB); "
        "free space or choose a --target_dir on another filesystem"
    )
    assert isinstance(full, SlimckptError) and isinstance(full, RuntimeError) and full.need_bytes == 1 << 30
