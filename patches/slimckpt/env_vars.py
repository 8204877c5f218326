"""Every `SLIMCKPT_*` environment variable, declared once: name, type, default, meaning, and who it is for.

The modules that read a variable still read it themselves (the `read_in` column names them);
this table is what the documentation is generated from and what `tests/unit/test_env_vars.py` holds
the code to: a `SLIMCKPT_` name used anywhere in patches/, scripts/ or tests/ must be declared
here, and docs/configuration.md's table must be this module's `--markdown` output.

Kinds:
  - user:  a switch a user sets (or a launcher sets for them);
  - bench: a knob that turns one piece of the merge's speed machinery off or records its timings,
           for benchmarks and diagnosis; the defaults are what users get;
  - test:  read by the test suite only.

Torch-free and import-free (nothing of ours): any module, script or test may import it.

    python -m slimckpt.env_vars --markdown                     # the table, on stdout
    python -m slimckpt.env_vars --write docs/configuration.md  # rewrite the table between its markers
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

KINDS = ("user", "bench", "test")
TYPES = ("flag", "int", "seconds", "path", "level", "version")


@dataclass(frozen=True)
class EnvVar:
    """One variable. `default` is the value the code assumes when it is unset (None: unset means off
    or none); a `flag` is on only when set to `1` unless its default is `1`, when `0` turns it off."""

    name: str
    type: str
    default: str | None
    kind: str
    meaning: str
    read_in: tuple[str, ...]  # files (relative to the repo) that read it


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("SLIMCKPT_DISABLE", "flag", None, "user",
           "`1`: the verl plugin applies nothing (plain verl, its merger included); the Hydra search path stays",
           ("patches/slimckpt/verl/plugin.py",)),
    EnvVar("SLIMCKPT_MEASURE", "flag", None, "user",
           "`1`: verl's own save is timed and its peak RSS sampled (retention, tracker and load stay verl's); "
           "reports go to `<default_local_dir>/slimckpt_reports/`. The launchers set it",
           ("patches/slimckpt/verl/plugin.py",)),
    EnvVar("SLIMCKPT_METRICS_FILE", "path", None, "user",
           "every save report (and async commit report) is also appended to this file as one JSON line",
           ("patches/slimckpt/observe/save_measure.py",)),
    EnvVar("SLIMCKPT_CHECKPOINT", "flag", None, "user",
           "`1`: the checkpoint feature (save/load hooks, retention, async tracker) without a recipe's config "
           "object; `recipes/incremental.yaml` sets it for Ray's trainer actor",
           ("patches/slimckpt/verl/plugin.py", "recipes/incremental.yaml")),
    EnvVar("SLIMCKPT_CPU", "flag", None, "user",
           "`1`: verl's trainer on a host without an accelerator (platform `cpu`, gloo, rollout `hf`)",
           ("patches/slimckpt/cpu/__init__.py", "patches/slimckpt/verl/plugin.py")),
    EnvVar("SLIMCKPT_CPU_FORCE", "flag", None, "user",
           "`1`: allow `SLIMCKPT_CPU=1` where a GPU is visible",
           ("patches/slimckpt/cpu/__init__.py",)),
    EnvVar("SLIMCKPT_ROLLOUT_THREADS", "int", "1", "user",
           "torch threads of the CPU `hf` rollout server",
           ("patches/slimckpt/cpu/hf_server.py",)),
    EnvVar("SLIMCKPT_LOG_LEVEL", "level", "INFO", "user",
           "level of the `slimckpt` logger; an unknown value falls back to INFO with a warning",
           ("patches/slimckpt/log.py",)),
    EnvVar("SLIMCKPT_ALLOW_UNTESTED_VERL", "version", None, "user",
           "a verl version: apply the patches to that verl anyway (only 0.9.1 is tested)",
           ("patches/slimckpt/verl/registry.py",)),
    EnvVar("SLIMCKPT_DIRECT_IO", "flag", "1", "user",
           "`0`: merges read and write through the page cache instead of O_DIRECT (a filesystem that "
           "refuses O_DIRECT falls back by itself, with one warning)",
           ("patches/slimckpt/read/direct_io.py",)),
    EnvVar("SLIMCKPT_MERGE_WORKERS", "int", "1", "user",
           "writer processes of the redirected `python -m verl.model_merger merge` (`slimckpt merge --workers`)",
           ("patches/slimckpt/merge/verl_merger.py",)),
    EnvVar("SLIMCKPT_MERGE_OVERWRITE", "flag", None, "user",
           "`1`: the redirected verl merger replaces a non-empty target dir",
           ("patches/slimckpt/merge/verl_merger.py",)),
    EnvVar("SLIMCKPT_MERGE_DISTRIBUTED", "flag", None, "user",
           "`1`: the redirected verl merger under torchrun shares the work across ranks "
           "(`slimckpt merge --distributed_merge`)",
           ("patches/slimckpt/merge/verl_merger.py",)),
    EnvVar("SLIMCKPT_MERGE_JOIN_TIMEOUT", "seconds", "600", "user",
           "seconds every rank of a distributed merge has to join; then one line names the missing ranks",
           ("patches/slimckpt/merge/pipeline.py",)),
    EnvVar("SLIMCKPT_MERGE_PEER_TIMEOUT", "seconds", "120", "user",
           "seconds a rank of a distributed merge may stop answering (killed, stopped) before the others end, "
           "in one line naming it",
           ("patches/slimckpt/merge/pipeline.py",)),
    EnvVar("SLIMCKPT_MERGE_NO_VERL_FALLBACK", "flag", None, "user",
           "`1`: the redirected verl merger refuses, in one line, a checkpoint the streaming merge does not "
           "handle instead of running verl's own merger on it (`slimckpt merge --no_verl_fallback`)",
           ("patches/slimckpt/merge/verl_merger.py",)),
    EnvVar("SLIMCKPT_PROGRESS", "flag", None, "user",
           "`1`: progress bars in the redirected verl merger when stderr is not a terminal",
           ("patches/slimckpt/merge/verl_merger.py",)),
    EnvVar("SLIMCKPT_TRUST_PICKLE", "flag", None, "user",
           "`1`: unpickle any global a checkpoint names, as `torch.load(weights_only=False)` does (what "
           "`--trust-pickle` and `checkpoint.trust_pickle=true` set; also for the redirected verl merger)",
           ("patches/slimckpt/read/pickle_policy.py",)),
    EnvVar("SLIMCKPT_TRUST_INTERNALS", "flag", None, "user",
           "`1`: on a torch or transformers release slimckpt was not checked on, use its internals anyway "
           "where they still import, instead of the public fallback (`slimckpt/internals.py` lists them)",
           ("patches/slimckpt/internals.py",)),
    EnvVar("SLIMCKPT_READAHEAD", "flag", "1", "bench",
           "`0`: no `posix_fadvise(WILLNEED)` on the shards a merge is about to read",
           ("patches/slimckpt/read/readahead.py",)),
    EnvVar("SLIMCKPT_MERGE_FORK", "flag", "1", "bench",
           "`0`: no writer child forked before torch is imported (it starts writing during the imports)",
           ("patches/slimckpt/write/forked_call.py",)),
    EnvVar("SLIMCKPT_MERGE_GUESS", "flag", "1", "bench",
           "`0`: that early writer does not start on a layout guessed from `config.json` (same bytes, slower)",
           ("patches/slimckpt/merge/early_write.py",)),
    EnvVar("SLIMCKPT_MERGE_STATS", "path", None, "bench",
           "the merge's torch-free writer writes where its time went (reading, waiting, casting) to this file "
           "as JSON",
           ("patches/slimckpt/write/writer_stats.py",)),
    EnvVar("SLIMCKPT_PICKLE_REFUSALS_LOG", "path", None, "test",
           "every pickle global refused is appended to this file (the test suite fails a test whose "
           "checkpoints got one)",
           ("patches/slimckpt/read/pickle_policy.py",)),
    EnvVar("SLIMCKPT_WRITE_SUPPORT_TABLE", "flag", None, "test",
           "`1`: `tests/multiprocess/test_coverage_matrix.py` rewrites docs/support_matrix.md from its run",
           ("tests/multiprocess/test_coverage_matrix.py",)),
)

BY_NAME = {v.name: v for v in VARIABLES}

TABLE_BEGIN, TABLE_END = "<!-- env-vars:begin -->", "<!-- env-vars:end -->"
COMMAND = "python -m slimckpt.env_vars --write docs/configuration.md"


def markdown_table() -> str:
    """The documentation's table, one row per variable in declaration order."""
    lines = ["| variable | for | type | default | what it does |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        default = f"`{v.default}`" if v.default is not None else "unset"
        lines.append(f"| `{v.name}` | {v.kind} | {v.type} | {default} | {v.meaning} |")
    return "\n".join(lines) + "\n"


def _commit(repo: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def provenance(commit: str) -> str:
    return (f"Generated from `patches/slimckpt/env_vars.py` by `{COMMAND}` at commit {commit}; "
            f"`tests/unit/test_env_vars.py` fails when it is out of date.")


def block(commit: str) -> str:
    """What lies between the markers: the provenance line and the table."""
    return f"{provenance(commit)}\n\n{markdown_table()}"


def rewrite(path: Path) -> None:
    """Replace the text between the markers of `path`; one line naming the file when they are missing."""
    text = path.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise SystemExit(f"slimckpt.env_vars: {path} has no {TABLE_BEGIN} ... {TABLE_END} block: add the two "
                         f"markers where the table belongs")
    before, rest = text.split(TABLE_BEGIN, 1)
    after = rest.split(TABLE_END, 1)[1]
    partial = path.with_name(path.name + ".partial")
    partial.write_text(before + TABLE_BEGIN + "\n" + block(_commit(path.resolve().parent)) + TABLE_END + after)
    partial.replace(path)


def table_in(text: str) -> str:
    """The table between the markers of a document (the provenance line left out)."""
    inner = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    return inner[inner.index("| variable |"):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimckpt.env_vars",
                                     description="the SLIMCKPT_* environment variables slimckpt reads")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    what.add_argument("--write", metavar="DOC", help="rewrite the table between the env-vars markers of DOC")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
    else:
        rewrite(Path(args.write))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
