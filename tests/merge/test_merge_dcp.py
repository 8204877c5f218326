"""slimckpt merge of incremental-tier steps (dcp/), from the real 2-rank FSDP2 saves of
slimckpt_testing/scenarios/batch.py (no torchrun of its own): the output equals the save's own huggingface/
export (fp32) and our merge of verl's rank files of the same step (which tests/merge/test_verl_merger.py
holds equal to verl's merger), tensor for tensor, and loads with from_pretrained; a critic step
(never exported) equals the model's own state dict; bad steps end in one line, nothing committed. A step's
dcp/ is read by engine/dcp_step."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from slimckpt import cli
from slimckpt.layout.merge_manifest import MANIFEST_NAME

from ..helpers.merge_helpers import assert_same_tensors, dir_tensors, run

pytestmark = pytest.mark.slow

STEP = os.path.join("global_step_1", "actor")


def merge(capsys, local_dir, target, *flags: str) -> tuple[int, str]:
    """Exit code and stderr of `slimckpt merge` in-process (the batch's imports are paid once)."""
    rc = cli.main(["merge", "--no_progress", "--local_dir", str(local_dir), "--target_dir", str(target), *flags])
    return rc, capsys.readouterr().err


def merged(capsys, local_dir, target, *flags: str) -> dict[str, torch.Tensor]:
    rc, err = merge(capsys, local_dir, target, *flags)
    assert rc == 0, err[-3000:]
    assert (target / MANIFEST_NAME).is_file()
    return dir_tensors(target)


def scenario_dir(root, name: str):
    error = root / name / "error.txt"
    assert not error.exists(), f"scenario {name} raised:\n{error.read_text()[-6000:]}"
    return root / name


def refusal(capsys, local_dir, target) -> str:
    rc, err = merge(capsys, local_dir, target)
    assert rc == 1, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("slimckpt merge: error:")]
    assert len(lines) == 1, err
    assert not os.path.exists(str(target) + ".partial") and not (target / MANIFEST_NAME).exists()
    return lines[0]


@pytest.mark.parametrize("model", ["llama", "qwen2-tied"])
def test_merge_equals_the_saves_export_and_verls_rank_files(ws2_scenarios, tmp_path, capsys, model):
    """fp32: the save's own export (export_dtype auto) byte for byte per tensor, loads with
    from_pretrained; bf16 (the default): our merge of verl's rank files of the same step, config
    included. qwen2-tied: lm_head.weight was saved once (an alias in the manifest) and dropped as verl does."""
    from transformers import AutoModelForCausalLM

    root = scenario_dir(ws2_scenarios, "hf_export") / model
    step = root / "sync" / STEP
    ours = merged(capsys, step, tmp_path / "fp32", "--dtype", "fp32")
    export = dir_tensors(step / "huggingface")
    assert {t.dtype for t in export.values()} == {torch.float32}
    assert_same_tensors(ours, export)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in ours.items())
    bf16 = merged(capsys, step, tmp_path / "bf16")
    assert_same_tensors(bf16, merged(capsys, root / "verl" / STEP, tmp_path / "verl_bf16"))
    assert (tmp_path / "bf16" / "config.json").read_text() == (tmp_path / "verl_bf16" / "config.json").read_text()


def model_state_equals(merged_tensors: dict, full_state: dict) -> None:
    """The merge holds the saved model's own full state dict, but for a tied lm_head.weight (verl's
    merger drops it: drop_tied_target_keys)."""
    tied = {n for n in set(full_state) - set(merged_tensors) if n == "lm_head.weight"}
    assert_same_tensors(merged_tensors, {n: t for n, t in full_state.items() if n not in tied})


@pytest.mark.parametrize("scenario", ["resume", "resume_async"])
def test_resume_steps_merge_to_the_saved_state(ws2_scenarios, tmp_path, capsys, scenario):
    """The resume scenarios' steps (FSDP2; resume_async: tied embeddings, written in the background
    while training went on): fp32 equals the full state dict the scenario took at the save."""
    root = scenario_dir(ws2_scenarios, scenario)
    full = torch.load(root / "full_state_at_save.pt", weights_only=False)["model"]
    model_state_equals(merged(capsys, root / "global_step_3" / "actor", tmp_path / "o", "--dtype", "fp32"), full)


def test_fsdp1_step_merges_and_loads(ws2_scenarios, tmp_path, capsys):
    """verl's default strategy (FSDP1): its step merges to a model every parameter of which loads."""
    from transformers import AutoModelForCausalLM

    ours = merged(
        capsys,
        scenario_dir(ws2_scenarios, "resume_fsdp1") / "global_step_3" / "actor",
        tmp_path / "o",
        "--dtype",
        "fp32",
    )
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "o", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    sd = model.state_dict()
    assert all(torch.equal(sd[n], t) for n, t in ours.items())


