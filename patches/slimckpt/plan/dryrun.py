"""`slimckpt dryrun [--plan] <hydra overrides...>`: the dry run's command (its checks are in
`slimckpt.verl.dryrun`, next to the rest of what slimckpt knows of verl's config), and with --plan,
`slimckpt plan` for the configuration a launcher composed, before any GPU.

`slimckpt dryrun --plan <hydra overrides...>` (what `bash scripts/train_70b.sh --dry-run` and
`train_small.sh --dry-run` run) validates the config, then calls `run` here: it reads off the
composed config everything `slimckpt plan` needs (the model's config.json, world size and ranks per
node, FSDP version, verl's offload switches, the critic and reference model, LoRA, the actor's
checkpoint block and retention) and prints, for the run's own save:

  - host memory per rank and per node (verl's offloaded copies + the save), against the node's
    memory and host_memory_budget_gb (`auto` resolved for that node);
  - device memory the save adds (FSDP1's sharded state dict);
  - seconds training is blocked per save, against the rollout window;
  - disk per step and with retention;
and one verdict line: the save fits, or what to change.

What the config cannot say is assumed and printed: the checkpoint storage's aggregate write
bandwidth (--disk-gbps), the rollout window from a save to the next update (--rollout-s), the
device-to-host copy bandwidth (--copy-gbps) and the training node's memory (--node-memory-gb,
default this machine's). A model path that is not a local directory is looked up in the Hugging
Face cache, then among the configs shipped in slimckpt/model_configs/ (the launchers' defaults);
without one the plan is skipped in one line naming `slimckpt plan --config`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimckpt.options.checkpoint_options import ROLE_KEYS
from slimckpt.plan.assumed import DEFAULT_COPY_GBPS, DEFAULT_DISK_GBPS, DEFAULT_ROLLOUT_S
from slimckpt.plan.build import build_report, plan_facts
from slimckpt.plan.printers import print_report
from slimckpt.verl.dryrun import compose_config
from slimckpt.verl.dryrun import run_parsed as verl_run
from slimckpt.verl.dryrun_report import plain, select
from slimckpt.verl.fsdp1_note import fsdp1_check

# lazy imports: huggingface_hub and verl's trainer modules (the roles) load only once a config is composed and
# planned

SHIPPED = Path(__file__).resolve().parent.parent / "model_configs"
PLAN_KEYS = (
    "async_save",
    "bucket_mb",
    "write_threads",
    "host_memory_budget_gb",
    "export_hf",
    "export_dtype",
    "incremental_save",
    "save_contents",
)


@dataclass(frozen=True)
class Assumptions:
    disk_gbps: float = DEFAULT_DISK_GBPS
    rollout_s: float = DEFAULT_ROLLOUT_S
    copy_gbps: float = DEFAULT_COPY_GBPS
    node_memory_gb: float | None = None


def roles(cfg) -> tuple[bool, bool]:
    """(critic, reference policy) of a composed config, as verl's trainer decides them."""
    from slimckpt.verl.dryrun_checks import roles_needed

    return roles_needed(cfg)


def model_config_path(model_path: str) -> tuple[str | None, str]:
    """The model's config.json and where it came from (None: not found here)."""
    path = os.path.expanduser(str(model_path))
    if os.path.isfile(os.path.join(path, "config.json")):
        return os.path.join(path, "config.json"), "the model dir"
    if os.path.isfile(path) and path.endswith(".json"):
        return path, "given"
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(model_path), "config.json")
        if isinstance(cached, str) and os.path.isfile(cached):
            return cached, "the Hugging Face cache"
    except Exception:  # noqa: BLE001 - no hub library or a malformed id: look further
        pass
    shipped = SHIPPED / (str(model_path).strip("/").replace("/", "--") + ".json")
    if shipped.is_file():
        return str(shipped), f"slimckpt/model_configs/{shipped.name} (shipped copy of the hub's config.json)"
    return None, ""


