"""slimckpt.engine.dcp_source in-process: how DCP chunks become merge sources (pure helpers), the
tensors it maps equal what DCP's own reader loads, and a record that does not hold what .metadata
says ends in one line naming the file and the tensor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slimckpt.engine.checkpoint_dir import CheckpointError
from slimckpt.engine.dcp_source import _contiguous, _shard_dim, open_dcp
from slimckpt.engine.resume_records import write_manifest
from slimckpt.layout.resume_manifest import Manifest, describe_files, read_manifest

from ..helpers.merge_helpers import synthetic_dcp_step


def chunk(offsets, sizes):
    return SimpleNamespace(offsets=tuple(offsets), sizes=tuple(sizes))


def test_shard_dim_of_chunks():
    assert _shard_dim((6, 4), [chunk((0, 0), (6, 4))]) is None  # one whole chunk: unsharded
    assert _shard_dim((6, 4), [chunk((0, 0), (3, 4)), chunk((3, 0), (3, 4))]) == 0
    assert _shard_dim((6, 4), [chunk((0, 0), (6, 2)), chunk((0, 2), (6, 2))]) == 1  # FSDP2 on another dim
    # split on two dims (tensor parallel too): not one dim's shards
    assert _shard_dim((6, 4), [chunk((0, 0), (3, 2)), chunk((3, 2), (3, 2))]) is None


def test_contiguous():
    assert _contiguous((2, 3), (3, 1)) and _contiguous((1, 3), (7, 1)) and _contiguous((), ())
    assert not _contiguous((2, 3), (1, 2))


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    return synthetic_dcp_step(tmp_path_factory.mktemp("dcp") / "actor")


def test_mapped_chunks_equal_dcps_own_load(step):
    import torch.distributed.checkpoint as dcp

    ckpt = open_dcp(str(step))
    state = {"model": {n: torch.empty(t.shape, dtype=t.dtype) for n, t in ckpt.tensors.items()}}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process load, as meant
        dcp.load(state, checkpoint_id=str(step / "dcp"), no_dist=True)
    for name, src in ckpt.tensors.items():
        assert src.shard_dim is None and len(src.pieces) == 1 and src.file_of(0).endswith("__0_0.distcp")
        assert torch.equal(src.pieces[0], state["model"][name]), name


@pytest.mark.pickle_refusals
def test_a_record_other_than_its_metadata_is_refused_in_one_line(step, tmp_path):
    import shutil

    bad = shutil.copytree(step, tmp_path / "actor")
    distcp = bad / "dcp" / "__0_0.distcp"
    data = bytearray(distcp.read_bytes())
    at = data.find(b"_rebuild_tensor_v2")  # in the first record's pickle: a tensor rebuilt by another function
    assert at > 0
    data[at : at + 18] = b"_rebuild_tensor_v9"
    distcp.write_bytes(bytes(data))
    old = read_manifest(str(bad))  # sealed again, as if the save itself had written it so
    rels = [e.path for e in old.files]
    write_manifest(
        str(bad),
        Manifest(
            global_step=1,
            world_size=1,
            contents=["model"],
            fsdp_version=2,
            files=describe_files(str(bad), rels),
            extra=old.extra,
        ),
    )
    with pytest.raises(CheckpointError) as err:
        open_dcp(str(bad))
    line = str(err.value)
    assert "\n" not in line and str(distcp) in line and "model.embed_tokens.weight" in line
    assert "refused: pickle global torch._utils._rebuild_tensor_v9" in line  # a global torch never writes


def test_checked_reader_and_planner_load_what_dcps_own_load(tmp_path, monkeypatch):
    """DCP's .metadata and byte records read through pickle_policy's unpickler (dcp_pickle) give what
    DCP's own reader and planner give: nested values, lists, tuples and tensors where DCP puts them."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from slimckpt.engine import pt_tensors
    from slimckpt.engine.dcp_pickle import CheckedFileSystemReader, CheckedLoadPlanner, read_metadata

    records = []  # the byte records our reader unpickled (watched, still read by it)
    real_load_bytes = pt_tensors.load_bytes
    monkeypatch.setattr(
        pt_tensors, "load_bytes", lambda data, path: records.append(path) or real_load_bytes(data, path)
    )

    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["a", "b"], "name": None}, {"lr": 0.2, "params": ["c"]}]
    step = synthetic_dcp_step(tmp_path / "actor", more={"optim": {"param_groups": groups, "extra": [1, "x"]}})
    dcp_dir = str(step / "dcp")

    def load(**kw):
        state = {
            "model": {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in open_dcp(str(step)).tensors.items()},
            "optim": {
                "param_groups": [
                    {"lr": 0.0, "betas": (0.0, 0.0), "params": [], "name": "?"},
                    {"lr": 0.0, "params": []},
                ],
                "extra": [0, ""],
            },
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # single-process load, as meant
            dcp.load(state, checkpoint_id=dcp_dir, no_dist=True, **kw)
        return state

    torch_loads = []  # DCP's reader builds each tensor record with torch.load; ours maps the file
    real_torch_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: torch_loads.append(a) or real_torch_load(*a, **kw))
    ours = load(storage_reader=CheckedFileSystemReader(dcp_dir), planner=CheckedLoadPlanner(dcp_dir))
    assert torch_loads == []
    theirs = load()
    assert torch_loads  # the watch sees DCP's own reads
    assert ours["optim"] == theirs["optim"] and ours["optim"]["param_groups"] == groups
    assert len(records) >= len(groups)  # each group's values were records of ours
    assert all(torch.equal(ours["model"][k], theirs["model"][k]) for k in theirs["model"])
    meta, real = read_metadata(dcp_dir), dcp.FileSystemReader(dcp_dir).read_metadata()
    assert meta.state_dict_metadata == real.state_dict_metadata and meta.storage_data == real.storage_data


def test_a_step_of_tensors_only_loads_through_the_checked_reader(tmp_path):
    """A plan with no byte record (a model-only step) is read wholly from the mapped records, and DCP
    waits on what the reader returns."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from slimckpt.engine.dcp_pickle import CheckedFileSystemReader, CheckedLoadPlanner

    step = synthetic_dcp_step(tmp_path / "actor")
    dcp_dir = str(step / "dcp")
    saved = open_dcp(str(step)).tensors
    state = {"model": {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in saved.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process load, as meant
        dcp.load(
            state,
            storage_reader=CheckedFileSystemReader(dcp_dir),
            planner=CheckedLoadPlanner(dcp_dir),
            no_dist=True,
        )
    reference = {"model": {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in saved.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(reference, checkpoint_id=dcp_dir, no_dist=True)
    assert state["model"].keys() == reference["model"].keys()
    assert all(torch.equal(state["model"][k], reference["model"][k]) for k in reference["model"])
    assert any(v.abs().sum() > 0 for v in state["model"].values())
