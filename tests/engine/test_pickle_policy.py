"""Never run code from a checkpoint: a pickle global verl and torch never write is refused before it
runs, by merge (one process and distributed), verify and a trainer's resume, naming the file and
the global; `--trust-pickle` / `checkpoint.trust_pickle` let it run. And nothing legitimate is
refused: every checkpoint kind loads through the restricted loader (conftest also fails any test of
the suite whose checkpoints got a refusal). A resume's refusal on every rank together: resume/pickle_gate."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from slimckpt import cli
from slimckpt.engine import pickle_policy
from slimckpt.engine.pickle_policy import PickleRefused, RestrictedUnpickler, check_bytes, check_file
from slimckpt.engine.safe_load import load_torch_file
from slimckpt.engine.step_pickles import dcp_refusals
from slimckpt.verify.command import verify_path
from slimckpt_testing.launch import launch
from slimckpt_testing.pickle_traps import (
    TRAPPED_GLOBAL,
    Trap,
    trap_bytes_record,
    trap_extra,
    trap_metadata,
    trap_torch_file,
)

from ..conftest import REPO, pickle_refusals
from ..helpers.launch import torchrun
from ..helpers.merge_helpers import fsdp_checkpoint, run_cli, synthetic_checkpoint, synthetic_dcp_step
from ..merge.test_merge_lora import FIXTURE_ARGS as LORA_ARGS
from ..merge.test_verl_merger import CHECKPOINTS, SHARDED_TENSOR

WORLD = 3


def _loads(data: bytes, path: str = "x.pt"):
    unpickler = RestrictedUnpickler(__import__("io").BytesIO(data))
    unpickler.path = path
    return unpickler.load()


# --------------------------------------------------------------------------- the policy itself


@pytest.mark.pickle_refusals
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_os_system_is_refused_in_every_protocol_before_it_runs(tmp_path, protocol):
    marker = tmp_path / "MARKER"
    data = pickle.dumps({"w": [1.0, 2.0], "evil": Trap(str(marker))}, protocol=protocol)
    for check in (check_bytes, _loads):
        with pytest.raises(PickleRefused) as err:
            check(data, str(tmp_path / "model_world_size_3_rank_0.pt"))
        assert err.value.reason == f"refused: pickle global {TRAPPED_GLOBAL} in model_world_size_3_rank_0.pt"
    assert not marker.exists()
    assert pickle.loads(data)["evil"] == 0 and marker.exists()  # the trap is live: plain pickle runs it


@pytest.mark.pickle_refusals
def test_getattr_gives_only_allowed_nested_classes():
    """Protocol 2 names a nested class as getattr(Outer, "Inner"); any other getattr (a method that
    writes a file, say) is refused."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    nested = pickle.dumps(ShardedTensor.ProcessGroupState, protocol=2)
    check_bytes(nested, "ok.pt")
    assert _loads(nested) is ShardedTensor.ProcessGroupState
    method = pickle.dumps(np.ndarray.tofile, protocol=2)  # getattr(numpy.ndarray, "tofile")
    for check in (check_bytes, _loads):
        with pytest.raises(PickleRefused, match=r"numpy\.ndarray\.tofile"):
            check(method, "bad.pt")


class _EnumsByName(pickle.Pickler):
    """Pickles an Enum member as getattr(<class>, "<name>"), as some Python 3.11 releases do (3.11.2,
    Debian 12's python3, does), whatever this interpreter does."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


@pytest.mark.pickle_refusals
def test_metadata_with_enum_members_pickled_by_name_loads(tmp_path):
    """DCP's .metadata and a ShardedTensor's metadata name a memory-format enum member; written by a
    Python that pickles members by name, both load, and a getattr of a name the enum does not allow
    is still refused."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor.metadata import MEM_FORMAT_ENCODING
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(tmp_path / "step"), no_dist=True)
    metadata = pickle.loads((tmp_path / "step" / ".metadata").read_bytes())
    for value in (metadata, _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST, MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT):
        buf = io.BytesIO()
        _EnumsByName(buf, protocol=4).dump(value)
        data = buf.getvalue()
        assert b"TORCH_" in data and b"getattr" in data
        check_bytes(data, ".metadata")
        pickle_policy.scan_ops(data, ".metadata")
        assert _loads(data, ".metadata") == value
    (tmp_path / "step" / ".metadata").write_bytes(_metadata_by_name(metadata))
    check_file(str(tmp_path / "step" / ".metadata"))
    other = pickle.dumps(_GetattrOf(_MEM_FORMAT_ENCODING, "_missing_"), protocol=4)  # a method, not a member
    for check in (check_bytes, pickle_policy.scan_ops, _loads):
        with pytest.raises(PickleRefused, match=r"_MEM_FORMAT_ENCODING\._missing_"):
            check(other, ".metadata")