def plan_namespace(
    cfg, assumed: Assumptions, config_json: str, overrides: list[str] | None = None
) -> tuple[argparse.Namespace, dict[str, Any]]:
    """`slimckpt plan`'s arguments for this composed config, and what the run is (for the verdict)."""
    ckpt = plain(select(cfg, ROLE_KEYS["actor"])) or {}
    needs_critic, needs_ref = roles(cfg)
    recipe = ckpt.get("recipe") if "SlimCheckpointConfig" in str(ckpt.get("_target_", "")) else None
    nnodes, per_node = int(cfg.trainer.nnodes), int(cfg.trainer.n_gpus_per_node)
    critic = needs_critic
    sets = [f"{k}={_yaml(ckpt[k])}" for k in PLAN_KEYS if k in ckpt and k != "save_contents"] if recipe else []
    sets += list(overrides or [])
    for key in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
        value = select(cfg, f"trainer.{key}")
        sets.append(f"trainer.{key}={'none' if value is None else value}")
    lora = int(select(cfg, "actor_rollout_ref.model.lora_rank", 0) or 0)
    targets = select(cfg, "actor_rollout_ref.model.target_modules", "all-linear")
    args = argparse.Namespace(
        config=config_json,
        world_size=nnodes * per_node,
        recipe=[recipe] if recipe else ["quickstart"],
        overrides=sets,
        max_actor_ckpt_to_keep=None,
        max_critic_ckpt_to_keep=None,
        critic=critic,
        disk_gbps=assumed.disk_gbps,
        rollout_s=str(assumed.rollout_s),
        copy_gbps=assumed.copy_gbps,
        fsdp=2 if str(select(cfg, "actor_rollout_ref.actor.strategy")) == "fsdp2" else 1,
        # the export's file layout in the dtype the run writes (auto: the fp32 parameters')
        export_dtype={"auto": "fp32"}.get(str(ckpt.get("export_dtype", "bf16")), str(ckpt.get("export_dtype", "bf16"))),
        max_shard_size=ckpt.get("max_shard_size") if recipe else None,
        trust_remote_code=bool(select(cfg, "actor_rollout_ref.model.trust_remote_code", False)),
        lora_rank=lora,
        lora_alpha=float(select(cfg, "actor_rollout_ref.model.lora_alpha", 16) or 16),
        lora_target_modules=targets if isinstance(targets, str) else ",".join(targets or []) or "all-linear",
        lora_exclude_modules="",
        lora_target_parameters="",
        json=False,
        gpus_per_node=per_node,
        node_memory_gb=assumed.node_memory_gb,
        param_offload=bool(select(cfg, "actor_rollout_ref.actor.fsdp_config.param_offload", False)),
        optimizer_offload=bool(select(cfg, "actor_rollout_ref.actor.fsdp_config.optimizer_offload", False)),
        critic_param_offload=bool(select(cfg, "critic.fsdp.param_offload", False)),
        critic_optimizer_offload=bool(select(cfg, "critic.fsdp.optimizer_offload", False)),
        ref_param_offload=needs_ref and bool(select(cfg, "actor_rollout_ref.ref.fsdp_config.param_offload", False)),
    )
    contents = list(ckpt.get("save_contents") or ["model", "optimizer", "extra"])
    if recipe:
        row = f"+recipe={recipe}"
    else:
        row = "verl + hf_model" if "hf_model" in contents else "verl default"
    return args, {"recipe": recipe, "row": row, "checkpoint": ckpt, "nnodes": nnodes}


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def own_rows(report: dict[str, Any], row: str, label: str) -> dict[str, Any]:
    """The report cut to the run's own save (the recipe's row, or verl's), named `label`."""
    keep = [i for i, e in enumerate(report["estimates"]) if e["strategy"] == row or e["strategy"].startswith(row + " ")]
    return {
        **report,
        "estimates": [{**report["estimates"][i], "strategy": label} for i in keep],
        "node_rows": [{**report["node_rows"][i], "strategy": label} for i in keep],
    }


def stream_alternative(
    cfg, assumed: Assumptions, config_json: str, what: dict[str, Any], facts: Any
) -> dict[str, Any] | None:
    """The incremental recipe as it is, with async_save=stream instead: what turning it on gives."""
    ckpt = what["checkpoint"]
    if not (what["recipe"] and ckpt.get("incremental_save")) or str(ckpt.get("async_save")).lower() == "stream":
        return None
    args, _ = plan_namespace(cfg, assumed, config_json, ["async_save=stream"])
    return own_rows(build_report(args, facts), what["row"], f"{what['row']} + async_save=stream")


