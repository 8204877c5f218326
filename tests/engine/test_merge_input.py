"""slimckpt merge on checkpoints made in-process (plain tensors, no torchrun): the output matches
verl's merger, and every bad input ends in a one-line error, a nonzero exit and nothing committed."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from slimckpt import cli
from slimckpt.layout.merge_manifest import MANIFEST_NAME, verify
from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_tokenizer

from ..helpers.merge_helpers import (
    adapter_config_fields,
    assert_same_tensors,
    dir_tensors,
    run_cli,
    synthetic_checkpoint,
    tiny_llama_config,
    tree_bytes,
    verl_merge,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synthetic_checkpoint(tmp_path_factory.mktemp("syn") / "actor", world_size=2)


@pytest.fixture(autouse=True)
def slim_log(capsys):
    """slimckpt's log lines, whichever stderr its handler was bound to when first configured."""
    import io
    import logging

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("slimckpt")
    logger.addHandler(handler)
    yield buf
    logger.removeHandler(handler)


def merge_cli(capsys, *args: str) -> tuple[int, str]:
    """Exit code and stderr (printed lines plus slimckpt's log lines) of `slimckpt merge ...` in-process."""
    import logging

    rc = cli.main(["merge", "--no_progress", *args])
    err = capsys.readouterr().err
    for h in logging.getLogger("slimckpt").handlers:
        if isinstance(getattr(h, "stream", None), __import__("io").StringIO):
            err += h.stream.getvalue()
    return rc, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("slimckpt merge: error:")]
    assert len(lines) == 1, err
    return lines[0]


def assert_nothing_committed(target):
    assert not os.path.exists(str(target) + ".partial"), "partial dir left behind"
    if os.path.exists(target):
        assert not os.path.exists(os.path.join(target, MANIFEST_NAME))
        assert not any(n.endswith(".safetensors") for n in os.listdir(target))


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_plain_checkpoint_matches_verl(ckpt, tmp_path, capsys):
    assert verl_merge(ckpt, tmp_path / "verl") is not None  # verl raises: no tokenizer (after writing)
    rc, err = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "ours"))
    assert rc == 0
    assert "no tokenizer" in err  # a warning, not a failure
    assert_same_tensors(dir_tensors(tmp_path / "ours"), dir_tensors(tmp_path / "verl"))
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "verl" / name).read_bytes(), name
    assert verify(str(tmp_path / "ours")) == []


@pytest.mark.parametrize("dtype,torch_dtype", [("fp16", torch.float16), ("fp32", torch.float32)])
def test_dtype_option(ckpt, tmp_path, capsys, dtype, torch_dtype):
    rc, _ = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "o"), "--dtype", dtype)
    assert rc == 0
    src = torch.load(ckpt / "model_world_size_2_rank_0.pt", weights_only=False)
    out = dir_tensors(tmp_path / "o")
    for name, t in out.items():
        assert t.dtype == torch_dtype
        assert torch.equal(t, src[name].to(torch_dtype))
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == str(torch_dtype).split(".")[1]


def test_max_shard_size_splits_like_save_pretrained(ckpt, tmp_path, capsys):
    rc, _ = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "o"), "--max_shard_size", "10KB")
    assert rc == 0
    index = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((tmp_path / "o" / f).stat().st_size <= 10_000 + 4096 for f in files)
    src = torch.load(ckpt / "model_world_size_2_rank_0.pt", weights_only=False)
    out = dir_tensors(tmp_path / "o")
    assert sorted(out) == sorted(index["weight_map"]) == sorted(src)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in src.values())


def test_missing_rank_file(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path / "actor")
    (bad / "model_world_size_2_rank_1.pt").unlink()
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    assert "model_world_size_2_rank_1.pt is missing" in error_line(err)
    assert_nothing_committed(tmp_path / "o")