def test_a_path_pickled_by_python_3_13_is_allowed():
    """Python 3.13 pickles DCP's StorageMeta.checkpoint_id (a PosixPath) as pathlib._local.PosixPath."""
    # pickle.dumps(pathlib.PosixPath("/a/b"), 4) on Python 3.13.0
    by_313 = (
        b"\x80\x04\x95+\x00\x00\x00\x00\x00\x00\x00\x8c\x0epathlib._local\x94\x8c\tPosixPath\x94\x93\x94"
        b"\x8c\x04/a/b\x94\x85\x94R\x94."
    )
    assert pickle_policy.is_allowed("pathlib._local", "PosixPath")
    pickle_policy.scan_ops(by_313, ".metadata")
    check_bytes(by_313, ".metadata")  # this Python has no pathlib._local: the opcode scan decides


class _GetattrOf:
    def __init__(self, owner, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def _metadata_by_name(metadata) -> bytes:
    import io

    buf = io.BytesIO()
    _EnumsByName(buf, protocol=4).dump(metadata)
    return buf.getvalue()


def test_extra_state_loads_through_torchs_restricted_loader(tmp_path):
    """verl's extra state (lr scheduler, torch/numpy/Python RNG) loads with weights_only=True."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    opt.step()
    sched.step()
    extra = {
        "lr_scheduler": sched.state_dict(),
        "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()},
    }
    torch.save(extra, tmp_path / "extra_state_world_size_1_rank_0.pt")
    got = load_torch_file(str(tmp_path / "extra_state_world_size_1_rank_0.pt"))
    assert got["lr_scheduler"] == extra["lr_scheduler"] and got["rng"]["random"] == extra["rng"]["random"]
    assert np.array_equal(got["rng"]["numpy"][1], extra["rng"]["numpy"][1])
    assert torch.equal(got["rng"]["cpu"], extra["rng"]["cpu"])


# --------------------------------------------------------------------------- booby-trapped inputs


@pytest.fixture
def trapped_native(tmp_path):
    """A verl-native dir at world size 3, its model, optimizer and extra state files trapped on one
    rank each (rank 0, 1, 2)."""
    actor = synthetic_checkpoint(tmp_path / "actor", world_size=WORLD)
    for r in range(WORLD):
        torch.save(
            {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}, actor / f"optim_world_size_{WORLD}_rank_{r}.pt"
        )
        torch.save(
            {
                "lr_scheduler": {"last_epoch": 1},
                "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()},
            },
            actor / f"extra_state_world_size_{WORLD}_rank_{r}.pt",
        )
    for r, kind in enumerate(("model", "optim", "extra_state")):
        trap_torch_file(actor / f"{kind}_world_size_{WORLD}_rank_{r}.pt", tmp_path / "MARKER")
    return actor


@pytest.fixture
def trapped_dcp(tmp_path):
    """Incremental-tier steps: one with its .metadata trapped, one with its extra state and an
    optimizer record trapped (manifests resealed)."""
    out = {}
    for name in ("metadata", "state"):
        role = tmp_path / name / "actor"
        role.mkdir(parents=True)
        torch.save({"rng": {"cpu": torch.get_rng_state()}}, role / "slimckpt_extra_world_size_1_rank_0.pt")
        synthetic_dcp_step(role, more={"optim": {"param_groups": [{"lr": 0.1}]}})
        if name == "metadata":
            trap_metadata(role, tmp_path / "MARKER")
        else:
            trap_extra(role, tmp_path / "MARKER")
            trap_bytes_record(role, tmp_path / "MARKER")
        out[name] = role
    return out


def _refused(text: str, path) -> bool:
    return f"{path}: refused: pickle global {TRAPPED_GLOBAL}" in text and "--trust-pickle" in text


@pytest.mark.slow
@pytest.mark.pickle_refusals
def test_merge_refuses_a_trapped_rank_file_and_trust_pickle_runs_it(trapped_native, tmp_path):
    """The merge's reader refuses; one line, exit 1, nothing written. With --trust-pickle the payload runs (proof the file is armed)."""
    target = tmp_path / "merged"
    proc = run_cli(["merge", "--no_progress", "--local_dir", str(trapped_native), "--target_dir", str(target)])
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("slimckpt merge: error:")]
    assert len(lines) == 1 and _refused(lines[0], trapped_native / f"model_world_size_{WORLD}_rank_0.pt"), proc.stderr
    assert not (tmp_path / "MARKER").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("merged")]
    proc = run_cli(
        ["merge", "--no_progress", "--trust-pickle", "--local_dir", str(trapped_native), "--target_dir", str(target)]
    )
    assert (tmp_path / "MARKER").exists() and "refused" not in proc.stderr  # then its keys differ from rank 1's


