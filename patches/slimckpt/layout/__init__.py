"""Layout: what checkpoint files hold and are called, decided before any byte moves. Pure: no torch,
no torch.distributed, no verl.

1. `names`: the on-disk names and the dtype tables every wing takes.
2. `safetensors_layout`: tensor specs -> files, headers and byte offsets of a Hugging Face output;
   `export_assign`: which rank writes which rows of each tensor in the gather-free export;
   `flowrl_names`: the parameters every export leaves out.
3. The records a step or an output is committed by: `merge_manifest` (an output dir's manifest and its
   checks), `resume_manifest` (an incremental step's commit record and the tracker),
   `dropped_optimizer` (retention's note that a step's optimizer went).
4. `retention_plan`: what retention does to each saved step of a role.
"""
