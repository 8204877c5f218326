"""What `slimckpt verify` can check of a verl-native role dir, which has no manifest.

verl's FSDP save writes per rank `{model,optim,extra_state}_world_size_{W}_rank_{r}.pt`, plus
`fsdp_config.json` and `huggingface/` on rank 0, and records no sizes or checksums. Checked here:

- fsdp_config.json parses and its world size matches the file names; every rank of that world
  size has each kind of file present; no file of another world size lies next to them.
- every .pt is a whole zip archive (torch's format) whose records all match the CRC32 torch's
  writer stores for each (so a truncation or a bit flip in tensor bytes is caught), whose
  archive name is the file's own name (torch names the archive after the file it writes: a
  renamed or swapped rank file shows), and which torch.load(mmap=True) opens with only the pickle
  globals verl and torch write (read.pickle_policy; any other is reported, never run): tensor bytes
  stay file-backed, never copied into anonymous memory.
- model and optimizer entries agree across ranks: same keys, same global shapes, and each rank's
  shard has the rows torch.chunk gives its mesh coordinate.
- huggingface/*.json parse; *.safetensors headers are valid and cover their files exactly.

What it cannot check is returned as notes: bytes torch's CRC32 does not cover (zip padding and
timestamps, harmless to a load), the meaning of JSON and tokenizer files that still parse, and
whether the state is the one the run wrote (no checksum of the whole was ever recorded).
"""

# lazy imports: torch only for a native step's sharded tensors; `slimckpt verify` reads manifests and indexes torch-free
from __future__ import annotations

import json
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from slimckpt.engine.pickle_policy import PickleRefused
from slimckpt.layout.dropped_optimizer import NATIVE_MARKER
from slimckpt.layout.merge_manifest import BadFile
from slimckpt.layout.names import DEFAULT_CHUNK_BYTES, DTYPE_BYTES, FSDP_CONFIG, HF_SUBDIR

RANK_FILE_RE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
NATIVE_FIX = "re-copy it from the training run, or resume from an earlier step"

NOTES = [
    "verl's format records no checksums: tensor bytes are covered only by the CRC32 torch stores per "
    "zip record (checked); zip padding, timestamps and other bytes outside the records are not covered",
    "JSON, tokenizer and other huggingface/ files: checked only that they parse, not that their values are "
    "the ones written",
    "that the files are the ones this run wrote: without a manifest, a whole file from another save of the "
    "same model, world size and name cannot be told apart",
]


@dataclass
class NativeResult:
    bad: list[BadFile]
    notes: list[str]
    files: int = 0
    bytes: int = 0


def is_native_dir(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, FSDP_CONFIG)) or any(RANK_FILE_RE.match(n) for n in os.listdir(path))


def native_bytes(role_dir: str) -> int:
    """Bytes check_native reads (for a progress bar)."""
    total = 0
    for name in os.listdir(role_dir):
        if RANK_FILE_RE.match(name):
            total += os.path.getsize(os.path.join(role_dir, name))
    return total


# --------------------------------------------------------------------------- zip / torch files


def check_zip_records(path: str, on_bytes: Callable[[int], object] | None = None) -> str | None:
    """Why a torch.save zip file is damaged (whole archive, archive name, CRC32 per record), or None."""
    stem = os.path.splitext(os.path.basename(path))[0]
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            if not infos:
                return "an empty zip archive, not a torch checkpoint"
            prefixes = {i.filename.split("/", 1)[0] for i in infos}
            # "archive": what torch.save names it when given a file object instead of a path
            if prefixes != {stem} and prefixes != {"archive"}:
                return (
                    f"holds archive {sorted(prefixes)[0]!r}, not {stem!r}: torch names the archive after the "
                    f"file it saves, so this file was renamed or swapped with another"
                )
            for info in infos:
                with zf.open(info) as member:
                    if info.CRC == 0 and info.file_size > 0:
                        member._expected_crc = None  # written with torch's CRC32 switched off
                    while chunk := member.read(DEFAULT_CHUNK_BYTES):
                        if on_bytes is not None:
                            on_bytes(len(chunk))
    except zipfile.BadZipFile as exc:
        return f"damaged zip archive ({exc})"
    except (OSError, EOFError, ValueError, zlib.error, struct.error) as exc:
        return f"unreadable ({type(exc).__name__}: {exc})"
    return None


