"""An export's output dir before its weights are written: config.json and generation_config.json
as save_pretrained writes them, the tokenizer (the offline merge), lora_adapter/adapter_config.json,
the weight files at full size with their headers, and model.safetensors.index.json. The one lay-out
of `slimckpt merge` (into `<target>.partial`) and of the gather-free export (into huggingface/).
"""

from __future__ import annotations

import os

import slimckpt.layout.safetensors_layout as layout
from slimckpt.engine.out_files import create_files
from slimckpt.hf.lora import write_adapter_config
from slimckpt.hf.naming import HfSide
from slimckpt.hf.plan import ExportPlan
from slimckpt.storage import for_path


def lay_out(out_dir: str, plan: ExportPlan, side: HfSide, tokenizer: bool = True) -> bool:
    """Everything but the weights' bytes into `out_dir`; returns whether a tokenizer was saved."""
    side.save_configs(out_dir)
    tokenizer_saved = side.save_tokenizer(out_dir) if tokenizer else False
    if plan.adapter_config is not None:
        write_adapter_config(out_dir, plan.adapter_config)
    create_files(out_dir, plan.plan)
    index = plan.model_plan.index_json(plan.total_parameters)
    if index is not None:
        with open(os.path.join(out_dir, layout.INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(index)
            f.flush()
            for_path(out_dir).sync_open(f)
    return tokenizer_saved
