"""The names slimckpt reads and writes on disk, and the dtype tables between them: the one place
save, merge, convert and verify take a directory name, a dtype choice or a safetensors dtype from.

Torch-free (the `.pt` index and the torch-free commands import it): torch dtypes are named
here by their torch name ("bfloat16"), and `by_torch_dtype(torch)` builds the torch-keyed table
in a module that has torch already.
"""

from __future__ import annotations

from types import ModuleType

# ---------------------------------------------------------------- directories and files of a step
HF_SUBDIR = "huggingface"  # a role dir's HF model: verl's hf_model save, slimckpt's export
FSDP_CONFIG = "fsdp_config.json"  # verl's record of a role dir's FSDP version and world size
DCP_DIR = "dcp"  # the incremental tier's torch.distributed.checkpoint files: __{rank}_{i}.distcp, .metadata
MODEL_PREFIX = "model."  # the model's keys in those files: the save's {"model": ..., "optim": ...}, flattened with "."
SHARD_CONTENTS = ("model", "optimizer", "extra")  # the save/load_contents kinds held in a rank's shards
LORA_ADAPTER_DIR = "lora_adapter"  # verl's merger's output for a peft actor: the adapter beside the base
LORA_ADAPTER_CONFIG = "adapter_config.json"
LORA_ADAPTER_WEIGHTS_PATTERN = LORA_ADAPTER_DIR + "/adapter_model{suffix}.safetensors"
LORA_TRAIN_META = "lora_train_meta.json"  # verl's manager writes the adapter's r and lora_alpha beside the rank files

# ---------------------------------------------------------------- LoRA keys
LORA_MARKS = ("lora_", ".adapter_")


def is_lora_key(name: str) -> bool:
    """A peft adapter's state-dict key, as verl 0.9.1 tells them: `fsdp_utils._is_lora_key`, what
    `save_lora_only` keeps and `is_lora_only_state_dict` accepts. (Its merger's own split tests
    "lora_" alone; peft's LoRA keys all hold it, so the two differ only for another tuner's keys.)"""
    return any(mark in name for mark in LORA_MARKS)


# ---------------------------------------------------------------- dtypes
# the --dtype / export_dtype choices -> safetensors' names and torch's names
DTYPE_CHOICES: dict[str, str] = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
TORCH_NAME_OF_CHOICE: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# safetensors' Dtype enum in declaration order: its serializer sorts tensors by this order,
# descending, then by name. Sub-byte dtypes (F4, F6_*) are listed for ordering only.
DTYPE_ORDER: tuple[str, ...] = (
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
)
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}

# torch's dtype name (str(dtype) without "torch.") -> its safetensors name, for the dtypes a
# checkpoint tensor is written in as it is
SAFETENSORS_OF_TORCH: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
}
TORCH_OF_SAFETENSORS: dict[str, str] = {v: k for k, v in SAFETENSORS_OF_TORCH.items()}

# torch's dtype globals as pickled (`torch float32`) -> itemsize
TORCH_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "float8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2fnuz": 1,
    "float8_e4m3fnuz": 1,
    "float8_e8m0fnu": 1,
}


def by_torch_dtype(torch: ModuleType, table: dict[str, str] = SAFETENSORS_OF_TORCH) -> dict:
    """`table` keyed by torch's dtype objects (dtypes this torch lacks left out); the caller passes
    the torch module it has imported, so this module stays torch-free."""
    return {getattr(torch, name): value for name, value in table.items() if hasattr(torch, name)}


def torch_dtypes_of_choices(torch: ModuleType) -> dict:
    """{"bf16": torch.bfloat16, ...}: the --dtype / export_dtype choices as torch dtypes."""
    return {choice: getattr(torch, name) for choice, name in TORCH_NAME_OF_CHOICE.items()}


# ---------------------------------------------------------------- sizes
# Source bytes per chunk of the merge's cast-and-write (and of the readers that hash files in
# chunks): 2 MiB, the value BENCHMARKS.md's merge figures were taken with (the reasons and the
# timings behind it are there).
DEFAULT_CHUNK_BYTES = 2 << 20
