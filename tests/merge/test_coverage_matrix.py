"""The coverage matrix: tiny models of every family verl users train, saved through
verl 0.9.1's own FSDPCheckpointManager (slimckpt_testing.verl_checkpoints.fsdp_checkpoint, gloo on CPU), and for each:

- `slimckpt merge` (in this process, streamed) writes every file verl's merger writes, byte for byte
  (verl's merger, unpatched, is the reference), without falling back to verl's merger;
- the incremental tier's gather-free in-training export of the same live model (bf16) writes the
  same files, byte for byte, but the tokenizer's (the trainer's tokenizer, as verl's hf_model save
  writes it; verl's merger re-saves the one it loads); the intermediate tier's export, which runs
  merge(), for two cases (`INTERMEDIATE`);
- a LoRA checkpoint also merges with `--merge_lora` to what peft's merge_and_unload() makes of verl's
  merger output (bf16, within one bf16 step), or ends in the one line recorded in KNOWN_UNSUPPORTED;
  the incremental tier's export with export_merge_lora writes `--merge_lora`'s files byte for byte
  (or is refused with its line);
- the merge's peak anonymous RSS above its start stays within one staging chunk plus allocator
  slack. That bound is relative: at these sizes the absolute bound (the imports plus a few chunks,
  ~270 MiB for the `slimckpt merge` command) is the imports' own footprint, and the models are
  kilobytes. tests/merge/test_memory.py checks the absolute flat bound on 400-540 MB of dense, MoE
  and LoRA shards; here the check is that no family takes a path whose memory grows.

One torchrun per (world size, FSDP version) saves every model of that cell in one process group
(`--models`, `--export`). The cells are sampled, not the cross product (the suite's time budget):
every family at world size 2 with FSDP2; world sizes 1 and 3 (3: uneven shards of every dim) for a
dense, an MoE and both LoRA models (3 also tied embeddings, DeepSeek-V3 and Qwen2.5-VL); FSDP1 for
a dense (tied and untied), an MoE, the VL and a LoRA model. LoRA on q_proj/v_proj everywhere, and with
verl's default target_modules=all-linear (peft then adapts fused MoE experts and routers too) at ws 2. A model
or export that fails in a cell is recorded with its reason in the support table, never skipped.

The run produces the support table (family x merge x in-training export x LoRA): docs/support_matrix.md
must equal it (SLIMCKPT_WRITE_SUPPORT_TABLE=1 rewrites the file, naming the commit it ran on).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from ..helpers.merge_helpers import REPO, run, same_adapter_config, tree_bytes, verl_merge

pytestmark = pytest.mark.slow

DENSE = ["llama", "qwen2", "qwen2-tied", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]
MOE = ["qwen2-moe", "qwen3-moe", "mixtral", "olmoe", "deepseek-v3"]
OTHER = ["qwen2.5-vl", "critic"]
LORA = ["llama+lora", "qwen3-moe+lora"]  # peft on q_proj/v_proj
LORA_ALL = ["llama+lora-all", "qwen3-moe+lora-all"]  # verl's default target_modules=all-linear: MoE experts adapted too
# (world size, FSDP version) -> the models that cell saves
CELLS: dict[tuple[int, int], list[str]] = {
    (2, 2): DENSE + MOE + OTHER + LORA + LORA_ALL,
    (1, 2): ["llama", "qwen3-moe", *LORA],
    (3, 2): ["llama", "qwen2-tied", "qwen3-moe", "deepseek-v3", "qwen2.5-vl", *LORA],
    (2, 1): ["llama", "qwen2-tied", "qwen3-moe", "qwen2.5-vl", "llama+lora"],
}
# the intermediate tier's export (it runs merge(), checked above): a dense and a LoRA MoE case
INTERMEDIATE = {(2, 2): ("llama",), (3, 2): ("qwen3-moe+lora",)}
# what the matrix found not supported, with the line it ends in: (cell, model, check) -> part of the reason.
# A case listed here must still fail that way (the test says when it starts to work); no other may fail.
KNOWN_UNSUPPORTED = {
    # peft 0.21 puts LoRA on the fused experts (a ParamWrapper: A [E*r, in], B [out, E*r]), not a
    # Linear's A/B: --merge_lora refuses it in one line (the unmerged base + lora_adapter/ is written)
    ("ws2-fsdp2", "qwen3-moe+lora-all", "merge_lora"): "adapts a module's parameters (peft's target_parameters",
    # verl's merger writes that adapter's adapter_config.json with `experts` in target_modules and no
    # target_parameters (slimckpt writes the same bytes): peft cannot load it back
    ("ws2-fsdp2", "qwen3-moe+lora-all", "adapter_loads"): "is not supported",
    # the incremental tier's merged export (export_merge_lora) refuses it with the same line
    ("ws2-fsdp2", "qwen3-moe+lora-all", "incremental_merged"): "refused as --merge_lora is: ",
}
FIXTURE_ARGS = ["--steps", "0", "--experts", "3", "--layers", "2", "--hidden", "64", "--vocab", "256"]
CHUNK = 1 << 20  # merge chunk: experts and embeddings cross chunks
RSS_SLACK = 48 << 20

# one row per family: (label, the models of it, its tied/untied note)
FAMILIES = [
    ("Llama", ["llama"]),
    ("Qwen2 (untied / tied embeddings)", ["qwen2", "qwen2-tied"]),
    ("Qwen3", ["qwen3"]),
    ("Mistral", ["mistral"]),
    ("Gemma2 (tied)", ["gemma2"]),
    ("Gemma3 (tied)", ["gemma3"]),
    ("Phi-3", ["phi3"]),
    ("Qwen2-MoE (shared expert)", ["qwen2-moe"]),
    ("Qwen3-MoE", ["qwen3-moe"]),
    ("Mixtral", ["mixtral"]),
    ("OLMoE", ["olmoe"]),
    ("DeepSeek-V3 (MLA, shared experts)", ["deepseek-v3"]),
    ("Qwen2.5-VL", ["qwen2.5-vl"]),
    ("critic value model (Qwen2, token classification, 1 label)", ["critic"]),
]
LORA_OF = {"llama": ["llama+lora", "llama+lora-all"], "qwen3-moe": ["qwen3-moe+lora", "qwen3-moe+lora-all"]}
TABLE_FILE = REPO / "docs" / "support_matrix.md"


def cell_name(cell: tuple[int, int]) -> str:
    return f"ws{cell[0]}-fsdp{cell[1]}"


def save_cell(root: Path, cell: tuple[int, int]) -> tuple[Path, float, str]:
    world, fsdp = cell
    out = root / cell_name(cell)
    export = "incremental" + (",intermediate:" + "/".join(INTERMEDIATE[cell]) if cell in INTERMEDIATE else "")
    loras = [m for m in CELLS[cell] if "+" in m]
    export += ",incremental-merged:" + "/".join(loras) if loras else ""
    t0 = time.perf_counter()
    proc = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(world),
            "-m",
            "slimckpt_testing.verl_checkpoints.fsdp_checkpoint",
            "--out",
            str(out),
            "--fsdp-version",
            str(fsdp),
            "--models",
            ",".join(CELLS[cell]),
            "--export",
            export,
            *FIXTURE_ARGS,
        ],
        env={"SLIMCKPT_LOG_LEVEL": "WARNING"},
        # one torchrun (up to 3 ranks) saves every model of its cell: tens of seconds; 300 s is a hang
        timeout=300,
    )
    (root / f"{cell_name(cell)}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"cell {cell_name(cell)}: torchrun failed\n{proc.stderr[-4000:]}"
    return out, time.perf_counter() - t0, proc.stderr


# an in-training export writes the trainer's tokenizer as verl's own hf_model save does; verl's merger
# re-saves the one it loads from huggingface/ (transformers adds is_local, a normalizer, ...): the
# export's tokenizer files are not compared with the merger's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tree_diff(ours: Path, ref: Path, skip: tuple[str, ...] = ()) -> str | None:
    """None when every file of `ref` is in `ours` with the same bytes and nothing else is; else why not."""
    a, b = tree_bytes(ours, skip), tree_bytes(ref, skip)
    if sorted(a) != sorted(b):
        return f"files differ: ours only {sorted(set(a) - set(b))}, reference only {sorted(set(b) - set(a))}"
    differ = [
        n for n in b if a[n] != b[n] and not (n.endswith("adapter_config.json") and same_adapter_config(a[n], b[n]))
    ]
    if not differ:
        return None
    from ..helpers.merge_helpers import dir_tensors

    why = []
    for n in differ:
        if n.endswith(".safetensors"):
            ta, tb = dir_tensors(ours / Path(n).parent), dir_tensors(ref / Path(n).parent)
            bad = [
                k
                for k in sorted(set(ta) | set(tb))
                if k not in ta
                or k not in tb
                or ta[k].dtype != tb[k].dtype
                or ta[k].shape != tb[k].shape
                or not ta[k].equal(tb[k])
            ]
            why.append(f"{n}: tensors {bad[:4]}" if bad else f"{n}: same tensors, other bytes")
        else:
            why.append(n)
    return "differ: " + "; ".join(why)


def first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else "(no message)"


def check_model(ckpt_root: Path, work: Path, cell: tuple[int, int], model: str) -> dict:
    """One (cell, model): the reference, our merge (RSS sampled), and each in-training export."""
    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeError, MergeOptions
    from slimckpt.observe.memory import RssSampler

    out: dict = {"cell": cell_name(cell), "model": model}
    ckpt = ckpt_root / model
    error = ckpt_root / f"{model}.error.txt"
    if error.exists():
        out["save"] = "verl's FSDPCheckpointManager failed: " + first_line(error.read_text())
        return out
    out["save"] = "ok"
    ref = work / "reference"
    failed = verl_merge(ckpt, ref)
    out["reference"] = "verl's merger" if failed is None else f"verl's merger failed: {failed}"
    if failed is not None:
        # where verl's merger fails, the full model's save_pretrained is the reference: not needed so far
        out["merge"] = out["export"] = f"no reference: verl's merger failed ({first_line(failed)})"
        return out
    ours = work / "ours"
    try:
        with RssSampler(interval_s=0.002) as rss:
            result = merge(MergeOptions(local_dir=str(ckpt), target_dir=str(ours), progress=False, chunk_bytes=CHUNK))
        out["merge_rss_extra"] = rss.result.extra
        if result.used_verl_merger:
            out["merge"] = "fell back to verl's whole-model merger"
        else:
            why = tree_diff(ours, ref)
            out["merge"] = "ok" if why is None else f"not equal to verl's merger: {why}"
            if why is None and rss.result.extra > CHUNK + RSS_SLACK:
                out["merge"] = (
                    f"peak RssAnon {rss.result.extra >> 20} MiB above its start (bound {(CHUNK + RSS_SLACK) >> 20} MiB)"
                )
    except MergeError as exc:
        out["merge"] = f"slimckpt merge refused: {exc}"
    if "+" in model:
        out["adapter_loads"] = check_adapter_loads(ref, model)
        out["merge_lora"] = check_merge_lora(ckpt, work, ref, model)
        out["incremental_merged"] = check_merged_export(ckpt_root, work, model, out["merge_lora"])
    for tier in ("incremental", "intermediate"):
        tier_dir = ckpt_root / f"{model}.{tier}"
        tier_error = ckpt_root / f"{model}.{tier}.error.txt"
        if tier_error.exists():
            out[tier] = "save failed: " + first_line(tier_error.read_text())
        elif tier_dir.exists():
            why = tree_diff(tier_dir / "huggingface", ref, TOKENIZER_FILES)
            out[tier] = "ok" if why is None else f"not equal to verl's merger: {why}"
    return out


def check_adapter_loads(ref: Path, model: str) -> str:
    """Whether peft loads the lora_adapter/ verl's merger wrote (ours is byte-equal to it)."""
    import torch
    from peft import PeftModel

    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import auto_class

    try:
        PeftModel.from_pretrained(auto_class(model).from_pretrained(ref, dtype=torch.bfloat16), ref / "lora_adapter")
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        message = " ".join(str(exc).split()).split(". ")[0]  # its first sentence, on one line
        return f"peft cannot load verl's lora_adapter/: {type(exc).__name__}: {message[:200]}"
    return "ok"


