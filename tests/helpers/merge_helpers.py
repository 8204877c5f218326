"""Shared by tests/test_merge_*.py: checkpoints to merge, verl's merger as the reference, readers."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

from slimckpt_testing.launch import STACKS_ON_ABORT, end_hung_tree
from slimckpt_testing.merge_check import adapter_config_fields
from slimckpt_testing.synthetic import synthetic_checkpoint, tiny_llama_config  # noqa: F401  (the tests' names)
from tests.helpers.launch import REPO, torchrun

# lazy imports: transformers, verl and DCP load in the tests that use them, so importing the helpers stays quick

# a torchrun of up to 4 ranks saving a tiny model is mostly torch's start-up; 240 s is a hang
FIXTURE_TIMEOUT = 240


def big_dcp_config():
    """A Llama whose incremental step is 416 MB of fp32 tensors in one .distcp file, none over 16 MiB:
    the memory tests' model (the bound: its largest tensor + a chunk + the interpreter's)."""
    return tiny_llama_config(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
    )


def synthetic_dcp_step(root: Path, config=None, more: dict | None = None) -> Path:
    """An incremental-tier role dir made without torchrun: the model's state dict saved by DCP in
    one process (one chunk per tensor, as a world-size-1 save), committed by slimckpt_resume.json
    as resume_state writes it. `more`: other top-level entries saved with it ({"optim": ...})."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from slimckpt.engine.checkpoint_dir import DCP_DIR
    from slimckpt.engine.resume_records import write_manifest
    from slimckpt.layout.resume_manifest import Manifest, describe_files

    config = config or tiny_llama_config()
    torch.manual_seed(0)
    sd = {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process": as meant
        dcp.save({"model": sd, **(more or {})}, checkpoint_id=str(root / DCP_DIR), no_dist=True)
    (root / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    config.save_pretrained(root / "huggingface")
    rels = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    contents = ["model"] + (["optimizer"] if "optim" in (more or {}) else [])
    write_manifest(
        str(root),
        Manifest(
            global_step=1,
            world_size=1,
            contents=contents,
            fsdp_version=2,
            files=describe_files(str(root), rels),
            extra={"aliases": {}},
        ),
    )
    return root


def fsdp_checkpoint(tmp_path_factory, name: str, nproc: int, *args: str) -> Path:
    """A real verl checkpoint from slimckpt_testing.verl_checkpoints.fsdp_checkpoint under torchrun, built once per session."""
    base = tmp_path_factory.getbasetemp() / "fsdp_fixtures" / name
    actor = base / "actor"
    done = base / "DONE"
    if done.exists():
        return actor
    base.mkdir(parents=True, exist_ok=True)
    proc = torchrun(
        nproc, ["-m", "slimckpt_testing.verl_checkpoints.fsdp_checkpoint", "--out", str(actor), *args], FIXTURE_TIMEOUT
    )
    assert proc.returncode == 0, f"fixture {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    done.write_text("ok")
    return actor


def verl_merge(local_dir: Path, target: Path) -> str | None:
    """Run verl 0.9.1's own FSDPModelMerger in this process; returns its exception text, if any
    (it raises after writing when the checkpoint has no tokenizer)."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    target.mkdir(parents=True, exist_ok=True)
    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(local_dir),
        target_dir=str(target),
        hf_model_config_path=str(local_dir / "huggingface"),
    )
    merger = FSDPModelMerger(config)
    original = getattr(FSDPModelMerger.merge_and_save, "__wrapped__", FSDPModelMerger.merge_and_save)
    try:
        original(merger)
    except Exception as exc:  # noqa: BLE001 - the reference's own failure is data for the test
        return f"{type(exc).__name__}: {exc}"
    return None


def dir_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        o = ours[name]
        assert o.dtype == t.dtype and o.shape == t.shape, (name, o.dtype, t.dtype, o.shape, t.shape)
        assert torch.equal(o.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def full_state_from_shards(local_dir: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights the checkpoint holds, gathered naively (the ground truth for logits)."""
    from torch.distributed.tensor import DTensor

    cfg = json.loads((local_dir / "fsdp_config.json").read_text())
    world = cfg["world_size"]
    sds = [
        torch.load(local_dir / f"model_world_size_{world}_rank_{r}.pt", weights_only=False, map_location="cpu")
        for r in range(world)
    ]
    out = {}
    for key, v0 in sds[0].items():
        if isinstance(v0, DTensor):
            shard = [i for i, p in enumerate(v0.placements) if p.is_shard()]
            mesh = v0.device_mesh.mesh
            ranks = mesh.reshape(-1, mesh.shape[-1])[0].tolist() if mesh.ndim > 1 else mesh.tolist()
            dim = v0.placements[shard[0]].dim
            out[key] = torch.cat([sds[r][key]._local_tensor for r in ranks], dim=dim)
        else:
            out[key] = v0
    return out


# a torchrun or CLI merge of a tiny checkpoint ends in well under a minute; 300 s is a hang
def run(cmd: list[str], env: dict | None = None, timeout: int = 300, preexec_fn=None) -> subprocess.CompletedProcess:
    """subprocess.run in its own session; on timeout every process's stacks, then the whole tree killed
    (torchrun leaves ranks behind)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **STACKS_ON_ABORT, **(env or {})}
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=REPO,
        start_new_session=True,
        preexec_fn=preexec_fn,
    ) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = end_hung_tree(p)  # every process's stacks, then the tree killed
            raise AssertionError(f"timed out after {timeout}s: {cmd}\nits stderr's end:\n{err[-12000:]}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


# the distributed merges of the byte tests sleep up to this at each race point (slimckpt.engine.race_points),
# so the ranks' order differs from run to run; `make stress-merge` does the same a hundred times
SHAKE = {"SLIMCKPT_TEST_MERGE_DELAY": "0.005"}


def assert_same_tree(ours: Path, reference: Path) -> None:
    """The two directories hold the same files, byte for byte; else one line naming the first
    differing file and offset (not a dump of both trees)."""
    from scripts.stress.merge_bytes import first_difference

    diff = first_difference(Path(ours), Path(reference))
    assert diff is None, f"{ours} differs from {reference}: {diff.line()}"


def run_cli(  # the CLI merges or verifies a tiny checkpoint in seconds after its imports; 300 s is a hang
    args: list[str], env: dict | None = None, timeout: int = 300, preexec_fn=None
) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "slimckpt.cli", *args], env=env, timeout=timeout, preexec_fn=preexec_fn)


def full_disk_after_headers(monkeypatch) -> None:
    """os.pwrite fails with ENOSPC past the first 4 KiB: headers go in, weights hit a full disk."""
    real = os.pwrite

    def pwrite(fd, data, off):
        if off > 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, off)

    monkeypatch.setattr(os, "pwrite", pwrite)


def tree_bytes(path: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under `path` but slimckpt's merge manifest (and the names in `skip`), by relative path."""
    from slimckpt.layout.merge_manifest import MANIFEST_NAME

    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(Path(path).rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME and p.name not in skip
    }


def same_adapter_config(a: bytes, b: bytes) -> bool:
    return adapter_config_fields(a) == adapter_config_fields(b)
