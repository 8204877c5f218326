"""`slimckpt verify <dir>`: is this checkpoint whole? One line per bad file, exit 1 if any.

    slimckpt verify ckpts/global_step_40/actor          # one role dir (incremental or verl's own)
    slimckpt verify ckpts/global_step_40                # every role of a step, and data.pt
    slimckpt verify ckpts                               # every step, and the tracker file
    slimckpt verify merged_model/ [--quick] [--json]    # a `slimckpt merge` output

What it accepts (found by what the dir holds):
- a merge output (`manifest.json`, slimckpt.layout.merge_manifest): size and checksum of every file, files not
  in the manifest, the manifest's own checksum;
- an incremental role dir (`slimckpt_resume.json`, slimckpt.layout.resume_manifest): the same checks,
  and each bad file's line is exactly the message a load of this step refuses with;
- a verl-native role dir (no manifest): what can be checked without one (verify_native), and
  what could not, printed as `not checked:` lines;
- a step dir `global_step_N/` (each role dir, and data.pt) and a checkpoint root (every step,
  and whether latest_checkpointed_iteration.txt names a step that is whole).
Exit status: 0 whole, 1 something is bad, 2 not a checkpoint dir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

import slimckpt.layout.resume_manifest as rm
import slimckpt.verify.native as verify_native
from slimckpt import SlimckptError
from slimckpt.engine.pickle_policy import REFUSED_PREFIX, set_trusted
from slimckpt.engine.step_pickles import dcp_refusals
from slimckpt.layout import merge_manifest
from slimckpt.layout.dropped_optimizer import DROPPED_KEY
from slimckpt.storage import UnknownStorage, absolute, for_path, in_flight, is_file, is_url

MERGE_FIX = "re-create this output (slimckpt merge into a new --target_dir)"
REFUSED_FIX = "verl and torch never write that global: do not load this checkpoint unless you trust who made it"
STEP_RE = re.compile(r"^global_step_(\d+)$")
PROGRESS_MIN_BYTES = 256 << 20

KIND_MERGE = "merge output"
KIND_INCREMENTAL = "incremental"
KIND_NATIVE = "verl native"
KIND_STEP = "step"
KIND_ROOT = "checkpoint root"


class NotACheckpoint(SlimckptError, RuntimeError):
    """The path is none of the dirs verify knows; the message says what it expected."""


@dataclass
class Problem:
    file: str  # absolute path of the bad file (or dir)
    reason: str
    message: str  # the one line printed: names the file and the fix


@dataclass
class Report:
    target: str
    checked: list[dict] = field(default_factory=list)  # {"path", "kind"} of every dir checked
    bad: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.bad

    def add(self, path: str, reason: str, fix: str) -> None:
        self.bad.append(Problem(path, reason, f"slimckpt: {path}: {reason}; {fix}"))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "ok": self.ok,
            "checked": self.checked,
            "bad": [asdict(p) for p in self.bad],
            "not_checked": self.notes,
            "files": self.files,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
        }


# --------------------------------------------------------------------------- what a dir is


def role_kind(path: str) -> str | None:
    """The kind of a role-level dir (one manifest or one verl save), or None."""
    store = for_path(path)
    if is_file(os.path.join(path, merge_manifest.MANIFEST_NAME)):
        return KIND_MERGE
    if rm.has_manifest(path) or store.is_dir(os.path.join(path, "dcp")):
        return KIND_INCREMENTAL
    if store.is_local and verify_native.is_native_dir(path):  # verl's own rank files live on local disk only
        return KIND_NATIVE
    names = store.list_dir(path)
    if not store.is_local and any(n == "fsdp_config.json" or n.startswith("slimckpt_") for n in names):
        return KIND_INCREMENTAL  # only the incremental tier saves to a remote medium: a save cut short
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return KIND_MERGE  # a model dir without its manifest: reported as never committed
    return None


def detect(path: str) -> str:
    if not for_path(path).is_dir(path):
        raise NotACheckpoint(
            f"{path}: no such directory; pass a checkpoint dir (trainer.default_local_dir, "
            f"a global_step_N dir, a role dir such as global_step_N/actor, or a merge output)"
        )
    kind = role_kind(path)
    if kind:
        return kind
    if STEP_RE.match(os.path.basename(path.rstrip("/"))):
        return KIND_STEP
    names = for_path(path).list_dir(path)
    if rm.TRACKER_NAME in names or any(STEP_RE.match(n) for n in names):
        return KIND_ROOT
    if path.rstrip(os.sep).endswith(merge_manifest.PARTIAL_SUFFIX):
        return KIND_MERGE  # a merge that never committed: reported as such below
    raise NotACheckpoint(
        f"{path}: not a checkpoint dir (no manifest.json, {rm.MANIFEST_NAME}, fsdp_config.json, "
        f"rank files or global_step_* dirs); pass trainer.default_local_dir or a dir inside it"
    )


# --------------------------------------------------------------------------- checks per kind


def check_merge(report: Report, path: str, quick: bool, on_bytes: Callable[[int], object] | None) -> None:
    if path.rstrip(os.sep).endswith(merge_manifest.PARTIAL_SUFFIX):
        report.add(path, "an unfinished merge (never renamed into place)", "delete it and re-run slimckpt merge")
        return
    bad = merge_manifest.verify(path, checksums=not quick, on_bytes=on_bytes)
    for b in bad:
        report.add(os.path.join(path, b.name), b.reason, MERGE_FIX)
    try:
        m = merge_manifest.read_manifest(path)
        report.files += len(m.files) + 1
        report.bytes += sum(e.size for e in m.files.values())
    except (OSError, ValueError, KeyError, TypeError, merge_manifest.CommitError):
        pass
    if quick:
        report.note("--quick: sizes only, checksums not compared")


def check_incremental(report: Report, path: str, quick: bool, on_bytes: Callable[[int], object] | None) -> None:
    # the load's own definition of intact (resume_manifest.role_damage), so each line here is the
    # line a load of this step refuses with
    m, damage = rm.role_damage(path, checksums=not quick, on_bytes=on_bytes)
    for d in damage:
        report.bad.append(Problem(d.file, d.reason, d.message))
    if m is None:
        return
    if not quick:
        for refused in dcp_refusals(path):
            report.add(refused.path, refused.reason, REFUSED_FIX)
    report.files += len(m.files) + 1
    report.bytes += sum(e.size for e in m.files)
    if DROPPED_KEY in m.extra:  # retention's keep_optimizer_last: a committed step that holds less
        report.note(
            f"{path}: optimizer state dropped by retention (keep_optimizer_last): holds "
            f"{'+'.join(m.contents)}, a resume from it starts the optimizer afresh"
        )
    if quick:
        report.note("--quick: sizes only, checksums not compared")


def check_native(report: Report, path: str, quick: bool, on_bytes: Callable[[int], object] | None) -> None:
    result = verify_native.check_native(path, on_bytes=on_bytes, quick=quick)
    for b in result.bad:
        report.add(os.path.join(path, b.name), b.reason, _fix(b.reason, verify_native.NATIVE_FIX))
    report.files += result.files
    report.bytes += result.bytes
    hf = os.path.join(path, verify_native.HF_SUBDIR)
    if os.path.isfile(os.path.join(hf, merge_manifest.MANIFEST_NAME)):  # the intermediate tier's export
        report.checked.append({"path": hf, "kind": KIND_MERGE})
        check_merge(report, hf, quick, on_bytes)
    for n in result.notes:
        report.note(f"{KIND_NATIVE} ({path}): {n}" if n.startswith("files verl") else f"{KIND_NATIVE}: {n}")


def _fix(reason: str, fix: str) -> str:
    return REFUSED_FIX if reason.startswith(REFUSED_PREFIX) else fix


def check_role(report: Report, path: str, kind: str, quick: bool, on_bytes) -> None:
    report.checked.append({"path": path, "kind": kind})
    {KIND_MERGE: check_merge, KIND_INCREMENTAL: check_incremental, KIND_NATIVE: check_native}[kind](
        report, path, quick, on_bytes
    )


def check_step(report: Report, path: str, quick: bool, on_bytes) -> None:
    report.checked.append({"path": path, "kind": KIND_STEP})
    roles = 0
    store = for_path(path)
    for name in store.list_dir(path):
        sub = os.path.join(path, name)
        if store.is_dir(sub):
            kind = role_kind(sub)
            if kind is None:
                report.add(
                    sub,
                    "neither slimckpt's nor verl's checkpoint (no manifest, fsdp_config.json or rank "
                    "files): an interrupted save",
                    "resume from an earlier step, or delete this step",
                )
                continue
            roles += 1
            check_role(report, sub, kind, quick, on_bytes)
        elif name == "data.pt":
            report.files += 1
            report.bytes += store.size(sub)
            reason = None if quick else verify_native.check_torch_file(sub, on_bytes)
            if reason:
                report.add(
                    sub, reason, _fix(reason, "resume from an earlier step (it holds the dataloader's position)")
                )
            report.note("data.pt (dataloader state): no checksum is recorded; checked that it is whole and loads")
    if roles == 0:
        report.add(path, "holds no role dir (actor/, critic/, ...)", "delete it; its save never wrote a role")


def check_root(report: Report, path: str, quick: bool, on_bytes) -> None:
    report.checked.append({"path": path, "kind": KIND_ROOT})
    store = for_path(path)
    steps = sorted(
        (int(m.group(1)), n)
        for n in store.list_dir(path)
        if (m := STEP_RE.match(n)) and store.is_dir(os.path.join(path, n))
    )
    whole: dict[int, bool] = {}
    for step, name in steps:
        before = len(report.bad)
        check_step(report, os.path.join(path, name), quick, on_bytes)
        whole[step] = len(report.bad) == before
    tracker = os.path.join(path, rm.TRACKER_NAME)
    good = [s for s, ok in whole.items() if ok]
    fix = (
        f"write the newest whole step into it (echo {max(good)} > {tracker})"
        if good
        else "delete it (no step here is whole: training starts from scratch)"
    )
    if not is_file(tracker):
        if steps:
            report.note(f"{tracker} does not exist: resume_mode=auto starts from scratch")
        return
    named = rm.read_tracker(path)
    if named is None:
        report.add(tracker, "does not hold a step number", fix)
    elif named not in whole:
        report.add(tracker, f"names step {named}, which does not exist here", fix)
    elif not whole[named]:
        report.add(tracker, f"names step {named}, which is damaged (see the lines above)", fix)


def verify_path(path: str, quick: bool = False, on_bytes: Callable[[int], object] | None = None) -> Report:
    """Check `path` (any kind verify accepts); raises NotACheckpoint. Called in a training job, it
    first waits for the commits of that job's saves in flight under `path`."""
    path = absolute(path)
    if is_url(path):
        try:
            for_path(path).check_access(path)
        except OSError as exc:
            raise NotACheckpoint(str(exc)) from None
    else:
        in_flight.wait_for(path)
    kind = detect(path)
    report = Report(target=path)
    start = time.perf_counter()
    if kind == KIND_ROOT:
        check_root(report, path, quick, on_bytes)
    elif kind == KIND_STEP:
        check_step(report, path, quick, on_bytes)
    else:
        check_role(report, path, kind, quick, on_bytes)
    report.seconds = time.perf_counter() - start
    return report


