"""Write a real verl FSDP checkpoint of a randomly initialised model, on CPU.

    torchrun --nproc_per_node 2 -m slimckpt_testing.verl_checkpoints.fsdp_checkpoint --out /tmp/ckpt/actor \
        --model llama --layers 2 --hidden 64 [--mesh 1d|2d] [--fsdp-version 2|1]
    torchrun --nproc_per_node 2 -m slimckpt_testing.verl_checkpoints.fsdp_checkpoint --out /tmp/ckpts \
        --models qwen3-moe,mixtral,olmoe,qwen2-moe,deepseek-v3 --experts 3 --steps 0
    torchrun --nproc_per_node 3 -m slimckpt_testing.verl_checkpoints.fsdp_checkpoint --out /tmp/ckpts --steps 0 \
        --models llama,gemma2,qwen2.5-vl,critic,llama+lora --export incremental,intermediate:llama

The model comes from a transformers config built here (fixed seed, fp32 master weights as verl
keeps them), is wrapped like verl wraps it (FSDP2: `fully_shard` on every decoder layer, then the
root; FSDP1: `FullyShardedDataParallel` with the device mesh and a per-layer wrap policy), and
is saved by verl's own `FSDPCheckpointManager.save_checkpoint` with save_contents
model+optimizer+extra: exactly the files verl writes (`model_world_size_{W}_rank_{r}.pt`,
`optim_...`, `extra_state_...`, `fsdp_config.json`, `huggingface/`).

Size knobs (--layers/--hidden/--intermediate/--vocab/--heads) make the ~0.25B/0.5B/1B models
the benchmarks use; --size-preset picks those. The mixture-of-experts families (`MOE_MODELS`, with
--experts routed experts of --intermediate/4 each, fused by transformers 5 into one [E, 2I, H] and
one [E, H, I] tensor per layer) are built the same way; `--models a,b,...` saves several models
in one torchrun (one process group, one import of verl), each into `<out>/<model>`. The dense
families (`DENSE_MODELS`: Llama, Qwen2 untied and tied, Qwen3, Mistral, Gemma2, Gemma3, Gemma4, Phi-3),
Qwen2.5-VL (its vision tower too) and verl's critic (`critic`: a Qwen2 token classifier with one
label, as verl's load_valuehead_model builds it) are built the same way; `NAME+lora` wraps NAME in
a peft LoRA adapter (q_proj/v_proj, rank 4, B random when no step is taken; `NAME+lora-all`: verl's
default target_modules=all-linear). `--export TIER,...`
saves each model again through a recipe's SlimCheckpointConfig after verl's save (the in-training
HF exports, into `<out>/<model>.<tier>`). With --models a model (or export) that fails on every
rank leaves `<out>/<model>[.<tier>].error.txt` and the next one runs. `--steps N` runs N AdamW
steps first so the optimizer file holds real state (costs 3x the model in memory; benchmarks use
--steps 0).
"""

# lazy imports: torch, transformers, peft and verl only when a checkpoint is built (the presets torch-free)
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import traceback
from typing import TYPE_CHECKING

from slimckpt.storage import for_path

if TYPE_CHECKING:
    import torch

