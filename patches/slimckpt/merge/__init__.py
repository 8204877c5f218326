"""The offline merge (`slimckpt merge`, and verl's `python -m verl.model_merger merge` redirected here):
plan the output from the checkpoint (through `slimckpt.hf`: names, config, tokenizer, LoRA), write it
with bounded memory (here, in worker processes, or on torchrun ranks), commit it with a manifest.

Modules are imported by name (nothing is re-exported here): the CLI's `--help` and a wrong
`--local_dir` answer before torch is imported."""
