"""FlowRL (arXiv 2509.15207) for verl 0.9.1, as part of the slimckpt overlay.

Chosen with `+algo=flowrl` (overrides/algo/flowrl.yaml), which points the actor's
`policy_loss._target_` at `slimckpt_flowrl.config.FlowRLLossConfig`. Building that config (in the
driver's validation and in each actor worker, before the model is built) registers the policy
loss "flowrl" in verl's registry and applies the "flowrl" patches (slimckpt.verl.patch_list).

Pieces:
  names        which parameters belong to FlowRL (`is_flowrl_param`, in slimckpt.layout.flowrl_names): every HF export, the
               rollout weight sync and the mergers leave them out. Imports nothing heavy.
  loss.py      the per-sample objective (pure torch) and the registered loss "flowrl"
  head.py      Z_phi: the log-partition head on the mean of the prompt's last hidden states
  config.py    FlowRLLossConfig (verl's PolicyLossConfig plus beta, weight cap, head size)
  patches.py   what the "flowrl" patches do inside verl's FSDP engine and actor loss
"""

from slimckpt.layout.flowrl_names import LOG_Z_ATTR, is_flowrl_param

__all__ = ["LOG_Z_ATTR", "is_flowrl_param"]
