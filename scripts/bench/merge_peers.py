#!/usr/bin/env python
"""Same-box merge comparison: the same weights saved by each tool's own writer, merged to HF safetensors by each tool.

  python -m scripts.bench.merge_peers --work /tmp/peers --json docs/bench_peers.json --out BENCHMARKS.md
  python -m scripts.bench.merge_peers --render docs/bench_peers.json --out BENCHMARKS.md    # re-render, no runs

Every input is saved in bf16 (the model built in bf16, so the save casts nothing and no merge casts:
each tool keeps dtypes), one tool at a time: written, merged `--repeats` times (the input's pages
dropped from the page cache before each merge), checked, killed halfway once, deleted.

  slimckpt merge            verl's rank files of --preset at --world-size, written rank by rank over torch's
                            fake process group (slimckpt_testing.verl_checkpoints.fake_pg_checkpoint --dtype bfloat16)
  slimckpt merge --distributed_merge   the same files, torchrun --nproc_per_node 2
  DCP consolidate           torch.distributed.checkpoint's HuggingFaceStorageWriter(save_distributed=True) shards
                            of --dcp-preset, saved on 2 real ranks (torchrun, gloo: DCP's save gathers every rank's
                            plan, so the fake group cannot write it rank by rank), merged by
                            torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files
  slimckpt merge (incremental step)   one step of slimckpt's incremental tier (`dcp/`) of --dcp-preset, saved on 2
                            real ranks through slimckpt's engine (scripts.bench.peers_save --tool slimckpt-incremental),
                            merged by `slimckpt merge --local_dir <step>/actor` (single)
  torch-checkpointing       0.1.1 (scripts/bench/requirements-peers.txt): its save of the same shards, 2 ranks; on a
                            CPU-only host its save stops in its metadata all-gather (a tensor on device "cuda"), and
                            the row says so

Per tool: peak RssAnon of the merge's process tree (slimckpt.observe.measure, sampled every 10 ms), wall,
wall over the I/O floor (input read + output written at the disk's speeds measured in this run, before and
after the merges, the faster path of each at its best), every output tensor compared with the values the
builder filled (`fake_pg_checkpoint.expected_values`, one tensor at a time), and what a SIGKILL halfway
through the merge leaves in the output dir.
"""

from __future__ import annotations

# lazy imports: torch and safetensors only where an output is checked
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from scripts.bench.merge import source_commit
from scripts.bench.peers_save import incremental_role_dir
from scripts.bench.save import machine_line, write_section
from slimckpt.observe.diskspeed import DiskSpeed, fastest_of, measure_disk_speed
from slimckpt.observe.measure import evict_from_page_cache, median, run_measured

REPO = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- merge-peers:begin -->", "<!-- merge-peers:end -->"
GB, GiB, MiB = 1e9, 2**30, 2**20
ENV = {"OMP_NUM_THREADS": "2", "SLIMCKPT_LOG_LEVEL": "WARNING", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
SINGLE, DISTRIBUTED, DCP, TC, INCR = (
    "slimckpt merge",
    "slimckpt merge --distributed_merge (2 ranks)",
    "torch DCP consolidate_safetensors_files",
    "torch-checkpointing 0.1.1",
    "slimckpt merge (incremental step)",
)
# --tools' names: the input each saves (and the key of its entry in the JSON's "inputs")
TOOLS = ("verl", "dcp", "slimckpt-incremental", "torch-checkpointing")
PY = sys.executable


# ------------------------------------------------------------------------------------------ running
def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in _files(root))


def _clean(*paths: Path) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(f"{p}.partial", ignore_errors=True)


def build_verl(preset: str, world: int, out: Path) -> dict:
    cmd = [PY, "-m", "slimckpt_testing.verl_checkpoints.fake_pg_checkpoint", "--out", str(out), "--world-size"]
    cmd += [str(world), "--size-preset", preset, "--save-contents", "model", "--dtype", "bfloat16"]
    res = run_measured(cmd, env=ENV)
    if res.returncode:
        raise SystemExit(f"[merge-peers] the verl builder failed:\n{res.output[-2000:]}")
    return {"command": " ".join(cmd[1:]), "save_s": res.wall_s, "bytes": _bytes(out), "peak": res.physical_peak}


