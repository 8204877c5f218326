"""The cost model: what a checkpoint save will cost a rank and a node, from a model's config alone,
before a GPU is allocated (`slimckpt plan`, and `slimckpt dryrun --plan` for a composed config).

1. `meta_model`: the model's parameters and export layout, from its config.
2. `cost`: the arithmetic of one save (`stream` for async_save=stream, `node` for a node's memory and
   the verdicts, `upload` for an object store, `resume_time` for a resume's check and convert).
3. `build`: one run's report from those; `printers` shows it.
4. `command` (`slimckpt plan`; its arguments in `cli`) and `dryrun` (the dry run's plan; its arguments in
   `dryrun_cli`) call it; `assumed` holds the defaults a plan assumes.
"""
