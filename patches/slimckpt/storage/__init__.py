"""Where checkpoint files live: `Storage` (base), one backend per medium, and `for_path`.

1. `for_path(path)` gives every wing the backend of a path: a plain path is the POSIX backend's
   (`posix`), a URL (`<scheme>://...`) the backend registered for its scheme (`s3`, over its parts:
   `s3_client`, `s3_upload`, `s3_ranges`, `s3_read`, `s3_conditional`, `s3_leases`, its errors in
   `s3_errors`). A new medium is one module here with a `Storage` subclass and one line in BACKENDS.
2. `base.Storage`: what slimckpt does to checkpoint files, one named method per step (ranged writes,
   atomic puts, the commit, leases, deletes, free space); `os_errors` words an OSError for the user.
3. `locks` (one writer or many readers, never retention under either) and `in_flight` (commits still
   running in this process, which a reader in the same job waits for).
4. `disk_probe`: timed writes and reads of a scratch file, for `slimckpt diskspeed` (never a checkpoint's).

Imports nothing of slimckpt's but the ground, so that every wing can stand on it.
"""

# lazy imports: a backend whose client library is an extra (s3: boto3) loads when its scheme is first used

from __future__ import annotations

import os
import re
from collections.abc import Callable

from slimckpt import SlimckptError
from slimckpt.storage.base import Lease, RangeWriter, Storage
from slimckpt.storage.posix import PosixStorage
from slimckpt.storage.s3 import S3Storage

LOCAL = ""  # the scheme of a plain path


def _s3() -> Storage:

    return S3Storage()


BACKENDS: dict[str, Callable[[], Storage]] = {
    LOCAL: PosixStorage,
    "s3": _s3,
}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BUCKET = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/]*")
_made: dict[Callable[[], Storage], Storage] = {}  # one instance per backend


def scheme_of(path: str) -> str:
    """ "s3" for "s3://bucket/key", LOCAL for a plain path."""
    m = _SCHEME.match(str(path))
    return m.group(1).lower() if m else LOCAL


class UnknownStorage(SlimckptError, ValueError):
    """A URL whose scheme no backend serves; the message names the path and the schemes known."""


def is_url(path: str) -> bool:
    return scheme_of(path) != LOCAL


def absolute(path: str) -> str:
    """`os.path.abspath` of a plain path; a URL as it is (abspath would fold its "//")."""
    return str(path) if is_url(path) else os.path.abspath(path)


def is_file(path: str) -> bool:
    """A file (not a directory, nor an object store's prefix) is at `path`."""
    store = for_path(path)
    return store.exists(path) and not store.is_dir(path)


_reached: set[str] = set()  # scheme://bucket whose access this process has checked


def check_access_once(path: str) -> None:
    """The storage's `check_access` of `path`, once per process and bucket (a rank's first save or
    load on a URL, before it writes: each rank may run on another node, with its own environment)."""
    if not is_url(path):
        return
    where = _BUCKET.match(str(path))
    key = where.group(0) if where else str(path)
    if key in _reached:
        return
    for_path(path).check_access(path)
    _reached.add(key)


def for_path(path: str) -> Storage:
    """The backend that holds `path` (one instance per scheme)."""
    scheme = scheme_of(path)
    store = _made.get(scheme)
    if store is None:
        make = BACKENDS.get(scheme)
        if make is None:
            known = ", ".join(repr(s) for s in sorted(BACKENDS) if s) or "none"
            raise UnknownStorage(
                f"{path}: no storage backend for {scheme}:// (URL schemes known: {known}); give a local path"
            )
        store = _made[scheme] = make()
    return store


__all__ = [
    "BACKENDS",
    "LOCAL",
    "Lease",
    "RangeWriter",
    "Storage",
    "UnknownStorage",
    "absolute",
    "check_access_once",
    "for_path",
    "is_file",
    "is_url",
    "scheme_of",
]