def _load_reason(path: str) -> tuple[object, str | None]:
    try:
        from slimckpt.engine.verl_sources import load_mmap

        return load_mmap(path), None
    except PickleRefused as exc:
        return None, exc.reason
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged file
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"torch.load fails ({text[:160]})"


# --------------------------------------------------------------------------- shapes


def _shape_info(value) -> tuple | None:
    """(global shape, placements, local shape, mesh) of a tensor entry; None for non-tensors."""
    import torch

    from slimckpt.engine.verl_sources import sharded_tensor_metadata

    metadata = sharded_tensor_metadata(value)
    if metadata is not None:
        return tuple(metadata.size), "sharded_tensor", None, None
    if not isinstance(value, torch.Tensor):
        return None
    if hasattr(value, "placements") and hasattr(value, "_local_tensor"):
        return tuple(value.shape), tuple(str(p) for p in value.placements), tuple(value._local_tensor.shape), value
    return tuple(value.shape), None, tuple(value.shape), None


def _expected_local(dtensor, rank: int) -> tuple[int, ...] | None:
    """The local shape torch.chunk gives `rank` of this DTensor's mesh (None: rank not in it)."""
    mesh = dtensor.device_mesh.mesh
    hits = (mesh == rank).nonzero()
    if len(hits) == 0:
        return None
    coord = hits[0].tolist()
    shape = list(dtensor.shape)
    for mesh_dim, placement in enumerate(dtensor.placements):
        if placement.is_shard():
            n, c = mesh.shape[mesh_dim], coord[mesh_dim]
            length = shape[placement.dim]
            chunk = -(-length // n)
            shape[placement.dim] = max(0, min(chunk, length - c * chunk))
    return tuple(shape)


def _flatten(obj, prefix: str = "") -> dict[str, object]:
    """Tensor entries of a nested dict/list (optimizer state), keyed by path."""
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
    elif _shape_info(obj) is not None:
        out[prefix.rstrip(".")] = obj
    return out


def compare_ranks(kind: str, loaded: dict[int, object], names: dict[int, str]) -> list[BadFile]:
    """Same keys and global shapes on every rank; each DTensor shard the size of its rank's chunk."""
    bad: list[BadFile] = []
    flat = {r: _flatten(sd if kind != "optim" else (sd or {}).get("state", {})) for r, sd in loaded.items()}
    if not flat:
        return bad
    ref_rank = min(flat)
    ref = flat[ref_rank]
    for r, entries in sorted(flat.items()):
        if set(entries) != set(ref):
            diff = sorted(set(entries) ^ set(ref))
            bad.append(BadFile(names[r], f"its {kind} entries differ from rank {ref_rank}'s (e.g. {diff[:2]})"))
            continue
        for key, value in entries.items():
            g, placements, local, dtensor = _shape_info(value)
            g0, p0, _, _ = _shape_info(ref[key])
            if g != g0 or placements != p0:
                bad.append(
                    BadFile(
                        names[r], f"{key}: shape {g} {placements or ''}, rank {ref_rank} has {g0} {p0 or ''}".rstrip()
                    )
                )
                break
            if dtensor is not None:
                want = _expected_local(dtensor, r)
                if want is not None and want != local:
                    bad.append(
                        BadFile(
                            names[r],
                            f"{key}: holds a {local} shard, rank {r} of this mesh owns {want}: "
                            f"a rank file of another rank or run",
                        )
                    )
                    break
    return bad


# --------------------------------------------------------------------------- huggingface/


def check_safetensors_header(path: str) -> str | None:
    """Why a .safetensors file's header is invalid (length, JSON, offsets cover the data), or None."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes: too short for a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                return f"header length {n} does not fit in {size} bytes"
            header = json.loads(f.read(n).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        return f"unreadable safetensors header ({exc})"
    if not isinstance(header, dict):
        return "safetensors header is not a JSON object"
    spans = []
    sizes = DTYPE_BYTES
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in t["data_offsets"])
            count = 1
            for d in t["shape"]:
                count *= int(d)
            width = sizes.get(t["dtype"])
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r}: malformed header entry"
        if width is not None and end - begin != count * width:
            return f"tensor {name!r}: {end - begin} bytes for shape {t['shape']} {t['dtype']}"
        spans.append((begin, end))
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos or end < begin:
            return f"tensor data offsets leave a gap or overlap at byte {pos}"
        pos = end
    if pos != size - 8 - n:
        return f"tensor data ends at {pos}, the file holds {size - 8 - n} bytes after the header"
    return None


def check_hf_dir(role_dir: str) -> tuple[list[BadFile], int]:
    """JSON files parse, config.json names a model, safetensors headers are valid. (bad, files checked)"""
    hf = os.path.join(role_dir, HF_SUBDIR)
    bad: list[BadFile] = []
    if not os.path.isdir(hf):
        return [BadFile(HF_SUBDIR + "/config.json", "missing (verl writes huggingface/config.json on rank 0)")], 0
    count = 0
    if not os.path.isfile(os.path.join(hf, "config.json")):
        bad.append(BadFile(HF_SUBDIR + "/config.json", "missing (verl writes it on rank 0 with every save)"))
    for name in sorted(os.listdir(hf)):
        rel, path = f"{HF_SUBDIR}/{name}", os.path.join(hf, name)
        if not os.path.isfile(path):
            continue
        count += 1
        if name.endswith(".json"):
            try:
                with open(path, "rb") as f:
                    data = json.loads(f.read().decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                bad.append(BadFile(rel, f"not valid JSON ({str(exc)[:120]})"))
                continue
            if name == "config.json" and not (
                isinstance(data, dict) and (data.get("model_type") or data.get("architectures"))
            ):
                bad.append(BadFile(rel, "names no model_type or architectures"))
        elif name.endswith(".safetensors"):
            reason = check_safetensors_header(path)
            if reason:
                bad.append(BadFile(rel, reason))
    names = set(os.listdir(hf))
    vocab = names & TOKENIZER_FILES
    if vocab and "tokenizer_config.json" not in names:
        bad.append(
            BadFile(
                HF_SUBDIR + "/tokenizer_config.json",
                f"missing, next to {sorted(vocab)[0]} (a tokenizer saved by save_pretrained has both)",
            )
        )
    elif "tokenizer_config.json" in names and not vocab:
        bad.append(
            BadFile(
                HF_SUBDIR + "/tokenizer.json",
                "missing: tokenizer_config.json is there but no tokenizer "
                "file (tokenizer.json, vocab.json, tokenizer.model)",
            )
        )
    return bad, count


# a tokenizer's own files, one of which save_pretrained writes next to tokenizer_config.json
TOKENIZER_FILES = {"tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model", "merges.txt"}


# --------------------------------------------------------------------------- the role dir


def _read_world(role_dir: str) -> tuple[int | None, BadFile | None]:
    path = os.path.join(role_dir, FSDP_CONFIG)
    if not os.path.isfile(path):
        return None, BadFile(
            FSDP_CONFIG, "missing (verl writes it on rank 0 after the shards: the save was interrupted)"
        )
    try:
        with open(path, "rb") as f:
            world = int(json.loads(f.read().decode("utf-8"))["world_size"])
        if world < 1:
            raise ValueError(world)
        return world, None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return None, BadFile(
            FSDP_CONFIG, f'unreadable ({type(exc).__name__}: {exc}); verl writes {{"FSDP_version": 2, "world_size": W}}'
        )


def check_native(role_dir: str, on_bytes: Callable[[int], object] | None = None, quick: bool = False) -> NativeResult:
    """Every check above; `quick`: names, fsdp_config.json and huggingface/ only (no file is read)."""
    bad: list[BadFile] = []
    world, problem = _read_world(role_dir)
    if problem:
        bad.append(problem)
    by_kind: dict[str, dict[int, str]] = {}
    worlds: dict[int, list[str]] = {}
    for name in sorted(os.listdir(role_dir)):
        m = RANK_FILE_RE.match(name)
        if m:
            worlds.setdefault(int(m.group(2)), []).append(name)
    if world is None and len(worlds) == 1:
        world = next(iter(worlds))
    elif world is not None and worlds and world not in worlds:
        bad.append(
            BadFile(
                FSDP_CONFIG,
                f"says world size {world}, the rank files are of world size {', '.join(map(str, sorted(worlds)))}",
            )
        )
        if len(worlds) == 1:  # the names agree among themselves: check the files by them
            world = next(iter(worlds))
    for w, names in sorted(worlds.items()):
        if w != world:
            bad += [
                BadFile(
                    n, f"of world size {w}, but {FSDP_CONFIG} says world size {world}: a stale file of another save"
                )
                for n in names
            ]
            continue
        for name in names:
            m = RANK_FILE_RE.match(name)
            by_kind.setdefault(m.group(1), {})[int(m.group(3))] = name
    dropped = os.path.isfile(os.path.join(role_dir, NATIVE_MARKER))
    if dropped:  # retention's keep_optimizer_last: no optim file is expected, a leftover one is finished later
        by_kind.pop("optim", None)
    if world is not None and not by_kind:
        bad.append(BadFile(f"model_world_size_{world}_rank_0.pt", "missing: no rank file of any kind"))
    for kind, ranks in sorted(by_kind.items()):
        for r in range(world or 0):
            if r not in ranks:
                bad.append(
                    BadFile(
                        f"{kind}_world_size_{world}_rank_{r}.pt",
                        f"missing ({FSDP_CONFIG} says world size {world}; rank {r} has none)",
                    )
                )
    files = sum(len(v) for v in by_kind.values())
    nbytes = 0
    if not quick:
        for kind in ("model", "optim", "extra_state"):
            loaded: dict[int, object] = {}
            for r, name in sorted(by_kind.get(kind, {}).items()):
                path = os.path.join(role_dir, name)
                nbytes += os.path.getsize(path)
                reason = check_zip_records(path, on_bytes)
                if reason is None:
                    obj, reason = _load_reason(path)
                    if reason is None and not isinstance(obj, dict):
                        reason = f"holds a {type(obj).__name__}, not a state dict"
                    if reason is None:
                        loaded[r] = obj
                if reason:
                    bad.append(BadFile(name, reason))
            if kind in ("model", "optim") and len(loaded) > 1:
                bad += compare_ranks(kind, loaded, by_kind[kind])
            loaded.clear()
    hf_bad, hf_files = check_hf_dir(role_dir)
    bad += hf_bad
    notes = list(NOTES)
    if quick:
        notes.insert(0, "--quick: rank files were not opened (no CRC32, load or shape check)")
    if dropped:
        notes.insert(
            0,
            f"optimizer state dropped by retention (keep_optimizer_last; {NATIVE_MARKER}): model and "
            f"extra state checked, a resume from it starts the optimizer afresh",
        )
    others = sorted(
        n
        for n in os.listdir(role_dir)
        if os.path.isfile(os.path.join(role_dir, n))
        and not RANK_FILE_RE.match(n)
        and n not in (FSDP_CONFIG, NATIVE_MARKER)
    )
    if others:
        notes.append(f"files verl's format does not define, not checked: {', '.join(others[:8])}")
    return NativeResult(bad, notes, files + hf_files + 1, nbytes)


def check_torch_file(path: str, on_bytes: Callable[[int], object] | None = None) -> str | None:
    """A single torch.save file outside a role dir (the trainer's data.pt): zip records and load."""
    reason = check_zip_records(path, on_bytes)
    if reason is None:
        _, reason = _load_reason(path)
    return reason
