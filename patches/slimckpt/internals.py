"""Every torch and transformers internal slimckpt uses, with the releases it was checked on.

A private name (`_write_item`, `_init_optim_state`) or a helper a library does not
document (`transformers.core_model_loading.revert_weight_conversion`) can change in any release.
Each one slimckpt's code calls is an `Internal` here: where it lives, the minor releases of its
package it was read and tested on (verl 0.9.1's GPU stack, torch 2.11 + transformers 5.9, and the
CPU pins of `make install`, torch 2.13 + transformers 5.10; `make test-verl-stack` runs the first),
and what the calling code does instead on any other release. `lookup(name)` is the only way code
reaches one:

  - on a checked release it returns the object, and raises InternalMissing if it is not there
    (a broken install or a wrong entry here: never silently the slower path);
  - on any other release it logs one warning naming the internal, the installed and the checked
    releases, and the fallback, and returns None: the caller takes the public API. With
    SLIMCKPT_TRUST_INTERNALS=1 it returns the object anyway where it still imports (a release not
    yet checked here), and warns that it does.

Pickle globals a checkpoint names (`torch._utils._rebuild_tensor_v2`, DTensor's classes) are not
calls into torch and are not listed here: they are the allow-list of engine/pickle_policy.py, and a
global a release renames is refused by name (tests/engine/test_pickle_policy.py runs on both stacks).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any

from slimckpt import SlimckptError, env_vars
from slimckpt.log import get_logger

log = get_logger("slimckpt.internals")

TRUST_ENV = "SLIMCKPT_TRUST_INTERNALS"

# verl 0.9.1's GPU extras (verl[vllm], verl[sglang], verl[fsdp]) pin torch 2.11.0 and transformers
# 5.9.0; `make install` pins torch 2.13.0 (CPU build) and resolves transformers 5.10.
CHECKED_TORCH = ("2.11", "2.13")
CHECKED_TRANSFORMERS = ("5.9", "5.10")


@dataclass(frozen=True)
class Internal:
    name: str  # "module:attribute[.attribute]"
    package: str  # the distribution whose release decides: "torch" or "transformers"
    checked: tuple[str, ...]  # its minor releases ("2.11") this use was read and tested on
    used_by: str  # the module of ours that calls it, and for what
    fallback: str  # what that module does on any other release


INTERNALS: dict[str, Internal] = {
    i.name: i
    for i in (
        Internal(
            "torch.distributed.checkpoint.filesystem:_write_item",
            "torch",
            CHECKED_TORCH,
            "engine/dcp_file_writer.py: DCP's per-item serializer, so the bounded writer's files are torch's own",
            "FileSystemWriter's own loop: each rank file keeps its tensors in host memory until it is written",
        ),
        Internal(
            "torch.distributed.checkpoint.filesystem:FileSystemWriter._write_data",
            "torch",
            CHECKED_TORCH,
            "engine/dcp_file_writer.py: the method the bounded writer replaces (its queue of (path, key, items))",
            "FileSystemWriter's own loop: each rank file keeps its tensors in host memory until it is written",
        ),
        Internal(
            "torch.distributed.checkpoint.state_dict:_init_optim_state",
            "torch",
            CHECKED_TORCH,
            "save/optim_capture.py: skipped, so a save before the first update does not step the optimizer",
            "torch's initialization runs: an optimizer saved before its first update gets Adam's step 1",
        ),
        Internal(
            "torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
            "torch",
            CHECKED_TORCH,
            "save/export/direct.py, slimckpt_testing/: the box of a DTensor this rank holds",
            "DTensor.__create_chunk_list__ (the chunk DCP itself saves)",
        ),
        Internal(
            "torch.distributed.distributed_c10d:_get_default_group",
            "torch",
            CHECKED_TORCH,
            "dist/heartbeat.py: the default group's timeout (its backend's options._timeout), for our own groups",
            "our gloo groups get torch's default timeout (30 minutes)",
        ),
        Internal(
            "torch.distributed.distributed_c10d:_get_default_store",
            "torch",
            CHECKED_TORCH,
            "dist/heartbeat.py: the job's store, where each rank's heartbeat lives",
            "no heartbeat: a failed collective's error does not name the rank that was lost",
        ),
        Internal(
            "torch.testing._internal.distributed.fake_pg:FakeStore",
            "torch",
            CHECKED_TORCH,
            "slimckpt_testing/verl_checkpoints/fake_pg_checkpoint.py, convert/command.py: the fake process group (its store; importing it "
            "registers the backend) a big checkpoint is made with, and convert writes another world size's "
            "DTensors with",
            "none in torch's public API: the test builder and convert stop, saying so",
        ),
        Internal(
            "torch._subclasses.fake_tensor:FakeTensorMode",
            "torch",
            CHECKED_TORCH,
            "convert/rank_file.py: tensors without storage, for the skeleton torch.save lays a rank file out from",
            "none in torch's public API: convert stops, saying so",
        ),
        Internal(
            "transformers.core_model_loading:revert_weight_conversion",
            "transformers",
            CHECKED_TRANSFORMERS,
            "hf/naming.py: the names and splits (MoE experts) save_pretrained writes",
            "the merge hands the model to verl's merger, which calls save_pretrained",
        ),
    )
}


class InternalMissing(SlimckptError, RuntimeError):
    """A listed internal is not where it is listed, on a release it was checked on."""


_WARNED: set[str] = set()
_LOCK = threading.Lock()


def release(package: str) -> str:
    """The installed minor release of `package` ("2.11" for torch 2.11.0+cu130)."""
    module = importlib.import_module(package)
    parts = str(module.__version__).split("+")[0].split(".")
    return ".".join(parts[:2])


def checked(name: str) -> bool:
    """Whether the installed release of the package behind `name` is one it was checked on."""
    internal = INTERNALS[name]
    return release(internal.package) in internal.checked


def resolve(name: str) -> Any:
    """The object `name` points at; raises ImportError or AttributeError."""
    module_name, _, attr = name.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def lookup(name: str) -> Any | None:
    """The internal `name` where its release was checked; None on any other, after one warning
    (the caller then takes the fallback INTERNALS[name] names). See the module doc."""
    internal = INTERNALS[name]
    have = release(internal.package)
    if have in internal.checked:
        try:
            return resolve(name)
        except (ImportError, AttributeError) as exc:
            raise InternalMissing(
                f"{internal.package} {have} has no {name} ({type(exc).__name__}: {exc}), though slimckpt was "
                f"checked on {internal.package} {have}: reinstall {internal.package}, or report it with "
                f"`pip show {internal.package}`"
            ) from None
    trusted = env_vars.flag(TRUST_ENV)
    obj = None
    if trusted:
        try:
            obj = resolve(name)
        except (ImportError, AttributeError):
            obj = None
    _warn_once(
        name,
        f"slimckpt: {internal.package} {have} is not a release {name} was checked on "
        f"({', '.join(internal.checked)}); "
        + (
            f"{TRUST_ENV}=1: using it anyway"
            if obj is not None
            else f"{internal.used_by.split(':')[0]} uses the public path instead: {internal.fallback}"
            + ("" if trusted else f" ({TRUST_ENV}=1 uses the internal where it still imports)")
        ),
    )
    return obj


def _warn_once(name: str, message: str) -> None:
    with _LOCK:
        if name in _WARNED:
            return
        _WARNED.add(name)
    log.warning(message)


def dtensor_box(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the block of DTensor `value` this rank holds."""
    compute = lookup("torch.distributed.tensor._utils:compute_local_shape_and_global_offset")
    if compute is not None:
        shape, offset = compute(value.shape, value.device_mesh, value.placements)
        return tuple(shape), tuple(offset)
    chunks = value.__create_chunk_list__()
    if len(chunks) != 1:
        raise ValueError(f"a DTensor with {len(chunks)} local chunks (one expected)")
    return tuple(chunks[0].sizes), tuple(chunks[0].offsets)
