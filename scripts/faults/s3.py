"""The S3 cell of the fault campaigns: saves to `s3://` on a local SeaweedFS, cut by SIGKILLs, a server
stopped mid-save, throttling and 5xx answers, and credentials revoked mid-save.

    python -m scripts.faults.s3                                # the default counts (about 30-40 min on 2 cores)
    python -m scripts.faults.s3 --kills 2 --rank-kills 2 --restarts 1 --throttles 2 --revokes 1 --json /tmp/s3.json
    python -m scripts.faults.s3 --render                       # the report section of --json

Each trial runs two gloo ranks (world size 2, forked from this process) of an FSDP2 model of four 768x768
layers with AdamW (each rank's DCP file is three 5 MiB parts), saving through the engine
(`save.step_save.save_resume_state`, incremental tier, sync) to `s3://<bucket>/<trial>/global_step_N/actor`:

  1. the ranks train and save step 1 (the previous committed step), then train step 2 and save it with the
     trial's fault; every rank records a hash of its shards and optimizer state before each save;
  2. this process lists the prefix through the storage: every step with a manifest must pass the manifest's
     checks (each object there, its size and checksum), else the trial is *half-committed*;
  3. two fresh ranks resume from the newest committed step (found from the manifests, no tracker), load it
     and compare their hashes with the recorded ones; after a resume from step 1 they train step 2 again
     (the same data) and save it (the next save of a step a kill cut: it must drop the killed save's
     objects and unfinished uploads and commit), and load it back.

Faults (deterministic moments: hooks in the ranks, no random timing):
  kill-mid-part   SIGKILL of both ranks while the k-th part of a rank's multipart upload is being sent
  kill-between    SIGKILL of both ranks right after the k-th part of a rank's upload is acknowledged
                  (one part in flight at a time: SLIMCKPT_S3_CONCURRENCY=2)
  kill-manifest   SIGKILL of both ranks at rank 0's manifest PUT: just before it (odd trials) or just after it
                  landed (even trials; the step is then committed)
  kill-rank       SIGKILL of one rank (alternating) after the k-th part of its upload; the other rank must end
                  by itself (the group's timeout), with a one-line error
  restart         the server stopped when a rank has sent its k-th part, started again 1-6 s later (the ranks'
                  requests meanwhile are refused and retried)
  throttle        the ranks talk through a fault proxy (slimckpt_testing.s3_proxy): 503 SlowDown, 500, 502, 504,
                  connections reset before or after a request reached the server, on parts, completions,
                  manifest PUTs, listings and reads; the last variant answers 503 to every PUT until the retries
                  give up (SLIMCKPT_S3_RETRIES=3)
  revoke          the server restarted mid-save with `-s3.config` identities that no longer hold the key

Outcomes: *exact* (step 2 committed; it loads to the recorded state bit for bit) and *resumed* (step 2 not
committed; step 1 loads exactly, and the next save of step 2 commits and loads exactly) are good. Bad:
*half-committed* (a manifest with a missing or changed object), *lost committed* (step 1 not found or not
loaded), *wrong state* (a load differs from the record), *re-save failed*, *hung*, *bad message* (a
failed save's error is not one line naming `s3://bucket/key` and a fix, or a rank did not fail), *fault
missed* (a kill's hook did not fire: the trial tested nothing).
"""

# lazy imports: torch and slimckpt's engine load once, after the arguments are read (--help and --render stay fast)

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from scripts import provenance
from scripts.faults.s3_ranks import WORLD, rank_body, step_url
from scripts.faults.s3_report import BAD, CELLS, GOOD, render

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "docs", "reliability", "s3.json")
PARTS = 3  # 5 MiB parts of a rank's DCP file (about 14 MB)
TRIAL_TIMEOUT_S = 300.0
RESTART_PAUSES_S = (1.0, 3.0, 6.0)
WHOLE_JOB_KILLS = ("kill-mid-part", "kill-between", "kill-manifest")

