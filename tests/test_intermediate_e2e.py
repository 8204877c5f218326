"""+recipe=intermediate inside verl 0.9.1's real trainer (CPU, 2 ranks): every actor save ends in
`huggingface/` safetensors streamed from the fresh shards by all ranks, equal tensor for tensor
to what verl's own merger makes of the same shards, loadable by from_pretrained, and committed
with a manifest."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from .test_cpu_e2e import CONSOLE, train_small

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("intermediate_e2e")
    ckpt = work / "ckpt"
    env = {"TINY_ASSETS": str(work / "assets"), "NPROC": "2", "ALGO": "grpo", "SLIMCKPT_MEASURE": "1"}
    text = train_small(work / "train.log", "+recipe=intermediate", "trainer.save_freq=1",
                       "trainer.total_training_steps=2", "trainer.test_freq=-1", CONSOLE,
                       f"trainer.default_local_dir={ckpt}", **env)
    return work, ckpt, text


def _tensors(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def test_every_actor_save_has_a_committed_hf_export(run):
    _work, ckpt, text = run
    for step in (1, 2):
        hf = ckpt / f"global_step_{step}" / "actor" / "huggingface"
        names = set(os.listdir(hf))
        assert {"config.json", "manifest.json", "tokenizer.json"} <= names, names
        assert any(n.endswith(".safetensors") for n in names)
        assert not (hf.parent / "huggingface.partial").exists()
        manifest = json.loads((hf / "manifest.json").read_text())
        assert manifest["files"], manifest
        assert not (ckpt / f"global_step_{step}" / "critic" / "huggingface" / "manifest.json").exists()
    assert "HF export" in text


def test_export_equals_verls_merger_and_loads(run):
    work, ckpt, _text = run
    actor = ckpt / "global_step_2" / "actor"
    reference = work / "verl_merged"
    proc = subprocess.run(
        [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(actor),
         "--target_dir", str(reference)],
        env={**os.environ, "SLIMCKPT_DISABLE": "1"}, capture_output=True, text=True, timeout=300)
    ours, theirs = _tensors(actor / "huggingface"), _tensors(reference)
    assert theirs, f"verl's merger wrote nothing (exit {proc.returncode}): {proc.stderr[-2000:]}"
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype == torch.bfloat16, name
        assert torch.equal(ours[name], tensor), name

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(actor / "huggingface")
    state = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(state[name].to(torch.bfloat16), tensor), name


def test_save_metrics_include_the_export(run):
    _work, ckpt, _text = run
    metrics = json.loads((ckpt / "global_step_1" / "actor" / "slimckpt_save_rank_0.json").read_text())
    assert metrics["recipe"] == "intermediate"
    assert metrics["bytes_written"] > 0
