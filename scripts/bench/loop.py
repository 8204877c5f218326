#!/usr/bin/env python
"""Saves inside verl's real training loop: async_save off / pool / stream, side by side.

  python -m scripts.bench.loop                                  # 3 runs (sync, pool, stream) -> BENCHMARKS.md
  python -m scripts.bench.loop --steps 4 --out /tmp/b.md --json /tmp/b.json      # a quick look
  python -m scripts.bench.loop --size 0.25b --steps 4 --json docs/bench_loop_0.25b.json   # a 0.26B Llama
      (its actor update peaks at ~5 GiB per rank: on a 24 GB machine shared with other runs Ray's
      memory monitor killed it; not part of `make bench`)
  python -m scripts.bench.loop --render docs/bench_loop.json --out BENCHMARKS.md  # re-render, no runs

Each mode is one run of verl 0.9.1's `python -m verl.trainer.main_ppo` (scripts/train_small.sh: GRPO,
2 ranks, FSDP2 over gloo on the CPU, slimckpt's hf rollout, the tiny model) with `+recipe=incremental`
(the recipe's actor checkpoint block: DCP resume state + the gather-free HF export) saving every step;
only `actor_rollout_ref.actor.checkpoint.async_save` differs. slimckpt's own per-save reports
($SLIMCKPT_METRICS_FILE, slimckpt.observe.save_measure) give, per save and rank:

  blocked      seconds training waited: the save call, plus (stream) what the mutation guards waited
               for the writer after it returned (the next optimizer step, offload, ...)
  extra RSS    peak anonymous RSS above the level before the save, over the save and its background
               write (the process's: the rollout's own memory during the write counts too)
  to commit    seconds from the save call to the step's manifest

The first save of a run is left out of the medians (it builds the checkpoint group and, in pool
mode, allocates the pool); min-max over the other saves is the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scripts.bench.save_report import write_section  # one way to replace a marked section of BENCHMARKS.md
from scripts.provenance import source_commit

# lazy imports: torch and transformers load only where a size's model is built; --render needs neither

REPO = Path(__file__).resolve().parents[2]
MODES = {"sync": "false", "pool": "pool", "stream": "stream"}
MARKERS = "<!-- save-loop{}:begin -->", "<!-- save-loop{}:end -->"


def markers(size: str) -> tuple[str, str]:
    """Each size has its own section, so that a run at one size leaves the other's in place."""
    tag = "" if size == "tiny" else f"-{size}"
    return MARKERS[0].format(tag), MARKERS[1].format(tag)


BEGIN, END = markers("tiny")


# --size: a Llama of the tiny model's tokenizer and config with these dims (layers, hidden,
# intermediate, heads, kv heads), random weights: verl's loop at a size where a save takes seconds
SIZES = {"tiny": None, "0.25b": (22, 1024, 2816, 16, 8)}


