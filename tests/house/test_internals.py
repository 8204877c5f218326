"""slimckpt.internals: every torch/transformers internal the package calls is listed with the
releases it was checked on, resolves on those, and on any other release warns once and leaves the
caller on its public fallback, which gives what the internal gives."""

from __future__ import annotations

import ast
import io
import logging
import os
import re

import pytest
import torch

from slimckpt import internals

from ..conftest import REPO, run_python

PKG = REPO / "patches" / "slimckpt"
# modules of these libraries that are not `_`-named but that their docs do not describe either
UNDOCUMENTED = {"transformers.core_model_loading"}


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in dotted.split("."))


def _internal_uses(path) -> list[str]:
    """`module:name` of every torch/transformers internal `path` imports or reaches by attribute
    from an imported torch/transformers module."""
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}  # local name -> the torch/transformers module or object it is
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("torch", "transformers"):
                    modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    if _private(a.name) or a.name in UNDOCUMENTED:
                        uses.append(a.name)
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "transformers")
        ):
            for a in node.names:
                modules[a.asname or a.name] = f"{node.module}.{a.name}"
                if _private(node.module) or _private(a.name) or node.module in UNDOCUMENTED:
                    uses.append(f"{node.module}:{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                uses.append(f"{modules[base.id]}.{'.'.join(reversed(chain))}")
    return uses


def _lookups(path) -> list[str]:
    return re.findall(r"""lookup\(\s*["']([^"']+)["']""", path.read_text())


def test_no_internal_is_called_but_through_the_list():
    found = {}
    for path in PKG.rglob("*.py"):
        if path.name == "internals.py" and path.parent == PKG:
            continue
        looked_up = {name.replace(":", ".") for name in _lookups(path)}
        for use in _internal_uses(path):
            if use.replace(":", ".") not in looked_up:  # e.g. a listed function replaced once looked up
                found.setdefault(use, []).append(str(path.relative_to(REPO)))
    assert not found, (
        "torch/transformers internals used directly (list each in slimckpt/internals.py "
        f"and reach it with internals.lookup): {found}"
    )


def test_every_listed_internal_is_used_and_every_lookup_is_listed():
    used = {name for path in PKG.rglob("*.py") for name in _lookups(path)}
    assert used - set(internals.INTERNALS) == set()
    assert set(internals.INTERNALS) - used == set(), "listed internals nobody looks up: drop them"


@pytest.mark.parametrize("name", sorted(internals.INTERNALS))
def test_each_resolves_on_a_checked_release(name):
    internal = internals.INTERNALS[name]
    assert internal.checked and internal.fallback and internal.used_by
    if not internals.checked(name):
        pytest.skip(f"{internal.package} {internals.release(internal.package)} is not a checked release")
    assert internals.lookup(name) is not None


def test_the_stack_under_test_is_a_checked_one():
    """The suite runs on the releases internals.py names (`make test`, `make test-verl-stack`):
    a new pin there must be read against every listed internal and added to CHECKED_*."""
    have = {"torch": internals.release("torch"), "transformers": internals.release("transformers")}
    assert have["torch"] in internals.CHECKED_TORCH and have["transformers"] in internals.CHECKED_TRANSFORMERS, (
        f"{have}: not a stack slimckpt.internals was checked on (torch {internals.CHECKED_TORCH}, transformers "
        f"{internals.CHECKED_TRANSFORMERS}); slimckpt runs on it through the public fallbacks, with warnings"
    )


def test_an_unchecked_release_warns_once_and_gives_the_fallback(monkeypatch, caplog):
    monkeypatch.setattr(internals, "release", lambda package: "9.99")
    monkeypatch.setattr(internals, "_WARNED", set())
    monkeypatch.delenv(internals.TRUST_ENV, raising=False)
    name = "torch.distributed.checkpoint.filesystem:_write_item"
    with caplog.at_level(logging.WARNING):
        assert internals.lookup(name) is None
        assert internals.lookup(name) is None
    warnings = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(warnings) == 1
    assert "torch 9.99" in warnings[0] and "2.11, 2.13" in warnings[0]
    assert internals.INTERNALS[name].fallback in warnings[0] and internals.TRUST_ENV in warnings[0]

    monkeypatch.setenv(internals.TRUST_ENV, "1")
    monkeypatch.setattr(internals, "_WARNED", set())
    with caplog.at_level(logging.WARNING):
        from torch.distributed.checkpoint import filesystem

        assert internals.lookup(name) is filesystem._write_item
    assert any("using it anyway" in r.getMessage() for r in caplog.records)


def test_a_checked_release_without_the_internal_fails_loudly(monkeypatch):
    name = "torch.distributed.checkpoint.filesystem:_no_such_writer"
    monkeypatch.setitem(
        internals.INTERNALS, name, internals.Internal(name, "torch", (internals.release("torch"),), "a test", "none")
    )
    with pytest.raises(internals.InternalMissing, match=r"has no torch\.distributed.*_no_such_writer.*reinstall torch"):
        internals.lookup(name)


def test_dcp_records_are_read_where_torchs_own_reader_reads_them(tmp_path):
    """engine/pt_index.py reads a torch.save zip (a DCP record) with Python's zipfile, not torch's private
    reader (torch 2.11's has no get_record_size): same entries, bytes and offsets."""
    from slimckpt.engine.pt_index import ZipRecords

    buf = io.BytesIO()
    torch.save(torch.arange(1000, dtype=torch.float32)[100:400], buf)
    theirs = torch._C.PyTorchFileReader(io.BytesIO(buf.getvalue()))
    ours = ZipRecords(io.BytesIO(buf.getvalue()))
    records = theirs.get_all_records()
    prefix = next(r for r in ours.get_all_records() if r.endswith("data.pkl"))[: -len("data.pkl")]
    assert sorted(prefix + r for r in records) == sorted(ours.get_all_records())
    for r in records:
        assert ours.get_record_offset(prefix + r) == theirs.get_record_offset(r)
        assert ours.get_record(prefix + r) == bytes(theirs.get_record(r))
        assert ours.get_record_size(prefix + r) == len(bytes(theirs.get_record(r)))
    data = next(r for r in records if r.startswith("data/"))
    start = ours.get_record_offset(prefix + data)
    raw = buf.getvalue()[start : start + 4000]
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32), torch.arange(1000.0))


