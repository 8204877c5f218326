"""Role dirs of the incremental tier for tests: a tiny dcp/ and its sealed manifest."""

from __future__ import annotations

from pathlib import Path

import slimckpt.engine.resume_records as rr
import slimckpt.layout.resume_manifest as rm


def role_dir(tmp_path: Path, step: int, role: str = "actor") -> Path:
    d = tmp_path / f"global_step_{step}" / role
    (d / "dcp").mkdir(parents=True)
    (d / "dcp" / "__0_0.distcp").write_bytes(b"x" * 100)
    (d / "dcp" / ".metadata").write_bytes(b"m" * 10)
    return d


def commit_manifest(d: Path, step: int) -> rm.Manifest:
    files = rm.describe_files(str(d), ["dcp/__0_0.distcp", "dcp/.metadata"])
    manifest = rm.Manifest(global_step=step, world_size=1, contents=["model"], files=files)
    rr.write_manifest(str(d), manifest)
    return manifest
