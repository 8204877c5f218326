"""Leases over S3, which has no lock that dies with its holder.

Exclusive: a small JSON object put with `If-None-Match: *` (holder, expiry `SLIMCKPT_S3_LEASE_S` ahead),
renewed by its holder every quarter of that; a writer finding one held watches it until it expires:
renewed, it is busy; expired unrenewed (its holder was killed), it is taken over. Shared: granted without
an object (a reader of a committed step is protected by the commit rules instead).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from slimckpt import env_vars
from slimckpt.storage.base import Lease, Storage
from slimckpt.storage.s3_client import CLIENT, call, split
from slimckpt.storage.s3_conditional import put_new, require_conditional_writes
from slimckpt.storage.s3_errors import S3Error


class S3Lease(Lease):
    """A lease held on S3. An exclusive one is renewed by a thread every quarter of
    `SLIMCKPT_S3_LEASE_S` while it is held, so it expires that long after its holder dies (a SIGKILL, a
    lost node) and the next writer takes it over then, instead of being refused until a long expiry."""

    def __init__(self, store: Storage, key: str, exclusive: bool, token: str | None, body: dict) -> None:
        self.store, self.key, self.exclusive = store, key, exclusive
        self.token, self.body = token, body
        self.held = True
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        if exclusive:
            threading.Thread(target=self.renew_until_released, name="slimckpt-s3-lease", daemon=True).start()

    def put_body(self, **changes: Any) -> None:
        """Our lease object again with `changes` and a new expiry, unless it is no longer ours."""
        with self.lock:
            if not self.held:
                return
            body = dict(self.body, **changes, expires=time.time() + env_vars.seconds("SLIMCKPT_S3_LEASE_S"))
            bucket, key = split(self.key)
            with contextlib.suppress(S3Error):
                # checked first: an expired lease may have been taken over (a holder stalled past its expiry)
                if (lease_body(self.key) or {}).get("token") != self.token:
                    return
                call(self.key, CLIENT.get().put_object, Bucket=bucket, Key=key, Body=json.dumps(body).encode())
                self.body = body

    def renew_until_released(self) -> None:
        while not self.stopped.wait(max(0.05, env_vars.seconds("SLIMCKPT_S3_LEASE_S") / 4)):
            self.put_body()

    def note(self, text: str) -> None:
        if self.held and self.exclusive:
            self.put_body(note=text)

    def release(self) -> None:
        if not self.held:
            return
        self.stopped.set()
        with self.lock:
            self.held = False
        if not self.exclusive:
            return
        # only our own: an expired lease may have been taken over by another writer since; a release that
        # fails (the server gone, the credentials revoked) leaves the lease to expire
        with contextlib.suppress(S3Error):
            if (lease_body(self.key) or {}).get("token") == self.token:
                with contextlib.suppress(FileNotFoundError):
                    self.store.remove(self.key)


def take(store: Storage, key: str, *, exclusive: bool) -> S3Lease | None:
    """`store`'s lease on `key` (see the module's doc), or None while another holds it."""
    if not exclusive:
        return S3Lease(store, key, False, None, {})
    bucket, k = split(key)
    require_conditional_writes(key)
    for _ in range(3):
        now = time.time()
        token = uuid.uuid4().hex
        body = {
            "holder": f"pid {os.getpid()} on {socket.gethostname()}",
            "created": now,
            "expires": now + env_vars.seconds("SLIMCKPT_S3_LEASE_S"),
            "token": token,
        }
        if put_new(key, json.dumps(body).encode()):
            return S3Lease(store, key, True, token, body)
        held = lease_body(key)
        if held is None:
            continue  # released between our put and our read: try again
        expires = held.get("expires")
        if not isinstance(expires, int | float):
            return None  # not one of ours: held, no expiry known
        if expires >= time.time() and not expired_unrenewed(key, expires):
            return None  # its holder renews it (alive), or it outlasts our watch
        with contextlib.suppress(FileNotFoundError):
            call(key, CLIENT.get().delete_object, Bucket=bucket, Key=k)
    return None


def expired_unrenewed(key: str, expires: float) -> bool:
    """Watch a held lease for at most `SLIMCKPT_S3_LEASE_S`: True when it expires unrenewed (its holder
    is dead) or is released; False as soon as it is renewed (or taken by another), or when the watch
    ends first (a lease longer than ours, e.g. a holder with another setting: held)."""
    ttl = env_vars.seconds("SLIMCKPT_S3_LEASE_S")
    poll = min(1.0, max(0.05, ttl / 8))
    until = min(expires, time.time() + ttl)
    while time.time() <= until:
        time.sleep(min(poll, max(0.0, until - time.time()) + 0.01))
        held = lease_body(key)
        if held is None:
            return True
        if held.get("expires") != expires:
            return False
    return time.time() > expires


def lease_body(key: str) -> dict | None:
    """The lease object at `key` as JSON: None when there is none, {} when it is not one of ours."""
    bucket, k = split(key)
    try:
        out = call(key, CLIENT.get().get_object, Bucket=bucket, Key=k)
        body = json.loads(out["Body"].read(65536).decode("utf-8"))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        return {}  # not one of ours: held, no expiry known
    return body if isinstance(body, dict) else {}


def lease_note(key: str) -> str:
    """Who holds the lease at `key`, in one line ("" when it is free or unreadable)."""
    try:
        body = lease_body(key)
    except OSError:
        return ""
    if not body:
        return ""
    note = str(body.get("note") or "").strip()
    if note:
        return note.splitlines()[0]
    holder = str(body.get("holder") or "")
    expires = body.get("expires")
    if holder and isinstance(expires, int | float):
        return f"{holder} (lease expires {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(expires))})"
    return holder


__all__ = ["S3Lease", "expired_unrenewed", "lease_body", "lease_note", "take"]