def test_the_bounded_writers_fallback_is_torchs_writer(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from slimckpt.engine.dcp_file_writer import BoundedFileSystemWriter

    def files(path):
        return {n: (path / n).read_bytes() for n in sorted(os.listdir(path)) if n.endswith(".distcp")}

    state = {"w": torch.randn(64, 8), "v": torch.arange(10.0), "step": 3}
    kw = {"single_file_per_rank": True, "sync_files": False, "thread_count": 1, "overwrite": True}
    dcp.save(state, storage_writer=BoundedFileSystemWriter(str(tmp_path / "bounded"), **kw), no_dist=True)
    monkeypatch.setattr(internals, "release", lambda package: "9.99")
    monkeypatch.setattr(internals, "_WARNED", set())
    monkeypatch.delenv(internals.TRUST_ENV, raising=False)
    calls = []
    real = FileSystemWriter._write_data
    monkeypatch.setattr(FileSystemWriter, "_write_data", lambda self, *a: calls.append(1) or real(self, *a))
    dcp.save(state, storage_writer=BoundedFileSystemWriter(str(tmp_path / "fallback"), **kw), no_dist=True)
    assert calls, "an unchecked torch must write with FileSystemWriter's own loop"
    assert files(tmp_path / "bounded") == files(tmp_path / "fallback") != {}


@pytest.mark.slow
def test_the_dtensor_box_fallback_is_the_internals_box():
    """Rows of a DTensor split over 4 ranks of torch's fake process group: the public chunk list and
    torch's helper agree on every rank's box, uneven last rank and an empty one included."""
    code = """
import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from slimckpt import internals

checked_release, world = internals.release, 4
for rank in range(world):
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    for shape in ((10, 3), (2, 5)):
        t = distribute_tensor(torch.zeros(shape), mesh, [Shard(0)])
        real = internals.dtensor_box(t)
        internals.release = lambda package: "9.99"
        fallback = internals.dtensor_box(t)
        internals.release = checked_release
        assert real == fallback, (rank, shape, real, fallback)
        print(rank, shape, real)
    dist.destroy_process_group()
"""
    proc = run_python(code, env={"SLIMCKPT_LOG_LEVEL": "ERROR"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    boxes = [line for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert len(boxes) == 8 and "(0, 0)" in proc.stdout