# throttle variants: proxy rules (slimckpt_testing.s3_proxy.Rule fields) and the env they run with
THROTTLES: list[tuple[str, list[dict[str, Any]], dict[str, str]]] = [
    ("503 SlowDown on the first 4 parts", [{"answer": "503", "method": "PUT", "query": "partNumber", "count": 4}], {}),
    (
        "500 on the manifest PUT, twice",
        [{"answer": "500", "method": "PUT", "key": "*/slimckpt_resume.json", "count": 2}],
        {},
    ),
    (
        "manifest PUT landed, its answer lost",
        [{"answer": "late", "method": "PUT", "key": "*/slimckpt_resume.json"}],
        {},
    ),
    (
        "502 then a lost answer on completions",
        [
            {"answer": "502", "method": "POST", "query": "uploadId", "count": 1},
            {"answer": "late", "method": "POST", "query": "uploadId", "count": 1},
        ],
        {},
    ),
    (
        "connection reset before 2 parts reach the server",
        [{"answer": "drop", "method": "PUT", "query": "partNumber", "skip": 1, "count": 2}],
        {},
    ),
    (
        "504 on listings and reads, 20%",
        [
            {"answer": "504", "method": "GET", "count": 0, "probability": 0.2},
            {"answer": "504", "method": "HEAD", "count": 0, "probability": 0.2},
        ],
        {},
    ),
    ("503 SlowDown on 15% of every request", [{"answer": "503", "count": 0, "probability": 0.15}], {}),
    (
        "part answers lost after they landed",
        [{"answer": "late", "method": "PUT", "query": "partNumber", "skip": 2, "count": 2}],
        {},
    ),
    ("500 on CreateMultipartUpload", [{"answer": "500", "method": "POST", "query": "uploads", "count": 2}], {}),
    (
        "503 on every PUT until the retries give up",
        [{"answer": "503", "method": "PUT", "count": 0}],
        {"SLIMCKPT_S3_RETRIES": "3"},
    ),
]


