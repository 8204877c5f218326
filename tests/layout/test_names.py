"""layout/names: the on-disk names and dtype tables every wing takes, checked against what torch,
safetensors and verl 0.9.1 themselves say."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save as st_save
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

from slimckpt.layout import names

KEYS = [
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight",
    "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
    "base_model.model.model.embed_tokens.lora_embedding_A.default",
    "base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector.default.weight",
    "base_model.model.model.layers.0.mlp.up_proj.adapter_gate.weight",
    "base_model.model.model.layers.0.mlp.up_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


@pytest.mark.parametrize("key", KEYS)
def test_a_lora_key_is_what_verls_checkpoint_manager_calls_one(key):
    # verl's save_lora_only keeps, and its loader accepts as LoRA-only, exactly these keys
    assert names.is_lora_key(key) == BaseCheckpointManager.is_lora_only_state_dict({key: None})


@pytest.mark.parametrize("name", sorted(names.SAFETENSORS_OF_TORCH))
def test_each_torch_dtype_is_written_by_safetensors_under_its_name_and_width(name):
    dtype = getattr(torch, name)
    blob = st_save({"t": torch.zeros(3, dtype=dtype)})
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    st_name = names.SAFETENSORS_OF_TORCH[name]
    assert header["t"]["dtype"] == st_name
    width = torch.empty((), dtype=dtype).element_size()
    assert names.DTYPE_BYTES[st_name] == width == names.TORCH_ITEMSIZE[name]
    assert names.by_torch_dtype(torch)[dtype] == st_name


def test_the_dtype_choices_name_one_dtype_in_every_table():
    as_torch = names.torch_dtypes_of_choices(torch)
    assert set(as_torch) == set(names.DTYPE_CHOICES) == {"bf16", "fp16", "fp32"}
    for choice, dtype in as_torch.items():
        assert names.by_torch_dtype(torch)[dtype] == names.DTYPE_CHOICES[choice]
    from slimckpt.engine import share_writer

    assert share_writer.OUT_DTYPES == as_torch


def test_the_tables_load_without_torch():
    code = "import sys; import slimckpt.layout.names, slimckpt.engine.pt_index; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_one_chunk_default_for_the_merge_and_its_writer():
    from slimckpt.engine import share_writer
    from slimckpt.merge import cli
    from slimckpt.merge.plan import MergeOptions

    assert MergeOptions("a", "b").chunk_bytes == share_writer.DEFAULT_CHUNK_BYTES == names.DEFAULT_CHUNK_BYTES
    assert cli.DEFAULT_CHUNK_MB << 20 == names.DEFAULT_CHUNK_BYTES
