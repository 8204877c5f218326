#!/usr/bin/env python
"""`slimckpt plan` next to the saves `make bench` measured: bytes and rank 0's host memory, predicted and measured.

  python -m scripts.bench.plan_check                         # print the table (docs/bench_save.json's saves)
  python -m scripts.bench.plan_check --out docs/plan_check.md   # write it into that file's marked section
                                                             # and README's plan-headline rows
  python -m scripts.bench.plan_check --json docs/bench_save.json --world-size 2

Every committed save of scripts/bench/save.py (a Llama preset of slimckpt_testing.verl_checkpoints.fsdp_checkpoint,
FSDP2, world size 2, on CPU: model, optimizer and extra state, with verl's hf_model or the
incremental recipe's export) is planned from the preset's config.json with `--device cpu --fsdp 2`:
the plan is what `slimckpt plan` prints for it. A point agrees when the bytes written are within
BYTES_TOLERANCE (the plan leaves out pickle framing, safetensors headers, configs and manifests) and
rank 0's extra host memory within MEMORY_TOLERANCE of the measured peak or MEMORY_SLACK, whichever
is larger (a few MiB of allocator and Python objects are no model bytes). The async row is planned
with the staging budget the bench had: the bench sizes it to the host's free memory, and records
whether the pool was used.

The saves of scripts/bench/train_scale.py (docs/bench_train_scale.json: the 3.6B Llama, model and extra
state, no optimizer) that finished are planned the same way, with those contents.

Time is not compared here: bench_save measures no disk speed in the same run, and its writes land
in the page cache of a shared host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from scripts.bench.save_report import write_section  # one way to replace a marked section of a report

# lazy imports: slimckpt's planner and the model builder (torch) load when the table is computed, not for --help

REPO = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- plan-check:begin -->", "<!-- plan-check:end -->"
HEADLINE = ("<!-- plan-headline:begin -->", "<!-- plan-headline:end -->")
BYTES_TOLERANCE = 0.001
MEMORY_TOLERANCE = 0.15
MEMORY_SLACK = 64 * 2**20
MiB = 2**20
MODE_LABEL = {
    "verl": "verl 0.9.1 (hf_model)",
    "intermediate": "+recipe=intermediate",
    "incremental": "+recipe=incremental",
    "async": "incremental, async",
    "stream": "incremental, async=stream",
}


@dataclass
class Point:
    size: str
    mode: str
    params: int
    planned_bytes: int
    measured_bytes: int
    planned_host: int
    measured_host: int  # rank 0's peak extra RssAnon in its first save (older JSONs: over all saves)
    measured_others: list[int]
    note: str
    largest_host: int | None = None  # rank 0's peak extra over all the saves of the run

    @property
    def bytes_ok(self) -> bool:
        return abs(self.measured_bytes - self.planned_bytes) <= BYTES_TOLERANCE * self.measured_bytes

    @property
    def host_ok(self) -> bool:
        return abs(self.measured_host - self.planned_host) <= max(MEMORY_TOLERANCE * self.measured_host, MEMORY_SLACK)


def preset_config(size: str, root: str) -> str:
    """The preset's config.json, as the bench's model is built from it."""
    from slimckpt_testing.verl_checkpoints import fsdp_checkpoint

    path = os.path.join(root, size)
    fsdp_checkpoint.build_config(fsdp_checkpoint.parse_args(["--out", path, "--size-preset", size])).save_pretrained(
        path
    )
    return path


# the incremental recipe exported fp32 (export_dtype: auto) until it shipped bf16: a measured row that does not
# record its export's dtype was written with fp32
UNRECORDED_EXPORT_DTYPE = "auto"


def strategy_for(
    mode: str, staged: bool | None, contents: tuple[str, ...] | None = None, export_dtype: str | None = None
):
    """The plan's strategy of a measured save; `contents`: the incremental tier's save_contents when the
    bench set them (scripts/bench/train_scale.py saves [model, extra]); `export_dtype`: the incremental
    export's dtype the bench ran with."""
    from slimckpt.plan import build, cost

    if mode == "verl":
        return cost.Strategy("verl + hf_model", contents=(*cost.VERL_CONTENTS, "hf_model"))
    if mode == "intermediate":
        return build.recipe_strategies(["intermediate"])[0]
    # the measured saves ran with a number for host_memory_budget_gb (the recipe's auto is per node)
    inc = replace(
        build.recipe_strategies(["incremental"])[0],
        host_memory_budget_gb=16.0,
        export_dtype=export_dtype or UNRECORDED_EXPORT_DTYPE,
    )
    if contents:
        inc = replace(inc, contents=contents)
    if mode == "incremental":
        return inc
    if mode == "stream":
        return replace(inc, async_save=True, async_stream=True)
    # the bench's budget was the host's free memory then: the pool was used, or it was not
    return replace(inc, async_save=True, host_memory_budget_gb=1e6 if staged else 0.0)


