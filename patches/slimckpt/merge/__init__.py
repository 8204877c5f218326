"""The offline merge (`slimckpt merge`, and verl's `python -m verl.model_merger merge` redirected here).

1. `cli` reads the arguments, `command` runs them (and `remote` an `s3://` input or output); `plan` holds the options,
   the result and the error a user can act on.
2. `pipeline` plans the output from the checkpoint (through `slimckpt.hf`: names, config, tokenizer,
   LoRA), then writes it with bounded memory through `workers` (here, in worker processes, or on
   torchrun ranks: `distributed`), then commits it with a manifest; `steps` holds what both ways
   share (the locks, the plan, the commit, the one-line error), `verl_fallback` verl's own merger for
   a checkpoint the streaming merge cannot reproduce.
3. `verl_merger`: verl's own merger command, redirected to the pipeline.

Modules are imported by name (nothing is re-exported here): the CLI's `--help` and a wrong
`--local_dir` answer before torch is imported."""
