"""The merge's Hugging Face side without `import verl`: verl's own helper files loaded by path
(`slimckpt.verl_files.leaves`), and the two small choices of verl's BaseModelMerger that `hf_side`
makes itself (auto class, generation config), held to verl's answers."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import textwrap

import pytest
import transformers
from transformers import LlamaConfig

import slimckpt.verl_files.leaves as verl_leaves
import slimckpt.verl_files.version as registry
from slimckpt.hf.naming import auto_model_class, load_generation_config


def verl_merger_with(config=None, hf_dir=None):
    """verl 0.9.1's FSDPModelMerger with only the attributes its helpers read (no checkpoint needed)."""
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    merger = object.__new__(FSDPModelMerger)
    merger.model_config = config
    merger.hf_model_config_path = hf_dir
    return merger


def config_with(architectures, auto_map=None):
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        architectures=architectures,
    )
    if auto_map is not None:
        cfg.auto_map = auto_map
    return cfg


CONFIGS = {
    "causal_lm": (["LlamaForCausalLM"], None),
    "token_classification": (["Qwen2ForTokenClassification"], None),
    "conditional_generation": (["Qwen2VLForConditionalGeneration"], None),
    "unknown_architecture": (["BertModel"], None),
    "remote_causal_lm": (["MyForCausalLM"], {"AutoConfig": "my.MyConfig", "AutoModelForCausalLM": "my.MyForCausalLM"}),
    "remote_token_classification": (["MyTagger"], {"AutoModelForTokenClassification": "my.MyTagger"}),
    "remote_vision2seq": (["MyVL"], {"AutoModelForVision2Seq": "my.MyVL"}),
    "remote_image_text_to_text": (["MyVL"], {"AutoModelForImageTextToText": "my.MyVL"}),
    "remote_unknown_auto_class": (["MyModel"], {"AutoModel": "my.MyModel"}),
    # auto_map present but naming other classes: decided by the architecture's suffix
    "auto_map_elsewhere": (["LlamaForCausalLM"], {"AutoTokenizer": ["my.Tok", None]}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_auto_model_class_is_verls(name):
    cfg = config_with(*CONFIGS[name])
    try:
        theirs = verl_merger_with(cfg).get_transformers_auto_model_class()
    except NotImplementedError as exc:
        with pytest.raises(NotImplementedError, match=re.escape(str(exc))):
            auto_model_class(cfg)
        return
    assert auto_model_class(cfg) is theirs
    assert theirs.__module__.startswith("transformers")  # the table above reaches a real class


@pytest.mark.parametrize("with_file", [True, False])
def test_generation_config_is_verls(tmp_path, with_file):
    if with_file:
        (tmp_path / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.9})
        )
    theirs = verl_merger_with(hf_dir=str(tmp_path)).load_generation_config(warn_if_missing=False)
    ours = load_generation_config(str(tmp_path))
    if not with_file:
        assert theirs is None and ours is None
        return
    assert ours.to_json_string() == theirs.to_json_string()
    assert ours.temperature == 0.6 and ours.eos_token_id == [2, 7]


def test_leaves_run_verls_own_files():
    from verl.model_merger import output_validation
    from verl.utils import transformers_compat
    from verl.utils.tokenizer import tokenizer

    for name, module in {
        "tokenizer": tokenizer,
        "transformers_compat": transformers_compat,
        "output_validation": output_validation,
    }.items():
        loaded = verl_leaves.leaf(name)
        assert loaded.__file__ == module.__file__
        assert loaded is verl_leaves.leaf(name)  # once per process
        for attr in ("hf_tokenizer", "hf_processor", "drop_tied_target_keys", "validate_hf_model_output"):
            if hasattr(module, attr):
                assert inspect.getsource(getattr(loaded, attr)) == inspect.getsource(getattr(module, attr))


def test_unknown_verl_version_fails_loudly(monkeypatch):
    monkeypatch.setattr(registry, "installed_verl_version", lambda: "0.10.0")
    monkeypatch.delitem(sys.modules, verl_leaves._PREFIX + "tokenizer", raising=False)
    monkeypatch.delenv(registry.ALLOW_ENV, raising=False)
    with pytest.raises(registry.UnsupportedVerlVersion, match="verl 0.10.0 is installed"):
        verl_leaves.leaf("tokenizer")


def test_hf_side_does_not_import_verl(tmp_path):
    """The whole HF side of a merge (config, names, config files, tokenizer, output check) in a
    fresh process: verl's package is never imported (it costs 0.6-1.0 s on the commit's path)."""
    from slimckpt_testing.tiny import build_model

    hf_dir = tmp_path / "actor" / "huggingface"
    build_model(hf_dir, "qwen2-tied")
    (hf_dir / "model.safetensors").unlink()
    script = textwrap.dedent(f"""
        import json, sys
        from slimckpt.hf.naming import HfSide
        from slimckpt.verl_files.leaves import leaf
        side = HfSide({str(tmp_path / "actor")!r}, "bf16", False)
        shapes = {{n: tuple(p.shape) for n, p in side.model.named_parameters(remove_duplicate=False)}}
        mapping = side.output_names(list(shapes), shapes)
        out = {str(tmp_path / "out")!r}
        side.save_configs(out)
        assert side.save_tokenizer(out)
        open(out + "/model.safetensors", "wb").write(b"x")
        leaf("output_validation").validate_hf_model_output(out)
        print(json.dumps({{"names": sorted(mapping), "verl": sorted(m for m in sys.modules if m.split(".")[0] == "verl")}}))
    """)
    # the child maps a tiny model's names and writes its configs, without verl: seconds; 300 s is a hang
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["verl"] == []
    assert "lm_head.weight" not in result["names"] and "model.embed_tokens.weight" in result["names"]  # tied
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").tie_word_embeddings
