"""torchrun scenario for the gather-free HF export (tests/save/test_export_direct.py):

    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.hf_direct_export --dir D [--models llama,qwen2-tied] [--fsdp 2]
    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.hf_direct_export --dir D --measure 0.25b

For each model (tiny Llama, tiny Qwen2 with tied embeddings), on one process group: one AdamW step,
then verl's own FSDPCheckpointManager saves with save_contents=[model,optimizer,extra,hf_model]
(rank-0 gather + save_pretrained), and the same live model is saved through the incremental tier
with export_hf (sync, one file; bf16; then async in small files, its write held back until training has
changed every parameter). Rank 0 compares each export with verl's tensor for tensor and writes
D/hf_direct_export_result.json.

--measure PRESET (one indicative run, not a test): peak anonymous RSS above its start, per rank, of
the export step (plan + write) of a save with export_hf, and of verl's save with
save_contents=[hf_model] (its gather + save_pretrained) of the same model; D/hf_direct_export_memory.json.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import glob
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist

from slimckpt_testing.merge_check import adapter_config_fields
from slimckpt_testing.scenarios import tiny_run
from slimckpt_testing.scenarios.tiny_run import Run, slim_config  # the same tiny model and manager

# lazy imports: verl and slimckpt's save path load inside a scenario, after it set the module settings they read


def load_export(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        out.update(load_file(path))
    return out


def compare(ours: str, verl: str) -> dict:
    a, b = load_export(ours), load_export(verl)
    diffs = [
        n
        for n in sorted(set(a) | set(b))
        if n not in a
        or n not in b
        or a[n].dtype != b[n].dtype
        or a[n].shape != b[n].shape
        or not torch.equal(
            a[n].view(torch.uint8) if a[n].numel() else a[n], b[n].view(torch.uint8) if b[n].numel() else b[n]
        )
    ]
    same_text = {}
    for name in ("config.json", "generation_config.json"):
        pa, pb = os.path.join(ours, name), os.path.join(verl, name)
        same_text[name] = os.path.exists(pa) and os.path.exists(pb) and open(pa).read() == open(pb).read()
    single = os.path.join(ours, "model.safetensors")
    return {
        "n_ours": len(a),
        "n_verl": len(b),
        "diffs": diffs[:10],
        "has_lm_head": "lm_head.weight" in a,
        "dtypes": sorted({str(t.dtype) for t in a.values()}),
        "files": sorted(os.path.basename(p) for p in glob.glob(os.path.join(ours, "*"))),
        "same_text": same_text,
        "bytes_identical": os.path.exists(single)
        and open(single, "rb").read() == open(os.path.join(verl, "model.safetensors"), "rb").read(),
    }


def loads(hf_dir: str) -> bool:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ref = load_export(hf_dir)
    sd = model.state_dict()
    return all(torch.equal(sd[n], t.to(sd[n].dtype)) for n, t in ref.items())


def manifest_lists(role_dir: str) -> list[str]:
    with open(os.path.join(role_dir, "slimckpt_resume.json")) as f:
        return sorted(e["path"] for e in json.load(f)["files"] if e["path"].startswith("huggingface/"))


def run_model(args, model: str) -> dict:
    from verl.trainer.config import CheckpointConfig

    import slimckpt.save.export.direct_write as hf_direct_write
    from slimckpt.save.resume_state import finish_pending

    tiny_run.MODEL = model
    root = os.path.join(args.dir, model)
    verl_cfg = CheckpointConfig(save_contents=["model", "optimizer", "extra", "hf_model"])
    run = Run(seed=0, ckpt_config=verl_cfg)
    run.step()
    verl_dir = os.path.join(root, "verl", "global_step_1", "actor")
    run.manager.save_checkpoint(verl_dir, global_step=1)

    # the gather-free export, sync: hf_model stays in save_contents and is skipped (logged)
    run.manager.checkpoint_config = slim_config(
        save_contents=["model", "optimizer", "extra", "hf_model"], export_hf=True, export_dtype="auto"
    )
    sync_dir = os.path.join(root, "sync", "global_step_1", "actor")
    t0 = time.perf_counter()
    run.manager.save_checkpoint(sync_dir, global_step=1)
    sync_s = time.perf_counter() - t0

    # bf16 export: a cast of the same values
    run.manager.checkpoint_config = slim_config(export_hf=True, export_dtype="bf16")
    bf16_dir = os.path.join(root, "bf16", "global_step_1", "actor")
    run.manager.save_checkpoint(bf16_dir, global_step=1)

    # a rank that fails mid-export: every rank raises, the step is not committed
    real_box = hf_direct_write._BoxWriter.write_box

    def failing_box(self, *a, **k):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device (simulated)")
        return real_box(self, *a, **k)

    hf_direct_write._BoxWriter.write_box = failing_box
    broken_dir = os.path.join(root, "broken", "global_step_1", "actor")
    try:
        run.manager.save_checkpoint(broken_dir, global_step=1)
        broken_error = None
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        broken_error = f"{type(exc).__name__}: {exc}"
    hf_direct_write._BoxWriter.write_box = real_box
    dist.barrier()

    # async, several files: the write starts only after training has moved every parameter
    real_write = hf_direct_write.write_export

    def late_write(*a, **k):
        # the tiny model's next step takes far less than 1 s: the write starts after it moved everything
        time.sleep(1.0)
        return real_write(*a, **k)

    hf_direct_write.write_export = late_write
    run.manager.checkpoint_config = slim_config(
        export_hf=True, export_dtype="auto", async_save=True, host_memory_budget_gb=1.0, max_shard_size="20KB"
    )
    async_dir = os.path.join(root, "async", "global_step_1", "actor")
    run.manager.save_checkpoint(async_dir, global_step=1)
    run.step()
    committed_early = os.path.exists(os.path.join(async_dir, "slimckpt_resume.json"))
    finish_pending()
    hf_direct_write.write_export = real_write

    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    verl_hf = os.path.join(verl_dir, "huggingface")
    ref = load_export(verl_hf)
    bf16 = load_export(os.path.join(bf16_dir, "huggingface"))
    # the recipe's default export_dtype=bf16 against what `python -m verl.model_merger merge` writes
    # (bf16) from verl's own rank files of the same weights
    merged = os.path.join(root, "verl_merged")
    verl_merged(verl_dir, merged)
    # (only rank 0 reaches here; rank 1's error was the same collective one)
    return {
        "bf16_vs_verl_merger": compare(os.path.join(bf16_dir, "huggingface"), merged),
        "sync": compare(os.path.join(sync_dir, "huggingface"), verl_hf),
        "async": compare(os.path.join(async_dir, "huggingface"), verl_hf),
        "async_committed_before_finish": committed_early,
        "bf16_equal_cast": set(bf16) == set(ref)
        and all(bf16[n].dtype == torch.bfloat16 and torch.equal(bf16[n], ref[n].to(torch.bfloat16)) for n in ref),
        "sync_loads": loads(os.path.join(sync_dir, "huggingface")),
        "async_loads": loads(os.path.join(async_dir, "huggingface")),
        "manifest_sync": manifest_lists(sync_dir),
        "manifest_async": manifest_lists(async_dir),
        "sync_dcp_files": sorted(os.listdir(os.path.join(sync_dir, "dcp"))),
        "sync_seconds": sync_s,
        "broken_error": broken_error,
        "broken_committed": os.path.exists(os.path.join(broken_dir, "slimckpt_resume.json")),
    }


def loaded_state(hf_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    """from_pretrained's state dict (MoE experts fused again) and its loading info."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    return model.state_dict(), {k: sorted(map(str, v)) for k, v in info.items() if v}


