"""Tiny models, tokenizer, RL data and reward for CPU runs of verl, built locally and deterministically.

Nothing is downloaded. `python -m slimckpt_testing.tiny --out DIR` writes:

  DIR/model/      a Hugging Face model dir (config.json, model.safetensors, generation_config.json,
                  tokenizer files): a 2-layer Llama, or a 2-layer Qwen2 with tied embeddings
  DIR/data/train.parquet, DIR/data/val.parquet
                  verl RL data for single-digit addition ("3+4=" -> "7"): columns `prompt` (chat
                  messages), `data_source`, `reward_model` {style, ground_truth}, `extra_info` {index, ...}

With --warmup-steps S the model is not left random: S short supervised steps on the task (a few
seconds for 150) from an unreliable teacher (slimckpt_testing.tiny_warmup) give RL a policy that is right
about a third of the time. tiny.json records every input of the build; with --reuse a directory
whose tiny.json matches is kept as it is (scripts/train_small.sh and quality_proof.py build so).

The reward is `compute_score` in this module; verl loads it with
  reward.custom_reward_function.path=pkg://slimckpt_testing.tiny reward.custom_reward_function.name=compute_score

The same seed gives the same bytes. Importing this module is cheap (no torch): verl's reward workers
import it only for `compute_score`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from slimckpt_testing.tiny_warmup import WarmUp, warm_up

# lazy imports: torch and pyarrow load only when assets are built (verl's reward workers import this module for compute_score)

DATA_SOURCE = "slimckpt/tiny_add"
MODELS = ("llama", "qwen2-tied")

# ChatML, as Qwen's templates: verl picks its Qwen token builder for model_type qwen2, which needs
# `<|im_end|>` and a one-token "\n"; Llama's generic builder accepts the same template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PAD, EOS, BOS, UNK = "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
ROLE_TOKENS = ["system", "user", "assistant"]
CHARACTERS = list("0123456789+-=\n ")
_BYTE_LEVEL = {"\n": "\u010a", " ": "\u0120"}  # "Ċ", "Ġ"
_LEADING_INT = re.compile(r"\s*(\d+)")
VOCAB_SIZE = 32  # model vocab; the tokenizer uses the first len(vocabulary()) ids


@dataclass(frozen=True)
class TinyAssets:
    model_dir: Path
    train_file: Path
    val_file: Path


def vocabulary() -> list[str]:
    # Byte-level spellings of "\n" and " " (as GPT-2/Qwen vocabularies): transformers rebuilds a
    # qwen2 model's tokenizer as a byte-level BPE from this vocabulary, whatever class we save.
    return SPECIAL_TOKENS + ROLE_TOKENS + [_BYTE_LEVEL.get(c, c) for c in CHARACTERS]


def build_tokenizer():
    """A character-level byte-level BPE (no merges) with ChatML special tokens, as a
    PreTrainedTokenizerFast; it tokenizes the same whether loaded as itself or as Qwen2Tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    assert len(vocab) <= VOCAB_SIZE
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=128,
        padding_side="left",
    )
    tokenizer.add_tokens(ROLE_TOKENS)  # already in the vocab: keeps their ids, matches them whole
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _model_config(model: str):
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        pad_token_id=vocabulary().index(PAD),
        bos_token_id=vocabulary().index(BOS),
        eos_token_id=vocabulary().index(EOS),
    )
    if model == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(tie_word_embeddings=False, **common)
    if model == "qwen2-tied":
        from transformers import Qwen2Config

        return Qwen2Config(tie_word_embeddings=True, **common)
    raise ValueError(f"unknown tiny model {model!r}; use one of {MODELS}")


def build_model(out_dir: Path, model: str = "llama", seed: int = 0) -> Path:
    """Write a randomly initialised tiny model (weights from `seed`) plus the tokenizer into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _model_config(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    net.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=True,
    )
    net.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir


def addition_rows(n: int, seed: int, split: str, max_operand: int = 4) -> list[dict]:
    """n rows of "a+b=" (0 <= a, b <= max_operand) in verl's RL dataset format."""
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for index in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": index, "split": split, "question": f"{a}+{b}="},
            }
        )
    return rows


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.partial")
    # No statistics or created_by drift: same rows, same bytes.
    pq.write_table(pa.Table.from_pylist(rows), tmp, compression="snappy", write_statistics=False)
    tmp.replace(path)
    return path


def build_data(
    out_dir: Path, seed: int = 0, n_train: int = 256, n_val: int = 32, max_operand: int = 4
) -> tuple[Path, Path]:
    train = write_parquet(addition_rows(n_train, seed, "train", max_operand), out_dir / "train.parquet")
    val = write_parquet(addition_rows(n_val, seed, "val", max_operand), out_dir / "val.parquet")
    return train, val


