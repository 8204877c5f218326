"""The plan of one run: `slimckpt plan`'s arguments (or the namespace a dry run reads off its composed
config) turned into the report, one dict (what `--json` prints and slimckpt.plan.printers shows).

The rows: verl's default save, verl's save with `hf_model`, and each slimckpt recipe asked for (its
actor checkpoint block, `--set` overrides on top); per row cost.estimate's bytes, host memory, time
and blocking, the peak disk under retention for the actor (and the critic with `--critic`), and the
node's verdict (node.node_rows) with host_memory_budget_gb=auto resolved for that node.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

import yaml

from slimckpt.plan.cost import (
    VERL_CONTENTS,
    ParamSpec,
    Strategy,
    critic_params,
    estimate,
    keep_choices,
    largest_shard_bytes,
    listing_format,
    model_shard_bytes,
    optim_shard_bytes,
    optim_total,
    parse_keep,
    peak_disk,
    resolve_auto_budget,
    retention_disk,
    shard_rows,
)
from slimckpt.plan.meta_model import LoraSpec, ModelFacts, extra_state_bytes, model_facts
from slimckpt.plan.node import Offload, node_rows, resident_bytes
from slimckpt.plan.resume_time import resume_times
from slimckpt.plan.upload import UploadSettings, merge_upload, rank_share, refused, save_upload, upload_settings
from slimckpt.storage.s3 import S3Storage
from slimckpt.verl.recipes import list_group


def recipe_strategies(names: Sequence[str] | None, overrides: Sequence[str] = ()) -> list[Strategy]:
    """The actor checkpoint config of each recipe, with `key=value` overrides applied to all."""
    options = {o.name: o for o in list_group("recipe")}
    chosen = list(names) if names else sorted(options)
    unknown = [n for n in chosen if n not in options]
    if unknown:
        raise ValueError(f"slimckpt plan: no recipe {unknown[0]!r}; known: {', '.join(sorted(options))}")
    extra = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"slimckpt plan: --set {item!r}: use KEY=VALUE, e.g. --set async_save=true")
        extra[key.strip()] = yaml.safe_load(value)
    suffix = "".join(f" {k}={v}" for k, v in extra.items())
    out = []
    for name in chosen:
        data = yaml.safe_load(options[name].path.read_text()) or {}
        cfg = ((data.get("actor_rollout_ref") or {}).get("actor") or {}).get("checkpoint") or {}
        trainer = data.get("trainer") or {}
        strategy = Strategy.from_checkpoint_config(f"+recipe={name}{suffix}", {**cfg, **extra})
        out.append(
            replace(
                strategy,
                actor_keep=parse_keep("trainer.max_actor_ckpt_to_keep", trainer.get("max_actor_ckpt_to_keep")),
                critic_keep=parse_keep("trainer.max_critic_ckpt_to_keep", trainer.get("max_critic_ckpt_to_keep")),
            )
        )
    return out


def plan_strategies(args: argparse.Namespace) -> list[Strategy]:
    """verl's two rows and the recipes asked for, with the retention overrides of `args`."""
    keep_given, overrides = retention_overrides(args)  # a bad value fails before the model is built
    strategies = [Strategy("verl default"), Strategy("verl + hf_model", contents=(*VERL_CONTENTS, "hf_model"))]
    strategies += recipe_strategies(args.recipe, overrides)
    return [replace(s, **keep_given) for s in strategies]


def plan_facts(args: argparse.Namespace, strategies: Sequence[Strategy] | None = None) -> ModelFacts:
    """The model's facts for these arguments (a meta model: the slow part of a plan), its HF listing
    in the dtype and file size the planned recipes export."""
    strategies = plan_strategies(args) if strategies is None else strategies
    dtype, shard_size = listing_format(strategies, args.export_dtype, args.max_shard_size)
    return model_facts(args.config, dtype, shard_size, args.trust_remote_code, lora_spec(args))