def tree_bytes(path: str) -> int:
    store = for_path(path)
    return sum(store.size(os.path.join(path, rel)) for rel in store.list_files(path))


# --------------------------------------------------------------------------- the command (its arguments: verify.cli)


def run(args: argparse.Namespace) -> int:
    set_trusted(args.trust_pickle)
    try:
        for_path(args.dir)
    except UnknownStorage as exc:
        print(f"slimckpt verify: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "clean", False) and is_url(args.dir):
        try:
            aborted = for_path(args.dir).abort_uploads(args.dir.rstrip("/") + "/")
        except OSError as exc:
            print(f"slimckpt verify: error: {exc}", file=sys.stderr)
            return 2
        print(f"cleaned: {aborted} unfinished upload(s) under {args.dir} aborted")

    total = (
        0
        if args.quick or args.no_progress or not sys.stderr.isatty()
        else tree_bytes(args.dir)
        if for_path(args.dir).is_dir(args.dir)
        else 0
    )
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc="verify", disable=total < PROGRESS_MIN_BYTES, file=sys.stderr
    )
    try:
        report = verify_path(args.dir, quick=args.quick, on_bytes=bar.update)
    except NotACheckpoint as exc:
        bar.close()
        print(f"slimckpt verify: error: {exc}", file=sys.stderr)
        return 2
    bar.close()
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
        return 0 if report.ok else 1
    for p in report.bad:
        print(p.message)
    for n in report.notes:
        print(f"not checked: {n}")
    kinds = ", ".join(sorted({c["kind"] for c in report.checked}))
    if report.ok:
        print(
            f"OK: {report.target} ({kinds}; {report.files} files, {report.bytes / 2**20:.1f} MiB, "
            f"{report.seconds:.1f} s)"
        )
        return 0
    print(f"BAD: {report.target}: {len(report.bad)} problem(s) ({kinds})")
    return 1


__all__ = ["NotACheckpoint", "Problem", "Report", "detect", "run", "verify_path"]