def warmup_questions(seed: int, max_operand: int, n: int = 2048) -> list[tuple[str, str]]:
    """(question, answer) pairs for the supervised warm-up, from their own split of the task."""
    return [
        (r["extra_info"]["question"], r["reward_model"]["ground_truth"])
        for r in addition_rows(n, seed, "warmup", max_operand)
    ]


def assets_key(model: str, seed: int, max_operand: int, warmup: WarmUp) -> dict:
    """Everything the assets are built from: tiny.json holds it, and a directory whose tiny.json
    equals it is reused as it is."""
    return {"model": model, "seed": seed, "max_operand": max_operand, "warmup": warmup.as_dict()}


def cached(out: Path, key: dict) -> TinyAssets | None:
    """The assets in `out` if they were built from `key`, else None."""
    try:
        found = json.loads((out / "tiny.json").read_text())
    except (OSError, ValueError):
        return None
    if found != key:
        return None
    return TinyAssets(out / "model", out / "data" / "train.parquet", out / "data" / "val.parquet")


def build_all(
    out: Path,
    model: str = "llama",
    seed: int = 0,
    max_operand: int = 4,
    warmup: WarmUp = WarmUp(),  # noqa: B008 - a frozen dataclass: one shared value is safe
) -> TinyAssets:
    key = assets_key(model, seed, max_operand, warmup)
    (out / "tiny.json").unlink(missing_ok=True)  # written last: a build cut short is never taken as cached
    model_dir = build_model(out / "model", model=model, seed=seed)
    warm_up(model_dir, warmup_questions(seed, max_operand), warmup, seed)
    train, val = build_data(out / "data", seed=seed, max_operand=max_operand)
    tmp = out / "tiny.json.partial"
    tmp.write_text(json.dumps(key, sort_keys=True) + "\n")
    tmp.replace(out / "tiny.json")
    return TinyAssets(model_dir, train, val)


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **_) -> float:
    """1.0 for exactly the sum; 0.5 for the sum followed by other text; else 0.0.

    The half credit gives a randomly initialised tiny model a signal within a few steps: its first
    token is a digit often enough, its stop token rarely.
    """
    match = _LEADING_INT.match(solution_str)
    if match is None or match.group(1) != str(ground_truth).strip():
        return 0.0
    return 1.0 if not solution_str[match.end() :].strip() else 0.5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slimckpt_testing.tiny",
        description="Build a tiny model, tokenizer and addition RL dataset locally (nothing is downloaded).",
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory (model/ and data/ go here)")
    parser.add_argument("--model", choices=MODELS, default="llama", help="architecture (default: llama)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and data (default: 0)")
    parser.add_argument(
        "--max-operand", type=int, default=4, help="questions a+b= with 0 <= a, b <= this (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        help="supervised warm-up steps on the task before RL (default: 0, random weights)",
    )
    parser.add_argument("--warmup-lr", type=float, default=WarmUp.lr, help="default: %(default)s")
    parser.add_argument("--warmup-batch-size", type=int, default=WarmUp.batch_size, help="default: %(default)s")
    parser.add_argument(
        "--warmup-teacher-error",
        default=",".join(map(str, WarmUp.teacher_error)),
        metavar="LOW,HIGH",
        help="each question's share of wrong (sum + 1) warm-up labels lies between these "
        "(default: %(default)s; 0,0: right labels only)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep --out as it is when its tiny.json says it was built from these same arguments",
    )
    args = parser.parse_args(argv)
    out = args.out.resolve()
    try:
        low, high = (float(x) for x in args.warmup_teacher_error.split(","))
    except ValueError:
        parser.error(f"--warmup-teacher-error {args.warmup_teacher_error!r}: expected LOW,HIGH, e.g. 0.4,0.9")
    warmup = WarmUp(
        steps=args.warmup_steps, lr=args.warmup_lr, batch_size=args.warmup_batch_size, teacher_error=(low, high)
    )
    key = assets_key(args.model, args.seed, args.max_operand, warmup)
    if args.reuse:
        # launchers started side by side ask for the same assets: one builds, the others wait and reuse
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the tiny model's build (not a checkpoint): waits, where leases refuse
            assets = cached(out, key) or build_all(
                out, model=args.model, seed=args.seed, max_operand=args.max_operand, warmup=warmup
            )
    else:
        assets = build_all(out, model=args.model, seed=args.seed, max_operand=args.max_operand, warmup=warmup)
    print(f"model_path={assets.model_dir}")
    print(f"train_file={assets.train_file}")
    print(f"val_file={assets.val_file}")
    return 0


if __name__ == "__main__":
    from slimckpt.log import cli_logging

    with cli_logging():
        sys.exit(main())
