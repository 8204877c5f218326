"""Hugging Face exports made during training.

1. `intermediate`: after verl has written a step's model shards, the merge runs on them (bounded).
2. `direct`: the incremental tier's gather-free export: every rank writes its own rows of each tensor
   straight into the planned safetensors files.
"""
