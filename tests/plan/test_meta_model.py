"""plan/meta_model: a model's parameters read from its config without building it."""

from __future__ import annotations

import json

from slimckpt.plan import meta_model

from .conftest import TINY


def test_tied_embeddings_are_counted_once(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps({**TINY, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True})
    )
    facts = meta_model.model_facts(str(cfg))
    assert facts.tied == ["lm_head.weight"]
    assert sum(p.nbytes for p in facts.params) == 4 * facts.total_parameters
