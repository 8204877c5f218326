"""Check a merged Hugging Face directory against the FSDP shards it came from, one tensor at a time.

    python -m slimckpt_testing.merge_check --shards CKPT/actor --merged OUT

The rank files are opened memory-mapped (their pages are the kernel's to drop, not the checker's
anonymous memory); each output tensor is compared with every rank's block of it, cast to the
output's dtype, and let go before the next. Memory stays about one rank's block of the largest
tensor, whatever the model's size.
"""

# lazy imports: torch and safetensors only when a merge is checked (`--help` stays torch-free)
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from dataclasses import dataclass, field

from slimckpt.internals import dtensor_box


@dataclass
class CheckResult:
    tensors: int = 0
    elements: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.tensors > 0


def adapter_config_fields(raw: bytes) -> dict:
    """An adapter_config.json's fields, target_modules sorted. verl's merger and peft both pass that
    field through Python sets, whose order follows the string hashes (PYTHONHASHSEED, and on a
    collision the order the names went in), so one merge may list the same modules in another order
    than the next; peft reads the field back as a set."""
    d = json.loads(raw)
    if isinstance(d.get("target_modules"), list):
        d["target_modules"] = sorted(d["target_modules"])
    return d


def _rank_files(shards: str) -> list[str]:
    files = glob.glob(os.path.join(shards, "model_world_size_*_rank_*.pt"))
    return sorted(files, key=lambda p: int(re.search(r"_rank_(\d+)\.pt$", p).group(1)))


def _blocks(value):
    """(local tensor, global shape, global offset) of one rank's entry: a DTensor's block, or a
    plain tensor every rank holds whole."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        _, offset = dtensor_box(value)
        return value.to_local(), tuple(value.shape), tuple(offset)
    return value, tuple(value.shape), (0,) * value.dim()


def check_merged(shards: str, merged: str) -> CheckResult:
    """Every tensor of `merged` equal to the shards' (each rank's block in place), every shard key
    present in `merged` unless the config ties it to the embedding."""
    import torch
    from safetensors import safe_open

    result = CheckResult()
    ranks = [torch.load(path, map_location="cpu", mmap=True, weights_only=False) for path in _rank_files(shards)]
    if not ranks:
        result.problems.append(f"{shards}: no model_world_size_*_rank_*.pt files")
        return result
    outputs: dict[str, str] = {}
    for path in sorted(glob.glob(os.path.join(merged, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            outputs.update({name: path for name in f.keys()})
    config_path = os.path.join(merged, "config.json")
    tied = os.path.exists(config_path) and json.load(open(config_path)).get("tie_word_embeddings", False)
    expected = set(ranks[0])
    if tied:
        expected.discard("lm_head.weight")
    for name in sorted(expected - set(outputs)):
        result.problems.append(f"{name}: in the shards, not in {merged}")
    for name in sorted(set(outputs) - expected):
        result.problems.append(f"{name}: in {merged}, not in the shards")
    for name in sorted(expected & set(outputs)):
        with safe_open(outputs[name], framework="pt") as f:
            view = f.get_slice(name)
            full_shape = tuple(view.get_shape())
            for rank, state in enumerate(ranks):
                local, shape, offset = _blocks(state[name])
                if shape != full_shape:
                    result.problems.append(f"{name}: shape {full_shape} in the output, {shape} in rank {rank}")
                    break
                if local.numel() == 0:
                    continue
                index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
                got = view[index] if index else f.get_tensor(name)
                if not torch.equal(got, local.to(got.dtype)):
                    bad = (got.float() != local.to(got.dtype).float()).sum().item()
                    result.problems.append(f"{name}: rank {rank}'s block differs in {bad} of {local.numel()} elements")
                    break
                del got
        result.tensors += 1
        result.elements += int(torch.Size(full_shape).numel())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slimckpt_testing.merge_check", description=__doc__.splitlines()[0])
    p.add_argument("--shards", required=True, help="the checkpoint's actor dir (model_world_size_*_rank_*.pt)")
    p.add_argument("--merged", required=True, help="the merged Hugging Face dir (*.safetensors)")
    args = p.parse_args(argv)
    result = check_merged(args.shards, args.merged)
    print(
        json.dumps(
            {"ok": result.ok, "tensors": result.tensors, "elements": result.elements, "problems": result.problems[:20]}
        )
    )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
