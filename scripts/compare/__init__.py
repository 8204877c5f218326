"""`make compare`: verl's trainer with its defaults vs each recipe, bit for bit (`python -m scripts.compare.quality_proof`),
and the wandb-run comparison it draws with (`python -m scripts.compare.runs`)."""
