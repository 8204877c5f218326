"""slimckpt.tiny: deterministic local assets, a ChatML tokenizer, verl-format RL data, the reward."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from slimckpt import tiny


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


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
    [("7", "7", 1.0), (" 7 \n", "7", 1.0), ("7+1", "7", 0.5), ("7\n3", "7", 0.5),
     ("71", "7", 0.0), ("8", "7", 0.0), ("", "7", 0.0), ("=7", "7", 0.0), ("12", "12", 1.0)],
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
    config = OmegaConf.create({"max_prompt_length": 16, "return_raw_chat": True, "filter_overlong_prompts": True,
                               "cache_dir": str(tmp_path / "cache")})
    ds = RLHFDataset(str(assets.train_file), tok, config)
    assert len(ds) == 256  # nothing filtered as overlong
    item = ds[3]
    assert item["index"] == 3 and item["raw_prompt"][0]["role"] == "user"


def test_cli(tmp_path):
    out = subprocess.run([sys.executable, "-m", "slimckpt.tiny", "--out", str(tmp_path), "--model", "qwen2-tied"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"model_path={tmp_path / 'model'}" in out.stdout
    assert (tmp_path / "model" / "config.json").exists() and (tmp_path / "data" / "val.parquet").exists()
    help_ = subprocess.run([sys.executable, "-m", "slimckpt.tiny", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "--model" in help_.stdout