def check_merged_export(ckpt_root: Path, work: Path, model: str, merge_lora: str) -> str:
    """The incremental tier's export with export_merge_lora (bf16) against `--merge_lora` of verl's save
    (work/merged), byte for byte; where `--merge_lora` refuses, the export must end in its line."""
    tier_dir, error = ckpt_root / f"{model}.incremental-merged", ckpt_root / f"{model}.incremental-merged.error.txt"
    if error.exists():
        line = error.read_text().strip().splitlines()[0]
        refused = merge_lora.removeprefix("--merge_lora refused in one line: --merge_lora: ")
        same = merge_lora != refused and refused.split(": not supported")[0] in line
        return f"{'refused as --merge_lora is' if same else 'save failed'}: {first_line(line)}"
    if merge_lora != "ok":
        return f"written where --merge_lora is not ok ({merge_lora})"
    why = tree_diff(tier_dir / "huggingface", work / "merged", TOKENIZER_FILES)
    return "ok" if why is None else f"not equal to --merge_lora: {why}"


def check_merge_lora(ckpt: Path, work: Path, ref: Path, model: str) -> str:
    """`--merge_lora` (bf16) against peft's merge_and_unload() of verl's merger output, as loaded."""
    import torch
    from peft import PeftModel

    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeError, MergeOptions
    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import auto_class

    try:
        merge(
            MergeOptions(
                local_dir=str(ckpt), target_dir=str(work / "merged"), progress=False, merge_lora=True, chunk_bytes=CHUNK
            )
        )
    except MergeError as exc:
        return f"--merge_lora refused in one line: {exc}"
    cls = auto_class(model)
    want = (
        PeftModel.from_pretrained(cls.from_pretrained(ref, dtype=torch.bfloat16), ref / "lora_adapter")
        .merge_and_unload()
        .state_dict()
    )
    got = cls.from_pretrained(work / "merged", dtype=torch.bfloat16).state_dict()
    if sorted(got) != sorted(want):
        return f"--merge_lora: other tensors than peft's merge_and_unload: {sorted(set(got) ^ set(want))[:4]}"
    off = [k for k in want if not torch.allclose(got[k].float(), want[k].float(), rtol=2**-7, atol=0)]
    return "ok" if not off else f"--merge_lora differs from peft's merge_and_unload: {off[:4]}"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    """Every cell saved (one torchrun each) and checked: {(cell name, model): outcome}, plus timings."""
    root = tmp_path_factory.mktemp("coverage_matrix")
    outcomes: dict = {}
    timings: dict = {}
    for cell in CELLS:
        ckpt_root, seconds, _ = save_cell(root, cell)
        timings[cell_name(cell)] = {"torchrun_s": round(seconds, 1)}
        t0 = time.perf_counter()
        for model in CELLS[cell]:
            outcomes[(cell_name(cell), model)] = check_model(
                ckpt_root, root / "work" / cell_name(cell) / model, cell, model
            )
        timings[cell_name(cell)]["checks_s"] = round(time.perf_counter() - t0, 1)
    (root / "outcomes.json").write_text(json.dumps({"timings": timings, "outcomes": [*outcomes.values()]}, indent=1))
    print(json.dumps(timings))
    return outcomes


