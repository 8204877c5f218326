#!/usr/bin/env python
"""How fast the merge's reads of verl's rank files can go: each way of reading them, on the same files.

  python -m scripts.bench.read_paths --ckpt DIR [--repeats 3] [--json docs/bench_read_paths.json]
  python -m scripts.bench.read_paths --render docs/bench_read_paths.json        # the table again, no runs

DIR is a verl checkpoint dir (`model_world_size_W_rank_r.pt` files), e.g. one built by
`python -m slimckpt_testing.verl_checkpoints.fake_pg_checkpoint --out DIR --world-size 8 --size-preset llama3-8b`.
Every path reads the same bytes in the merge's order: tensor by tensor, each tensor's shard from
every rank file in turn (so W files are read at once, each front to back), in chunks of the merge's
chunk size, each chunk cast to bf16 into one reused buffer as the merge's writer casts it. The files'
pages are dropped from the page cache before every path (posix_fadvise DONTNEED), and the paths take
turns repeat after repeat, so a slow minute of the shared host falls on all of them.

  mmap                 the merge today: the cast reads a memory map, its page faults are the reads
  mmap+sequential      the same map with madvise(MADV_SEQUENTIAL) (the kernel reads ahead further)
  mmap+willneed        the same map, posix_fadvise(WILLNEED) issued AHEAD chunks before the cast reaches them
  mmap+madvise         the same, asked through the map (madvise WILLNEED: no file offsets needed)
  readinto             pread into a reused buffer, then the cast from it (one thread: read, cast, read)
  readinto+thread      a reader thread preads AHEAD chunks ahead into a ring of buffers while the cast runs
  odirect+thread       the same with O_DIRECT (page-aligned buffers; past the page cache)
  cold read            each file read front to back alone in 16 MiB requests, no cast: the disk's pace

No output is written: the merge's writes are a separate question (`slimckpt diskspeed`).
"""

from __future__ import annotations

# lazy imports: torch and slimckpt's readers only when files are read (--render and the report need neither)
import argparse
import json
import mmap
import os
import queue
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

GB = 1e9
CHUNK = 2 << 20  # slimckpt.layout.names.DEFAULT_CHUNK_BYTES: the merge's chunk of source
AHEAD = 8  # chunks read ahead of the cast
PATHS = (
    "mmap",
    "mmap+sequential",
    "mmap+willneed",
    "mmap+madvise",
    "readinto",
    "readinto+thread",
    "odirect+thread",
    "cold read",
)
BEGIN, END = "<!-- read-paths:begin -->", "<!-- read-paths:end -->"


@dataclass
class Piece:
    """One tensor's shard: `nbytes` of `dtype` at `offset` of rank file `file`."""

    file: int
    offset: int
    nbytes: int
    dtype: str


@dataclass
class PathRun:
    path: str
    seconds: float
    nbytes: int
    load: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / GB if self.seconds else 0.0


@dataclass
class Result:
    ckpt: str
    files: int
    nbytes: int
    chunk: int
    ahead: int
    commit: str
    date: str
    command: str = ""
    runs: list[PathRun] = field(default_factory=list)


# -- the merge's read order ---------------------------------------------------------------------
def pieces_in_merge_order(files: list[str]) -> list[Piece]:
    """Every tensor's shards in the merge's order: tensor by tensor (rank 0's order), rank by rank."""
    from slimckpt.engine import pt_index

    per_file = []
    for path in files:
        pt = pt_index.PtFile(path)
        records = [rec for _, rec in pt_index.tensor_records(pt.state)]
        per_file.append([(r.storage.data_offset, r.storage.nbytes, r.dtype.name) for r in records])
    out = []
    for k in range(len(per_file[0])):
        for f, recs in enumerate(per_file):
            offset, nbytes, dtype = recs[k]
            if nbytes:
                out.append(Piece(f, offset, nbytes, dtype))
    return out


def chunks(pieces: list[Piece], chunk: int = CHUNK) -> list[tuple[int, int, int, str]]:
    """(file, offset, nbytes, dtype) of each chunk the merge casts, in order."""
    out = []
    for p in pieces:
        for start in range(0, p.nbytes, chunk):
            out.append((p.file, p.offset + start, min(chunk, p.nbytes - start), p.dtype))
    return out


# -- the paths ----------------------------------------------------------------------------------
def _evict(files: list[str]) -> None:
    from slimckpt.observe.measure import evict_from_page_cache

    evict_from_page_cache(files)