def build_report(args: argparse.Namespace, facts: ModelFacts | None = None) -> dict[str, Any]:
    """The plan; `facts` from plan_facts(args) when a caller plans one model more than once."""
    if args.world_size < 1:
        raise ValueError("slimckpt plan: --world-size must be >= 1")
    upload = storage_settings(args)  # a bad value fails before the model is built
    strategies = plan_strategies(args)
    facts = plan_facts(args, strategies) if facts is None else facts
    extra = extra_state_bytes()
    fsdp = int(getattr(args, "fsdp", 1))
    device = str(getattr(args, "device", "accelerator"))
    with_critic = bool(getattr(args, "critic", False))
    node = node_context(args, facts.params)
    strategies = [
        resolve_auto_budget(s, node["memory_bytes"], node["local_ranks"], node["resident_bytes"]) for s in strategies
    ]
    offload = offload_of(args)
    writer = writer_bandwidth(args, node["local_ranks"])
    estimates = []
    for s in strategies:
        e = asdict(
            estimate(
                facts.params,
                args.world_size,
                s,
                extra,
                facts.hf_bytes,
                args.disk_gbps,
                fsdp,
                facts.hf_dtype,
                rollout_windows(args),
                getattr(args, "copy_gbps", None),
                offload.actor_kinds,
                device,
                writer["gbps"],
            )
        )
        if facts.split_on_save and s.incremental and s.export_hf:
            e["notes"].append("fused MoE experts split on save: each rank writes its rows of every per-expert tensor")
        e["peak_disk"] = {"actor": peak_disk(e["total_write_bytes"] + e["hf_export_bytes"], s.actor_keep)}
        slim = s.name.startswith("+recipe=")  # verl's own retention has no keep_optimizer_last / keep_best
        optim = optim_total(facts.params, args.world_size, s)
        e["retention_disk"] = {
            "actor": [
                retention_disk(e["total_write_bytes"] + e["hf_export_bytes"], optim, s.actor_keep, last, s.keep_best)
                for last in keep_choices(s, optim)
            ]
            if slim
            else []
        }
        if s.incremental:
            e["resume_times"] = resume_times(e["total_write_bytes"], args.world_size, args.disk_gbps, writer["gbps"])
        if with_critic:  # the critic saves the same contents, never an HF export
            critic = replace(s, contents=tuple(c for c in s.contents if c != "hf_model"), export_hf=False)
            c = estimate(critic_params(facts.params), args.world_size, critic, extra, 0, None, fsdp, device=device)
            e["peak_disk"]["critic"] = peak_disk(c.total_write_bytes, s.critic_keep)
            c_optim = optim_total(critic_params(facts.params), args.world_size, critic)
            e["retention_disk"]["critic"] = (
                [
                    retention_disk(c.total_write_bytes, c_optim, s.critic_keep, last, s.keep_best)
                    for last in keep_choices(s, c_optim)
                ]
                if slim
                else []
            )
            e["critic_host_peak_bytes"] = c.host_peak_bytes
        estimates.append(e)
    report = {
        "config": args.config,
        "world_size": args.world_size,
        "fsdp": fsdp,
        "offload": list(offload.actor_kinds),
        "device": device,
        "parameters": facts.total_parameters,
        "tied": facts.tied,
        "split_on_save": {"fused_tensors": len(facts.split_on_save), "outputs": sum(facts.split_on_save.values())},
        "lora": facts.lora,
        "vision_parameters": facts.vision_parameters,
        "fp32_model_bytes": sum(p.nbytes for p in facts.params),
        "rank0_model_shard_bytes": model_shard_bytes(facts.params, args.world_size, 0),
        "rank0_optimizer_shard_bytes": optim_shard_bytes(facts.params, args.world_size, 0),
        "extra_bytes_per_rank": extra,
        "largest_tensor_shard_bytes": largest_shard_bytes(facts.params, args.world_size, 0),
        "hf_export": {
            "dtype": facts.hf_dtype,
            "max_shard_size": facts.max_shard_size,
            "files": [{"name": n, "bytes": b} for n, b in facts.hf_files],
            "bytes": facts.hf_bytes,
        },
        "disk_gbps": args.disk_gbps,
        "writer": writer,
        "estimates": estimates,
        "critic": with_critic,
        "node": node,
        "node_rows": node_rows(node, estimates, getattr(args, "copy_gbps", None)),
    }
    if upload is not None:  # only then: a POSIX plan's report stays as it was
        report["storage"] = "s3"
        report["s3"] = s3_report(args, upload, strategies, estimates, facts, node["local_ranks"])
    return report