def _failing_save(run, path: str, config) -> dict:
    """A save that must fail on every rank: its one line and how long each rank took to get it."""
    run.manager.checkpoint_config = config
    t0 = time.perf_counter()
    try:
        run.manager.save_checkpoint(path, global_step=1)
        line = None
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        line = str(exc)
    mine = {"line": line, "seconds": time.perf_counter() - t0}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    hf = os.path.join(path, "huggingface")
    return {
        "ranks": every,
        "committed": os.path.exists(os.path.join(hf, "manifest.json")),
        "weights": sorted(n for n in os.listdir(hf) if n.endswith(".safetensors")) if os.path.isdir(hf) else [],
    }


def run_moe(args, model: str, fallbacks: bool, name: str | None = None) -> dict:
    """An MoE actor (experts fused in memory, split per expert on save) saved by verl's manager with
    hf_model, then with both tiers' exports: the incremental tier's gather-free one (each rank its
    rows of every per-expert tensor; in several files, and in one) and the intermediate tier's
    streaming one (bf16).
    With `fallbacks`, the intermediate export forced onto verl's merger (as for a conversion that is
    not one run of one tensor): refused with allow_verl_fallback=false, and a verl merger that dies
    on rank 0; every rank must raise the same line at once."""
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger
    from verl.trainer.config import CheckpointConfig

    import slimckpt.hf.naming as hf_side
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    tiny_run.MODEL = model
    root = os.path.join(args.dir, name or model)
    run = Run(seed=0, ckpt_config=CheckpointConfig(save_contents=["model", "optimizer", "extra", "hf_model"]))
    placements = sorted({str(p.placements) for n, p in run.model.named_parameters() if ".experts." in n})
    run.step()
    verl_dir = os.path.join(root, "verl", "global_step_1", "actor")
    run.manager.save_checkpoint(verl_dir, global_step=1)

    run.manager.checkpoint_config = slim_config(
        save_contents=["model", "optimizer", "extra", "hf_model"],
        export_hf=True,
        export_dtype="auto",
        max_shard_size="20KB",
    )
    inc_dir = os.path.join(root, "incremental", "global_step_1", "actor")
    t0 = time.perf_counter()
    run.manager.save_checkpoint(inc_dir, global_step=1)
    inc_s = time.perf_counter() - t0
    run.manager.checkpoint_config = slim_config(export_hf=True, export_dtype="auto")  # one file, as verl's
    one_dir = os.path.join(root, "one_file", "global_step_1", "actor")
    run.manager.save_checkpoint(one_dir, global_step=1)

    def intermediate(**kw):
        return SlimCheckpointConfig(
            recipe="intermediate",
            save_contents=["model"],
            load_contents=["model"],
            export_hf=True,
            export_dtype="bf16",
            measure=False,
            **kw,
        )

    run.manager.checkpoint_save_contents = ["model"]
    inter_dir = os.path.join(root, "intermediate", "global_step_1", "actor")
    run.manager.checkpoint_config = intermediate()
    t0 = time.perf_counter()
    run.manager.save_checkpoint(inter_dir, global_step=1)
    inter_s = time.perf_counter() - t0

    out: dict = {}
    if fallbacks:
        real_sources, real_load = hf_side.HfSide.output_sources, FSDPModelMerger._load_and_merge_state_dicts

        def not_a_slice(self, names, shapes):  # only rank 0 plans
            raise hf_side.NeedsVerlMerger(
                "transformers converts tensors on save (e.g. 'x' is not a part of one "
                "checkpoint tensor; forced by the test)"
            )

        def verl_dies(self, *a, **k):
            raise RuntimeError("verl's merger died (simulated)")

        hf_side.HfSide.output_sources = not_a_slice
        FSDPModelMerger._load_and_merge_state_dicts = verl_dies
        try:
            out["refused"] = _failing_save(
                run, os.path.join(root, "refused", "global_step_1", "actor"), intermediate(allow_verl_fallback=False)
            )
            out["verl_died"] = _failing_save(
                run, os.path.join(root, "verl_died", "global_step_1", "actor"), intermediate()
            )
        finally:
            hf_side.HfSide.output_sources, FSDPModelMerger._load_and_merge_state_dicts = real_sources, real_load

    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    verl_hf = os.path.join(verl_dir, "huggingface")
    ref, inter = load_export(verl_hf), load_export(os.path.join(inter_dir, "huggingface"))
    ref_loaded, _ = loaded_state(verl_hf)
    checks = {}
    for name, hf_dir in (
        ("incremental", os.path.join(inc_dir, "huggingface")),
        ("intermediate", os.path.join(inter_dir, "huggingface")),
    ):
        state, info = loaded_state(hf_dir)
        checks[name] = {
            "loading_info": info,
            "same_as_verl_loaded": sorted(state) == sorted(ref_loaded)
            and all(
                torch.equal(
                    state[n], ref_loaded[n].to(torch.bfloat16).float() if name == "intermediate" else ref_loaded[n]
                )
                for n in ref_loaded
            ),
        }
    return {
        **out,
        "incremental": compare(os.path.join(inc_dir, "huggingface"), verl_hf),
        "one_file": compare(os.path.join(one_dir, "huggingface"), verl_hf),
        "intermediate_equal_cast": sorted(inter) == sorted(ref)
        and all(inter[n].dtype == torch.bfloat16 and torch.equal(inter[n], ref[n].to(torch.bfloat16)) for n in ref),
        "intermediate_committed": os.path.exists(os.path.join(inter_dir, "huggingface", "manifest.json")),
        "n_experts_split": sum(".experts." in n for n in ref),
        "expert_placements": placements,
        "loads": checks,
        "manifest_incremental": manifest_lists(inc_dir),
        "seconds": {"incremental_save": inc_s, "intermediate_save": inter_s},
    }


