"""Run verl 0.9.1's own trainer on a machine without an accelerator (SLIMCKPT_CPU=1 only).

Pieces, each in its own module:
  platform.py       verl platform "cpu" (device "cpu", gloo, host RNG/memory calls)
  fixes.py          replacements for the verl attributes that assume an accelerator
  registrations.py  the entries CPU mode adds to verl's tables (platform, `hf` rollout, engines)
  sample_keys.py    carries each trajectory's (step, sample index, rollout n) to the rollout server
  sampling.py       seeded KV-cached sampling; hf_server.py / rollout.py: the `hf` rollout backend
  batch_order.py    a step's trajectories in dataset order, so CPU runs repeat bit for bit

All of them reach verl only through feature "cpu" of slimckpt.verl.patch_list, which slimckpt's
plugin switches on at `import verl` with SLIMCKPT_CPU=1. `check_host` refuses a machine with a GPU.
"""

# lazy imports: torch only to look for a GPU: the plugin imports this package at `import verl`
from __future__ import annotations

from slimckpt import env_vars
from slimckpt.log import get_logger

log = get_logger("slimckpt.cpu")

ENABLE_ENV = "SLIMCKPT_CPU"
FORCE_ENV = "SLIMCKPT_CPU_FORCE"


def check_host() -> None:
    """Refuse to run on CPU where a GPU is visible, unless the user insists (SLIMCKPT_CPU_FORCE=1)."""
    import torch

    if torch.cuda.is_available() and not env_vars.flag(FORCE_ENV):
        raise SystemExit(
            f"[slimckpt] {ENABLE_ENV}=1 asks verl to train on the CPU, but this machine has a CUDA GPU: "
            f"unset {ENABLE_ENV} to train on the GPU, or also set {FORCE_ENV}=1 to run on the CPU anyway"
        )
