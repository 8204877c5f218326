"""RNG streams for ranks a resharded resume adds.

verl's extra state holds one RNG state per rank (`BaseCheckpointManager.get_rng_state`: torch's
CPU generator, numpy's global RandomState, python's `random`, and the accelerator's generator
where one is usable). Resuming on more ranks than were saved, the new ranks have no state of
their own; handing them a saved rank's state would make two ranks draw the same numbers (the
same dropout masks, for one), so each new rank gets a state derived from a saved
one and its own rank: distinct, and the same on every resume of that checkpoint.

Pure: no torch.distributed, no global generator touched.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

# changing it changes every derived stream: resumes of old checkpoints would then differ
_DOMAIN = b"slimckpt/rng-reshard/1"


def _encode(value: Any, out: list[bytes]) -> None:
    """A byte encoding of an RNG state that does not depend on the process (pickle's may)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        out += [b"T", str(t.dtype).encode(), repr(tuple(t.shape)).encode(), t.view(torch.uint8).numpy().tobytes()]
    elif isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        out += [b"A", a.dtype.str.encode(), repr(a.shape).encode(), a.tobytes()]
    elif isinstance(value, Mapping):
        out += [b"D", str(len(value)).encode()]
        for key in sorted(value, key=str):
            out.append(repr(key).encode())
            _encode(value[key], out)
    elif isinstance(value, (tuple, list)):
        out += [b"L", str(len(value)).encode()]
        for item in value:
            _encode(item, out)
    else:  # str, int, float, bool, None: repr is exact for all of them
        out += [b"S", repr(value).encode()]
    out.append(b";")


def _seed_bytes(source: Mapping[str, Any], rank: int) -> bytes:
    parts: list[bytes] = [_DOMAIN, str(int(rank)).encode()]
    _encode(source, parts)
    return hashlib.sha256(b"\0".join(parts)).digest()


def _generator_seed(seed: bytes, key: str) -> bytes:
    # one seed per generator, so no two of a rank's generators start from the same number
    return hashlib.sha256(seed + b"/" + key.encode()).digest()


def _torch_state(seed: bytes, device: str) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(seed[:8], "little") >> 1)  # 63 bits: a seed every backend accepts
    return generator.get_state()


def derive_rng_state(source: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """The RNG state of new rank `rank` (one the saved run did not have), derived from `source`,
    a saved rank's state as verl's `get_rng_state` returns it, in the same form, ready for
    `load_rng_state`.

    Every generator in `source` is seeded afresh from sha256(`source`'s bytes, `rank`): the same
    inputs give the same state; another rank, or another saved state, gives another one, and a
    freshly seeded generator does not take up a saved rank's stream. An accelerator's state
    (a key besides cpu/numpy/random) is derived only where that device is usable here; otherwise
    it is left out, as verl's `load_rng_state` would skip it anyway.
    """
    seed = _seed_bytes(source, rank)
    derived: dict[str, Any] = {}
    for key in source:
        s = _generator_seed(seed, key)
        if key == "cpu":
            derived[key] = _torch_state(s, "cpu")
        elif key == "numpy":
            derived[key] = np.random.RandomState(np.frombuffer(s, dtype=np.uint32)).get_state()
        elif key == "random":
            derived[key] = random.Random(int.from_bytes(s, "little")).getstate()
        else:
            try:
                derived[key] = _torch_state(s, key)
            except (RuntimeError, AssertionError):  # no such device (or no build for it) on this host
                continue
    return derived


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def reshard_message(saved_world: int, world: int) -> str | None:
    """The line a resharded resume logs about its RNG streams; None at the saved world size."""
    if world == saved_world:
        return None
    shared = min(world, saved_world)
    kept = (
        f"{_ranks(0, shared - 1)} "
        + ("resumes its saved stream" if shared == 1 else "resume their saved streams")
        + " exactly"
    )
    head = f"RNG resharded from world size {saved_world} to {world}: {kept}; "
    if world > saved_world:
        if world - saved_world == 1:
            return head + f"rank {saved_world} gets a new stream derived from saved rank 0 and its rank"
        return head + (
            f"{_ranks(saved_world, world - 1)} get new streams derived, rank r from saved rank "
            f"r % {saved_world}, and the rank"
        )
    if saved_world - world == 1:
        return head + f"the stream of saved rank {world} is not resumed"
    return head + f"the streams of saved {_ranks(world, saved_world - 1)} are not resumed"
