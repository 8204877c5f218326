"""The Hugging Face side of an export, below both the offline merge and the in-training export.

1. `naming`: what save_pretrained names, drops and writes.
2. `lora`: a peft actor's base model and adapter.
3. `plan`: the one `ExportPlan` (output names -> checkpoint tensors).
4. `lay_out`: the output dir before its weights (config.json, generation_config.json, tokenizer).
"""