CASES = [(cell_name(c), m) for c, models in CELLS.items() for m in models]


@pytest.mark.parametrize("cell,model", CASES, ids=[f"{c}-{m}" for c, m in CASES])
def test_merge_and_export_equal_verl_merger(matrix, cell, model):
    got = matrix[(cell, model)]
    checks = ["save", "merge", "incremental"] + (
        ["adapter_loads", "merge_lora", "incremental_merged"] if "+" in model else []
    )
    if (cell, model) in {(cell_name(c), m) for c, ms in INTERMEDIATE.items() for m in ms}:
        checks.append("intermediate")
    assert got["save"] != "ok" or got["reference"] == "verl's merger", got
    for check in checks:
        known = KNOWN_UNSUPPORTED.get((cell, model, check))
        if known:
            assert known in got.get(check, ""), (
                f"{check} of {model} at {cell} no longer fails as recorded (KNOWN_UNSUPPORTED): {got}"
            )
        else:
            assert got.get(check) == "ok", (check, got)


def test_every_family_is_in_the_matrix():
    """Every family at ws 2 FSDP2; ws 1 and 3 for a dense, an MoE and a LoRA case; FSDP1 for a dense
    and an MoE case; a family with tied and untied embeddings."""
    assert {m for _, ms in FAMILIES for m in ms} <= set(CELLS[(2, 2)])
    for cell in ((1, 2), (3, 2)):
        assert {"llama", "qwen3-moe", "llama+lora", "qwen3-moe+lora"} <= set(CELLS[cell])
    assert all(
        c in CELLS and m in CELLS[c]
        for c, m in {(tuple(int(x) for x in c.removeprefix("ws").split("-fsdp")), m) for c, m, _ in KNOWN_UNSUPPORTED}
    )
    assert {"llama", "qwen3-moe"} <= set(CELLS[(2, 1)])
    assert {"qwen2", "qwen2-tied"} <= set(CELLS[(2, 2)])