@pytest.mark.parametrize("model", ["qwen3-moe", "deepseek-v3"])
def test_moe_step_splits_fused_experts_as_its_export(ws2_scenarios, tmp_path, capsys, model):
    step = scenario_dir(ws2_scenarios, "moe_export") / model / "incremental" / STEP
    export = dir_tensors(step / "huggingface")
    assert {t.dtype for t in export.values()} == {torch.float32}
    assert_same_tensors(merged(capsys, step, tmp_path / "o", "--dtype", "fp32"), export)


def test_lora_step_merges_as_verls_rank_files_and_its_merged_export(ws2_scenarios, tmp_path, capsys):
    """A LoRA actor: unmerged, the base model plus lora_adapter/ as our merge of verl's rank files of
    the same step; --merge_lora --dtype fp32: the save's own merged export (export_merge_lora, fp32)."""
    root = scenario_dir(ws2_scenarios, "lora_export")
    ours = merged(capsys, root / "incremental" / STEP, tmp_path / "unmerged")
    assert_same_tensors(ours, merged(capsys, root / "verl" / STEP, tmp_path / "verl"))
    assert_same_tensors(
        dir_tensors(tmp_path / "unmerged" / "lora_adapter"), dir_tensors(tmp_path / "verl" / "lora_adapter")
    )
    step = root / "incremental_merged_fp32" / STEP
    assert_same_tensors(
        merged(capsys, step, tmp_path / "merged", "--merge_lora", "--dtype", "fp32"), dir_tensors(step / "huggingface")
    )


def test_critic_step_merges_to_the_models_state_dict(ws2_scenarios, tmp_path, capsys):
    """verl's critic (value head `score`), saved without an export: fp32 equals the model's own full
    state dict and loads as a token classifier; bf16 equals our merge of verl's rank files of the step;
    verl's `python -m verl.model_merger merge` of the step is the same merge."""
    from transformers import AutoModelForTokenClassification

    root = scenario_dir(ws2_scenarios, "critic_save")
    step = root / "incremental" / "global_step_1" / "critic"
    assert not list((step / "huggingface").glob("*.safetensors"))
    full = torch.load(root / "full_state.pt")
    ours = merged(capsys, step, tmp_path / "fp32", "--dtype", "fp32")
    assert "score.weight" in ours
    assert_same_tensors(ours, full)
    loaded = AutoModelForTokenClassification.from_pretrained(tmp_path / "fp32", dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in full.items())
    bf16 = merged(capsys, step, tmp_path / "bf16")
    assert_same_tensors(bf16, merged(capsys, root / "verl" / "global_step_1" / "critic", tmp_path / "verl_bf16"))
    import sys

    proc = run(
        [
            sys.executable,
            "-m",
            "verl.model_merger",
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(step),
            "--target_dir",
            str(tmp_path / "verl_cmd"),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_tensors(dir_tensors(tmp_path / "verl_cmd"), bf16)


def test_bad_steps_are_refused_in_one_line(ws2_scenarios, tmp_path, capsys):
    """No slimckpt_resume.json (a save that never finished), a .distcp file altered after the commit,
    and a save_lora_only step (no base weights): one line each, nothing committed."""
    step = scenario_dir(ws2_scenarios, "hf_export") / "llama" / "sync" / STEP
    uncommitted = shutil.copytree(step, tmp_path / "uncommitted" / STEP)
    (uncommitted / "slimckpt_resume.json").unlink()
    line = refusal(capsys, uncommitted, tmp_path / "o1")
    assert "slimckpt_resume.json" in line and "never finished" in line and "merge an earlier" in line

    damaged = shutil.copytree(step, tmp_path / "damaged" / STEP)
    distcp = damaged / "dcp" / "__1_0.distcp"
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0xFF
    distcp.write_bytes(bytes(data))
    line = refusal(capsys, damaged, tmp_path / "o2")
    assert str(distcp) in line and "damaged" in line

    lora_root = scenario_dir(ws2_scenarios, "lora_only") / "lora_only"
    lora_only = next(p for p in sorted(lora_root.glob("global_step_*/actor")) if (p / "slimckpt_resume.json").exists())
    line = refusal(capsys, lora_only, tmp_path / "o3")
    assert "save_lora_only" in line and "no base weights" in line and "model.path" in line