@pytest.mark.pickle_refusals
def test_merge_refuses_a_trapped_dcp_metadata(trapped_dcp, tmp_path, capsys):
    rc = cli.main(
        [
            "merge",
            "--no_progress",
            "--local_dir",
            str(trapped_dcp["metadata"]),
            "--target_dir",
            str(tmp_path / "merged"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1 and _refused(err, trapped_dcp["metadata"] / "dcp" / ".metadata"), err
    assert not (tmp_path / "MARKER").exists() and not (tmp_path / "merged").exists()


@pytest.mark.pickle_refusals
def test_verify_reports_every_trapped_file_as_damage(trapped_native, trapped_dcp, tmp_path, capsys):
    report = verify_path(str(trapped_native))
    reasons = sorted(p.reason for p in report.bad)
    assert reasons == sorted(
        f"refused: pickle global {TRAPPED_GLOBAL} in {kind}_world_size_{WORLD}_rank_{r}.pt"
        for r, kind in enumerate(("model", "optim", "extra_state"))
    ), reasons
    meta = verify_path(str(trapped_dcp["metadata"]))
    assert [p.reason for p in meta.bad] == [f"refused: pickle global {TRAPPED_GLOBAL} in .metadata"]
    state = verify_path(str(trapped_dcp["state"]))
    assert sorted(p.reason for p in state.bad) == [
        f"refused: pickle global {TRAPPED_GLOBAL} in __0_0.distcp (the record of optim.param_groups.0.lr)",
        f"refused: pickle global {TRAPPED_GLOBAL} in slimckpt_extra_world_size_1_rank_0.pt",
    ], state.bad
    rc = cli.main(["verify", "--no_progress", str(trapped_native)])
    out = capsys.readouterr().out
    assert rc == 1 and out.count("refused: pickle global") == 3, out
    assert not (tmp_path / "MARKER").exists()


@pytest.mark.slow
@pytest.mark.pickle_refusals
@pytest.mark.parametrize("kind", ["rank_file", "dcp_metadata"])
def test_distributed_merge_refuses_on_every_rank(trapped_native, trapped_dcp, tmp_path, kind):
    src, bad = (
        (trapped_native, trapped_native / f"model_world_size_{WORLD}_rank_0.pt")
        if kind == "rank_file"
        else (trapped_dcp["metadata"], trapped_dcp["metadata"] / "dcp" / ".metadata")
    )
    proc = torchrun(
        2,
        [
            "-m",
            "slimckpt.cli",
            "merge",
            "--distributed_merge",
            "--no_progress",
            "--local_dir",
            str(src),
            "--target_dir",
            str(tmp_path / "merged"),
        ],
    )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("slimckpt merge: error:")]
    assert lines and all(_refused(ln, bad) for ln in lines), proc.stderr[-3000:]
    assert not (tmp_path / "MARKER").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("merged")]


@pytest.mark.slow
@pytest.mark.pickle_refusals
def test_trainer_resume_refuses_trapped_steps_on_every_rank(tmp_path):
    """verl's FSDPCheckpointManager under a recipe (slimckpt_testing/scenarios/pickle_trap.py): the incremental
    tier's .metadata, extra state and optimizer record, and verl's own model, optim and extra_state
    files, each trapped: every rank raises the same line before loading anything; the steps as saved
    (AdamW and SGD state) load; with checkpoint.trust_pickle the trap runs."""
    launched = launch(
        2,
        "slimckpt_testing.scenarios.pickle_trap",
        "--dir",
        str(tmp_path),
        env={"OMP_NUM_THREADS": "1", "SLIMCKPT_LOG_LEVEL": "WARNING"},
        # 2 ranks save and load several trapped steps (verl imported per rank); 400 s is a hang
        timeout=400,
        cwd=REPO,
        result=tmp_path / "result.json",
    )
    assert launched.proc.returncode == 0, launched.proc.stderr[-4000:]
    result = launched.result
    for case, got in result.items():
        fmt, kind = case.split("/")[:2]
        if case.endswith("/clean") or kind == "extra_state_trusted":
            assert got["ranks"] == ["loaded", "loaded"], (case, got)
            assert got["marker"] is (kind == "extra_state_trusted"), case
            continue
        bad = {
            "metadata": "dcp/.metadata",
            "extra": "slimckpt_extra_world_size_2_rank_0.pt",
            "optim": "dcp/__" if fmt == "incremental" else "optim_world_size_2_rank_0.pt",
            "model": "model_world_size_2_rank_0.pt",
            "extra_state": "extra_state_world_size_2_rank_0.pt",
        }[kind]
        for line in got["ranks"]:
            assert line.startswith(f"PickleRefused: {tmp_path / fmt / kind / bad}"), (case, line)
            assert f"refused: pickle global {TRAPPED_GLOBAL}" in line, (case, line)
        assert len(set(got["ranks"])) == 1 and not got["marker"], (case, got)
    assert len(result) == 11


# --------------------------------------------------------------------------- nothing legitimate refused


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory):
    """The suite's checkpoint kinds: FSDP2 (1-D mesh) and LoRA actors with AdamW state after a step,
    FSDP1 on a mesh and without (ShardedTensor), verl's value model and its incremental-tier step
    (the trainer scenario above loads both formats with AdamW and SGD state)."""
    dirs = [
        fsdp_checkpoint(tmp_path_factory, name, CHECKPOINTS[name][0], *CHECKPOINTS[name][1])
        for name in ("fsdp2_w2", "fsdp1_qwen2_tied")
    ]
    dirs.append(fsdp_checkpoint(tmp_path_factory, *SHARDED_TENSOR[:2], *SHARDED_TENSOR[2]))
    lora = fsdp_checkpoint(tmp_path_factory, "lora_models", 2, *LORA_ARGS)
    dirs += [lora / "llama", lora / "qwen3-moe"]
    kinds = fsdp_checkpoint(
        tmp_path_factory,
        "pickle_kinds",
        2,
        "--models",
        "critic",
        "--export",
        "incremental",
        "--steps",
        "0",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--vocab",
        "96",
    )
    dirs += [kinds / "critic", kinds / "critic.incremental"]
    return dirs