def _cells_of(matrix: dict, model: str) -> list[str]:
    return [c for (c, m) in matrix if m == model]


def _column(matrix: dict, models: list[str], key: str) -> str:
    """'yes (cells)' when every case of these models is ok in `key`, else the first reason (`**no**`)."""
    cases = [(c, m) for m in models for c in _cells_of(matrix, m)]
    bad = [
        (c, m, matrix[(c, m)].get(key) or matrix[(c, m)].get("save"))
        for c, m in cases
        if matrix[(c, m)].get(key) != "ok"
    ]
    if bad:
        c, m, why = bad[0]
        return f"**no** ({m}, {c}: {why})".replace("|", "/")
    return "yes (" + ", ".join(sorted({c for c, _ in cases}, key=_cell_order)) + ")"


def _merged_export(matrix: dict, lora: str) -> str:
    """The incremental merged export's column: 'as --merge_lora' where it is refused with --merge_lora's line."""
    col = _column(matrix, [lora], "incremental_merged")
    if col.startswith("**no**") and all(
        matrix[(c, lora)].get("incremental_merged", "").startswith("refused as") for c in _cells_of(matrix, lora)
    ):
        return "refused in `--merge_lora`'s line"
    return col


def _cell_order(name: str):
    return [cell_name(c) for c in CELLS].index(name)