# sizes the merge/save benchmarks use: (layers, hidden, intermediate, vocab, heads, kv_heads)
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (2, 64, 128, 256, 4, 2),
    "0.25b": (16, 1024, 2816, 32000, 16, 8),  # 0.254B params (llama, untied)
    "0.5b": (16, 1536, 4096, 32000, 16, 8),  # 0.514B params
    "1b": (20, 2048, 5632, 32000, 32, 8),  # 1.033B params
    # the shapes of Llama-3.2-3B and Llama-3-8B (for slimckpt_testing.verl_checkpoints.fake_pg_checkpoint: no host holds them here)
    "llama3.2-3b": (28, 3072, 8192, 128256, 24, 8),  # 3.61B params untied (3.21B with tied embeddings)
    "llama3-8b": (32, 4096, 14336, 128256, 32, 8),  # 8.03B params
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m slimckpt_testing.verl_checkpoints.fsdp_checkpoint",
        description="Save a verl FSDP checkpoint of a random model on CPU (run under torchrun).",
    )
    p.add_argument("--out", required=True, help="checkpoint dir to write (verl's <step>/actor)")
    p.add_argument(
        "--model",
        choices=ALL_MODELS,
        default="llama",
        help="llama (untied lm_head), qwen2-tied (tie_word_embeddings=True), another dense family, "
        "a mixture-of-experts family, qwen2.5-vl, or critic (verl's value model)",
    )
    p.add_argument(
        "--models",
        default=None,
        help="several of --model's choices, comma separated: each saved into <out>/<model> in this run; "
        "NAME+lora: that model wrapped in a LoRA adapter (rank --lora-rank, else 4)",
    )
    p.add_argument(
        "--export",
        default="",
        help="comma separated tiers (incremental, incremental-merged, intermediate) whose in-training HF export each model "
        "also gets after verl's save, into <out>/<model>.<tier> (one process group for all); "
        "TIER:a/b for models a and b only",
    )
    p.add_argument("--experts", type=int, default=4, help="routed experts of the mixture-of-experts families")
    p.add_argument(
        "--size-preset",
        choices=sorted(PRESETS),
        default=None,
        help="fills layers/hidden/intermediate/vocab/heads; explicit flags still win",
    )
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument(
        "--mesh",
        choices=["1d", "2d"],
        default="1d",
        help="1d: ('fsdp',); 2d: ('ddp','fsdp') hybrid sharding as verl builds with fsdp_size",
    )
    p.add_argument("--fsdp-size", type=int, default=2, help="inner (fsdp) mesh size for --mesh 2d")
    p.add_argument("--fsdp-version", type=int, choices=[1, 2], default=2)
    p.add_argument(
        "--fsdp1-no-mesh",
        action="store_true",
        help="FSDP1 without a device mesh (verl always passes one): the state dict then holds "
        "ShardedTensors instead of DTensors",
    )
    p.add_argument(
        "--shard-placement",
        default="dim0",
        help="FSDP2 only: 'divisible' shards each param on its first dim divisible by the "
        "fsdp size (verl.utils.fsdp_utils.get_shard_placement_fn); 'divisible:a/b' for models a and b "
        "only, the others on dim 0",
    )
    p.add_argument("--steps", type=int, default=1, help="AdamW steps before saving (0: empty optimizer state)")
    p.add_argument("--lora-rank", type=int, default=0, help="wrap with a peft LoRA adapter of this rank")
    p.add_argument("--no-tokenizer", action="store_true", help="save no tokenizer in huggingface/")
    p.add_argument("--no-generation-config", action="store_true", help="save no generation_config.json in huggingface/")
    p.add_argument(
        "--save-contents",
        default="model,optimizer,extra",
        help="verl checkpoint.save_contents, comma separated (add hf_model for verl's own HF export)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.models = args.models.split(",") if args.models else None
    unknown = [
        m for m in args.models or () if m.partition("+")[0] not in ALL_MODELS or m.partition("+")[2] not in LORA_KINDS
    ]
    if unknown:
        p.error(f"--models: unknown model {unknown[0]!r}")
    kind, _, only = args.shard_placement.partition(":")
    if kind not in ("dim0", "divisible") or (only and kind != "divisible"):
        p.error(f"--shard-placement: {args.shard_placement!r} is not dim0, divisible or divisible:a/b")
    preset = PRESETS[args.size_preset or "tiny"]
    for name, value in zip(("layers", "hidden", "intermediate", "vocab", "heads", "kv_heads"), preset):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


MOE_MODELS = ("qwen3-moe", "mixtral", "olmoe", "qwen2-moe", "deepseek-v3")
# dense causal LMs: (transformers config class, tie_word_embeddings); llama/qwen2 give an untied and a
# tied case of one family
DENSE_MODELS = {
    "llama": ("LlamaConfig", False),
    "qwen2": ("Qwen2Config", False),
    "qwen2-tied": ("Qwen2Config", True),
    "qwen3": ("Qwen3Config", False),
    "qwen3-tied": ("Qwen3Config", True),
    "mistral": ("MistralConfig", False),
    "gemma2": ("Gemma2Config", True),
    "gemma3": ("Gemma3TextConfig", True),
    "gemma4": ("Gemma4TextConfig", True),  # persistent buffers (each layer's layer_scalar) besides its weights
    "phi3": ("Phi3Config", False),
}
VL_MODELS = ("qwen2.5-vl",)
CRITIC_MODELS = ("critic",)  # verl's value model: AutoModelForTokenClassification(num_labels=1) of a Qwen2
ALL_MODELS = (*DENSE_MODELS, *MOE_MODELS, *VL_MODELS, *CRITIC_MODELS)
# NAME+KIND: the model wrapped in a LoRA adapter on these target_modules ("all-linear" is verl's default;
# with transformers 5 peft then adapts fused MoE experts and routers too)
LORA_KINDS = {"": None, "lora": ["q_proj", "v_proj"], "lora-all": "all-linear"}


def build_config(args: argparse.Namespace, model: str | None = None):
    model = model or args.model
    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=256,
        attn_implementation="sdpa",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    import transformers

    model = model.partition("+")[0]
    if model in MOE_MODELS:
        return moe_config(model, args, common)
    if model == "critic":  # verl's critic: the actor's config with num_labels=1 (load_valuehead_model)
        return transformers.Qwen2Config(
            tie_word_embeddings=False, num_labels=1, architectures=["Qwen2ForTokenClassification"], **common
        )
    if model == "qwen2.5-vl":
        head = args.hidden // args.heads
        section = [head // 8, 3 * head // 16, 3 * head // 16]  # mrope: sums to head_dim / 2
        text = {k: v for k, v in common.items() if k != "attn_implementation"}
        return transformers.Qwen2_5_VLConfig(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": section}},
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=args.hidden,
                fullatt_block_indexes=[1],
                window_size=28,
            ),
            tie_word_embeddings=False,
            architectures=["Qwen2_5_VLForConditionalGeneration"],
            attn_implementation="sdpa",
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    cls_name, tied = DENSE_MODELS[model]
    cls = getattr(transformers, cls_name)
    arch = {"Gemma3TextConfig": "Gemma3ForCausalLM", "Gemma4TextConfig": "Gemma4ForCausalLM"}.get(
        cls_name, cls_name.removesuffix("Config") + "ForCausalLM"
    )
    extra = {"head_dim": args.hidden // args.heads} if model.startswith(("gemma", "qwen3")) else {}
    if model == "gemma4":  # its defaults add a 262144-row per-layer embedding and 512-wide global heads
        extra.update(
            global_head_dim=args.hidden // args.heads,
            vocab_size_per_layer_input=args.vocab,
            hidden_size_per_layer_input=max(8, args.hidden // 4),
            layer_types=["sliding_attention"] * (args.layers - 1) + ["full_attention"],  # its last must be full
        )
    return cls(tie_word_embeddings=tied, architectures=[arch], **extra, **common)


def auto_class(model: str):
    """The transformers Auto class verl loads `model` with (actor, VL actor, critic)."""
    import transformers

    model = model.partition("+")[0]
    if model in CRITIC_MODELS:
        return transformers.AutoModelForTokenClassification
    if model in VL_MODELS:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def moe_config(model: str, args: argparse.Namespace, common: dict):
    """A mixture-of-experts family's config: args.experts routed experts of intermediate/4 each,
    2 per token; DeepSeek-V3 with MLA, one shared expert and its first layer dense."""
    import transformers

    moe = max(8, args.intermediate // 4)
    experts = args.experts
    routed = dict(num_experts_per_tok=min(2, experts), tie_word_embeddings=False)
    if model == "qwen3-moe":
        return transformers.Qwen3MoeConfig(
            moe_intermediate_size=moe,
            num_experts=experts,
            head_dim=args.hidden // args.heads,
            architectures=["Qwen3MoeForCausalLM"],
            **routed,
            **common,
        )
    if model == "mixtral":
        return transformers.MixtralConfig(
            num_local_experts=experts,
            architectures=["MixtralForCausalLM"],
            **routed,
            **{**common, "intermediate_size": moe},
        )
    if model == "olmoe":
        return transformers.OlmoeConfig(
            num_experts=experts, architectures=["OlmoeForCausalLM"], **routed, **{**common, "intermediate_size": moe}
        )
    if model == "qwen2-moe":
        return transformers.Qwen2MoeConfig(
            moe_intermediate_size=moe,
            num_experts=experts,
            shared_expert_intermediate_size=2 * moe,
            architectures=["Qwen2MoeForCausalLM"],
            **routed,
            **common,
        )
    head = args.hidden // args.heads
    return transformers.DeepseekV3Config(
        moe_intermediate_size=moe,
        n_routed_experts=experts,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=args.hidden // 2,
        kv_lora_rank=args.hidden // 4,
        qk_rope_head_dim=head // 2,
        qk_nope_head_dim=head // 2,
        v_head_dim=head,
        architectures=["DeepseekV3ForCausalLM"],
        **routed,
        **common,
    )


def build_tokenizer(vocab: int):
    """A word-level tokenizer made here (nothing downloaded), with ids below the model's vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = [f"w{i}" for i in range(max(0, min(vocab, 512) - len(specials)))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def decoder_layer_classes(model) -> set[type]:
    """The model's decoder layer classes (its _no_split_modules): one FSDP unit each, as verl wraps."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def wrap_fsdp2(
    model: torch.nn.Module, mesh, placement: str, fsdp_size: int, ignored_params: set[torch.nn.Parameter] | None = None
) -> torch.nn.Module:
    """`fully_shard` on every decoder layer, then the root, as verl's apply_fsdp2 wraps a model;
    `ignored_params` stay whole on every rank (plain tensors in the state dict, as buffers are)."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh}
    if ignored_params:  # every call: a layer's own fully_shard would otherwise shard them
        kwargs["ignored_params"] = ignored_params
    if placement == "divisible":
        from verl.utils.fsdp_utils import get_shard_placement_fn

        kwargs["shard_placement_fn"] = get_shard_placement_fn(fsdp_size)
    layer_classes = decoder_layer_classes(model)
    for module in [m for m in model.modules() if type(m) in layer_classes]:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def wrap_fsdp1(model, mesh, no_mesh: bool = False, use_orig_params: bool = True):
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=decoder_layer_classes(model))
    strategy = ShardingStrategy.HYBRID_SHARD if mesh.ndim == 2 else ShardingStrategy.FULL_SHARD
    # verl passes sync_module_states=True and a GPU device_id; on CPU both are left out (every rank
    # builds the same weights from the same seed, so there is nothing to sync).
    where = {} if no_mesh else {"device_mesh": mesh}
    # use_orig_params: verl's fsdp_config.use_orig_params (verl's default is False)
    return FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=strategy,
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
        **where,
    )


def placement_of(spec: str, name: str) -> str:
    """The FSDP2 placement `--shard-placement` gives model `name`: dim0 or divisible."""
    kind, _, only = spec.partition(":")
    return kind if not only or name in only.split("/") else "dim0"


def training_state(model, ckpt_config, vocab: int):
    """What a tiny run trains and saves beside its wrapped model: AdamW (lr 1e-2, weight decay 0.01) on
    the trainable parameters, a 4-step linear warm-up (so the scheduler's saved state matters) and
    verl's FSDPCheckpointManager over them. Returns (optimizer, scheduler, manager)."""
    import torch
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    manager = FSDPCheckpointManager(
        model, optimizer, scheduler, processing_class=build_tokenizer(vocab), checkpoint_config=ckpt_config
    )
    return optimizer, scheduler, manager


def train_steps(model, optimizer, vocab: int, steps: int, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mesh == "2d":
        if world % args.fsdp_size or world == args.fsdp_size:
            raise SystemExit(
                f"--mesh 2d needs a world size that is a multiple of --fsdp-size {args.fsdp_size} "
                f"and larger than it; got {world}"
            )
        mesh = init_device_mesh("cpu", (world // args.fsdp_size, args.fsdp_size), mesh_dim_names=("ddp", "fsdp"))
        fsdp_size = args.fsdp_size
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        fsdp_size = world

    for name in args.models or [args.model]:
        out = os.path.join(args.out, name) if args.models else args.out
        if not args.models:
            n_params = save_one(args, name, out, mesh, fsdp_size)
        else:  # one model failing on every rank is recorded next to it and the next one runs
            try:
                n_params = save_one(args, name, out, mesh, fsdp_size)
            except Exception as exc:  # noqa: BLE001 - the caller reads <out>.error.txt
                _record_error(out + ".error.txt", exc)
                dist.barrier()
                continue
        if rank == 0:
            print(
                json.dumps(
                    {
                        "out": os.path.abspath(out),
                        "model": name,
                        "world_size": world,
                        "params": n_params,
                        "fsdp_version": args.fsdp_version,
                        "mesh": args.mesh,
                    }
                )
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _record_error(path: str, exc: BaseException) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.write(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
    traceback.print_exc()


def build_model(args: argparse.Namespace, name: str) -> torch.nn.Module:
    """Model `name` as the saver builds it before wrapping (seeded, fp32; `NAME+lora`: in its peft
    adapter): with --steps 0 the model the checkpoint holds, so a test can rebuild it unsharded."""
    import torch

    torch.manual_seed(args.seed)
    model = auto_class(name).from_config(build_config(args, name), dtype=torch.float32)
    lora_kind = name.partition("+")[2]
    lora_rank = args.lora_rank or (4 if lora_kind else 0)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        # without training steps B starts random instead of zero, so the adapter changes the model
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora_rank,
                lora_alpha=2 * lora_rank,
                init_lora_weights=bool(args.steps),
                target_modules=LORA_KINDS[lora_kind or "lora"],
                task_type="CAUSAL_LM",
            ),
        )
    return model


def save_one(args: argparse.Namespace, name: str, out: str, mesh, fsdp_size: int) -> int:
    """Build model `name` (seeded), wrap it as verl does, and save it with verl's manager into `out`
    (then, with --export, each tier's in-training export of the same model into `<out>.<tier>`)."""
    import torch
    from omegaconf import OmegaConf
    from transformers import GenerationConfig
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    model = build_model(args, name)
    n_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)  # the base model's
    gen_dir = None
    if not args.no_generation_config:
        # verl saves generation_config.json only when config.name_or_path points at one
        gen_dir = tempfile.mkdtemp(prefix="slimckpt-gen-")
        GenerationConfig(
            bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=True, temperature=0.7, top_p=0.9
        ).save_pretrained(gen_dir)
        model.config.name_or_path = gen_dir
    if args.fsdp_version == 2:
        model = wrap_fsdp2(model, mesh, placement_of(args.shard_placement, name), fsdp_size)
    else:
        model = wrap_fsdp1(model, mesh, args.fsdp1_no_mesh)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if args.steps:
        train_steps(model, optimizer, args.vocab, args.steps, args.seed)
        scheduler.step()

    tokenizer = None if args.no_tokenizer else build_tokenizer(args.vocab)
    ckpt_cfg = OmegaConf.create(
        {"save_contents": args.save_contents.split(","), "load_contents": ["model", "optimizer", "extra"]}
    )
    manager = FSDPCheckpointManager(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, processing_class=tokenizer, checkpoint_config=ckpt_cfg
    )
    manager.save_checkpoint(local_path=out, global_step=args.steps)
    for spec in filter(None, args.export.split(",")):
        tier, _, only = spec.partition(":")  # TIER:a/b: only models a and b get this tier's export
        if only and name not in only.split("/"):
            continue
        try:
            save_export(manager, tier, f"{out}.{tier}", args.steps)
        except Exception as exc:  # noqa: BLE001 - recorded next to it; the caller reads it
            _record_error(f"{out}.{tier}.error.txt", exc)
        import torch.distributed as dist

        dist.barrier()
    if gen_dir:
        for_path(gen_dir).remove_tree(gen_dir, ignore_errors=True)
    return n_params


def save_export(manager, tier: str, out: str, step: int) -> None:
    """The same live model saved again by verl's manager under a recipe's SlimCheckpointConfig:
    `incremental` (export_hf, its gather-free per-rank export, bf16 as verl's merger writes; `incremental-merged`:
    with export_merge_lora, a LoRA actor's adapter merged into the base weights) or `intermediate`
    (model only, its streaming export through merge(), bf16); the export lands in <out>/huggingface."""
    from slimckpt.save.resume_state import finish_pending
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    saved = manager.checkpoint_config, manager.checkpoint_save_contents
    if tier in ("incremental", "incremental-merged"):
        manager.checkpoint_config = SlimCheckpointConfig(
            recipe="incremental",
            incremental_save=True,
            measure=False,
            export_hf=True,
            export_dtype="bf16",
            export_merge_lora=tier == "incremental-merged",
        )
    elif tier == "intermediate":
        manager.checkpoint_config = SlimCheckpointConfig(
            recipe="intermediate",
            save_contents=["model"],
            load_contents=["model"],
            export_hf=True,
            export_dtype="bf16",
            measure=False,
        )
        manager.checkpoint_save_contents = ["model"]
    else:
        raise SystemExit(f"--export: unknown tier {tier!r} (incremental, incremental-merged, intermediate)")
    try:
        manager.save_checkpoint(local_path=out, global_step=step)
        finish_pending()
    finally:
        manager.checkpoint_config, manager.checkpoint_save_contents = saved


if __name__ == "__main__":
    from slimckpt.log import cli_logging

    with cli_logging():
        sys.exit(main())