def save_peer(tool: str, preset: str, out: Path) -> dict:
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "scripts.bench.peers_save"]
    cmd += ["--tool", tool, "--out", str(out), "--size-preset", preset, "--dtype", "bfloat16"]
    res = run_measured(cmd, env=ENV, cwd=str(REPO))
    line = next((ln for ln in res.output.splitlines() if ln.startswith("{") and '"tool"' in ln), None)
    found = {"command": " ".join(["torchrun", *cmd[3:]]), "returncode": res.returncode, "peak": res.physical_peak}
    if res.returncode or line is None:
        found["error"] = _first_error(res.output)
        return found
    info = json.loads(line)
    found.update(save_s=info["save_s"], bytes=info["bytes"], params=info["params"], index=info["index"])
    return found


def _first_error(output: str) -> str:
    """The exception line a failed rank printed (torchrun prefixes it with [rankN]:)."""
    for line in output.splitlines():
        text = line.split("]: ", 1)[-1].strip()
        if text and ("Error:" in text or text.startswith("AssertionError")) and not text.startswith("File"):
            return text[:300]
    return output.strip().splitlines()[-1][:300] if output.strip() else ""


def parse_tools(text: str) -> list[str]:
    """--tools' comma separated names, each one of TOOLS (a misspelt one would silently run nothing)."""
    tools = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        raise SystemExit(f"[merge-peers] --tools: unknown {', '.join(unknown)}; pick from {','.join(TOOLS)}")
    return tools


def merge_commands(tool: str, src: Path, target: Path, index_file: Path | None = None) -> list[str]:
    if tool in (SINGLE, INCR):  # the same command: slimckpt merge reads a step's dcp/ as it reads rank files
        return [
            PY,
            "-m",
            "slimckpt.cli",
            "merge",
            "--local_dir",
            str(src),
            "--target_dir",
            str(target),
            "--no_progress",
        ]
    if tool == DISTRIBUTED:
        return [
            PY,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "slimckpt.cli",
            "merge",
        ] + [
            "--local_dir",
            str(src),
            "--target_dir",
            str(target),
            "--no_progress",
            "--distributed_merge",
        ]
    if tool == DCP:
        code = (
            "import json,os,sys; from torch.distributed.checkpoint._consolidate_hf_safetensors import "
            "consolidate_safetensors_files as c; os.makedirs(sys.argv[2], exist_ok=True); "
            "c(sys.argv[1], sys.argv[2], json.load(open(sys.argv[3])))"
        )
        return [PY, "-c", code, str(src), str(target), str(index_file)]
    raise ValueError(tool)


def check_output(target: Path) -> dict:
    """Every tensor of the output's safetensors against the builder's values, one at a time."""
    code = (
        "import json,sys,glob,torch; from safetensors import safe_open; "
        "from slimckpt_testing.verl_checkpoints.fake_pg_checkpoint import expected_values as e\n"
        "n=bad=el=0\n"
        "for f in sorted(glob.glob(sys.argv[1]+'/*.safetensors')):\n"
        "  with safe_open(f,'pt') as s:\n"
        "    for k in s.keys():\n"
        "      t=s.get_tensor(k); n+=1; el+=t.numel()\n"
        "      if not torch.equal(t, e(k, t.shape, t.dtype)): bad+=1\n"
        "      del t\n"
        "print(json.dumps({'tensors':n,'unequal':bad,'elements':el}))"
    )
    res = run_measured([PY, "-c", code, str(target)], env=ENV)
    line = next((ln for ln in res.output.splitlines() if ln.startswith("{")), None)
    found = json.loads(line) if line else {"tensors": 0, "unequal": -1, "error": res.output[-500:]}
    found["ok"] = res.returncode == 0 and found.get("tensors", 0) > 0 and found.get("unequal") == 0
    return found


