"""The cost model: what a checkpoint save will cost a rank and a node, from a model's config alone,
before a GPU is allocated (`slimckpt plan`, and `slimckpt dryrun --plan` for a composed config).

Data flows one way: `meta_model` (the model's parameters and export layout, from its config) and
`cost` (the arithmetic of one save; `stream` for async_save=stream, `node` for a node's memory and
the verdicts, `upload` for a save to an object store) feed `build` (one run's report), which
`printers` shows and `command` (the CLI) and `dryrun` (the dry run's plan) call.
"""
