"""The checkpoint engine writes one incremental step of a tiny FSDP2 Llama to a local dir and to an
`s3://` prefix (the same shards, the same step); run by tests/merge/test_remote.py:

    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.s3_engine_step \
        --local-dir D/global_step_1/actor --url s3://bucket/prefix/global_step_1/actor [--async-save stream]

Each rank builds the model (seeded), takes one AdamW step, and saves [model, optimizer, extra] through
`save.step_save.save_resume_state` with a SaveTarget built here; the caller's own files (verl writes
them: fsdp_config.json, huggingface/config.json) go through the storage of the path. With `--kill-at
upload` the process group is SIGKILLed while rank 0 has a rank file half uploaded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import slimckpt.save.modes.writer as resume_async
from slimckpt.options.checkpoint_options import CheckpointOptions
from slimckpt.save.step_save import save_resume_state
from slimckpt.save.target import SaveTarget, TargetState, fsdp_version_of
from slimckpt.storage import for_path
from slimckpt_testing.synthetic import tiny_llama_config


def _model(vocab: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=vocab, hidden_size=64, intermediate_size=96))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _side_files(config):
    def write(local_path: str, _contents: list[str]) -> None:
        if dist.get_rank() != 0:
            return
        store = for_path(local_path)
        fsdp = json.dumps({"FSDP_version": 2, "world_size": dist.get_world_size()}).encode()
        store.put_atomic(os.path.join(local_path, "fsdp_config.json"), fsdp)
        store.make_dirs(os.path.join(local_path, "huggingface"), exist_ok=True)
        store.put_atomic(os.path.join(local_path, "huggingface", "config.json"), config.to_json_string().encode())

    return write


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local-dir", default="", help="the step's role dir on local disk ('' for none)")
    parser.add_argument("--url", default="", help="the step's role dir on the object store ('' for none)")
    parser.add_argument("--async-save", default="off", choices=["off", "pool", "stream"])
    parser.add_argument("--kill-at", default="", choices=["", "upload"])
    parser.add_argument("--vocab", type=int, default=96, help="vocabulary size (the rank files grow with it)")
    return parser.parse_args(argv)


def _kill_mid_upload() -> None:
    """SIGKILL this rank's process group once its first multipart part is sent (rank 0)."""
    from slimckpt.storage import s3_upload

    sent = s3_upload.Upload.put_part

    def killing(self, *a, **kw):
        out = sent(self, *a, **kw)
        os.killpg(os.getpgid(0), signal.SIGKILL)
        return out

    s3_upload.Upload.put_part = killing


def run(args: argparse.Namespace) -> None:
    model = _model(args.vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + dist.get_rank())
    ids = torch.randint(0, args.vocab, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    options = CheckpointOptions(
        recipe="incremental", incremental_save=True, async_save=args.async_save, measure=False, export_hf=False
    )
    state = TargetState()
    target = SaveTarget(
        model=model,
        optimizer=optimizer,
        options=options,
        state=state,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        save_contents=["model", "optimizer", "extra"],
        fsdp_version=fsdp_version_of(model),
        get_rng_state=torch.get_rng_state,
        load_rng_state=torch.set_rng_state,
        side_files=_side_files(model.config),
    )
    if args.kill_at == "upload" and dist.get_rank() == 0:
        _kill_mid_upload()
    for path in (p for p in (args.local_dir, args.url) if p):
        save_resume_state(target, path, 1)
        resume_async.writer_for(state).wait()
    dist.barrier()
