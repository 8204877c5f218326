"""`slimckpt plan`: what a checkpoint will cost, per rank, before a GPU is allocated.

    slimckpt plan --config path/to/config.json --world-size 64 [--recipe incremental] [--disk-gbps 2]
                  [--max-actor-ckpt-to-keep 2] [--max-critic-ckpt-to-keep 2 --critic]
                  [--storage s3 [--upload-gbps 10] [--s3-part-mb 32] [--s3-concurrency 4]]
    python -m slimckpt.plan ...   (the same)

From the model config alone (a meta-device model: shapes, no weights) it prints, for verl's
default save, verl's save with `hf_model`, and each slimckpt recipe: the bytes each rank writes
(fp32 model shard, AdamW's two fp32 moments, extra state), the host memory a rank needs for the
save, the time at the given aggregate disk bandwidth, and how long training is blocked; then the
peak disk under retention and the Hugging Face export's file layout. With a recipe's
keep_optimizer_last / keep_best (`--set keep_optimizer_last=1 --set keep_best=2`) a second table
splits the steps held into whole ones and ones without their optimizer state, next to the same
retention with the optimizer in every kept step and with keep_optimizer_last=1. `--critic` counts
a PPO critic's checkpoints; `--lora-rank R` (with verl's lora_alpha / target_modules /
exclude_modules / target_parameters keys) plans a LoRA actor. `--storage s3` adds, per row that can
save to an s3:// bucket (the incremental tier's), the bytes uploaded, the time until the step is
committed at `--upload-gbps` and the upload's host memory, and the same for `slimckpt merge` of the
HF model to s3://.

The arithmetic is in slimckpt.plan.cost (slimckpt.plan.upload for an object store), the model
in slimckpt.plan.meta_model, the report in slimckpt.plan.build, the tables in slimckpt.plan.printers.
"""

from __future__ import annotations

import argparse
import json
import sys

from slimckpt.plan.build import build_report
from slimckpt.plan.printers import print_report
from slimckpt.plan.upload import DEFAULT_CONCURRENCY, DEFAULT_PART_MB, DEFAULT_UPLOAD_GBPS, SLACK_BYTES

