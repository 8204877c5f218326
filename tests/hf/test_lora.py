"""hf/lora: a LoRA checkpoint made in-process, streamed by `slimckpt merge` to what verl's merger writes (the
base model with peft's names undone, lora_adapter/), and --merge_lora of an adapter on fused experts refused
in one line. The LoRA checkpoints verl saves under torchrun: tests/merge/test_merge_lora.py."""

from __future__ import annotations

import json

import pytest
import torch

from slimckpt.layout.merge_manifest import verify
from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_tokenizer

from ..helpers.merge_cli import (
    assert_nothing_committed,
    error_line,
    log_lines,
    merge_cli,
    tiny_mixtral_config,
)
from ..helpers.merge_helpers import (
    adapter_config_fields,
    dir_tensors,
    synthetic_checkpoint,
    tiny_llama_config,
    tree_bytes,
    verl_merge,
)

slim_log = pytest.fixture(autouse=True, name="slim_log")(log_lines)


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
