#!/usr/bin/env python
"""Which S3 client writes a rank file fastest: slimckpt's S3 backend (boto3) against obstore, and both against
the same bytes written to local disk with fsync.

  python -m scripts.bench.s3_clients                 # 2 GiB per row, median of 3
  python -m scripts.bench.s3_clients --gib 7.2 --reps 1 --dir /scratch

Each row writes `--gib` GiB generated in 8 MiB chunks (one buffer, a different first bytes per chunk:
never the whole file in memory) as one object, in order, the way DCP writes a rank file:

  boto3    slimckpt.storage.s3's open_stream (parts of SLIMCKPT_S3_PART_MB, SLIMCKPT_S3_CONCURRENCY held)
  obstore  obstore.open_writer on an S3Store (buffer_size = that part size, max_concurrency = that concurrency)
  disk     open(), write, fsync, close, in `--dir`

Every S3 repetition starts a fresh SeaweedFS (`weed mini`, slimckpt_testing.s3_server) with its data in
`--dir` and removes it after; each client is made, and warmed by one small write, before the clock starts (SeaweedFS frees deleted space only on vacuum). The time is from the first
write until the object is complete (the server answered CompleteMultipartUpload); SeaweedFS does not
fsync what it stores, so the disk row is the stricter one. The peak rise of this process's RssAnon
during the write is printed too (obstore's buffers live in Rust, and count).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from slimckpt.observe.memory import RssSampler

# lazy imports: boto3, obstore and the server helper load when a row runs, not for --help

CHUNK = 8 << 20
GB = 1e9


def chunks(total: int) -> Callable[[], object]:
    """A generator of `total` bytes in CHUNK pieces over one reused buffer."""
    buf = bytearray(os.urandom(CHUNK))

    def gen():
        left, i = total, 0
        while left > 0:
            n = min(CHUNK, left)
            buf[:8] = i.to_bytes(8, "little")
            yield memoryview(buf)[:n]
            left, i = left - n, i + 1

    return gen


def boto3_writer(server, total: int, gen) -> Callable[[], None]:
    from slimckpt.storage import for_path, s3, s3_client

    os.environ.update(server.env)
    s3.after_fork()  # a client made from this server's environment
    url = f"s3://{server.bucket}/bench/rank_0.distcp"
    store = for_path(url)
    with store.open_stream(f"{url}.warm") as f:  # the client, its models and upload threads made untimed
        f.write(b"w" * (s3_client.part_bytes() + 1))
    store.remove(f"{url}.warm")

    def write() -> None:
        with store.open_stream(url) as f:
            for piece in gen():
                f.write(piece)

    return write


def obstore_writer(server, total: int, gen) -> Callable[[], None]:
    import obstore
    from obstore.store import S3Store

    from slimckpt.storage import s3_client

    store = S3Store(
        server.bucket,
        endpoint=server.endpoint,
        access_key_id=server.env["AWS_ACCESS_KEY_ID"],
        secret_access_key=server.env["AWS_SECRET_ACCESS_KEY"],
        region=server.env["AWS_REGION"],
        client_options={"allow_http": True},
    )
    obstore.put(store, "bench/warm", b"w")

    def write() -> None:
        with obstore.open_writer(
            store, "bench/rank_0.distcp", buffer_size=s3_client.part_bytes(), max_concurrency=s3_client.concurrency()
        ) as f:
            for piece in gen():
                f.write(piece)

    return write


def object_size(server) -> int:
    return int(server.client().head_object(Bucket=server.bucket, Key="bench/rank_0.distcp")["ContentLength"])


def timed_s3(make_writer, total: int, gen, where: str) -> tuple[float, int]:
    from slimckpt_testing import s3_server

    server = s3_server.start(root=where)
    try:
        write = make_writer(server, total, gen)
        with RssSampler() as rss:
            t0 = time.perf_counter()
            write()
            elapsed = time.perf_counter() - t0
        assert object_size(server) == total
    finally:
        server.stop()
    return elapsed, rss.result.extra


def timed_disk(total: int, gen, where: str) -> tuple[float, int]:
    path = os.path.join(where, f"slimckpt-bench-{os.getpid()}.distcp")
    try:
        with RssSampler() as rss:
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                for piece in gen():
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
            elapsed = time.perf_counter() - t0
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return elapsed, rss.result.extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench.s3_clients",
        description="GB/s of one rank file written to a fresh local SeaweedFS by boto3 (slimckpt's backend) "
        "and by obstore, and to local disk with fsync",
    )
    parser.add_argument("--gib", type=float, default=2.0, help="GiB per row (default 2; 7.2 is a 3.6B bf16 model)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per row; the median is printed (default 3)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the server's data and the disk row go")
    parser.add_argument(
        "--rows", default="boto3,obstore,disk", help="comma-separated rows among boto3, obstore, disk (default all)"
    )
    args = parser.parse_args(argv)
    total = int(args.gib * (1 << 30))
    gen = chunks(total)
    rows = {
        "boto3": lambda: timed_s3(boto3_writer, total, gen, args.dir),
        "obstore": lambda: timed_s3(obstore_writer, total, gen, args.dir),
        "disk": lambda: timed_disk(total, gen, args.dir),
    }
    from slimckpt.storage import s3_client

    print(
        f"{total / GB:.2f} GB per row in {CHUNK >> 20} MiB writes, part {s3_client.part_bytes() >> 20} MiB x "
        f"{s3_client.concurrency()}; median of {args.reps}"
    )
    print(f"{'row':8} {'GB/s':>6} {'s':>7} {'runs (s)':>26} {'RssAnon rise':>13}")
    for name in [r.strip() for r in args.rows.split(",") if r.strip()]:
        runs = [rows[name]() for _ in range(args.reps)]
        secs = statistics.median(t for t, _ in runs)
        rise = max(r for _, r in runs)
        shown = ", ".join(f"{t:.2f}" for t, _ in runs)
        print(f"{name:8} {total / GB / secs:6.2f} {secs:7.2f} {shown:>26} {rise / (1 << 20):10.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