def scenario_moe(args) -> None:
    """Every MoE family of args.models (`qwen3-moe:divisible`: its fused experts sharded on dim 1, as
    verl's get_shard_placement_fn shards 3 experts over 2 ranks): D/moe_export_result.json (run by
    slimckpt_testing/scenarios/batch.py)."""
    out = {}
    for i, spec in enumerate(args.models.split(",")):  # MODEL[:PLACEMENT]
        model, _, placement = spec.partition(":")
        tiny_run.PLACEMENT = placement or "dim0"
        try:
            out[spec] = run_moe(args, model, fallbacks=i == 0, name=spec.replace(":", "-"))
        finally:
            tiny_run.PLACEMENT = "dim0"
    _write(args, out, "moe_export_result.json")


def tree_digest(path: str) -> dict[str, str]:
    """Every file under `path` but slimckpt's manifest: relative path -> sha256 of its bytes. An
    adapter_config.json is hashed with its target_modules sorted: verl's merger and peft write that
    list from a Python set, whose order changes from one process to the next."""
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            full = os.path.join(root, n)
            rel = os.path.relpath(full, path)
            if rel == "manifest.json":
                continue
            raw = open(full, "rb").read()
            if n == "adapter_config.json":
                raw = json.dumps(adapter_config_fields(raw), sort_keys=True).encode()
            out[rel] = hashlib.sha256(raw).hexdigest()
    return dict(sorted(out.items()))