def verdict_lines(report: dict[str, Any], alternative: dict[str, Any] | None, nnodes: int) -> list[str]:
    """One line per row: fits or not, and what to change."""
    lines = []
    for v in report["node_rows"]:
        blocked = "-" if v["blocked_s"] is None else f"{v['blocked_s']:.1f} s"
        head = (
            f"{v['strategy']}: host {v['per_node_bytes'] / 2**30:.1f} of {v['node_memory_bytes'] / 2**30:.0f} GiB "
            f"per node ({nnodes} node(s)), blocked {blocked} per save"
        )
        lines.append(f"plan: {head}: " + ("fits" if v["fits"] else "DOES NOT FIT: " + "; ".join(v["problems"])))
    if alternative:
        for v in alternative["node_rows"]:
            blocked = "-" if v["blocked_s"] is None else f"{v['blocked_s']:.1f} s"
            state = "fits" if v["fits"] else "does not fit: " + "; ".join(v["problems"])
            lines.append(
                f"plan: with actor_rollout_ref.actor.checkpoint.async_save=stream "
                f"critic.checkpoint.async_save=stream: blocked {blocked} per save, "
                f"host {v['per_node_bytes'] / 2**30:.1f} GiB per node: {state}"
            )
    return lines


def run(overrides: list[str], assumed: Assumptions, out=None) -> int:
    """Compose, plan and print (on stderr: stdout is the composed config); 0 either way (the
    verdict lines say whether the save fits), 2 when the plan cannot be made or a launch would stop
    at start-up (an incremental save on FSDP1 that does not fit the GPU)."""
    out = out if out is not None else sys.stderr
    cfg = compose_config(overrides)
    model = str(select(cfg, "actor_rollout_ref.model.path"))
    config_json, source = model_config_path(model)
    if config_json is None:
        print(
            f"plan: skipped: {model} is not a local model dir, nor in the Hugging Face cache or "
            f"slimckpt/model_configs/; run `slimckpt plan --config <its config.json> --world-size "
            f"{int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)}` where it is",
            file=out,
        )
        return 0
    try:
        args, what = plan_namespace(cfg, assumed, config_json)
        facts = plan_facts(args)
        report = own_rows(build_report(args, facts), what["row"], f"{what['row']} (as composed)")
        alternative = stream_alternative(cfg, assumed, config_json, what, facts)
    except Exception as exc:  # noqa: BLE001 - the config passed; a plan it cannot make is one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"plan: cannot plan {config_json}: {first}", file=out)
        return 2
    print(f"\n=== slimckpt plan for this configuration (model config: {source}) ===", file=out)
    print(
        f"assumed (the config cannot say): checkpoint storage {assumed.disk_gbps:g} GB/s aggregate "
        f"(--disk-gbps / DISK_GBPS), rollout window {assumed.rollout_s:g} s from a save to the next update "
        f"(--rollout-s / ROLLOUT_S), device-to-host {assumed.copy_gbps:g} GB/s per rank (--copy-gbps / COPY_GBPS), "
        f"node memory {f'{assumed.node_memory_gb:g} GiB' if assumed.node_memory_gb else 'this machine' + chr(39) + 's'} "
        f"(--node-memory-gb / NODE_MEMORY_GB)",
        file=out,
    )
    print_report(report, out)
    lines = verdict_lines(report, alternative, what["nnodes"])
    for line in lines:
        print(line, file=out)
    # what the driver checks at start-up: an incremental save on FSDP1 against the GPU's memory
    use_critic, use_ref = roles(cfg)
    line, stop = fsdp1_check(cfg, use_critic, use_ref, model_json=config_json)
    if stop:
        print(f"{line} (a launch stops here, before Ray starts)", file=out)
        return 2
    if line:
        print(f"plan: {line.removeprefix('slimckpt: ')}", file=out)
    return 0


def _after(args: argparse.Namespace, overrides: list[str]) -> int:
    if not getattr(args, "plan", False) or args.no_validate or args.show:
        return 0
    assumed = Assumptions(
        disk_gbps=args.disk_gbps, rollout_s=args.rollout_s, copy_gbps=args.copy_gbps, node_memory_gb=args.node_memory_gb
    )
    return run(overrides, assumed)


def run_parsed(args: argparse.Namespace, overrides: list[str]) -> int:
    """The command (its options: slimckpt.plan.dryrun_cli): verl's dry run, then the plan once the config passed."""
    return verl_run(args, overrides, after=_after)