def planned(
    facts,
    world: int,
    strategy,
    extra: int,
    size: str,
    row: dict,
    peaks: list[int],
    note: str,
    largest: int | None = None,
) -> Point:
    """`slimckpt plan --device cpu --fsdp 2`'s estimate of one measured save (`row`) of the model of
    `facts`, next to what was measured: the bytes on disk and each rank's peak extra RssAnon in one
    save (`peaks`); `largest`: rank 0's over all the run's saves."""
    from slimckpt.plan import cost

    e = cost.estimate(
        facts.params, world, strategy, extra, facts.hf_bytes, None, fsdp=2, hf_dtype=facts.hf_dtype, device="cpu"
    )
    total = e.total_write_bytes + e.hf_export_bytes
    return Point(
        size,
        row["mode"],
        row["params"],
        total,
        row["bytes_on_disk"],
        e.host_peak_bytes,
        peaks[0],
        peaks[1:],
        note,
        largest,
    )


def points(bench: dict, world: int) -> list[Point]:
    from slimckpt.plan import meta_model

    extra = meta_model.extra_state_bytes()
    out = []
    with tempfile.TemporaryDirectory(prefix="plan-check-") as root:
        facts = {}
        for row in bench["rows"]:
            if row["size"] not in facts:
                facts[row["size"]] = meta_model.model_facts(preset_config(row["size"], root))
            f = facts[row["size"]]
            note = (
                "pool not used: the host lacked the memory"
                if row["mode"] == "async" and row.get("staged") is False
                else ""
            )
            strategy = strategy_for(row["mode"], row.get("staged"), export_dtype=row.get("export_dtype"))
            one = row.get("first_save_extra_per_rank") or row["peak_extra_per_rank"]
            largest = row["peak_extra_per_rank"][0] if row.get("first_save_extra_per_rank") else None
            out.append(planned(f, world, strategy, extra, row["size"], row, one, note, largest))
    return out


def train_points(train: dict, world: int) -> list[Point]:
    """The saves scripts/bench/train_scale.py measured at its largest size ([model, extra]; intermediate
    [model]) that finished: verl's hf_model save was killed there, so it has no measured point."""
    from slimckpt.plan import meta_model

    extra = meta_model.extra_state_bytes()
    preset, out = train["meta"]["preset"], []
    with tempfile.TemporaryDirectory(prefix="plan-check-") as root:
        f = meta_model.model_facts(preset_config(preset, root))
        for row in train["rows"]:
            if row["preset"] != preset or row["killed"] or row["mode"] not in ("intermediate", "incremental", "stream"):
                continue
            strategy = strategy_for(
                row["mode"], None, contents=("model", "extra"), export_dtype=row.get("export_dtype")
            )
            note = "model and extra state, no optimizer (make bench-train-scale)"
            one = row.get("first_save_extra_per_rank") or row["save_extra_per_rank"]
            largest = row["save_extra_per_rank"][0] if row.get("first_save_extra_per_rank") else None
            out.append(planned(f, world, strategy, extra, preset, row, one, note, largest))
    return out