def verl_merged(local_dir: str, target: str) -> None:
    """verl 0.9.1's own FSDPModelMerger (unpatched) on `local_dir`."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    os.makedirs(target, exist_ok=True)
    merger = FSDPModelMerger(
        ModelMergerConfig(
            operation="merge",
            backend="fsdp",
            local_dir=local_dir,
            target_dir=target,
            hf_model_config_path=os.path.join(local_dir, "huggingface"),
        )
    )
    getattr(FSDPModelMerger.merge_and_save, "__wrapped__", FSDPModelMerger.merge_and_save)(merger)


def scenario_lora(args) -> None:
    """A LoRA actor (peft on q_proj/v_proj, r=4, alpha=8, one AdamW step so B is not zero), FSDP2 on 2
    ranks. Reference: verl's manager saves it, verl's own merger merges that (rank 0). Then the
    intermediate tier's export (bf16; and with export_merge_lora=true) and the incremental tier's
    gather-free one (bf16; merged in fp32, and merged in bf16 with async_save, written while the
    next training step changes the weights), and `slimckpt merge --merge_lora --dtype fp32` of
    verl's save. D/lora_export_result.json: file digests of each, and the merged export against
    peft's merge_and_unload() of the reference."""
    from verl.trainer.config import CheckpointConfig

    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    tiny_run.LORA_RANK = 4
    root = args.dir
    run = Run(seed=0, ckpt_config=CheckpointConfig(save_contents=["model", "optimizer", "extra"]))
    run.step()
    dirs = {
        k: os.path.join(root, k, "global_step_1", "actor") for k in ("verl", "intermediate", "merged", "incremental")
    }
    run.manager.save_checkpoint(dirs["verl"], global_step=1)
    run.manager.checkpoint_save_contents = ["model"]
    seconds = {}
    for kind, merge_lora in (("intermediate", False), ("merged", True)):
        run.manager.checkpoint_config = SlimCheckpointConfig(
            recipe="intermediate",
            save_contents=["model"],
            load_contents=["model"],
            export_hf=True,
            export_dtype="bf16",
            measure=False,
            export_merge_lora=merge_lora,
        )
        t0 = time.perf_counter()
        run.manager.save_checkpoint(dirs[kind], global_step=1)
        seconds[kind] = time.perf_counter() - t0
    run.manager.checkpoint_save_contents = ["model", "optimizer", "extra"]
    # the incremental tier: unmerged (bf16), merged as the intermediate's (bf16, from the staged copy of
    # async_save) and merged in the parameters' dtype (auto: fp32)
    from slimckpt.save.resume_state import finish_pending

    for kind, kw in (
        ("incremental", {"export_dtype": "bf16"}),
        ("incremental_merged_fp32", {"export_dtype": "auto", "export_merge_lora": True}),
        ("incremental_merged", {"export_dtype": "bf16", "export_merge_lora": True, "async_save": True}),
        # weights moved by the step above: stream's export against a sync one of them
        ("incremental_merged_now", {"export_dtype": "bf16", "export_merge_lora": True}),
        ("incremental_merged_stream", {"export_dtype": "bf16", "export_merge_lora": True, "async_save": "stream"}),
    ):
        dirs[kind] = os.path.join(root, kind, "global_step_1", "actor")
        run.manager.checkpoint_config = slim_config(export_hf=True, **kw)
        if kw.get("async_save"):  # hold the background write back until the step below changed B in place
            from slimckpt.save import step_write

            real_writer = getattr(step_write.storage_writer, "real", step_write.storage_writer)
            # the tiny model's next step takes far less than 1 s: the write starts after it has moved B
            step_write.storage_writer = lambda *a, **k: (time.sleep(1.0), real_writer(*a, **k))[1]
            step_write.storage_writer.real = real_writer
        t0 = time.perf_counter()
        run.manager.save_checkpoint(dirs[kind], global_step=1)
        if kw.get("async_save"):  # B moves in place before the background write: only the staged copy (pool)
            run.step()  # or the optimizer step's guard copy (stream) is step 1
            finish_pending()
        seconds[kind] = time.perf_counter() - t0
    finish_pending()
    dist.barrier()
    if dist.get_rank() != 0:
        return
    ref = os.path.join(root, "verl_merged")
    verl_merged(dirs["verl"], ref)
    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeOptions

    merge(
        MergeOptions(
            local_dir=dirs["verl"],
            target_dir=os.path.join(root, "merge_lora_fp32"),
            dtype="fp32",
            merge_lora=True,
            progress=False,
        )
    )
    out = {
        "seconds": seconds,
        "reference": tree_digest(ref),
        "merge_lora_fp32": tree_digest(os.path.join(root, "merge_lora_fp32")),
    }
    for kind in (
        "intermediate",
        "merged",
        "incremental",
        "incremental_merged",
        "incremental_merged_now",
        "incremental_merged_stream",
        "incremental_merged_fp32",
    ):
        out[kind] = tree_digest(os.path.join(dirs[kind], "huggingface"))
    # peft's merge_and_unload() of the reference (bf16 base + adapter) against the merged export, as loaded
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.bfloat16)
    want = PeftModel.from_pretrained(base, os.path.join(ref, "lora_adapter")).merge_and_unload().state_dict()
    got = AutoModelForCausalLM.from_pretrained(
        os.path.join(dirs["merged"], "huggingface"), dtype=torch.bfloat16
    ).state_dict()
    unmerged = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.bfloat16).state_dict()
    out["merged_vs_peft"] = {
        "same_keys": sorted(got) == sorted(want),
        "max_abs_diff": max((got[k].float() - want[k].float()).abs().max().item() for k in want if k in got),
        "changed": sorted(k for k in got if not torch.equal(got[k], unmerged[k])),
    }
    _write(args, out, "lora_export_result.json")