class _Caster:
    """The merge writer's cast: a chunk of the source dtype into one reused bf16 buffer."""

    def __init__(self, chunk: int) -> None:
        import torch

        self.torch = torch
        self.out = torch.empty(chunk, dtype=torch.bfloat16)

    def cast(self, buf, nbytes: int, dtype: str) -> None:
        torch = self.torch
        kind = getattr(torch, dtype)
        src = torch.frombuffer(buf, dtype=kind, count=nbytes // torch.empty((), dtype=kind).element_size())
        self.out[: src.numel()].copy_(src)


def _read_mmap(files: list[str], plan, caster: _Caster, advice: str) -> None:
    fds = [os.open(f, os.O_RDONLY) for f in files]
    maps = [mmap.mmap(fd, 0, access=mmap.ACCESS_READ) for fd in fds]
    try:
        if advice == "sequential":
            for m in maps:
                m.madvise(mmap.MADV_SEQUENTIAL)
        views = [memoryview(m) for m in maps]
        for i, (f, off, n, dtype) in enumerate(plan):
            if advice == "willneed" and i + AHEAD < len(plan):
                af, aoff, an, _ = plan[i + AHEAD]
                os.posix_fadvise(fds[af], aoff, an, os.POSIX_FADV_WILLNEED)
            elif advice == "madvise" and i + AHEAD < len(plan):
                af, aoff, an, _ = plan[i + AHEAD]
                maps[af].madvise(mmap.MADV_WILLNEED, aoff - aoff % mmap.PAGESIZE, an + aoff % mmap.PAGESIZE)
            caster.cast(views[f][off : off + n], n, dtype)
        for v in views:
            v.release()
    finally:
        for m in maps:
            m.close()
        for fd in fds:
            os.close(fd)


def _aligned(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes)  # anonymous maps are page-aligned, as O_DIRECT wants


def _read_into(files: list[str], plan, caster: _Caster, threaded: bool, direct: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fds = [os.open(f, flags) for f in files]
    page = mmap.PAGESIZE
    size = CHUNK + 2 * page  # an O_DIRECT read is page-aligned on both ends
    try:
        if not threaded:
            buf = memoryview(_aligned(size))
            for f, off, n, dtype in plan:
                got = os.preadv(fds[f], [buf[:n]], off)
                caster.cast(buf[:got], got, dtype)
            return
        ring = [memoryview(_aligned(size)) for _ in range(AHEAD)]
        free: queue.Queue = queue.Queue()
        ready: queue.Queue = queue.Queue()
        for k in range(AHEAD):
            free.put(k)

        def reader() -> None:
            for f, off, n, dtype in plan:
                k = free.get()
                if direct:
                    start = off - off % page
                    end = -(-(off + n) // page) * page
                    os.preadv(fds[f], [ring[k][: end - start]], start)
                    ready.put((k, off - start, n, dtype))
                else:
                    os.preadv(fds[f], [ring[k][:n]], off)
                    ready.put((k, 0, n, dtype))
            ready.put(None)

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        while (item := ready.get()) is not None:
            k, skip, n, dtype = item
            caster.cast(ring[k][skip : skip + n], n, dtype)
            free.put(k)
        t.join()
    finally:
        for fd in fds:
            os.close(fd)


def _cold_bytes(files: list[str], nbytes: int) -> int:
    """What the cold read reads: as many bytes as the merge's order, spread evenly over the files."""
    return min(nbytes, sum(os.path.getsize(f) for f in files))


def _cold_read(files: list[str], nbytes: int) -> None:
    buf = memoryview(_aligned(16 << 20))
    each = -(-_cold_bytes(files, nbytes) // len(files))
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            at = 0
            while at < each and (n := os.preadv(fd, [buf[: min(len(buf), each - at)]], at)) > 0:
                at += n
        finally:
            os.close(fd)


def run_path(name: str, files: list[str], plan, caster: _Caster) -> float:
    _evict(files)
    start = time.perf_counter()
    if name == "mmap":
        _read_mmap(files, plan, caster, "")
    elif name == "mmap+sequential":
        _read_mmap(files, plan, caster, "sequential")
    elif name == "mmap+willneed":
        _read_mmap(files, plan, caster, "willneed")
    elif name == "mmap+madvise":
        _read_mmap(files, plan, caster, "madvise")
    elif name == "readinto":
        _read_into(files, plan, caster, threaded=False)
    elif name == "readinto+thread":
        _read_into(files, plan, caster, threaded=True)
    elif name == "odirect+thread":
        _read_into(files, plan, caster, threaded=True, direct=True)
    elif name == "cold read":
        _cold_read(files, sum(n for _, _, n, _ in plan))
    else:
        raise ValueError(name)
    return time.perf_counter() - start


# -- the report (pure: tests/unit/test_bench_read_paths.py) -------------------------------------
def summary(result: Result) -> list[dict]:
    """Per path: runs, median and spread of GB/s, and the median against the mmap's (today's)."""
    import statistics

    rows = []
    by_path: dict[str, list[PathRun]] = {}
    for run in result.runs:
        by_path.setdefault(run.path, []).append(run)
    base = by_path.get("mmap")
    base_median = statistics.median(r.gbps for r in base) if base else 0.0
    for name in [p for p in PATHS if p in by_path] + [p for p in by_path if p not in PATHS]:
        runs = by_path[name]
        speeds = [r.gbps for r in runs]
        med = statistics.median(speeds)
        rows.append(
            {
                "path": name,
                "runs": len(runs),
                "median_gbps": med,
                "min_gbps": min(speeds),
                "max_gbps": max(speeds),
                "vs_mmap": med / base_median if base_median else 0.0,
                "loads": [r.load for r in runs],
            }
        )
    return rows


def run_table(result: Result) -> str:
    """One run: its command and what it read, then a row per path."""
    lines = [
        f"`{result.command}`, commit {result.commit}, {result.date}: "
        f"{result.files} rank files, {result.nbytes / GB:.1f} GB of them, read in the merge's order in "
        f"{result.chunk >> 20} MiB chunks.",
        "",
        "| path | runs | GB/s (median) | GB/s (spread) | against mmap | load |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary(result):
        loads = ", ".join(f"{x:.1f}" for x in row["loads"])
        lines.append(
            f"| {row['path']} | {row['runs']} | {row['median_gbps']:.2f} | {row['min_gbps']:.2f}-{row['max_gbps']:.2f} "
            f"| {row['vs_mmap']:.2f}x | {loads} |"
        )
    return "\n".join(lines)


def render(results: Result | list[Result], note: str = "") -> str:
    """The section: what every path does to the bytes, then each run's table, then `note`."""
    results = results if isinstance(results, list) else [results]
    lines = [
        BEGIN,
        "### The merge's read paths, measured",
        "",
        "Each chunk is cast to bf16 into one reused buffer as the merge's writer casts it; the files are dropped "
        "from the page cache before every path and the paths take turns, repeat after repeat. The host is shared "
        "(2 cores, 3 people): the 1-minute load average is given per run.",
    ]
    for result in results:
        lines += ["", run_table(result)]
    if note:
        lines += ["", note]
    lines.append(END)
    return "\n".join(lines)


def to_json(result: Result) -> dict:
    return asdict(result)


def from_json(d: dict) -> Result:
    runs = [PathRun(**r) for r in d.get("runs", [])]
    return Result(**{**{k: v for k, v in d.items() if k != "runs"}, "runs": runs})


# -- the run ------------------------------------------------------------------------------------
def measure(ckpt: str, repeats: int, paths: list[str], limit_bytes: int = 0, command: str = "") -> Result:
    import subprocess

    files = sorted(str(p) for p in Path(ckpt).glob("model_world_size_*_rank_*.pt"))
    if not files:
        raise SystemExit(f"{ckpt}: no model_world_size_*_rank_*.pt files; pass a verl checkpoint dir")
    plan = chunks(pieces_in_merge_order(files))
    if limit_bytes:  # the first bytes of the merge's order: the same files, the same pattern, shorter
        total, cut = 0, len(plan)
        for i, (_, _, n, _) in enumerate(plan):
            total += n
            if total >= limit_bytes:
                cut = i + 1
                break
        plan = plan[:cut]
    nbytes = sum(n for _, _, n, _ in plan)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result = Result(ckpt, len(files), nbytes, CHUNK, AHEAD, commit, when, command)
    caster = _Caster(CHUNK)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # the cast only reads it
    for i in range(repeats):
        for name in paths:
            load = os.getloadavg()[0]
            seconds = run_path(name, files, plan, caster)
            size = _cold_bytes(files, nbytes) if name == "cold read" else nbytes
            result.runs.append(PathRun(name, seconds, size, round(load, 2)))
            print(
                f"[read-paths] {i + 1}/{repeats} {name}: {size / seconds / GB:.2f} GB/s (load {load:.1f})", flush=True
            )
    _evict(files)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.read_paths", description=__doc__.splitlines()[1])
    p.add_argument("--ckpt", help="a verl checkpoint dir (model_world_size_*_rank_*.pt)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma separated, of: {', '.join(PATHS)}")
    p.add_argument("--gb", type=float, default=0.0, help="read only the first GB of the merge's order (0: all)")
    p.add_argument("--json", default=None, help="write the run here")
    p.add_argument("--render", default=None, metavar="JSON[,JSON]", help="print the tables of earlier runs")
    p.add_argument("--note", default="", help="a paragraph under the tables (with --render)")
    args = p.parse_args(argv)
    if args.render:
        runs = [from_json(json.loads(Path(f).read_text())) for f in args.render.split(",")]
        print(render(runs, args.note))
        return 0
    if not args.ckpt:
        p.error("--ckpt or --render is needed")
    command = "python -m scripts.bench.read_paths " + " ".join(argv if argv is not None else sys.argv[1:])
    unknown = [x for x in args.paths.split(",") if x not in PATHS]
    if unknown:
        p.error(f"unknown paths {unknown}; known: {', '.join(PATHS)}")
    result = measure(args.ckpt, args.repeats, args.paths.split(","), int(args.gb * GB), command)
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(result), indent=1) + "\n")
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