def table(found: list[Point], meta: dict) -> str:
    lines = [
        f"{BEGIN}",
        f"`slimckpt plan --device cpu --fsdp 2 --world-size 2` for each save `make bench` measured "
        f"(docs/bench_save.json, commit {meta.get('commit', '?')}, {meta.get('date', '?')}; "
        f"`python -m scripts.bench.plan_check --out docs/plan_check.md`). Bytes agree within "
        f"{BYTES_TOLERANCE:.1%} (the plan leaves out pickle framing, headers, configs, manifests); host "
        f"memory is rank 0's extra peak RssAnon in the first save of a fresh process, agreeing within "
        f"{MEMORY_TOLERANCE:.0%} or {MEMORY_SLACK // MiB} MiB, whichever is larger. The largest over all "
        f"the run's saves is shown beside it: later saves also carry what the allocator kept of the earlier "
        f"ones, which the plan does not model.",
        "",
        "| model | save | bytes planned | bytes measured | rank 0 host planned | rank 0 measured, one save "
        "| rank 0, largest of the saves | other rank | agrees |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in found:
        ok = "yes" if p.bytes_ok and p.host_ok else "**no**"
        largest = "-" if p.largest_host is None else f"{p.largest_host / MiB:,.0f} MiB"
        lines.append(
            f"| {p.params / 1e9:.2f}B | {MODE_LABEL.get(p.mode, p.mode)} | {p.planned_bytes / 1e9:.3f} GB | "
            f"{p.measured_bytes / 1e9:.3f} GB | {p.planned_host / MiB:,.0f} MiB | {p.measured_host / MiB:,.0f} MiB"
            f" | {largest} | {', '.join(f'{x / MiB:,.0f}' for x in p.measured_others)} MiB | {ok}"
            + (f" ({p.note})" if p.note else "")
            + " |"
        )
    lines.append(END)
    return "\n".join(lines) + "\n"


def headline(bench: list[Point], train: list[Point]) -> str:
    """README's rows: verl's hf_model save of the largest model `make bench` measured (`bench`), and ours
    of the largest `make bench-train-scale` measured (`train`), planned next to measured."""
    found = bench + train
    top = max(p.params for p in bench)
    shown = [(p, "model, optimizer and extra state") for p in bench if p.params == top and p.mode == "verl"]
    shown += [(p, "model and extra state") for p in train if p.mode == "incremental"]
    agree = sum(p.bytes_ok and p.host_ok for p in found)
    lines = [
        HEADLINE[0],
        f"| `slimckpt plan --device cpu` against a save measured on CPU ({agree} of {len(found)} agree: "
        "[docs/plan_check.md](docs/plan_check.md); on a GPU the plan adds the copies to host) "
        "| bytes written, planned / measured "
        "| rank 0's extra host memory, planned / measured |",
        "|---|---|---|",
    ]
    for p, contents in shown:
        lines.append(
            f"| {p.params / 1e9:.2f}B, {MODE_LABEL.get(p.mode, p.mode)}, {contents} | {p.planned_bytes / 1e9:.2f} / {p.measured_bytes / 1e9:.2f} GB "
            f"| {p.planned_host / MiB:,.0f} / {p.measured_host / MiB:,.0f} MiB |"
        )
    lines.append(HEADLINE[1])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(REPO / "docs" / "bench_save.json"), help="scripts/bench/save.py's results")
    p.add_argument("--world-size", type=int, default=2, help="the bench's ranks (its --nproc)")
    p.add_argument("--out", default=None, help="a markdown file whose plan-check section to write")
    p.add_argument(
        "--train-json",
        default=str(REPO / "docs" / "bench_train_scale.json"),
        help="scripts/bench/train_scale.py's results ('' for none)",
    )
    args = p.parse_args(argv)
    bench = json.loads(Path(args.json).read_text())
    ours = points(bench, args.world_size)
    train = []
    if args.train_json and Path(args.train_json).exists():
        train = train_points(json.loads(Path(args.train_json).read_text()), args.world_size)
    found = ours + train
    section = table(found, bench.get("meta", {}))
    if args.out:
        write_section(section, Path(args.out))
        readme = REPO / "README.md"
        if HEADLINE[0] not in readme.read_text():
            sys.exit(f"{readme}: no {HEADLINE[0]} line; put the two plan-headline markers where the rows go")
        write_section(headline(ours, train), readme)
    print(section, end="")
    return 0 if all(pt.bytes_ok and pt.host_ok for pt in found) else 1


if __name__ == "__main__":
    sys.exit(main())