def test_an_uncommitted_incremental_step_is_refused(ckpt, tmp_path, capsys):
    """An incremental-tier role dir (dcp/, no verl rank files) without slimckpt_resume.json (a save
    that never finished) is not merged: one line naming the manifest, the resume's own words."""
    role = tmp_path / "actor"
    (role / "dcp").mkdir(parents=True)
    (role / "dcp" / "__0_0.distcp").write_bytes(b"x")
    shutil.copy(ckpt / "fsdp_config.json", role / "fsdp_config.json")
    rc, err = merge_cli(capsys, "--local_dir", str(role), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    line = error_line(err)
    assert "slimckpt_resume.json" in line and "never finished" in line and "merge an earlier" in line
    assert "is missing" not in line
    assert_nothing_committed(tmp_path / "o")


def test_two_world_sizes(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path / "actor")
    shutil.copy(bad / "model_world_size_2_rank_0.pt", bad / "model_world_size_4_rank_3.pt")
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    line = error_line(err)
    assert "two world sizes" in line and "model_world_size_4_rank_3.pt" in line
    assert_nothing_committed(tmp_path / "o")


def test_a_wrong_local_dir_fails_before_torch_is_imported(ckpt, tmp_path):
    """The dir checks run before the merge's imports: the one-line error comes in milliseconds."""
    bad = copy_ckpt(ckpt, tmp_path / "actor")
    (bad / "model_world_size_2_rank_1.pt").unlink()
    code = (
        "import sys; from slimckpt import cli; "
        f"rc = cli.main(['merge', '--local_dir', {str(bad)!r}, '--target_dir', {str(tmp_path / 'o')!r}]); "
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)"
    )
    # the error comes before torch is imported, in about a second; 120 s is a hang
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split()[-2:] == ["NO-TORCH", "1"], proc.stdout + proc.stderr
    assert "model_world_size_2_rank_1.pt is missing" in proc.stderr


@pytest.mark.parametrize("damage", ["truncated", "foreign_pickle", "text", "empty", "list"])
def test_damaged_rank_file(ckpt, tmp_path, capsys, damage):
    bad = copy_ckpt(ckpt, tmp_path / "actor")
    path = bad / "model_world_size_2_rank_1.pt"
    if damage == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage == "foreign_pickle":
        import pickle

        path.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    elif damage == "text":
        path.write_text("not a checkpoint\n")
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        torch.save([torch.zeros(3)], path)
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    assert str(path) in error_line(err)
    assert_nothing_committed(tmp_path / "o")


def test_ranks_disagree_on_unsharded_tensor(tmp_path, capsys):
    def edit(rank, sd):
        if rank == 1:
            sd["model.norm.weight"] += 1.0

    bad = synthetic_checkpoint(tmp_path / "actor", world_size=2, per_rank_edit=edit)
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    line = error_line(err)
    assert "rank_1.pt" in line and "model.norm.weight" in line
    assert_nothing_committed(tmp_path / "o")


def test_ranks_disagree_on_keys(tmp_path, capsys):
    bad = synthetic_checkpoint(
        tmp_path / "actor", world_size=2, per_rank_edit=lambda r, sd: sd.pop("lm_head.weight") if r == 1 else None
    )
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1 and "rank_1.pt: its keys differ" in error_line(err)


def test_missing_metadata_files(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path / "a1")
    (bad / "fsdp_config.json").unlink()
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1 and "fsdp_config.json is missing" in error_line(err)
    bad = copy_ckpt(ckpt, tmp_path / "a2")
    shutil.rmtree(bad / "huggingface")
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1 and "huggingface/config.json is missing" in error_line(err)
    rc, err = merge_cli(capsys, "--local_dir", str(tmp_path / "nowhere"), "--target_dir", str(tmp_path / "o"))
    assert rc == 1 and "no such checkpoint directory" in error_line(err)
    assert_nothing_committed(tmp_path / "o")


