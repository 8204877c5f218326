"""Distributed merges shaken at every race point, each output compared byte for byte with the
single-process merge of the same checkpoint.

    python -m scripts.stress.merge_bytes --work /tmp/stress_merge --runs 100     # make stress-merge

The checkpoints are real verl saves (slimckpt_testing.verl_checkpoints.fsdp_checkpoint under torchrun, FSDP2, 2 ranks):
a dense Llama and two MoE families (DeepSeek-V3: shared experts and a dense first layer; Qwen3-MoE),
with 3 experts over 2 ranks so shards are uneven and outputs cut fused expert tensors. Each is merged
once by one process with no delays: the reference. Then `--runs` distributed merges
(`torchrun --nproc_per_node 2|3 slimckpt merge --distributed_merge --workers 1|2`: `configurations`, files split small
so shares cross files and experts) run with SLIMCKPT_TEST_MERGE_DELAY set: every point of
`slimckpt.engine.race_points` (lay-out, each pwrite, fsync, the outcome collective, read-back, commit)
sleeps a random part of it, so ranks and workers reach them in a different order each run. While they
run, a second process keeps one core busy (`--no-load` turns it off).

A run whose directory differs from its reference prints the file and offset of the first difference
and keeps its directory; the exit status is 1 if any run failed or differed. `--json` writes the
counts, per configuration, with the commit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from scripts.provenance import source_commit
from scripts.stress import cpu_load
from slimckpt.layout.merge_manifest import MANIFEST_NAME

REPO = Path(__file__).resolve().parents[2]
# the builder's arguments of tests/merge/test_verl_merger.py's fsdp2_w2 and test_merge_moe.py's families
CHECKPOINTS = {
    "dense": "--model llama --layers 2 --hidden 64 --vocab 256".split(),
    "moe": "--models deepseek-v3,qwen3-moe --experts 3 --steps 0 --layers 2 --hidden 64 --vocab 256".split(),
}
CASES = {"dense": "dense/actor", "deepseek-v3": "moe/actor/deepseek-v3", "qwen3-moe": "moe/actor/qwen3-moe"}
MAX_SHARD = "30KB"  # a tiny model in about ten files: shares cross file boundaries and experts
READ = 1 << 20


@dataclass(frozen=True)
class Difference:
    """The first place two directories differ: a file only one has, or the first differing byte."""

    file: str
    offset: int | None  # None: the file is missing on one side
    ours: int | None = None  # the byte there (None past the end of the file)
    reference: int | None = None

    def line(self) -> str:
        if self.offset is None:
            side = "the reference" if self.ours is None else "this output"
            return f"{self.file}: only in {side}"
        return (
            f"{self.file}: first difference at byte offset {self.offset} "
            f"(this output {_byte(self.ours)}, reference {_byte(self.reference)})"
        )


def _byte(b: int | None) -> str:
    return "ends there" if b is None else f"0x{b:02x}"


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def first_difference(ours: Path, reference: Path) -> Difference | None:
    """None when the two trees hold the same files with the same bytes; else where they first differ
    (files in name order, bytes in offset order), read 1 MiB at a time."""
    a, b = _files(ours), _files(reference)
    for name in sorted(set(a) ^ set(b)):
        return Difference(name, None, ours=1 if name in a else None)
    for name in a:
        with open(ours / name, "rb") as fa, open(reference / name, "rb") as fb:
            pos = 0
            while True:
                x, y = fa.read(READ), fb.read(READ)
                if x != y:
                    n = next((i for i in range(min(len(x), len(y))) if x[i] != y[i]), min(len(x), len(y)))
                    return Difference(name, pos + n, x[n] if n < len(x) else None, y[n] if n < len(y) else None)
                if not x:
                    break
                pos += len(x)
    return None


def _run(cmd: list[str], env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO
    )


def _torchrun(nproc: int, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    return _run(cmd, env)


def build_checkpoints(work: Path) -> None:
    """The verl checkpoints the merges read, built once per work dir."""
    for name, args in CHECKPOINTS.items():
        done = work / name / "DONE"
        if done.exists():
            continue
        shutil.rmtree(work / name, ignore_errors=True)
        proc = _torchrun(
            2, ["-m", "slimckpt_testing.verl_checkpoints.fsdp_checkpoint", "--out", str(work / name / "actor"), *args]
        )
        if proc.returncode != 0:
            raise SystemExit(f"building the {name} checkpoint failed:\n{proc.stderr[-3000:]}")
        done.write_text("ok")


def merge_args(source: Path, target: Path) -> list[str]:
    return [
        "-m",
        "slimckpt.cli",
        "merge",
        "--no_progress",
        "--max_shard_size",
        MAX_SHARD,
        "--local_dir",
        str(source),
        "--target_dir",
        str(target),
    ]


def single_merge(source: Path, target: Path) -> None:
    proc = _run([sys.executable, *merge_args(source, target)])
    if proc.returncode != 0:
        raise SystemExit(f"the single-process merge of {source} failed:\n{proc.stderr[-3000:]}")


@dataclass
class Outcome:
    run: int
    case: str
    ranks: int
    workers: int
    seconds: float
    status: str  # "same", "differs", "failed"
    detail: str = ""


def distributed_merge(work: Path, k: int, case: str, ranks: int, workers: int, delay: float) -> Outcome:
    source, reference = work / CASES[case], work / "reference" / case
    target = work / "runs" / f"{k:03d}_{case}_r{ranks}w{workers}"
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(exist_ok=True)
    args = merge_args(source, target)
    args[3:3] = ["--distributed_merge", "--workers", str(workers)]
    t0 = time.perf_counter()
    proc = _torchrun(ranks, args, env={"SLIMCKPT_TEST_MERGE_DELAY": str(delay), "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
        return Outcome(k, case, ranks, workers, seconds, "failed", f"exit {proc.returncode}: {tail}")
    diff = first_difference(target, reference)
    if diff is not None:
        return Outcome(k, case, ranks, workers, seconds, "differs", f"{diff.line()}; kept in {target}")
    shutil.rmtree(target)
    return Outcome(k, case, ranks, workers, seconds, "same")


def configurations(runs: int) -> list[tuple[str, int, int]]:
    """`runs` (case, ranks, workers) triples, cycling over the combinations: every case on 2 and 3 ranks,
    and two of them with 2 writer processes per rank as well (a quarter of the runs: each spawned
    writer starts its own interpreter, which costs more than the merge here)."""
    combos = list(itertools.product(CASES, (2, 3), (1,))) + [("dense", 2, 2), ("deepseek-v3", 3, 2)]
    return [combos[k % len(combos)] for k in range(runs)]


def summary(outcomes: list[Outcome]) -> dict:
    by: dict[str, dict[str, int]] = {}
    for o in outcomes:
        row = by.setdefault(f"{o.case} ranks={o.ranks} workers={o.workers}", {"same": 0, "differs": 0, "failed": 0})
        row[o.status] += 1
    return by


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.stress.merge_bytes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--work", type=Path, default=Path("runs/stress_merge"), help="checkpoints and outputs")
    parser.add_argument("--runs", type=int, default=100, help="distributed merges (default 100)")
    parser.add_argument("--delay", type=float, default=0.02, help="most seconds each race point sleeps (default 0.02)")
    parser.add_argument("--no-load", action="store_true", help="no second process loading the CPU")
    parser.add_argument("--json", type=Path, help="write the counts and every differing or failed run here")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.delay <= 0:
        parser.error("--runs must be at least 1 and --delay above 0")

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    commit = source_commit()
    t_start = time.time()
    build_checkpoints(work)
    for case, rel in CASES.items():
        ref = work / "reference" / case
        if not (ref / MANIFEST_NAME).exists():
            shutil.rmtree(ref, ignore_errors=True)
            ref.parent.mkdir(exist_ok=True)
            single_merge(work / rel, ref)

    outcomes: list[Outcome] = []
    with cpu_load(not args.no_load):
        for k, (case, ranks, workers) in enumerate(configurations(args.runs)):
            o = distributed_merge(work, k, case, ranks, workers, args.delay)
            outcomes.append(o)
            mark = "ok" if o.status == "same" else o.status.upper()
            print(
                f"[{k + 1}/{args.runs}] {case} ranks={ranks} workers={workers} {o.seconds:.1f} s: {mark} {o.detail}",
                flush=True,
            )

    bad = [o for o in outcomes if o.status != "same"]
    wall = time.time() - t_start
    print(
        f"{len(outcomes) - len(bad)} of {len(outcomes)} distributed merges byte-identical to the single merge "
        f"({sum(o.status == 'differs' for o in bad)} differed, {sum(o.status == 'failed' for o in bad)} failed), "
        f"delay up to {args.delay} s per race point, {'no load' if args.no_load else 'one core loaded'}, "
        f"{wall / 60:.1f} min, commit {commit}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "commit": commit,
                    "command": "python -m scripts.stress.merge_bytes " + " ".join(argv or sys.argv[1:]),
                    "runs": len(outcomes),
                    "delay_s": args.delay,
                    "cpu_load": not args.no_load,
                    "minutes": round(wall / 60, 1),
                    "by_configuration": summary(outcomes),
                    "not_same": [asdict(o) for o in bad],
                },
                indent=1,
            )
            + "\n"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