HELP = "predict per-rank checkpoint bytes, host memory and time from a model config (no weights)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the model's Hugging Face config.json (or its directory)")
    p.add_argument("--world-size", type=int, required=True, help="FSDP ranks of the actor (GPUs)")
    p.add_argument(
        "--recipe",
        action="append",
        default=None,
        help="a slimckpt recipe to compare (repeatable; default: all of them)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe's checkpoint key, e.g. --set async_save=true --set host_memory_budget_gb=32; "
        "trainer.max_actor_ckpt_to_keep=N and trainer.max_critic_ckpt_to_keep=N set retention",
    )
    p.add_argument(
        "--max-actor-ckpt-to-keep",
        dest="max_actor_ckpt_to_keep",
        default=None,
        metavar="N",
        help="trainer.max_actor_ckpt_to_keep for every row's peak disk (none: keep every step; "
        "default: each row's own, a recipe's value or verl's null)",
    )
    p.add_argument(
        "--max-critic-ckpt-to-keep",
        dest="max_critic_ckpt_to_keep",
        default=None,
        metavar="N",
        help="trainer.max_critic_ckpt_to_keep, the same for the critic (with --critic)",
    )
    p.add_argument(
        "--critic",
        action="store_true",
        help="the run has a critic (PPO with GAE): count its checkpoints in the peak disk",
    )
    p.add_argument(
        "--disk-gbps",
        type=float,
        default=None,
        help="aggregate write bandwidth of the checkpoint storage, GB/s (10^9), for the time column",
    )
    p.add_argument(
        "--storage",
        choices=["posix", "s3"],
        default="posix",
        help="where the checkpoints go: posix (a directory: the disk columns) or s3 (an s3:// bucket: adds each "
        "save's upload, time to durable and upload buffers, beside the disk time; verl's own rank files, "
        "+recipe=quickstart and intermediate included, refuse s3://: incremental only, with export_hf=false: "
        "slimckpt merge uploads the HF model)",
    )
    p.add_argument(
        "--upload-gbps",
        type=float,
        default=None,
        help=f"with --storage s3: the whole job's bandwidth to the object store, GB/s (10^9), aggregate over all "
        f"nodes as --disk-gbps is (default {DEFAULT_UPLOAD_GBPS:g}: one 10 Gb/s link, conservative: what one "
        f"gateway to an on-premise store often gives; a bucket in the cluster's own cloud region usually takes "
        f"more: nodes x each node's share). slimckpt merge to s3:// gets one node's share",
    )
    p.add_argument(
        "--s3-part-mb",
        type=int,
        default=None,
        help=f"with --storage s3: multipart part size, MiB: the run's SLIMCKPT_S3_PART_MB (default "
        f"{DEFAULT_PART_MB}, the backend's); a rank holds part x concurrency + {SLACK_BYTES >> 20} MiB extra "
        f"while it uploads",
    )
    p.add_argument(
        "--s3-concurrency",
        type=int,
        default=None,
        help=f"with --storage s3: parts a rank holds at once: the run's SLIMCKPT_S3_CONCURRENCY (default "
        f"{DEFAULT_CONCURRENCY}, the backend's)",
    )
    p.add_argument(
        "--writer-gbps",
        type=float,
        default=None,
        help="write bandwidth one process gets writing alone, GB/s: rank 0 writing verl's hf_model export "
        "(default: --disk-gbps over the number of nodes, --gpus-per-node)",
    )
    p.add_argument(
        "--rollout-s",
        default=None,
        metavar="S[,S...]",
        help="async_save=stream: seconds from a save to the next optimizer step (rollout, reward, "
        "reference passes), comma separated; default: 0, 1/4, 1/2, 1 and 2 times the write time",
    )
    p.add_argument(
        "--copy-gbps",
        type=float,
        default=None,
        help="async_save=stream: device-to-host copy bandwidth per rank, GB/s, for the guard's copy time "
        "(without it the copy is shown in bytes)",
    )
    p.add_argument(
        "--offload",
        choices=["none", "param", "optimizer", "both"],
        default="none",
        help="verl's actor fsdp_config.param_offload / optimizer_offload of the run (both: the 70B "
        "launcher's); async_save=stream then reads the offload's host copies",
    )
    p.add_argument(
        "--fsdp",
        type=int,
        choices=[1, 2],
        default=1,
        help="FSDP version of the run: 1 = verl's strategy=fsdp (its default), 2 = strategy=fsdp2",
    )
    p.add_argument(
        "--device",
        choices=["accelerator", "cpu"],
        default="accelerator",
        help="where training holds the tensors: accelerator (GPUs, NPUs: a save copies them to host) "
        "or cpu (verl on CPU, SLIMCKPT_CPU=1: they are host memory already)",
    )
    p.add_argument(
        "--export-dtype",
        choices=["bf16", "fp16", "fp32"],
        default=None,
        help="HF listing's dtype (default: the export_dtype of the recipes that export, where they agree; else bf16)",
    )
    p.add_argument(
        "--max-shard-size",
        default=None,
        help="HF export file size limit, e.g. 5GB (default: the exporting recipes' max_shard_size, where "
        "they agree; else save_pretrained's, as verl uses)",
    )
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="a LoRA actor (verl's actor_rollout_ref.model.lora_rank): the base model frozen, only the "
        "adapter trained; its export adds lora_adapter/",
    )
    p.add_argument("--lora-alpha", type=float, default=16, help="verl's model.lora_alpha (reported only)")
    p.add_argument(
        "--lora-target-modules",
        default="all-linear",
        help="verl's model.target_modules: all-linear (its default; with transformers 5 peft also adapts "
        "fused MoE experts and routers) or module names, comma separated",
    )
    p.add_argument("--lora-exclude-modules", default="", help="verl's model.exclude_modules, comma separated")
    p.add_argument(
        "--lora-target-parameters",
        default="",
        help="verl's model.target_parameters (LoRA on nn.Parameters, e.g. fused experts), comma separated",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_node_arguments(p)


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """The node's side: ranks per node, its memory and verl's offload (plan_node)."""
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="ranks per node (trainer.n_gpus_per_node; default: the world size, at most 8)",
    )
    p.add_argument(
        "--node-memory-gb",
        type=float,
        default=None,
        help="host memory of a training node, GiB (default: this machine's); host_memory_budget_gb=auto "
        "and the per-node check use it",
    )
    p.add_argument(
        "--ref-param-offload",
        action="store_true",
        help="the run has a reference model with param_offload (its bf16 params on the host)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        report = build_report(args)
    except (FileNotFoundError, ValueError, OSError) as exc:
        if str(exc).startswith("slimckpt plan:"):
            print(str(exc).splitlines()[0], file=sys.stderr)
            return 2
        print(_cannot_plan(args, exc), file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - any config it cannot plan: one line, never a traceback
        print(_cannot_plan(args, exc), file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print_report(report)
    return 0


def _cannot_plan(args: argparse.Namespace, exc: BaseException) -> str:
    """One line for a config this command cannot plan: what failed, first line only."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"slimckpt plan: cannot plan {args.config}: {type(exc).__name__}: {first}".rstrip(": ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimckpt.plan", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))