def test_non_empty_target_refused_unless_overwrite(ckpt, tmp_path, capsys):
    target = tmp_path / "o"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    rc, err = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(target))
    assert rc == 1 and "is not empty; pass --overwrite" in error_line(err)
    assert (target / "keep.txt").read_text() == "mine"
    rc, _ = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(target), "--overwrite")
    assert rc == 0
    assert not (target / "keep.txt").exists() and verify(str(target)) == []
    assert not [p for p in os.listdir(tmp_path) if ".old-" in p or p.endswith(".partial")]


def test_empty_target_dir_is_fine(ckpt, tmp_path, capsys):
    # verl's generate_config_from_args creates the target dir before merging
    (tmp_path / "o").mkdir()
    rc, _ = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "o"))
    assert rc == 0 and verify(str(tmp_path / "o")) == []


def test_stale_partial_is_replaced(ckpt, tmp_path, capsys):
    (tmp_path / "o.partial").mkdir()
    (tmp_path / "o.partial" / "model.safetensors").write_bytes(b"junk")
    rc, _ = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "o"))
    assert rc == 0 and verify(str(tmp_path / "o")) == [] and not (tmp_path / "o.partial").exists()


def _limit_file_size(limit: int):
    def set_limit():
        # SIGXFSZ would kill before the error can be reported; slimckpt ignores it too
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def test_disk_full_rlimit(ckpt, tmp_path):
    """A file-size limit below the weights file: EFBIG while reserving/writing it."""
    target = tmp_path / "o"
    proc = run_cli(
        ["merge", "--no_progress", "--local_dir", str(ckpt), "--target_dir", str(target)],
        preexec_fn=_limit_file_size(20_000),
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = error_line(proc.stderr)
    assert "model.safetensors" in line and "no space left" in line and "--target_dir" in line
    assert_nothing_committed(target)


def _unshare_ok() -> bool:
    if not shutil.which("unshare") or sys.platform != "linux":
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


def _merge_in_tmpfs(
    ckpt, mount, size: str, readonly: bool, before: str = "", distributed: bool = False
) -> subprocess.CompletedProcess:
    """Run the merge in a private mount namespace with a small tmpfs at `mount` (no global mount);
    `before` runs in the mount first; what the mount holds afterwards is printed as `left: ...`."""
    mount.mkdir()
    remount = f" && mount -o remount,ro {mount}" if readonly else ""
    launch = (
        f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 2 -m slimckpt.cli"
        if distributed
        else f"{sys.executable} -m slimckpt.cli"
    )
    script = (
        f"mount -t tmpfs -o size={size} tmpfs {mount}{remount} && {before or 'true'} && "
        f"{launch} merge --no_progress --local_dir {ckpt} --target_dir {mount}/out "
        f"{'--distributed_merge' if distributed else ''}; rc=$?; "
        f"echo left: $(cd {mount} && find . -mindepth 1 | sort); exit $rc"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the tiny merge may start a 2-rank torchrun (torch imported per rank); 300 s is a hang
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=300)


def _left(proc: subprocess.CompletedProcess) -> list[str]:
    return next(ln for ln in proc.stdout.splitlines() if ln.startswith("left:")).split()[1:]


def _output_bytes(ckpt) -> int:
    """The weight files' planned size: what the refusal must name."""
    from slimckpt.engine.merge_input import open_source
    from slimckpt.hf.naming import HfSide, default_max_shard_size
    from slimckpt.hf.plan import make_plan

    source = open_source(str(ckpt))
    try:
        return make_plan(source, HfSide(str(ckpt), "bf16", False), "bf16", default_max_shard_size()).weight_bytes
    finally:
        source.close()


@pytest.mark.skipif(not _unshare_ok(), reason="needs `unshare -rm` and tmpfs mounts")
@pytest.mark.parametrize("how", ["single", pytest.param("distributed", marks=pytest.mark.slow)])
def test_disk_too_small_is_refused_before_writing(ckpt, tmp_path, monkeypatch, how):
    """A filesystem that cannot hold the output: refused up front, naming the bytes needed and free,
    and nothing is created there (no partial, no empty files at their final size)."""
    proc = _merge_in_tmpfs(
        ckpt,
        tmp_path / "mnt",
        f"{max(4, _output_bytes(ckpt) // 2048)}k",
        readonly=False,
        distributed=how == "distributed",
    )
    assert proc.returncode != 0 if how == "distributed" else proc.returncode == 1, proc.stderr[-2000:]
    lines = {ln for ln in proc.stderr.splitlines() if ln.startswith("slimckpt merge: error:")}
    assert len(lines) == 1, proc.stderr[-3000:]  # every rank says the same line
    line = lines.pop()
    need = _output_bytes(ckpt)
    assert "no space left" in line and "nothing was written" in line and "--target_dir" in line, line
    found = re.search(r"needs (\d+) KiB, the filesystem has (\d+) KiB free", line)
    assert found, line
    needed, free = int(found[1]), int(found[2])
    assert needed >= round(need / 1024) and free < needed, line  # the weights and the configs beside them
    assert _left(proc) == []


@pytest.mark.skipif(not _unshare_ok(), reason="needs `unshare -rm` and tmpfs mounts")
def test_stale_partial_counts_as_free(ckpt, tmp_path):
    """A merge killed midway leaves `<target>.partial`, which the next run deletes first: its blocks
    count as free, so the rerun on a disk that holds one output (and not two) goes through."""
    need = _output_bytes(ckpt)
    size_kib = (need * 3 // 2) // 1024 + 256  # room for one output and its configs, not for two
    stale = f"mkdir {tmp_path}/mnt/out.partial && head -c {need} /dev/urandom > {tmp_path}/mnt/out.partial/model.safetensors"
    proc = _merge_in_tmpfs(ckpt, tmp_path / "mnt", f"{size_kib}k", readonly=False, before=stale)
    assert proc.returncode == 0, proc.stderr[-2000:]
    left = _left(proc)
    assert "./out/manifest.json" in left and not any(p.startswith("./out.partial") for p in left), left


@pytest.mark.skipif(not _unshare_ok(), reason="needs `unshare -rm` and tmpfs mounts")
def test_read_only_target(ckpt, tmp_path):
    proc = _merge_in_tmpfs(ckpt, tmp_path / "mnt", "10m", readonly=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = error_line(proc.stderr)
    assert "not writable" in line and "out.partial" in line


def test_lora_checkpoint_is_streamed(tmp_path, capsys):
    """LoRA keys: the streaming merge writes what verl's merger writes (the base model with peft's
    names undone, lora_adapter/ with the adapter and its config), byte for byte, verl's merger not run."""
    root, _ = _lora_checkpoint(tmp_path)
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 0, err
    assert "running verl's own FSDPModelMerger" not in err and "slimckpt merge committed" in err
    assert verl_merge(root, tmp_path / "v") is None
    ours, theirs = tree_bytes(tmp_path / "o"), tree_bytes(tmp_path / "v")
    config = "lora_adapter/adapter_config.json"
    # a dict comparison, so that a failure shows the field that differs
    assert adapter_config_fields(ours.pop(config)) == adapter_config_fields(theirs.pop(config))
    assert ours == theirs
    out = dir_tensors(tmp_path / "o")
    assert "model.layers.0.self_attn.q_proj.weight" in out and not any("lora_" in k for k in out)
    assert verify(str(tmp_path / "o")) == []


def force_verl_fallback(monkeypatch) -> None:
    """The streaming merge's planner says this model needs verl's merger (as for a save-time
    conversion that is not a slice of one tensor)."""
    import slimckpt.hf.naming as hf_side

    def needs_verl(self, names, shapes):
        raise hf_side.NeedsVerlMerger(
            "transformers converts tensors of X on save (e.g. 'c' is not a part of one checkpoint tensor)"
        )

    monkeypatch.setattr(hf_side.HfSide, "output_sources", needs_verl)


def test_verl_fallback_failure_is_one_line(tmp_path, capsys, monkeypatch):
    """verl's own merger failing inside the fallback (here: no tokenizer) is one line, exit 1."""
    root = synthetic_checkpoint(tmp_path / "actor")
    force_verl_fallback(monkeypatch)
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 1 and "verl's FSDPModelMerger (which this checkpoint needs) failed" in error_line(err)


def _lora_checkpoint(tmp_path):
    """A world-size-1 LoRA checkpoint made in-process, without lora_train_meta.json."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = tiny_llama_config()
    torch.manual_seed(1)
    model = get_peft_model(
        AutoModelForCausalLM.from_config(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    root = tmp_path / "actor"
    root.mkdir()
    torch.save(sd, root / "model_world_size_1_rank_0.pt")
    (root / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    cfg.save_pretrained(root / "huggingface")
    build_tokenizer(cfg.vocab_size).save_pretrained(root / "huggingface")
    return root, sd


def test_verl_fallback_says_its_memory_or_is_refused(tmp_path, capsys, monkeypatch):
    """The fallback line gives verl's merger's host memory: the rank model files it reads whole plus
    the model in bf16; --no_verl_fallback (and SLIMCKPT_MERGE_NO_VERL_FALLBACK=1 through verl's own
    command) refuses in one line, with nothing written."""
    root = synthetic_checkpoint(tmp_path / "actor")
    build_tokenizer(96).save_pretrained(root / "huggingface")
    sd = torch.load(root / "model_world_size_1_rank_0.pt")
    force_verl_fallback(monkeypatch)
    shards = os.path.getsize(root / "model_world_size_1_rank_0.pt")
    params = sum(t.numel() for t in sd.values())
    from slimckpt.merge.verl_fallback import human_bytes

    want = (
        f"about {human_bytes(shards + 2 * params)} of host memory (the {human_bytes(shards)} of rank model "
        f"files, read whole, + {params:,} parameters x 2 bytes in bf16)"
    )
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"), "--no_verl_fallback")
    assert rc == 1, err
    line = error_line(err)
    assert "'c' is not a part" in line and want in line and "not run, as --no_verl_fallback asks" in line, line
    assert "running verl's own" not in err and not (tmp_path / "o").exists()
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 0 and want in err and "--no_verl_fallback refuses instead" in err, err
    # verl's own command, redirected: the env var stands in for the flag
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    from slimckpt.merge import verl_merger

    ran = []
    patched = verl_merger.wrap_merge_and_save(lambda self: ran.append(self))
    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(root),
        target_dir=str(tmp_path / "v"),
        hf_model_config_path=str(root / "huggingface"),
    )
    monkeypatch.setenv(verl_merger.NO_FALLBACK_ENV, "1")
    with pytest.raises(SystemExit) as exc:
        patched(FSDPModelMerger(config))
    assert "not run, as SLIMCKPT_MERGE_NO_VERL_FALLBACK=1 asks" in str(exc.value) and not ran
    monkeypatch.delenv(verl_merger.NO_FALLBACK_ENV)
    patched(FSDPModelMerger(config))
    assert len(ran) == 1  # verl's original merge_and_save


def test_cli_help_and_bad_options(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["merge", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--local_dir",
        "--target_dir",
        "--dtype",
        "--max_shard_size",
        "--workers",
        "--distributed_merge",
        "--overwrite",
        "--merge_lora",
    ):
        assert flag in out
    assert cli.main([]) == 2
    rc, err = merge_cli(capsys, "--local_dir", "x", "--target_dir", "y", "--max_shard_size", "5G")
    assert rc == 1 and "--max_shard_size" in error_line(err)


def tiny_mixtral_config(**overrides):
    from transformers import MixtralConfig

    kw = dict(
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        num_local_experts=3,
        architectures=["MixtralForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    return MixtralConfig(**kw)


def test_moe_experts_are_streamed_and_match_verl(tmp_path, capsys, slim_log):
    """transformers 5 fuses Mixtral's experts in memory ([E, 2I, H], [E, H, I]) and splits them per
    expert on save: each split is a run of the fused tensor's elements, streamed like any tensor.
    Unsharded copies on two ranks (compared as verl does), tiny chunks so that parts cross chunks."""
    root = synthetic_checkpoint(tmp_path / "actor", world_size=2, config=tiny_mixtral_config())
    build_tokenizer(64).save_pretrained(root / "huggingface")
    assert verl_merge(root, tmp_path / "verl") is None
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 0, err
    assert "verl's own FSDPModelMerger" not in err and "slimckpt merge committed" in err
    out = dir_tensors(tmp_path / "o")
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in out
    assert_same_tensors(out, dir_tensors(tmp_path / "verl"))
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == (tmp_path / "verl" / "model.safetensors").read_bytes()
    assert verify(str(tmp_path / "o")) == []
    # 100-byte chunks: every expert's rows cross chunks (and the source's rows)
    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeOptions

    merge(MergeOptions(local_dir=str(root), target_dir=str(tmp_path / "small"), chunk_bytes=100, progress=False))
    assert (tmp_path / "small" / "model.safetensors").read_bytes() == (
        tmp_path / "o" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    "config_edit,what",
    [
        ({"num_local_experts": 4}, "makes it [4, 16, 32]"),  # expert count
        ({"intermediate_size": 24}, "makes it [3, 16, 24]"),
    ],
)  # expert sizes
def test_moe_config_that_does_not_fit_the_shards(tmp_path, capsys, config_edit, what):
    """config.json from another model: the fused tensor's split would follow the shards, loading the
    config's; one line naming the tensor and the rank file, nothing committed."""
    root = synthetic_checkpoint(tmp_path / "actor", world_size=2, config=tiny_mixtral_config())
    tiny_mixtral_config(**config_edit).save_pretrained(root / "huggingface")
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    line = error_line(err)
    assert (
        "model_world_size_2_rank_0.pt: 'model.layers.0.mlp.experts.down_proj' is [3, 16, 32]" in line and what in line
    )
    assert "config.json" in line and "verl's own FSDPModelMerger" not in err
    assert_nothing_committed(tmp_path / "o")


def test_flowrl_log_z_head_left_out(tmp_path, capsys):
    """FlowRL's log Z head is checkpointed with the actor; HF exports (ours and verl's, patched) drop it."""
    extra = {"flowrl_log_z.net.0.weight": torch.randn(8, 32), "flowrl_log_z.net.0.bias": torch.randn(8)}
    root = synthetic_checkpoint(tmp_path / "actor", world_size=2, extra=extra)
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 0 and "leaves out FlowRL's log Z head (2 tensors)" in err
    out = dir_tensors(tmp_path / "o")
    assert not any("flowrl_log_z" in k for k in out) and "model.norm.weight" in out


def test_redirect_uploads_after_commit_and_delegates_test(ckpt, tmp_path, monkeypatch, capsys):
    """The patched FSDPModelMerger.merge_and_save: merge -> streaming merge, then verl's own uploader on
    the committed dir (--hf_upload_path); `test` -> verl's original."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    from slimckpt.merge.verl_merger import wrap_merge_and_save

    calls = []
    monkeypatch.setattr(
        FSDPModelMerger, "upload_to_huggingface", lambda self: calls.append(("upload", verify(self.config.target_dir)))
    )
    patched = wrap_merge_and_save(lambda self: calls.append(("original", self.config.operation)))
    target = tmp_path / "o"
    target.mkdir()  # as verl's generate_config_from_args leaves it
    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(ckpt),
        target_dir=str(target),
        hf_upload_path="someone/model",
        hf_model_config_path=str(ckpt / "huggingface"),
        use_cpu_initialization=True,
    )
    patched(FSDPModelMerger(config))
    assert calls == [("upload", [])]  # uploaded once, after the commit verified clean
    config = ModelMergerConfig(
        operation="test",
        backend="fsdp",
        local_dir=str(ckpt),
        test_hf_dir=str(target),
        hf_model_config_path=str(ckpt / "huggingface"),
    )
    patched(FSDPModelMerger(config))
    assert calls[-1] == ("original", "test")


def test_distributed_flag_outside_torchrun(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    rc, err = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "o"), "--distributed_merge")
    assert rc == 1 and "start it with torchrun" in error_line(err)


def test_redirect_goes_distributed_only_when_asked(ckpt, tmp_path, monkeypatch):
    """verl's merger command in a shell with WORLD_SIZE/RANK (any torchrun, SLURM or PyTorchJob shell)
    merged distributed and init_process_group waited up to 4 hours for ranks that never came:
    the ranks share the merge only with SLIMCKPT_MERGE_DISTRIBUTED=1."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    from slimckpt.merge import verl_merger
    from slimckpt.merge.plan import MergeResult

    seen = []
    monkeypatch.setattr(
        verl_merger, "merge", lambda opts, verl_fallback: seen.append(opts) or MergeResult(opts.target_dir)
    )
    patched = verl_merger.wrap_merge_and_save(lambda self: None)
    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(ckpt),
        target_dir=str(tmp_path / "o"),
        hf_model_config_path=str(ckpt / "huggingface"),
    )
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(verl_merger.DISTRIBUTED_ENV, raising=False)
    patched(FSDPModelMerger(config))
    monkeypatch.setenv(verl_merger.DISTRIBUTED_ENV, "1")
    patched(FSDPModelMerger(config))
    assert [o.distributed for o in seen] == [False, True]
    assert seen[1].distributed_hint == "SLIMCKPT_MERGE_DISTRIBUTED=1"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "rank, says",
    [
        ("0", "rank(s) 1 of 2 did not join within 3 s (this is rank 0)"),  # rank 1 never started
        ("1", "rank 1 of 2 could not reach rank 0's store at 127.0.0.1:"),  # rank 0 never started
    ],
)
def test_a_distributed_merge_whose_ranks_do_not_all_join_ends_in_minutes(ckpt, tmp_path, rank, says):
    """init_process_group waited up to 4 hours for a missing rank; now the join has
    SLIMCKPT_MERGE_JOIN_TIMEOUT seconds (600 by default) and the error names who is missing."""
    env = {
        "RANK": rank,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "SLIMCKPT_MERGE_JOIN_TIMEOUT": "3",
    }
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK"):
        env[k] = ""
    proc = run_cli(
        [
            "merge",
            "--distributed_merge",
            "--no_progress",
            "--local_dir",
            str(ckpt),
            "--target_dir",
            str(tmp_path / "o"),
        ],
        env=env,
        # the join gives up after its 3 s plus the imports; 90 s fails a join that waits its default 600 s
        timeout=90,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert says in line and "SLIMCKPT_MERGE_JOIN_TIMEOUT=<seconds>" in line and "MASTER_ADDR:MASTER_PORT" in line, line
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_merge_lora_of_an_adapter_on_fused_experts_is_refused_in_one_line(tmp_path, capsys):
    """verl's default target_modules=all-linear on an MoE model: peft 0.21 adapts the fused experts
    through target_parameters (A [E*r, in] on `experts.base_layer`, no Linear weight under it).
    --merge_lora says that in one line; without it the base and lora_adapter/ are written."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = tiny_mixtral_config()
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_config(config),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert any(".experts.base_layer.lora_A." in k for k in sd)

    def peft_state(rank, rank_sd):
        rank_sd.clear()
        rank_sd.update(sd)

    root = synthetic_checkpoint(tmp_path / "actor", world_size=1, config=config, per_rank_edit=peft_state)
    (root / "lora_train_meta.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM"}))
    build_tokenizer(64).save_pretrained(root / "huggingface")
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "m"), "--merge_lora")
    assert rc == 1
    line = error_line(err)
    assert "adapts a module's parameters (peft's target_parameters" in line and "merge without --merge_lora" in line
    assert_nothing_committed(tmp_path / "m")
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 0, err
    assert (tmp_path / "o" / "lora_adapter" / "adapter_model.safetensors").is_file()