def _intermediate(matrix: dict, models: list[str]) -> str:
    cases = [(cell_name(c), m) for c, ms in INTERMEDIATE.items() for m in ms if m in models]
    if not cases:
        return ""
    bad = [matrix[k].get("intermediate") for k in cases if matrix[k].get("intermediate") != "ok"]
    return "; intermediate tier: " + (
        f"**no** ({bad[0]})".replace("|", "/") if bad else "yes (" + ", ".join(c for c, _ in cases) + ")"
    )


def support_table(matrix: dict) -> str:
    lines = [
        "| family | `slimckpt merge` (= verl's merger, streamed) | in-training export (incremental tier, gather-free) | LoRA (target_modules: merge + incremental export; `--merge_lora` = peft's merge_and_unload) |",
        "|---|---|---|---|",
    ]
    for label, models in FAMILIES:
        merge_col = _column(matrix, models, "merge")
        export_col = _column(matrix, models, "incremental")
        export_col += _intermediate(matrix, models)
        if models[0] in LORA_OF:
            parts = []
            for lora in LORA_OF[models[0]]:
                targets = "all-linear" if lora.endswith("-all") else "q_proj,v_proj"
                lora_merge, lora_export = _column(matrix, [lora], "merge"), _column(matrix, [lora], "incremental")
                col = lora_merge if lora_merge == lora_export else f"merge {lora_merge}; export {lora_export}"
                loads = _column(matrix, [lora], "adapter_loads")
                parts.append(
                    f"{targets}: {col}{_intermediate(matrix, [lora])}; `--merge_lora`: "
                    + _column(matrix, [lora], "merge_lora")
                    + "; merged export (`export_merge_lora`, = `--merge_lora`): "
                    + _merged_export(matrix, lora)
                    + ("" if loads.startswith("yes") else f"; the adapter verl writes: {loads}")
                )
            lora_col = "<br>".join(parts)
        else:
            lora_col = (
                "not in the matrix (its LoRA cases: Llama, Qwen3-MoE; the adapter path does not depend on the family)"
            )
        lines.append(f"| {label} | {merge_col} | {export_col} | {lora_col} |")
    cells = "; ".join(f"{cell_name(c)}: {', '.join(ms)}" for c, ms in CELLS.items())
    return "\n".join(lines) + (
        f"\n\nCells (world size, FSDP version): {cells}. The in-training export of the intermediate tier (which runs "
        f"the same merge) is checked for {', '.join(f'{m} at {cell_name(c)}' for c, ms in INTERMEDIATE.items() for m in ms)}.\n"
    )


def _header(commit: str) -> str:
    return (
        "# Support matrix\n\nGenerated by `SLIMCKPT_WRITE_SUPPORT_TABLE=1 python -m pytest "
        f'tests/merge/test_coverage_matrix.py` at commit {commit}. "yes" lists the cells '
        "(world size, FSDP version) where the output equalled verl's merger byte for byte.\n\n"
    )


def test_support_table_is_what_the_run_produced(matrix):
    table = support_table(matrix)
    if os.environ.get("SLIMCKPT_WRITE_SUPPORT_TABLE") == "1":
        import subprocess

        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
        TABLE_FILE.write_text(_header(commit) + table)
    text = TABLE_FILE.read_text()
    assert text.startswith("# Support matrix\n\nGenerated by `SLIMCKPT_WRITE_SUPPORT_TABLE=1")
    assert text[text.index("| family") :] == table, (
        "docs/support_matrix.md is stale: rerun with SLIMCKPT_WRITE_SUPPORT_TABLE=1"
    )
