"""slimckpt_testing.tiny: deterministic local assets, a ChatML tokenizer, verl-format RL data, the reward."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from slimckpt_testing import tiny


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny.build_all(tmp_path_factory.mktemp("tiny") / "a", model="llama", seed=0)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, assets):
    root = assets.model_dir.parent
    again = tiny.build_all(tmp_path / "b", model="llama", seed=0)
    assert _digests(root) == _digests(again.model_dir.parent)
    other = tiny.build_all(tmp_path / "c", model="llama", seed=1)
    a, c = _digests(root), _digests(other.model_dir.parent)
    assert a["model/model.safetensors"] != c["model/model.safetensors"]
    assert a["data/train.parquet"] != c["data/train.parquet"]
    assert a["model/tokenizer.json"] == c["model/tokenizer.json"]


def test_chat_template_round_trip(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    messages = [{"role": "user", "content": "3+4="}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == list(ids)
    assert len(ids) == 12  # fits data.max_prompt_length=16 of overrides/size/tiny.yaml
    assert tok.decode(tok.encode("12+3=\n7", add_special_tokens=False)) == "12+3=\n7"
    # verl's Qwen token builder needs a one-token newline and <|im_end|>; EOS ends the assistant turn
    assert len(tok.encode("\n", add_special_tokens=False)) == 1
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    assert tok.decode(tok.encode("7", add_special_tokens=False) + [tok.eos_token_id], skip_special_tokens=True) == "7"
    assert len(tok) <= tiny.VOCAB_SIZE


def test_qwen2_loads_the_same_tokenizer(tmp_path, assets):
    """transformers rebuilds a qwen2 model's tokenizer as Qwen2Tokenizer (byte-level BPE) from
    the vocabulary; verl's Qwen token builder then needs "\n" to stay one token."""
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(tiny.build_model(tmp_path / "q", model="qwen2-tied"))
    llama = AutoTokenizer.from_pretrained(assets.model_dir)
    assert type(qwen).__name__ == "Qwen2Tokenizer"
    text = "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n7 1\n"
    assert qwen.encode(text, add_special_tokens=False) == llama.encode(text, add_special_tokens=False)
    assert qwen.decode(qwen.encode(text, add_special_tokens=False)) == text
    assert len(qwen.encode("\n", add_special_tokens=False)) == 1


@pytest.mark.parametrize("model,tied", [("llama", False), ("qwen2-tied", True)])
def test_models_load_and_tie(tmp_path, model, tied):
    import torch
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(tiny.build_model(tmp_path / model, model=model))
    assert net.config.tie_word_embeddings is tied
    assert (net.lm_head.weight.data_ptr() == net.get_input_embeddings().weight.data_ptr()) is tied
    out = net(torch.tensor([[1, 5, 20]]))
    assert out.logits.shape == (1, 3, tiny.VOCAB_SIZE)


@pytest.mark.parametrize(
    "response,truth,score",
    [
        ("7", "7", 1.0),
        (" 7 \n", "7", 1.0),
        ("7+1", "7", 0.5),
        ("7\n3", "7", 0.5),
        ("71", "7", 0.0),
        ("8", "7", 0.0),
        ("", "7", 0.0),
        ("=7", "7", 0.0),
        ("12", "12", 1.0),
    ],
)
def test_reward(response, truth, score):
    assert tiny.compute_score(tiny.DATA_SOURCE, response, truth, extra_info={}) == score


def test_parquet_schema_matches_verl_rl_format(assets, tmp_path):
    table = pq.read_table(assets.train_file)
    assert set(table.column_names) >= {"prompt", "data_source", "reward_model", "extra_info"}
    rows = table.to_pylist()
    assert len(rows) == 256 and len(pq.read_table(assets.val_file)) == 32
    for i, row in enumerate(rows):
        assert row["data_source"] == tiny.DATA_SOURCE
        (message,) = row["prompt"]
        assert message["role"] == "user"
        a, b = message["content"].rstrip("=").split("+")
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(int(a) + int(b))}
        assert row["extra_info"]["index"] == i


