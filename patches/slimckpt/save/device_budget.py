"""Whether an incremental save on FSDP1 fits the GPU: the arithmetic, pure (no torch, no verl).

FSDP2 hands the incremental save views of the live shards. FSDP1 cannot: its sharded state dict
clones every parameter's rows out of the flat parameter, and its sharded optimizer state dict
all-gathers each unit's flat AdamW state before cutting the rows out, so the rank's model and
optimizer shards exist twice on the GPU while they are written. verl loads an offloaded model back
onto the GPU for a save (its engine's save_checkpoint), so param_offload does not move the model's
copy; optimizer_offload keeps the AdamW state, and so its copy, in host memory.

At the save's peak one GPU holds (bytes per parameter of the rank's shard, P/W):
  - what training keeps there between steps, for every role on that GPU: fp32 parameters and
    their gradients (8, none with param_offload), AdamW's two moments (8, none with
    optimizer_offload); the reference model's bf16 parameters (2, none with its param_offload);
  - the role being saved (roles save one after the other; the largest counts): its fp32 model
    parameters loaded back if they were offloaded (4), and the copy: model rows (4) and, unless its
    optimizer is offloaded, AdamW's rows (8);
  - the all-gathered state of the largest FSDP unit while it is cut (its full parameters x 8 for the
    two moments, or x 4 for the model when the optimizer lives on the host);
  - a reserve for what is not training state: the CUDA contexts of the trainer and the rollout
    server, NCCL's buffers, the sleeping rollout engine and the allocator's fragmentation.
Measured on an H200 (FSDP1, one rank, 1.6B parameters with AdamW): 12.3 GiB added for a 9.2 GiB
shard: the copy plus the gathered unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

FP32 = 4
BF16 = 2
ADAM = 8  # exp_avg + exp_avg_sq, fp32
RESERVE_SHARE = 0.10  # of the GPU: contexts, NCCL, the sleeping rollout, fragmentation


@dataclass(frozen=True)
class RoleOnGpu:
    """One FSDP role on a GPU: the parameters of its shard on one rank and what verl offloads."""

    name: str
    elements: int  # parameters of the rank's shard (all parameters / world size)
    param_offload: bool = False
    optimizer_offload: bool = False
    copies_on_save: bool = False  # an incremental save on FSDP1
    unit_elements: int = 0  # parameters of its largest FSDP unit, whole (FSDP1 gathers one at a time)

    def between_steps(self) -> int:
        held = 0 if self.param_offload else (FP32 + FP32) * self.elements  # params + grads
        return held + (0 if self.optimizer_offload else ADAM * self.elements)

    def save_adds(self) -> int:
        """What its save adds on the GPU over between_steps (0 when it makes no copy)."""
        if not self.copies_on_save:
            return 0
        loaded_back = FP32 * self.elements if self.param_offload else 0
        copy = FP32 * self.elements + (0 if self.optimizer_offload else ADAM * self.elements)
        gathered = (FP32 if self.optimizer_offload else ADAM) * self.unit_elements
        return loaded_back + copy + gathered

    def host_copy(self) -> int:
        """The copy's bytes that go to host memory instead (its AdamW rows, with optimizer_offload)."""
        return ADAM * self.elements if self.copies_on_save and self.optimizer_offload else 0


@dataclass(frozen=True)
class GpuPeak:
    """One GPU at an FSDP1 save's peak, by what holds it."""

    gpu_bytes: int
    training: int  # every role's state between steps, the reference model's too
    save: int  # the largest role's save over its state between steps
    reserve: int
    host_copy: int  # what the copy puts in host memory instead (the largest role's)
    host_copy_role: str
    saving: str  # the role whose save is the largest
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def need(self) -> int:
        return self.training + self.save + self.reserve

    @property
    def fits(self) -> bool:
        return self.need <= self.gpu_bytes

    @property
    def spare(self) -> int:
        return self.gpu_bytes - self.need


def gpu_peak(roles: Sequence[RoleOnGpu], gpu_bytes: int, ref_elements: int = 0, ref_offload: bool = True) -> GpuPeak:
    """The peak of the save of `roles` (those on one GPU) against `gpu_bytes`."""
    parts = {r.name: r.between_steps() for r in roles}
    if ref_elements and not ref_offload:
        parts["ref"] = BF16 * ref_elements
    largest = max(roles, key=lambda r: r.save_adds(), default=None)
    return GpuPeak(
        gpu_bytes=gpu_bytes,
        training=sum(parts.values()),
        save=largest.save_adds() if largest else 0,
        reserve=int(RESERVE_SHARE * gpu_bytes),
        host_copy=max((r.host_copy() for r in roles), default=0),
        host_copy_role=max(roles, key=lambda r: r.host_copy()).name if roles else "",
        saving=largest.name if largest else "",
        parts=parts,
    )


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


__all__ = ["ADAM", "BF16", "FP32", "RESERVE_SHARE", "GpuPeak", "RoleOnGpu", "gib", "gpu_peak"]
