"""`slimckpt plan ...` (and `python -m slimckpt.plan ...`): the command's arguments (wired in
slimckpt.cli); its run is slimckpt.plan.command, which loads the cost model (and torch)."""

# lazy imports: `slimckpt plan --help` and the argument errors answer before the cost model (and torch) is imported
from __future__ import annotations

import argparse

from slimckpt.cli_flags import Formatter, flag
from slimckpt.plan.assumed import DEFAULT_CONCURRENCY, DEFAULT_PART_MB, DEFAULT_UPLOAD_GBPS, SLACK_BYTES

HELP = "predict per-rank checkpoint bytes, host memory and time from a model config (no weights)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flag(p, "--config", required=True, help="the model's Hugging Face config.json (or its directory)")
    flag(p, "--world-size", type=int, required=True, help="FSDP ranks of the actor (GPUs)")
    flag(
        p,
        "--recipe",
        action="append",
        default=None,
        help="a slimckpt recipe to compare (repeatable; default: all of them)",
    )
    flag(
        p,
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe's checkpoint key, e.g. --set async_save=true --set host_memory_budget_gb=32; "
        "trainer.max_actor_ckpt_to_keep=N and trainer.max_critic_ckpt_to_keep=N set retention",
    )
    flag(
        p,
        "--max-actor-ckpt-to-keep",
        default=None,
        metavar="N",
        help="trainer.max_actor_ckpt_to_keep for every row's peak disk (none: keep every step; "
        "default: each row's own, a recipe's value or verl's null)",
    )
    flag(
        p,
        "--max-critic-ckpt-to-keep",
        default=None,
        metavar="N",
        help="trainer.max_critic_ckpt_to_keep, the same for the critic (with --critic)",
    )
    flag(
        p,
        "--critic",
        action="store_true",
        help="the run has a critic (PPO with GAE): count its checkpoints in the peak disk",
    )
    flag(
        p,
        "--disk-gbps",
        type=float,
        default=None,
        help="aggregate write bandwidth of the checkpoint storage, GB/s (10^9), for the time column",
    )
    flag(
        p,
        "--storage",
        choices=["posix", "s3"],
        default="posix",
        help="where the checkpoints go: posix (a directory: the disk columns) or s3 (an s3:// bucket: adds each "
        "save's upload, time to durable and upload buffers, beside the disk time; verl's own rank files, "
        "+recipe=quickstart and intermediate included, refuse s3://: incremental only, with export_hf=false: "
        "slimckpt merge uploads the HF model)",
    )
    flag(
        p,
        "--upload-gbps",
        type=float,
        default=None,
        help=f"with --storage s3: the whole job's bandwidth to the object store, GB/s (10^9), aggregate over all "
        f"nodes as --disk-gbps is (default {DEFAULT_UPLOAD_GBPS:g}: one 10 Gb/s link, conservative: what one "
        f"gateway to an on-premise store often gives; a bucket in the cluster's own cloud region usually takes "
        f"more: nodes x each node's share). slimckpt merge to s3:// gets one node's share",
    )
    flag(
        p,
        "--s3-part-mb",
        type=int,
        default=None,
        help=f"with --storage s3: multipart part size, MiB: the run's SLIMCKPT_S3_PART_MB (default "
        f"{DEFAULT_PART_MB}, the backend's); a rank holds part x concurrency + {SLACK_BYTES >> 20} MiB extra "
        f"while it uploads",
    )
    flag(
        p,
        "--s3-concurrency",
        type=int,
        default=None,
        help=f"with --storage s3: parts a rank holds at once: the run's SLIMCKPT_S3_CONCURRENCY (default "
        f"{DEFAULT_CONCURRENCY}, the backend's)",
    )
    flag(
        p,
        "--writer-gbps",
        type=float,
        default=None,
        help="write bandwidth one process gets writing alone, GB/s: rank 0 writing verl's hf_model export "
        "(default: --disk-gbps over the number of nodes, --gpus-per-node)",
    )
    flag(
        p,
        "--rollout-s",
        default=None,
        metavar="S[,S...]",
        help="async_save=stream: seconds from a save to the next optimizer step (rollout, reward, "
        "reference passes), comma separated; default: 0, 1/4, 1/2, 1 and 2 times the write time",
    )
    flag(
        p,
        "--copy-gbps",
        type=float,
        default=None,
        help="async_save=stream: device-to-host copy bandwidth per rank, GB/s, for the guard's copy time "
        "(without it the copy is shown in bytes)",
    )
    flag(
        p,
        "--offload",
        choices=["none", "param", "optimizer", "both"],
        default="none",
        help="verl's actor fsdp_config.param_offload / optimizer_offload of the run (both: the 70B "
        "launcher's); async_save=stream then reads the offload's host copies",
    )
    flag(
        p,
        "--fsdp",
        type=int,
        choices=[1, 2],
        default=1,
        help="FSDP version of the run: 1 = verl's strategy=fsdp (its default), 2 = strategy=fsdp2",
    )
    flag(
        p,
        "--device",
        choices=["accelerator", "cpu"],
        default="accelerator",
        help="where training holds the tensors: accelerator (GPUs, NPUs: a save copies them to host) "
        "or cpu (verl on CPU, SLIMCKPT_CPU=1: they are host memory already)",
    )
    flag(
        p,
        "--export-dtype",
        choices=["bf16", "fp16", "fp32"],
        default=None,
        help="HF listing's dtype (default: the export_dtype of the recipes that export, where they agree; else bf16)",
    )
    flag(
        p,
        "--max-shard-size",
        default=None,
        help="HF export file size limit, e.g. 5GB (default: the exporting recipes' max_shard_size, where "
        "they agree; else save_pretrained's, as verl uses)",
    )
    flag(
        p,
        "--trust-remote-code",
        action="store_true",
        help="build a model whose config.json names code transformers does not ship (auto_map), from the "
        "config's directory, as merge --trust-remote-code does",
    )
    flag(
        p,
        "--lora-rank",
        type=int,
        default=0,
        help="a LoRA actor (verl's actor_rollout_ref.model.lora_rank): the base model frozen, only the "
        "adapter trained; its export adds lora_adapter/",
    )
    flag(p, "--lora-alpha", type=float, default=16, help="verl's model.lora_alpha (reported only)")
    flag(
        p,
        "--lora-target-modules",
        default="all-linear",
        help="verl's model.target_modules: all-linear (its default; with transformers 5 peft also adapts "
        "fused MoE experts and routers) or module names, comma separated",
    )
    flag(p, "--lora-exclude-modules", default="", help="verl's model.exclude_modules, comma separated")
    flag(
        p,
        "--lora-target-parameters",
        default="",
        help="verl's model.target_parameters (LoRA on nn.Parameters, e.g. fused experts), comma separated",
    )
    flag(p, "--json", action="store_true", help="print JSON instead of tables")
    add_node_arguments(p)


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """The node's side: ranks per node, its memory and verl's offload (plan_node)."""
    flag(
        p,
        "--gpus-per-node",
        type=int,
        default=None,
        help="ranks per node (trainer.n_gpus_per_node; default: the world size, at most 8)",
    )
    flag(
        p,
        "--node-memory-gb",
        type=float,
        default=None,
        help="host memory of a training node, GiB (default: this machine's); host_memory_budget_gb=auto "
        "and the per-node check use it",
    )
    flag(
        p,
        "--ref-param-offload",
        action="store_true",
        help="the run has a reference model with param_offload (its bf16 params on the host)",
    )


def run(args: argparse.Namespace) -> int:
    from slimckpt.plan.command import run as plan_command

    return plan_command(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimckpt.plan", description=HELP, formatter_class=Formatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
