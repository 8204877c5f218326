"""The corruption campaign's damage: one kind of harm done to a copy of a checkpoint (truncated, a bit flipped in the
data or in a safetensors header, a file deleted, two files swapped, an extra file, the manifest edited), chosen
at random among the files of its format, and the files it touched (verify must name one). Nothing here verifies
or loads; scripts/faults/corruption.py does."""

from __future__ import annotations

import os
import random
import shutil
import struct
from dataclasses import dataclass

# lazy imports: slimckpt's manifest names load once a campaign runs (--help stays fast)


@dataclass
class Trial:
    fmt: str
    kind: str
    targets: list[str]  # files the damage touched (verify must name one)
    what: str


def _files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(out)


def _manifest_name(fmt: str) -> str:
    import slimckpt.layout.merge_manifest as mm
    import slimckpt.layout.resume_manifest as rm

    return {"merge": mm.MANIFEST_NAME, "incremental": rm.MANIFEST_NAME, "native": "fsdp_config.json"}[fmt]


def _flip(path: str, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def _safetensors_header_end(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _swappable(fmt: str, files: list[str]) -> list[tuple[str, str]]:
    """Pairs of files of the same role, different rank/shard."""
    if fmt == "merge":
        group = [f for f in files if f.endswith(".safetensors")]
    elif fmt == "incremental":
        group = [f for f in files if f.endswith(".distcp")]
        extra = [f for f in files if f.startswith("slimckpt_extra_")]
        return [(group[0], group[1]), (extra[0], extra[1])]
    else:
        pairs = []
        for kind in ("model", "optim", "extra_state"):
            ranks = [f for f in files if f.startswith(f"{kind}_world_size_")]
            pairs.append((ranks[0], ranks[1]))
        return pairs
    return [(group[i], group[i + 1]) for i in range(len(group) - 1)]


def damage(root: str, fmt: str, kind: str, rng: random.Random) -> Trial:
    """Apply one damage of `kind` to the copy at `root`."""
    manifest = _manifest_name(fmt)
    files = [f for f in _files(root) if f != manifest]
    if kind == "bitflip_header":  # the format's own headers: safetensors headers, .distcp bodies, zip headers
        if fmt == "merge":
            rel = rng.choice([f for f in files if f.endswith(".safetensors")])
            offset = rng.randrange(_safetensors_header_end(os.path.join(root, rel)))
        elif fmt == "incremental":
            rel = rng.choice([f for f in files if f.endswith(".distcp")])
            offset = rng.randrange(os.path.getsize(os.path.join(root, rel)))
        else:
            rel = rng.choice([f for f in files if f.endswith(".pt")])
            offset = rng.randrange(min(512, os.path.getsize(os.path.join(root, rel))))
        bit = rng.randrange(8)
        _flip(os.path.join(root, rel), offset, bit)
        return Trial(fmt, kind, [rel], f"flip bit {bit} of byte {offset} of {rel}")
    if kind == "manifest":
        how = rng.choice(("truncate", "bitflip", "delete"))
        path = os.path.join(root, manifest)
        size = os.path.getsize(path)
        if how == "truncate":
            os.truncate(path, rng.randrange(size))
        elif how == "bitflip":
            _flip(path, rng.randrange(size), rng.randrange(8))
        else:
            os.remove(path)
        return Trial(fmt, kind, [manifest], f"{how} {manifest}")
    if kind == "swap":
        a, b = rng.choice(_swappable(fmt, files))
        pa, pb = os.path.join(root, a), os.path.join(root, b)
        tmp = pa + ".swap"
        os.rename(pa, tmp)
        os.rename(pb, pa)
        os.rename(tmp, pb)
        return Trial(fmt, kind, [a, b], f"swap {a} and {b}")
    if kind == "extra":
        choices = {
            "merge": ["notes.txt", "model-99999-of-99999.safetensors"],
            "incremental": ["dcp/__2_0.distcp", "slimckpt_extra_world_size_4_rank_3.pt", "notes.txt"],
            "native": ["model_world_size_4_rank_3.pt", "notes.txt"],
        }[fmt]
        rel = rng.choice(choices)
        src = os.path.join(root, rng.choice([f for f in files if f.endswith((".pt", ".distcp", ".safetensors"))]))
        shutil.copyfile(src, os.path.join(root, rel)) if not rel.endswith(".txt") else open(
            os.path.join(root, rel), "w"
        ).write("stray\n")
        return Trial(fmt, kind, [rel], f"add stray {rel}")
    rel = rng.choice(files)
    path = os.path.join(root, rel)
    size = os.path.getsize(path)
    if kind == "truncate":
        new = rng.randrange(size) if size else 0
        os.truncate(path, new)
        return Trial(fmt, kind, [rel], f"truncate {rel} from {size} to {new} bytes")
    if kind == "bitflip":
        offset, bit = rng.randrange(size), rng.randrange(8)
        _flip(path, offset, bit)
        return Trial(fmt, kind, [rel], f"flip bit {bit} of byte {offset} of {rel}")
    if kind == "delete":
        os.remove(path)
        return Trial(fmt, kind, [rel], f"delete {rel}")
    raise ValueError(kind)