def measure(args) -> dict:
    """Per-rank extra peak RssAnon: the gather-free export step vs verl's hf_model save."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from verl.trainer.config import CheckpointConfig
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    import slimckpt.save.export.direct as hf_direct_export
    import slimckpt.save.export.direct_write as hf_direct_write
    from slimckpt.observe.memory import RssSampler
    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_config, build_tokenizer, parse_args, wrap_fsdp2

    world = dist.get_world_size()
    fx = parse_args(["--out", args.dir, "--size-preset", args.measure])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(fx), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    model = wrap_fsdp2(model, init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)), "dim0", world)
    gc.collect()
    manager = FSDPCheckpointManager(
        model,
        None,
        None,
        processing_class=build_tokenizer(fx.vocab),
        checkpoint_config=CheckpointConfig(save_contents=["hf_model"]),
    )
    peaks: dict[str, list[int]] = {"plan_export": [], "write_export": []}

    def sampled(fn, key):
        def run(*a, **k):
            with RssSampler() as s:
                out = fn(*a, **k)
            peaks[key].append(s.result.extra)
            return out

        return run

    # ours first: leftovers of verl's 1 GB gather in the allocator would flatter our numbers
    real = hf_direct_export.plan_export, hf_direct_write.write_export
    hf_direct_export.plan_export = sampled(real[0], "plan_export")
    hf_direct_write.write_export = sampled(real[1], "write_export")
    manager.checkpoint_config = slim_config(save_contents=["model"], export_hf=True, export_dtype=args.export_dtype)
    manager.checkpoint_save_contents = ["model"]
    with RssSampler() as whole:
        manager.save_checkpoint(os.path.join(args.dir, "slim", "actor"), global_step=0)
    hf_direct_export.plan_export, hf_direct_write.write_export = real
    gc.collect()
    manager.checkpoint_config = CheckpointConfig(save_contents=["hf_model"])
    manager.checkpoint_save_contents = ["hf_model"]
    with RssSampler() as verl:
        manager.save_checkpoint(os.path.join(args.dir, "verl", "actor"), global_step=0)
    mine = {
        "export_step_extra_bytes": max(peaks["plan_export"] + peaks["write_export"]),
        "slim_save_extra_bytes": whole.result.extra,
        "verl_hf_model_save_extra_bytes": verl.result.extra,
    }
    allr: list = [None] * world
    dist.all_gather_object(allr, mine)
    return {
        "preset": args.measure,
        "export_dtype": args.export_dtype,
        "params": params,
        "world_size": world,
        "per_rank": allr,
    }


def _write(args, result: dict, name: str) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, name), "w") as f:
            json.dump(result, f, indent=1)


def scenario(args) -> None:
    """Every model of args.models (comma-separated): D/hf_direct_export_result.json (also run by
    slimckpt_testing/scenarios/batch.py)."""
    _write(args, {m: run_model(args, m) for m in args.models.split(",")}, "hf_direct_export_result.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--models", default="llama,qwen2-tied")
    p.add_argument("--fsdp", type=int, choices=[1, 2], default=2)
    p.add_argument("--measure", default=None, help="size preset (e.g. 0.25b): measure memory instead of testing")
    p.add_argument("--export-dtype", default="auto", help="with --measure: export_dtype of our export")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    tiny_run.FSDP_VERSION = args.fsdp
    if args.measure:
        _write(args, measure(args), "hf_direct_export_memory.json")
    else:
        faulthandler.dump_traceback_later(200, exit=True)  # a hang shows its stacks before the test times out
        scenario(args)