def test_verl_dataset_reads_it(assets, tmp_path):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    config = OmegaConf.create(
        {
            "max_prompt_length": 16,
            "return_raw_chat": True,
            "filter_overlong_prompts": True,
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    ds = RLHFDataset(str(assets.train_file), tok, config)
    assert len(ds) == 256  # nothing filtered as overlong
    item = ds[3]
    assert item["index"] == 3 and item["raw_prompt"][0]["role"] == "user"


def test_cli(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "slimckpt_testing.tiny", "--out", str(tmp_path), "--model", "qwen2-tied"],
        capture_output=True,
        text=True,
        # building the tiny model and data takes seconds; 120 s is a hang
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"model_path={tmp_path / 'model'}" in out.stdout
    assert (tmp_path / "model" / "config.json").exists() and (tmp_path / "data" / "val.parquet").exists()
    help_ = subprocess.run([sys.executable, "-m", "slimckpt_testing.tiny", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "--model" in help_.stdout


def _greedy_score(model_dir: Path, rows: list[dict]) -> float:
    """Mean reward of greedy answers, as verl's validation samples them (temperature 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimckpt_cpu.sampling import generate

    tok = AutoTokenizer.from_pretrained(model_dir)
    net = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total = 0.0
    for row in rows:
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        out, _ = generate(net, list(ids), max_new_tokens=8, eos_token_ids=[tok.eos_token_id], temperature=0)
        total += tiny.compute_score(
            tiny.DATA_SOURCE, tok.decode(out, skip_special_tokens=True), row["reward_model"]["ground_truth"]
        )
    return total / len(rows)


def test_warm_up_is_deterministic_cached_by_its_inputs_and_learns(tmp_path, assets):
    warm = tiny.WarmUp(steps=150)  # make compare's
    a = tiny.build_all(tmp_path / "a", warmup=warm)
    tiny.build_all(tmp_path / "b", warmup=warm)
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
    # the random model of the same seed, trained: other weights, same tokenizer and data
    cold = _digests(assets.model_dir.parent)
    assert _digests(tmp_path / "a")["model/model.safetensors"] != cold["model/model.safetensors"]
    assert _digests(tmp_path / "a")["data/val.parquet"] == cold["data/val.parquet"]

    key = tiny.assets_key("llama", 0, 4, warm)
    assert tiny.cached(tmp_path / "a", key) == a
    assert tiny.cached(tmp_path / "a", tiny.assets_key("llama", 0, 4, tiny.WarmUp(steps=151))) is None
    assert tiny.cached(tmp_path / "a", tiny.assets_key("llama", 0, 4, tiny.WarmUp(150, teacher_error=(0, 0)))) is None
    assert tiny.cached(tmp_path / "a", tiny.assets_key("llama", 0, 9, warm)) is None
    (tmp_path / "b" / "tiny.json").write_text("{")  # a build cut short is rebuilt, not reused
    assert tiny.cached(tmp_path / "b", key) is None

    val = pq.read_table(a.val_file).to_pylist()
    # right where the teacher was right more often than not: some questions, far from all
    assert _greedy_score(assets.model_dir, val) < 0.1 < _greedy_score(a.model_dir, val) < 0.6


def test_teacher_errs_at_each_questions_own_rate_within_the_bounds():
    import random

    from slimckpt_testing.tiny_warmup import teacher_label

    rng = random.Random(0)
    rates = []
    for a in range(5):
        labels = [teacher_label(f"{a}+1=", str(a + 1), (0.4, 0.9), rng) for _ in range(2000)]
        assert set(labels) <= {str(a + 1), str(a + 2)}  # the sum or the sum plus one
        rates.append(labels.count(str(a + 2)) / len(labels))
    assert all(0.35 < r < 0.95 for r in rates) and max(rates) - min(rates) > 0.05  # per question, not one rate
    assert {teacher_label("3+4=", "7", (0.0, 0.0), rng) for _ in range(100)} == {"7"}


def test_cli_reuse_keeps_matching_assets_and_rebuilds_others(tmp_path):
    def cli(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "slimckpt_testing.tiny", "--out", str(tmp_path), "--reuse", *extra],
            capture_output=True,
            text=True,
            # building (or reusing) the tiny model and data takes seconds; 120 s is a hang
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return json.loads((tmp_path / "tiny.json").read_text()), (tmp_path / "model" / "model.safetensors").stat()

    key, first = cli("--warmup-steps", "5")
    assert key["warmup"]["steps"] == 5
    _, again = cli("--warmup-steps", "5")
    assert again.st_mtime_ns == first.st_mtime_ns
    key, other = cli("--warmup-steps", "5", "--max-operand", "6")
    assert key["max_operand"] == 6 and other.st_mtime_ns != first.st_mtime_ns