def killed_halfway(cmd: list[str], target: Path, at_s: float) -> dict:
    """The merge SIGKILLed (its whole process group) `at_s` into its run: what the output dir holds."""
    proc = subprocess.Popen(
        cmd, env={**os.environ, **ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    time.sleep(at_s)
    finished = proc.poll() is not None
    if not finished:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    dirs = [d for d in (target, Path(f"{target}.partial")) if d.exists()]
    files = [p for d in dirs for p in _files(d)]
    return {
        "kill_after_s": at_s,
        "finished_first": finished,
        "dirs": [d.name for d in dirs],
        "files": [p.name for p in files],
        "bytes": sum(p.stat().st_size for p in files),
        "target_exists": target.exists(),
        "index": any(p.name.endswith(".index.json") for p in files),
        "manifest": any(p.name == "manifest.json" for p in files),
        "headers_ok": _headers_ok(files),
    }


def _headers_ok(files: list[Path]) -> bool:
    """Whether every safetensors file left opens as one (a reader finds a whole header and file size)."""
    import struct

    tensors = [p for p in files if p.suffix == ".safetensors"]
    if not tensors:
        return False
    for p in tensors:
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return False
            n = struct.unpack("<Q", head)[0]
            try:
                header = json.loads(f.read(n))
            except ValueError:
                return False
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if p.stat().st_size != 8 + n + end:
            return False
    return True


def merge_rows(
    tools: list[tuple[str, dict]], src: Path, work: Path, repeats: int, read_bytes: int, index_file: Path | None = None
) -> list[dict]:
    """Each (tool, extra env) merging `src` `repeats` times, taking turns run after run (a slow minute
    of the shared host falls on all of them); then the first run's output checked and a kill halfway."""
    target = work / "merged"
    inputs = [str(p) for p in _files(src)]
    rows = []
    for tool, env in tools:
        cmd = merge_commands(tool.split(" [")[0], src, target, index_file)
        row = {"tool": tool, "command": " ".join(["python" if c == PY else c for c in cmd]), "walls": [], "peaks": []}
        row.update(loads=[], read_bytes=read_bytes, env=env, cmd=cmd)
        rows.append(row)
    for i in range(repeats):
        for row in rows:
            if row.get("error"):
                continue
            _clean(target)
            os.sync()
            evict_from_page_cache(inputs)
            row["loads"].append(round(os.getloadavg()[0], 2))
            res = run_measured(row["cmd"], env={**ENV, **row["env"]})
            if res.returncode:
                row["error"] = res.output[-1500:]
                print(f"[merge-peers] {row['tool']} failed:\n{res.output[-1500:]}", flush=True)
                continue
            launcher = next(iter(res.peaks), None)
            ranks = [p for pid, p in res.peaks.items() if pid != launcher]
            row["peaks"].append(max(ranks, default=0) if DISTRIBUTED in row["tool"] else res.physical_peak)
            row["walls"].append(res.wall_s)
            row["written_bytes"] = sum(p.stat().st_size for p in target.glob("*.safetensors"))
            print(
                f"[merge-peers] {row['tool']} {i + 1}/{repeats}: {res.wall_s:.1f} s, peak "
                f"{row['peaks'][-1] / MiB:.0f} MiB (load {row['loads'][-1]:.1f})",
                flush=True,
            )
            if i == repeats - 1 and not row["env"]:
                row["check"] = check_output(target)
                print(f"[merge-peers] {row['tool']} output: {row['check']}", flush=True)
    for row in rows:
        if row["walls"] and not row["env"]:
            _clean(target)
            os.sync()
            evict_from_page_cache(inputs)
            row["killed"] = killed_halfway(row["cmd"], target, median(row["walls"]) / 2)
            print(f"[merge-peers] {row['tool']} killed halfway: {row['killed']}", flush=True)
        row.pop("cmd")
    _clean(target)
    return rows


def measure(args: argparse.Namespace) -> dict:
    tools = parse_tools(args.tools)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    if free < args.min_free_gib * GiB:
        print(
            f"[merge-peers] {work}: {free / GiB:.0f} GiB free, the run needs {args.min_free_gib:.0f} (the 8B rank "
            f"files in bf16 and their merge); skipped: pass --work on a bigger disk",
            flush=True,
        )
        return {}
    started = time.time()
    meta = {
        "command": " ".join(["python -m scripts.bench.merge_peers", *sys.argv[1:]]),
        **source_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_line(),
        "preset": args.preset,
        "world_size": args.world_size,
        "dcp_preset": args.dcp_preset,
        "repeats": args.repeats,
        "load_start": os.getloadavg()[0],
    }
    disk_bytes = int(args.disk_gib * GiB)
    disks = [measure_disk_speed(str(work), size_bytes=disk_bytes)]
    rows, inputs = [], {}
    try:
        if "verl" in tools:
            ckpt = work / "verl" / "actor"
            inputs["verl"] = built = build_verl(args.preset, args.world_size, ckpt)
            print(f"[merge-peers] verl rank files: {built['bytes'] / GB:.1f} GB in {built['save_s']:.0f} s", flush=True)
            runs = [(SINGLE, {}), (DISTRIBUTED, {})]
            if args.baseline_patches:  # the same merge on another checkout's code, taking turns with this one
                runs.insert(1, (f"{SINGLE} [{args.baseline_name}]", {"PYTHONPATH": args.baseline_patches}))
            rows += merge_rows(runs, ckpt, work, args.repeats, built["bytes"])
            _clean(work / "verl")
        if "dcp" in tools:
            shards = work / "dcp"
            inputs["dcp"] = saved = save_peer("dcp-hf", args.dcp_preset, shards)
            if "error" in saved:
                rows.append({"tool": DCP, "error": saved["error"]})
            else:
                index_file = work / "dcp_index.json"
                index_file.write_text(json.dumps(saved.pop("index")))
                rows += merge_rows([(DCP, {})], shards, work, args.repeats, saved["bytes"], index_file)
            _clean(shards)
        if "slimckpt-incremental" in tools:
            step = work / "incremental"
            inputs["slimckpt-incremental"] = saved = save_peer("slimckpt-incremental", args.dcp_preset, step)
            saved.pop("index", None)  # the merge splits its output as save_pretrained would, as for verl's files
            if "error" in saved:
                rows.append({"tool": INCR, "error": saved["error"]})
            else:
                role_dir = Path(incremental_role_dir(step))
                rows += merge_rows([(INCR, {})], role_dir, work, args.repeats, saved["bytes"])
            _clean(step)
        if "torch-checkpointing" in tools:
            shards = work / "tc"
            inputs["torch-checkpointing"] = saved = save_peer("torch-checkpointing", args.dcp_preset, shards)
            saved.pop("index", None)
            rows.append({"tool": TC, "error": saved.get("error", "")})
            _clean(shards)
        disks.append(measure_disk_speed(str(work), size_bytes=disk_bytes))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    meta.update(seconds=time.time() - started, load_end=os.getloadavg()[0])
    return {**meta, "inputs": inputs, "rows": rows, "disk": asdict(fastest_of(disks))}


# ------------------------------------------------------------------------------------------ rendering
def floor_s(disk: dict, read_bytes: int, written_bytes: int) -> float:
    """Input read at the disk's best read speed, output written at its best write speed."""
    return DiskSpeed(**disk).io_floor_s(read_bytes, written_bytes)


def killed_words(k: dict | None) -> str:
    if not k:
        return "-"
    if k["finished_first"]:
        return f"finished before {k['kill_after_s']:.0f} s"
    if not k["files"]:
        return f"killed at {k['kill_after_s']:.0f} s: nothing"
    where = ", ".join(f"`{d}/`" for d in k["dirs"])
    marks = []
    if k["manifest"]:
        marks.append("a manifest")
    if k["index"]:
        marks.append("an index")
    looks = "every file whole-sized with a valid header" if k["headers_ok"] else "files cut short or headerless"
    complete = k["target_exists"] and (k["index"] or k["manifest"]) and k["headers_ok"]
    verdict = "**looks complete**" if complete else "does not look complete"
    return (
        f"killed at {k['kill_after_s']:.0f} s: {where} with {len(k['files'])} files ({k['bytes'] / GB:.1f} GB), "
        f"{' and '.join(marks) or 'no index or manifest'}, {looks}: {verdict}"
    )


def table(result: dict) -> str:
    lines = [
        "| tool | input (its own writer) | runs | peak RssAnon | wall (median) | walls | I/O floor | wall / floor "
        "| output equal | killed halfway |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if row.get("error") and not row.get("walls"):
            lines.append(f"| {row['tool']} | - | 0 | - | - | - | - | - | - | could not run: {row['error']} |")
            continue
        walls = row["walls"]
        written = row.get("written_bytes", 0)
        # a row merged into this run from another (its own input and disk) carries its floor and input
        floor = row.get("floor_s") or floor_s(result["disk"], row["read_bytes"], written)
        check = row.get("check") or {}
        equal = f"{check.get('tensors', 0)} tensors equal" if check.get("ok") else f"**no** ({check})" if check else "-"
        lines.append(
            f"| {row['tool']} | {_input_words(result, row)} | {len(walls)} | {max(row['peaks']) / MiB:,.0f} MiB "
            f"| {median(walls):.1f} s | {min(walls):.1f}-{max(walls):.1f} s | {floor:.1f} s "
            f"| {median(walls) / floor:.2f}x | {equal} | {killed_words(row.get('killed'))} |"
        )
    return "\n".join(lines)


def _input_words(result: dict, row: dict) -> str:
    if row.get("input"):
        return row["input"]
    key = {DCP: "dcp", INCR: "slimckpt-incremental"}.get(row["tool"], "verl")
    found = result["inputs"].get(key, {})
    size = f"{found.get('bytes', 0) / GB:.1f} GB"
    if key == "verl":
        return f"verl's rank files, {result['preset']} at world size {result['world_size']}, fake group, {size}"
    if key == "slimckpt-incremental":
        return f"slimckpt incremental step (DCP files), {result['dcp_preset']} at world size 2, real save, {size}"
    return f"DCP HF shards, {result['dcp_preset']} at world size 2, real save, {size}"


def render(result: dict) -> str:
    disk = DiskSpeed(**result["disk"])
    loads = f"1-minute load {result['load_start']:.1f} at the start, {result['load_end']:.1f} at the end"
    tc = result["inputs"].get("torch-checkpointing") or {}
    lines = [
        BEGIN,
        "## Same box, same weights: the merge against its peers",
        "",
        f"`{result['command']}`, commit {result.get('commit')}, {result['date']}, in "
        f"{result['seconds'] / 60:.1f} minutes; {result['machine']}; {loads} (the host is shared by three people: "
        f"timings drift). Every input saved in bf16 (the model built in bf16: no save casts, no merge casts). "
        f"The disk, best of this run's two measurements: {disk.describe()}.",
        "",
        table(result),
    ]
    for key, found in result["inputs"].items():
        if found.get("command"):
            lines += [
                "",
                f"- {key} input written by `{found['command']}`"
                + (f" in {found['save_s']:.0f} s" if found.get("save_s") else ""),
            ]
    if tc.get("error"):
        lines += ["", f"torch-checkpointing 0.1.1 could not save on this host: `{tc['error']}`."]
    if result.get("note"):
        lines += ["", result["note"]]
    lines.append(END)
    return "\n".join(lines)


def add_run(result: dict, other: dict, tag: str) -> dict:
    """`other`'s rows added to `result`'s, each named with `tag` and carrying its own input and floor
    (from `other`'s disk measurements), so two runs' rows sit in one table."""
    for row in other["rows"]:
        if row.get("walls"):
            row["floor_s"] = floor_s(other["disk"], row["read_bytes"], row.get("written_bytes", 0))
            row["input"] = f"{_input_words(other, row)}; {tag}"
        row["tool"] = f"{row['tool']} ({tag})"
        result["rows"].append(row)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.merge_peers", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3-8b", help="verl rank files' size preset")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--dcp-preset", default="llama3.2-3b", help="the peers' size preset (saved on 2 real ranks)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma separated, of {','.join(TOOLS)}")
    p.add_argument("--work", default=str(REPO / "bench_work" / "peers"))
    p.add_argument("--keep", action="store_true")
    p.add_argument("--min-free-gib", type=float, default=36.0, help="free disk the run needs under --work")
    p.add_argument("--baseline-patches", default="", help="also run slimckpt merge with PYTHONPATH=this (A/B)")
    p.add_argument("--baseline-name", default="baseline", help="how the table names the --baseline-patches row")
    p.add_argument("--disk-gib", type=float, default=1.0, help="scratch file size of each disk measurement")
    p.add_argument("--json", default=None)
    p.add_argument("--out", default=None, help="report whose merge-peers section to write")
    p.add_argument("--render", default=None, metavar="JSON")
    p.add_argument("--note", default=None, help="a paragraph under the table, kept in the JSON (with --render)")
    p.add_argument(
        "--add", action="append", metavar="JSON:TAG", help="with --render: another run's rows in the same table"
    )
    args = p.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        for extra in args.add or []:
            path, tag = extra.split(":", 1)
            add_run(result, json.loads(Path(path).read_text()), tag)
        if args.note is not None:
            result["note"] = args.note
    else:
        result = measure(args)
        if not result:
            return 0
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    section = render(result)
    if args.out:
        write_section(section + "\n", Path(args.out))
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
