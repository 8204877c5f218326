"""One line for an OSError while writing (a full or read-only filesystem...), with the fix of
whoever asked for the write: the same full disk means "choose another --target_dir" to
`slimckpt merge` and "point trainer.default_local_dir elsewhere" to a trainer saving a step.

The error a writer raises keeps its OSError (`os_failure`), so a caller higher up that knows
better what the user controls can say it again with its own fixes (`redescribe`).

Imports nothing of slimckpt's and no torch.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


@dataclass(frozen=True)
class OsErrorFixes:
    """What the user can do, in the words of the command they ran."""

    full: str  # the filesystem is full (or a quota, or the file size limit)
    not_writable: str


MERGE_FIXES = OsErrorFixes(
    full="free space or choose a --target_dir on another filesystem", not_writable="choose a writable --target_dir"
)


def _size(n: int) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{max(1, round(n / 1024))} KiB"


def describe_os_error(
    exc: OSError, path: str, need_bytes: int | None = None, *, fixes: OsErrorFixes, free_bytes: int | None = None
) -> str:
    """One line naming the path and what to do about it, in the words of the caller's `fixes`
    (`free_bytes`: a refusal before writing, which names what the filesystem had)."""
    where = exc.filename or path
    if exc.errno in DISK_FULL:
        need = f" (this output needs {_size(need_bytes)}" if need_bytes else ""
        if need and free_bytes is not None:
            need += f", the filesystem has {_size(free_bytes)} free; nothing was written"
        need += ")" if need else ""
        return f"{where}: no space left ({os.strerror(exc.errno)}){need}; {fixes.full}"
    if exc.errno in NOT_WRITABLE:
        return f"{where}: not writable ({os.strerror(exc.errno)}); {fixes.not_writable}"
    return f"{where}: {exc.strerror or exc}"


def os_failure(
    cls: type[Exception], exc: OSError, path: str, need_bytes: int | None = None, free_bytes: int | None = None
) -> Exception:
    """`cls(one line)` that keeps `exc`, `path`, `need_bytes` and `free_bytes` for `redescribe`. The
    line a writer raises it with is the merge's (the writers' own command); every other caller (a
    trainer's save or export) says it again with its fixes before a user reads it."""
    error = cls(describe_os_error(exc, path, need_bytes, fixes=MERGE_FIXES, free_bytes=free_bytes))
    error.os_error, error.os_path, error.need_bytes, error.free_bytes = exc, path, need_bytes, free_bytes
    return error


def redescribe(exc: BaseException, fixes: OsErrorFixes) -> str | None:
    """The line of an `os_failure` error with `fixes`; None for any other error."""
    os_error = getattr(exc, "os_error", None)
    if not isinstance(os_error, OSError):
        return None
    return describe_os_error(
        os_error,
        getattr(exc, "os_path", "") or "",
        getattr(exc, "need_bytes", None),
        fixes=fixes,
        free_bytes=getattr(exc, "free_bytes", None),
    )