def build_model(size: str, work: Path) -> Path | None:
    """The model directory for `size` (None: train_small.sh's tiny model), built once under `work`."""
    dims = SIZES[size]
    if dims is None:
        return None
    out = work / f"model-{size}"
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    tiny = work / "tiny_assets"
    if not (tiny / "model" / "config.json").exists():
        subprocess.run([sys.executable, "-m", "slimckpt_testing.tiny", "--out", str(tiny)], check=True)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny / "model")
    layers, hidden, inter, heads, kv = dims
    config.update(
        {
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": hidden // heads,
        }
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for f in (tiny / "model").iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "generation_config.json":
            shutil.copy(f, out / f.name)
    print(
        f"[bench-loop] {size}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters in {out}", flush=True
    )
    return out


def run_mode(mode: str, steps: int, work: Path, timeout: int, model: Path | None = None) -> list[dict]:
    """One training run; its report lines (JSON objects) from $SLIMCKPT_METRICS_FILE."""
    out = work / f"loop-{mode}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    metrics = out / "metrics.jsonl"
    cmd = [
        "bash",
        str(REPO / "scripts" / "train_small.sh"),
        "+recipe=incremental",
        f"actor_rollout_ref.actor.checkpoint.async_save={MODES[mode]}",
        "trainer.save_freq=1",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={out}/ckpt",
        f"trainer.rollout_data_dir={out}/rollouts",
    ]
    env = {
        **os.environ,
        "NPROC": "2",
        "ALGO": "grpo",
        "SLIMCKPT_METRICS_FILE": str(metrics),
        **({"MODEL_PATH": str(model), "TINY_ASSETS": str(work / "tiny_assets")} if model else {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "patches"), os.environ.get("PYTHONPATH")])),
    }
    log = work / f"loop-{mode}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"[bench-loop] {mode}: exit {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def per_save(reports: list[dict]) -> list[dict]:
    """One row per actor save, by step: the numbers above, max over ranks, and per rank."""
    steps: dict[int, dict[int, dict]] = {}
    for r in reports:
        if r.get("role") != "actor":
            continue
        slot = steps.setdefault(int(r["global_step"]), {}).setdefault(int(r["rank"]), {})
        slot[r["kind"]] = r
    rows = []
    for step, ranks in sorted(steps.items()):
        blocked, extra, commit_s = {}, {}, {}
        for rank, kinds in ranks.items():
            save = kinds.get("save")
            done = kinds.get("commit") or (save if save and save.get("committed") else None)
            if save is None or done is None:
                continue  # a save whose commit report is missing (the run ended first) is not counted
            blocked[rank] = float(save["blocking_seconds"]) + float(done.get("guard_blocked_seconds", 0.0))
            extra[rank] = int(done["peak_rss_extra_bytes"])
            commit_s[rank] = float(done["seconds"])
        if blocked:
            rows.append(
                {
                    "step": step,
                    "blocked_s": max(blocked.values()),
                    "extra_rss": [extra[k] for k in sorted(extra)],
                    "to_commit_s": max(commit_s.values()),
                    "guard_copied": max(
                        int((ranks[k].get("commit") or {}).get("guard_copied_bytes", 0)) for k in ranks
                    ),
                }
            )
    return rows


def summarise(mode: str, saves: list[dict]) -> dict:
    rest = saves[1:] or saves

    def stat(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {
        "mode": mode,
        "saves": saves,
        "n": len(rest),
        "blocked": stat([s["blocked_s"] for s in rest]),
        "extra_rss": stat([max(s["extra_rss"]) for s in rest]),
        "to_commit": stat([s["to_commit_s"] for s in rest]),
        "guard_copied": max((s["guard_copied"] for s in rest), default=0),
    }


def _spread(stat: dict, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(stat['median'] * scale)} ({fmt.format(stat['min'] * scale)}-{fmt.format(stat['max'] * scale)})"


def render_section(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    lines = [
        "| async_save | saves | blocked s, median (min-max) | blocked vs sync save | extra peak RSS MiB per rank, "
        "median (min-max) | save -> commit s, median (min-max) | guard copies |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = (
            "-"
            if sync is None or r is sync
            else f"{100 * r['blocked']['median'] / max(sync['to_commit']['median'], 1e-9):.0f}%"
        )
        lines.append(
            f"| {r['mode']} | {r['n']} | {_spread(r['blocked'])} | {share} "
            f"| {_spread(r['extra_rss'], 1 / 2**20, '{:,.1f}')} | {_spread(r['to_commit'])} "
            f"| {r['guard_copied'] / 2**20:,.1f} MiB |"
        )
    size = meta.get("size", "tiny")
    begin, end = markers(size)
    model = "the tiny model" if size == "tiny" else f"a random {size} Llama with the tiny model's tokenizer"
    title = "" if size == "tiny" else f" ({size})"
    return f"""{begin}
## Saves inside verl's training loop{title}: async_save off / pool / stream

Produced by `{meta["command"]}` on {meta["date"]} at commit {meta["commit"]}, in {meta["seconds"] / 60:.1f} minutes.
Machine: {meta["machine"]}. Each mode is one run of verl 0.9.1's `main_ppo` (scripts/train_small.sh: GRPO,
2 ranks, FSDP2/gloo on the CPU, {model}, hf rollout) with `+recipe=incremental` saving every step
({meta["steps"]} steps); only `async_save` differs. From slimckpt's per-save reports; the first save of each
run is left out. Blocked: the save call plus, in stream mode, the guards' waits for the writer after it
returned (max over ranks). Extra peak RSS: per rank, over the save and its background write. Guard copies:
the most a stream save's guards copied into host memory (budget `host_memory_budget_gb`).

{chr(10).join(lines)}

{meta.get("note", "")}
{end}
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument(
        "--size",
        choices=list(SIZES),
        default="tiny",
        help="the model: train_small.sh's tiny one, or a random 0.25B Llama with its tokenizer",
    )
    p.add_argument("--work", default=str(REPO / "bench_work"))
    p.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    p.add_argument(
        "--out", default=str(REPO / "BENCHMARKS.md"), help="report whose loop section is (re)written; '' for none"
    )
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--render", help="re-render the section from this JSON (no runs)")
    p.add_argument("--note", default="", help="a line under the table (e.g. how loaded the machine was)")
    args = p.parse_args()
    if args.render:
        result = json.loads(Path(args.render).read_text())
    else:
        modes = [m for m in args.modes.split(",") if m]
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise SystemExit(f"[bench-loop] unknown mode {bad}; modes: {list(MODES)}")
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        started = time.time()
        # the code the runs use: HEAD as they start (a commit made meanwhile is not theirs)
        commit = source_commit()
        rows = []
        model = build_model(args.size, work)
        for mode in modes:
            saves = per_save(run_mode(mode, args.steps, work, args.timeout, model))
            if len(saves) < 2:
                raise SystemExit(
                    f"[bench-loop] {mode}: {len(saves)} complete save report(s); see {work}/loop-{mode}.log"
                )
            rows.append(summarise(mode, saves))
            print(
                f"[bench-loop] {mode}: {rows[-1]['blocked']}, rss {rows[-1]['extra_rss']}, "
                f"commit {rows[-1]['to_commit']}",
                flush=True,
            )
        result = {
            "rows": rows,
            "meta": {
                "command": "python -m scripts.bench.loop"
                + (f" --steps {args.steps}" if args.steps != 6 else "")
                + (f" --size {args.size}" if args.size != "tiny" else ""),
                "date": time.strftime("%Y-%m-%d"),
                "commit": commit,
                "steps": args.steps,
                "size": args.size,
                "seconds": time.time() - started,
                "note": args.note,
                "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
            },
        }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.out:  # '' for none, as scripts.bench.save takes it
        write_section(render_section(result), Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