@pytest.mark.slow
def test_every_checkpoint_kind_passes_the_restricted_loader(every_kind):
    """Every pickle of every kind: the check, the real readers (verify opens every rank file with
    the restricted unpickler; an incremental step's .metadata, records and extra state too) and
    torch's restricted loader for extra state. Any refusal fails here (and in conftest)."""
    before = len(pickle_refusals())
    checked = 0
    for role in every_kind:
        assert not (role.parent / f"{role.name}.error.txt").exists(), role
        report = verify_path(str(role))
        assert report.ok, [p.message for p in report.bad]
        assert dcp_refusals(str(role)) == []
        for path in sorted(role.rglob("*.pt")) + sorted(role.rglob(".metadata")):
            check_file(str(path))
            checked += 1
            if "extra" in path.name:
                assert isinstance(load_torch_file(str(path)), dict)
    assert checked >= 30
    assert pickle_refusals()[before:] == []
    assert not pickle_policy.trusted()


@pytest.mark.slow
def test_a_one_rank_fsdp1_checkpoint_of_verl_merges_and_verifies_without_trust(tmp_path_factory, tmp_path):
    """verl's FSDP1 save at world size 1 pickles plain tensors through `_rebuild_from_type_v2(...,
    torch.Tensor, ...)`: a global verl writes, so merge and verify accept it without --trust-pickle."""
    actor = fsdp_checkpoint(
        tmp_path_factory,
        "fsdp1-ws1",
        1,
        "--model",
        "llama",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--fsdp-version",
        "1",
        "--steps",
        "1",
    )
    for name in ("model", "optim", "extra_state"):
        check_file(str(actor / f"{name}_world_size_1_rank_0.pt"))  # raises PickleRefused on a foreign global
    merged = run_cli(["merge", "--local_dir", str(actor), "--target_dir", str(tmp_path / "hf")])
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert (tmp_path / "hf" / "model.safetensors").exists() or list((tmp_path / "hf").glob("*.safetensors"))