def run_group(spec: dict, server, on_file=None) -> dict:
    """Two ranks forked under a leader in their own process group; this process watches for the ranks'
    requests to stop or revoke the server (`on_file`) until the leader ends or TRIAL_TIMEOUT_S passes."""
    leader = os.fork()
    if leader == 0:
        os.setpgid(0, 0)
        pids = []
        for rank in range(WORLD):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    rank_body(spec, rank)
                except BaseException:  # noqa: BLE001 - a child never returns into the campaign
                    code = 1
                os._exit(code)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
        os._exit(0)
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    hung = False
    while True:
        done, _status = os.waitpid(leader, os.WNOHANG)
        if done:
            break
        if on_file is not None:
            on_file()
        if time.monotonic() > deadline:
            hung = True
            try:
                os.killpg(leader, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(leader, 0)
            break
        time.sleep(0.02)
    ranks = []
    for rank in range(WORLD):
        path = os.path.join(spec["dir"], f"{spec['tag']}.rank{rank}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else None)  # None: killed
    return {"hung": hung, "ranks": ranks}


# --------------------------------------------------------------------------- the oracle


def committed_steps(root: str) -> tuple[list[int], list[str]]:
    """The steps under `root` whose manifest is there, found through the storage; and the line of each
    step with a manifest that does not pass its checks (half-committed)."""
    from slimckpt.layout.resume_manifest import STEP_DIR, UncommittedCheckpoint, check_committed, has_manifest
    from slimckpt.storage import for_path

    store = for_path(root)
    try:
        names = store.list_dir(root)
    except FileNotFoundError:
        return [], []
    steps, broken = [], []
    for step in sorted(int(m.group(1)) for m in map(STEP_DIR.match, names) if m):
        role = step_url(root, step)
        if not has_manifest(role):
            continue
        try:
            check_committed(role)
        except (UncommittedCheckpoint, OSError) as exc:
            broken.append(f"global_step_{step}: {exc}")
            continue
        steps.append(step)
    return steps, broken


def message_ok(line: str | None, bucket: str) -> bool:
    """One line that names an object or prefix of the bucket and says what to do."""
    return bool(line) and "\n" not in line.strip() and f"s3://{bucket}/" in line and ";" in line


def judge(cell: str, faulted: dict, steps: list[int], broken: list[str], resumed: dict | None, bucket: str) -> dict:
    out: dict[str, Any] = {"committed": steps}
    errors = [r.get("error") if r else None for r in faulted["ranks"]]
    out["errors"] = [e.splitlines()[0][:400] if e else e for e in errors]
    if faulted["hung"]:
        return {**out, "outcome": "hung", "why": "the faulted save did not end"}
    killed = [rank for rank, r in enumerate(faulted["ranks"]) if r is None]
    if cell in WHOLE_JOB_KILLS and len(killed) != WORLD or cell == "kill-rank" and len(killed) != 1:
        return {**out, "outcome": "fault missed", "why": f"killed ranks {killed}: the hook did not fire as planned"}
    if broken:
        return {**out, "outcome": "half-committed", "why": broken[0]}
    if 1 not in steps:
        return {**out, "outcome": "lost committed", "why": "step 1 is not committed"}
    failed = [e for e in errors if e]
    if cell in ("revoke",) or (cell == "throttle" and failed):
        ranks_failed = [r for r in faulted["ranks"] if r is None or r.get("error")]
        if len(ranks_failed) != WORLD or not all(message_ok(e, bucket) for e in errors):
            return {
                **out,
                "outcome": "bad message",
                "why": f"every rank must fail in one line naming the URL: {errors}",
            }
    if cell == "kill-rank":
        survivors = [r for r in faulted["ranks"] if r is not None]
        if len(survivors) != WORLD - 1 or not survivors[0].get("error") or 2 in survivors[0].get("saved", []):
            return {**out, "outcome": "bad message", "why": f"the surviving rank did not fail: {errors}"}
    if resumed is None or resumed["hung"] or any(r is None for r in resumed["ranks"]):
        return {**out, "outcome": "hung", "why": "the resume did not end"}
    bad = [r for r in resumed["ranks"] if r.get("error")]
    if bad:
        return {**out, "outcome": "re-save failed", "why": bad[0]["error"].splitlines()[0][:400]}
    unequal = sorted({k for r in resumed["ranks"] for k, v in r["equal"].items() if not v})
    if unequal:
        return {**out, "outcome": "wrong state", "why": f"differs from the record: {unequal}"}
    newest = max(steps)
    out["outcome"] = "exact" if newest == 2 else "resumed"
    return out


# --------------------------------------------------------------------------- trials


def trial_specs(args: argparse.Namespace) -> list[dict]:
    counts = {
        "kill-mid-part": args.kills,
        "kill-between": args.kills,
        "kill-manifest": args.kills,
        "kill-rank": args.rank_kills,
        "restart": args.restarts,
        "throttle": args.throttles,
        "revoke": args.revokes,
    }
    specs = []
    for cell in CELLS:
        for i in range(counts[cell]):
            fault: dict[str, Any] = {"kind": cell, "rank": i % WORLD, "part": 1 + (i // WORLD) % PARTS}
            if cell == "kill-manifest":
                fault = {"kind": cell, "variant": "before" if i % 2 else "after"}
            elif cell == "restart":
                fault["pause"] = RESTART_PAUSES_S[i % len(RESTART_PAUSES_S)]
                fault["rank"] = 0
            elif cell == "revoke":
                fault["rank"] = 0
            elif cell == "throttle":
                variants = args.variants or list(range(len(THROTTLES)))
                fault = {"kind": cell, "variant": variants[i % len(variants)]}
            specs.append({"cell": cell, "index": i, "fault": fault})
    return specs


def describe(fault: dict) -> str:
    kind = fault["kind"]
    if kind == "kill-manifest":
        return f"{fault['variant']} the PUT"
    if kind == "throttle":
        return THROTTLES[fault["variant"]][0]
    text = f"rank {fault['rank']}, part {fault['part']}"
    return text + (f", {fault['pause']:.0f} s down" if kind == "restart" else "")


def run_trial(spec: dict, server, work: str, base_env: dict) -> dict:
    from slimckpt_testing.s3_proxy import FaultProxy, rules_from

    fault = spec["fault"]
    trial_dir = tempfile.mkdtemp(prefix=f"{spec['cell']}-{spec['index']}-", dir=work)
    root = server.url(f"{spec['cell']}-{spec['index']}")
    t0 = time.monotonic()
    proxy = None
    env = dict(base_env)
    if fault["kind"] == "throttle":
        _name, rules, more = THROTTLES[fault["variant"]]
        proxy = FaultProxy(server.endpoint, [], seed=spec["index"]).start()
        env.update(more, AWS_ENDPOINT_URL=proxy.endpoint)
    os.environ.update(env)

    def on_file() -> None:
        for kind in ("restart", "revoke"):
            flag = os.path.join(trial_dir, kind)
            if os.path.exists(flag) and not os.path.exists(flag + ".done"):
                if kind == "restart":
                    server.halt()
                    open(flag + ".done", "w").close()
                    time.sleep(fault["pause"])
                    server.resume()
                else:
                    server.resume(revoked=True)
                    open(flag + ".done", "w").close()

    # step 1 and the faulted step 2 in one group: the rules start with step 2 (step 1 is the committed base)
    first = {"dir": trial_dir, "tag": "faulted", "root": root, "last": 2, "fault": fault}
    if proxy is not None:
        proxy.set_rules([])

        def arm() -> None:
            if not armed[0] and os.path.exists(os.path.join(trial_dir, "expected.2.rank0")):
                proxy.set_rules(rules_from(rules))
                armed[0] = True

        armed = [False]
        faulted = run_group(first, server, arm)
    else:
        faulted = run_group(first, server, on_file)
    if proxy is not None:
        spec["faults_answered"] = len(proxy.faults)
        proxy.stop()
    os.environ.update(base_env)
    if fault["kind"] == "revoke":
        server.resume()
    steps, broken = committed_steps(root)
    resumed = None
    if steps and not broken and not faulted["hung"]:
        resumed = run_group(
            {"dir": trial_dir, "tag": "resumed", "root": root, "last": 2, "load": max(steps)}, server, None
        )
    verdict = judge(spec["cell"], faulted, steps, broken, resumed, server.bucket)
    verdict.update(
        cell=spec["cell"],
        index=spec["index"],
        fault=describe(fault),
        seconds=round(time.monotonic() - t0, 1),
        faults_answered=spec.get("faults_answered"),
    )
    if proxy is not None and not spec.get("faults_answered") and verdict["outcome"] in GOOD:
        verdict.update(outcome="fault missed", why="the proxy answered no fault")
    if verdict["outcome"] in GOOD:
        shutil.rmtree(trial_dir, ignore_errors=True)
        from slimckpt.storage import for_path

        for_path(root).remove_tree(root, ignore_errors=True)
    else:
        verdict["dir"] = trial_dir
        verdict["traces"] = [r.get("trace") for r in (resumed or faulted)["ranks"] if r and r.get("trace")]
    return verdict


def host_note() -> str:
    import torch

    load = os.getloadavg()[0]
    return f"{os.cpu_count()} CPUs, torch {torch.__version__}, 1-minute load {load:.1f} at the start"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--kills", type=int, default=30, help="whole-job SIGKILLs per moment (mid-part, between, manifest)")
    p.add_argument("--rank-kills", type=int, default=30, help="SIGKILLs of one rank (30)")
    p.add_argument("--restarts", type=int, default=10, help="server stopped and restarted mid-save (10)")
    p.add_argument("--throttles", type=int, default=10, help="throttling/5xx trials, cycling the variants (10)")
    p.add_argument("--revokes", type=int, default=10, help="credentials revoked mid-save (10)")
    p.add_argument(
        "--variants",
        type=int,
        nargs="+",
        choices=range(len(THROTTLES)),
        default=None,
        help="the throttle variants to cycle (indexes into THROTTLES; default all)",
    )
    p.add_argument("--cells", nargs="+", choices=CELLS, default=list(CELLS))
    p.add_argument("--work", default=os.path.join(REPO, "runs", "s3_faults"), help="trial dirs (bad ones are kept)")
    p.add_argument("--json", default=OUT, help=f"results (default {os.path.relpath(OUT, REPO)})")
    p.add_argument("--render", action="store_true", help="print the report section of --json and exit")
    args = p.parse_args(argv)
    if args.render:
        with open(args.json) as f:
            sys.stdout.write(render(json.load(f)))
        return 0

    # loaded here once: the forked ranks start with them
    import torch  # noqa: F401

    import slimckpt.save.step_save as resume_save  # noqa: F401
    import slimckpt.storage.s3 as s3  # noqa: F401
    from slimckpt_testing import s3_server

    commit = provenance.source_commit()
    os.makedirs(args.work, exist_ok=True)
    base_env = {
        "SLIMCKPT_S3_PART_MB": "5",
        "SLIMCKPT_S3_CONCURRENCY": "2",
        "SLIMCKPT_S3_RETRIES": "10",
        "SLIMCKPT_S3_RETRY_S": "60",
        "SLIMCKPT_S3_LEASE_S": "4",  # a killed save's lease is taken over 4 s after the kill
        "OMP_NUM_THREADS": "1",
        "SLIMCKPT_LOG_LEVEL": "ERROR",
    }
    started = time.monotonic()
    host = host_note()
    server = s3_server.start()
    trials: list[dict] = []
    data: dict[str, Any] = {}
    try:
        base_env.update(server.env)
        for spec in trial_specs(args):
            if spec["cell"] not in args.cells:
                continue
            verdict = run_trial(spec, server, args.work, base_env)
            trials.append(verdict)
            print(
                f"{verdict['cell']:>14} #{verdict['index']:<3} {verdict['fault']:<48} {verdict['outcome']:<15} "
                f"{verdict['seconds']:5.1f} s {verdict.get('why', '')}",
                flush=True,
            )
            data = {
                "command": " ".join(["python -m scripts.faults.s3", *(argv if argv is not None else sys.argv[1:])]),
                "commit": commit,
                "host": host,
                "minutes": (time.monotonic() - started) / 60,
                "trials": trials,
            }
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)
    finally:
        server.stop()
    if data:
        sys.stdout.write(render(data))
    return 1 if any(t["outcome"] in BAD for t in trials) else 0


if __name__ == "__main__":
    raise SystemExit(main())