def storage_settings(args: argparse.Namespace) -> UploadSettings | None:
    """--storage s3's upload settings; None for POSIX (where the upload options are refused)."""
    storage = getattr(args, "storage", "posix") or "posix"
    given = {
        "--upload-gbps": getattr(args, "upload_gbps", None),
        "--s3-part-mb": getattr(args, "s3_part_mb", None),
        "--s3-concurrency": getattr(args, "s3_concurrency", None),
    }
    if storage != "s3":
        option = next((k for k, v in given.items() if v is not None), None)
        if option:
            raise ValueError(f"slimckpt plan: {option} plans an upload to an object store: add --storage s3")
        return None
    return upload_settings(*given.values())


def s3_report(
    args: argparse.Namespace,
    upload: UploadSettings,
    strategies: Sequence[Strategy],
    estimates: list[dict[str, Any]],
    facts: ModelFacts,
    local_ranks: int,
) -> dict[str, Any]:
    """Each row's upload to s3:// (estimate["s3"]; verl's rank files refused), and the settings and
    `slimckpt merge`'s upload of the HF model, for the report."""
    world = args.world_size
    rank0_model, full_model = model_shard_bytes(facts.params, world, 0), sum(p.nbytes for p in facts.params)
    for s, e in zip(strategies, estimates):
        if not s.incremental:
            e["s3"] = refused()
            continue
        e["s3"] = save_upload(
            e["rank0_write_bytes"],
            e["total_write_bytes"],
            rank_share(e["hf_export_bytes"], rank0_model, full_model),
            e["hf_export_bytes"],
            -(-e["rank0_write_bytes"] // max(1, s.write_threads)),  # DCP: a file per rank and write thread
            e["host_peak_bytes"],
            upload,
            S3Storage.supports_inplace_writes,  # the in-training export writes in place (save.step_save)
            max(1, s.write_threads),
        )
    nodes = -(-world // max(1, local_ranks))
    merge_gbps = upload.gbps / nodes
    source = "--upload-gbps" if upload.gbps_source == "--upload-gbps" else "the default"
    source = f"{source}, one node" if nodes == 1 else f"{source} over {nodes} nodes"
    largest = max((b for _, b in facts.hf_files), default=0)
    return {
        "upload_gbps": upload.gbps,
        "upload_gbps_source": upload.gbps_source,
        "part_bytes": upload.part_bytes,
        "concurrency": upload.concurrency,
        "upload_buffer_bytes": upload.buffer_bytes,
        "merge": {"dtype": facts.hf_dtype, **merge_upload(facts.hf_bytes, largest, merge_gbps, source, upload)},
    }


def node_memory_bytes(given_gb: float | None) -> tuple[int, str]:
    """The training node's RAM: given, or this machine's MemTotal (the head node is a training node
    in verl's multi-node set-up)."""
    if given_gb:
        return int(float(given_gb) * 2**30), "given"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024, "this machine's MemTotal"
    raise ValueError("slimckpt plan: cannot read this machine's memory; pass --node-memory-gb")


def offload_of(args: argparse.Namespace) -> Any:
    """verl's offload switches of the run (node.Offload): `--offload` for the actor (and the
    critic unless the namespace says otherwise, as a dry run's does)."""
    choice = getattr(args, "offload", "none") or "none"
    param = choice in ("param", "both") or bool(getattr(args, "param_offload", False))
    optim = choice in ("optimizer", "both") or bool(getattr(args, "optimizer_offload", False))
    critic_param = bool(getattr(args, "critic_param_offload", param))
    critic_optim = bool(getattr(args, "critic_optimizer_offload", optim))
    return Offload(
        actor_param=param,
        actor_optimizer=optim,
        critic_param=critic_param,
        critic_optimizer=critic_optim,
        ref_param=bool(getattr(args, "ref_param_offload", False)),
        critic=bool(getattr(args, "critic", False)),
        ref=bool(getattr(args, "ref_param_offload", False)),
    )


def node_context(args: argparse.Namespace, params: Sequence[ParamSpec]) -> dict[str, Any]:
    """Ranks per node, the node's memory and what verl's offload keeps on the host per rank."""
    world = args.world_size
    given_ranks = getattr(args, "gpus_per_node", None)
    ranks = int(given_ranks) if given_ranks else min(world, 8)
    memory, source = node_memory_bytes(getattr(args, "node_memory_gb", None))
    offload = offload_of(args)
    trainable = [p for p in params if p.trainable]
    elements = sum(shard_rows(p.rows, world, 0) * p.row_bytes // p.itemsize for p in trainable)
    critic = critic_params(params) if offload.critic else []
    critic_elements = sum(shard_rows(p.rows, world, 0) * p.row_bytes // p.itemsize for p in critic)
    resident = resident_bytes(
        model_shard_bytes(params, world, 0), elements, model_shard_bytes(critic, world, 0), critic_elements, offload
    )
    return {
        "local_ranks": ranks,
        "local_ranks_given": bool(given_ranks),
        "memory_bytes": memory,
        "memory_source": source,
        "offload": asdict(offload),
        "resident": resident,
        "resident_bytes": sum(resident.values()),
    }


def writer_bandwidth(args: argparse.Namespace, local_ranks: int) -> dict[str, Any]:
    """What one process writing alone gets (rank 0 writing verl's hf_model export): --writer-gbps,
    else one node's share of --disk-gbps (a lone writer is held to its node's link)."""
    given = getattr(args, "writer_gbps", None)
    if given is not None:
        if given <= 0:
            raise ValueError(f"slimckpt plan: --writer-gbps {given:g}: give a bandwidth above 0 GB/s")
        return {"gbps": float(given), "source": "--writer-gbps"}
    if not args.disk_gbps:
        return {"gbps": None, "source": None}
    nodes = -(-args.world_size // max(1, local_ranks))
    if nodes == 1:
        return {"gbps": float(args.disk_gbps), "source": "--disk-gbps, one node"}
    return {"gbps": args.disk_gbps / nodes, "source": f"--disk-gbps over {nodes} nodes"}


def rollout_windows(args: argparse.Namespace) -> list[float] | None:
    given = getattr(args, "rollout_s", None)
    if not given:
        return None
    try:
        windows = [float(x) for x in str(given).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"slimckpt plan: --rollout-s {given!r}: give seconds, comma separated, e.g. 30,60") from None
    if any(w < 0 for w in windows):
        raise ValueError(f"slimckpt plan: --rollout-s {given!r}: windows are 0 or more seconds")
    return windows


def lora_spec(args: argparse.Namespace) -> LoraSpec | None:
    rank = int(getattr(args, "lora_rank", 0) or 0)
    if not rank:
        return None
    targets = str(getattr(args, "lora_target_modules", "all-linear") or "all-linear")

    def items(attr: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in str(getattr(args, attr, "") or "").split(",") if x.strip())

    return LoraSpec(
        rank=rank,
        alpha=float(getattr(args, "lora_alpha", 16)),
        exclude_modules=items("lora_exclude_modules"),
        target_parameters=items("lora_target_parameters"),
        target_modules=targets if targets == "all-linear" else tuple(t.strip() for t in targets.split(",")),
    )


def retention_overrides(args: argparse.Namespace) -> tuple[dict[str, int | None], list[str]]:
    """The retention keys given (options or `--set trainer.max_*_ckpt_to_keep=N`), as Strategy
    fields; and the other --set items, for the recipes."""
    given: dict[str, int | None] = {}
    rest: list[str] = []
    for item in getattr(args, "overrides", ()) or ():
        key, _, value = item.partition("=")
        key = key.strip()
        if not key.startswith("trainer."):
            rest.append(item)
        elif key in ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep"):
            given[key] = value
        else:
            raise ValueError(
                f"slimckpt plan: --set {key}: of trainer's keys only trainer.max_actor_ckpt_to_keep "
                f"and trainer.max_critic_ckpt_to_keep change the plan; drop it"
            )
    for key, attr in (
        ("trainer.max_actor_ckpt_to_keep", "max_actor_ckpt_to_keep"),
        ("trainer.max_critic_ckpt_to_keep", "max_critic_ckpt_to_keep"),
    ):
        if getattr(args, attr, None) is not None:
            given[key] = getattr(args, attr)
    fields = {"trainer.max_actor_ckpt_to_keep": "actor_keep", "trainer.max_critic_ckpt_to_keep": "critic_keep"}
    return {fields[k]: parse_keep(k, v) for k, v in given.items()}, rest
