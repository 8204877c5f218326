"""Ways a committed incremental role dir rots on disk, for the damaged-newest-step scenario and
campaign: a flipped byte in a DCP data file, a truncated file, a deleted file, a damaged manifest
and a manifest stripped of its seal. Each returns what it did, naming the file."""

from __future__ import annotations

import json
import os
import random

from slimckpt.layout.merge_manifest import SEAL_KEY
from slimckpt.layout.resume_manifest import MANIFEST_NAME

KINDS = ("flip", "truncate", "delete", "manifest", "seal")


def _files(role_dir: str) -> list[str]:
    out = []
    for d, _, names in os.walk(role_dir):
        out += [os.path.relpath(os.path.join(d, n), role_dir) for n in names]
    return sorted(f for f in out if f != MANIFEST_NAME)


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0xFF]))


def damage_step(role_dir: str, kind: str, rng: random.Random) -> str:
    """Damage the committed role dir one way of KINDS; returns what was done (the file named)."""
    files = _files(role_dir)
    manifest = os.path.join(role_dir, MANIFEST_NAME)
    if kind == "flip":
        rel = rng.choice([f for f in files if f.endswith(".distcp")])
        offset = rng.randrange(os.path.getsize(os.path.join(role_dir, rel)))
        flip_byte(os.path.join(role_dir, rel), offset)
        return f"flip byte {offset} of {rel}"
    if kind == "truncate":
        rel = rng.choice([f for f in files if os.path.getsize(os.path.join(role_dir, f))])
        size = os.path.getsize(os.path.join(role_dir, rel))
        new = rng.randrange(size)
        os.truncate(os.path.join(role_dir, rel), new)
        return f"truncate {rel} from {size} to {new} bytes"
    if kind == "delete":
        rel = rng.choice(files)
        os.remove(os.path.join(role_dir, rel))  # damage on purpose, behind the storage's back
        return f"delete {rel}"
    if kind == "manifest":
        size = os.path.getsize(manifest)
        if rng.random() < 0.5:
            offset = rng.randrange(size)
            flip_byte(manifest, offset)
            return f"flip byte {offset} of {MANIFEST_NAME}"
        new = rng.randrange(size)
        os.truncate(manifest, new)
        return f"truncate {MANIFEST_NAME} from {size} to {new} bytes"
    if kind == "seal":
        with open(manifest) as f:
            data = json.load(f)
        data.pop(SEAL_KEY)
        with open(manifest, "w") as f:
            json.dump(data, f, indent=1)
        return f"strip {SEAL_KEY} from {MANIFEST_NAME}"
    raise ValueError(f"unknown damage {kind!r}; choose from {', '.join(KINDS)}")
