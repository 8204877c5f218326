"""Where the environment campaign's writes land, one directory per (path, fault): a tmpfs mounted too small
(disk_full, and export_full at a calibrated size), a read-only tmpfs or else a chmod 555 directory (read_only), a
chmod 000 one (permission), or a plain one where the fault is set on the writer instead (the file-size limit, a
held lock); how each fault is made on this machine (Env.mechanism), and all of it undone by Env.close().
scripts/faults/env.py runs the merges and saves into them."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

from scripts.faults.env_report import MERGE_PATHS

FSIZE_LIMIT = 64 * 1024
FULL_SIZE = {"merge": "256k", "save": "64k"}  # below what each writes (merge ~0.9 MB, a save >= 100 KiB)


def _run(cmd: list[str]) -> bool:
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


class Env:
    """Mount points and directories for every (path, fault); undone by close()."""

    def __init__(self, work: str) -> None:
        self.work = work
        self.mounts: list[str] = []
        self.root = os.geteuid() == 0
        self.drop_caps = self.root and shutil.which("setpriv") is not None
        probe = os.path.join(work, "probe")
        os.makedirs(probe)
        self.can_mount = _run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe])
        if self.can_mount:
            _run(["umount", probe])

    def mount(self, where: str, size: str, read_only: bool = False) -> None:
        os.makedirs(where, exist_ok=True)
        opts = f"size={size}" + (",ro" if read_only else "")
        if not _run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", where]):
            raise RuntimeError(f"mount tmpfs at {where} failed")
        self.mounts.append(where)

    def mechanism(self, fault: str) -> str | None:
        """How `fault` is made here, or None when it cannot be (the row says skipped)."""
        if fault == "export_full":
            return "tmpfs: the save without half its HF export's weights" if self.can_mount else None
        if fault == "disk_full":
            return f"tmpfs ({FULL_SIZE['merge']} merge, {FULL_SIZE['save']} save)" if self.can_mount else None
        if fault == "fsize_limit":
            return f"RLIMIT_FSIZE {FSIZE_LIMIT // 1024} KiB"
        if fault == "read_only":
            if self.can_mount:
                return "read-only tmpfs (EROFS)"
            return "chmod 555" if (not self.root or self.drop_caps) else None
        if fault == "permission":
            if not self.root:
                return "chmod 000"
            return "chmod 000, writer without CAP_DAC_OVERRIDE (setpriv)" if self.drop_caps else None
        return "slimckpt writer lock held by another process"

    def base(self, path: str, fault: str, size: int | None = None) -> str:
        """The directory a (path, fault) writes under: the checkpoint root or the target's parent."""
        where = os.path.join(self.work, path, fault)
        if fault == "export_full":
            self.mount(where, str(size))
        elif fault == "disk_full":
            self.mount(where, FULL_SIZE["merge" if path in MERGE_PATHS else "save"])
        elif fault == "read_only" and self.can_mount:
            self.mount(where, "64k", read_only=True)
        else:
            os.makedirs(where, exist_ok=True)
            if fault == "read_only":
                os.chmod(where, 0o555)
            elif fault == "permission":
                os.chmod(where, 0o000)
        return where

    def close(self) -> None:
        for where in reversed(self.mounts):
            _run(["umount", where])
        for dirpath, dirs, _files in os.walk(self.work):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(dirpath, d), 0o755)
        with contextlib.suppress(OSError):
            os.chmod(self.work, 0o755)
