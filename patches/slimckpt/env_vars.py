"""Every `SLIMCKPT_*` environment variable, declared once (name, type, default, meaning, who it is for)
and read here only: the package's modules ask `flag`, `integer`, `seconds`, `path` or `text` for a
declared name, never `os.environ` (`tests/test_house.py` holds them to it).

`tests/house/test_env_vars.py` holds the rest of the code to this table: a `SLIMCKPT_` name used anywhere
in patches/, scripts/ or tests/ must be declared here, and docs/configuration.md's table must be
this module's `--markdown` output.

Kinds:
  - user:  a switch a user sets (or a launcher sets for them);
  - bench: a knob that turns one piece of the merge's speed machinery off or records its timings,
           for benchmarks and diagnosis; the defaults are what users get;
  - test:  read by the test suite only.

A variable set to the empty string counts as unset. The readers look at the environment on every
call (a test's monkeypatch, or `set_flag` before a load, is seen at once).

Torch-free and import-free (nothing of ours): any module, script or test may import it.

    python -m slimckpt.env_vars --markdown                     # the table, on stdout
    python -m slimckpt.env_vars --write docs/configuration.md  # rewrite the table between its markers
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from slimckpt import SlimckptError

KINDS = ("user", "bench", "test")
TYPES = ("flag", "int", "seconds", "path", "level", "version")


@dataclass(frozen=True)
class EnvVar:
    """One variable. `default` is the value the code assumes when it is unset (None: unset means off
    or none); a `flag` is on only when set to one of `on` (`1`)."""

    name: str
    type: str
    default: str | None
    kind: str
    meaning: str
    on: tuple[str, ...] = ("1",)  # the values that turn a flag on (compared stripped, lower-case)


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        "SLIMCKPT_DISABLE",
        "flag",
        None,
        "user",
        "`1`: the verl plugin applies nothing (plain verl, its merger included); the Hydra search path stays",
    ),
    EnvVar(
        "SLIMCKPT_MEASURE",
        "flag",
        None,
        "user",
        "`1`: verl's own save is timed and its peak RSS sampled (retention, tracker and load stay verl's); "
        "reports go to `<default_local_dir>/slimckpt_reports/`. The launchers set it",
    ),
    EnvVar(
        "SLIMCKPT_METRICS_FILE",
        "path",
        None,
        "user",
        "every save report (and async commit report) is also appended to this file as one JSON line",
    ),
    EnvVar(
        "SLIMCKPT_CHECKPOINT",
        "flag",
        None,
        "user",
        "`1`: the checkpoint feature (save/load hooks, retention, async tracker) without a recipe's config "
        "object; `recipes/incremental.yaml` sets it for Ray's trainer actor",
    ),
    EnvVar(
        "SLIMCKPT_CPU",
        "flag",
        None,
        "user",
        "`1`: verl's trainer on a host without an accelerator (platform `cpu`, gloo, rollout `hf`)",
    ),
    EnvVar("SLIMCKPT_CPU_FORCE", "flag", None, "user", "`1`: allow `SLIMCKPT_CPU=1` where a GPU is visible"),
    EnvVar(
        "SLIMCKPT_GPU_MEMORY_GB",
        "int",
        None,
        "user",
        "GiB of one training GPU, for the start-up check of an incremental save on FSDP1 where the driver sees "
        "no GPU (a dry run, a CPU head node); unset: the driver's free GPU memory",
    ),
    EnvVar("SLIMCKPT_ROLLOUT_THREADS", "int", "1", "user", "torch threads of the CPU `hf` rollout server"),
    EnvVar(
        "SLIMCKPT_LOG_LEVEL",
        "level",
        "INFO",
        "user",
        "level of the `slimckpt` logger; an unknown value falls back to INFO with a warning",
    ),
    EnvVar(
        "SLIMCKPT_ALLOW_UNTESTED_VERL",
        "version",
        None,
        "user",
        "a verl version: apply the patches to that verl anyway (only 0.9.1 is tested)",
    ),
    EnvVar(
        "SLIMCKPT_MERGE_WORKERS",
        "int",
        "1",
        "user",
        "writer processes of the redirected `python -m verl.model_merger merge` (`slimckpt merge --workers`)",
    ),
    EnvVar(
        "SLIMCKPT_MERGE_OVERWRITE",
        "flag",
        None,
        "user",
        "`1`: the redirected verl merger replaces a non-empty target dir",
    ),
    EnvVar(
        "SLIMCKPT_MERGE_DISTRIBUTED",
        "flag",
        None,
        "user",
        "`1`: the redirected verl merger under torchrun shares the work across ranks "
        "(`slimckpt merge --distributed_merge`)",
    ),
    EnvVar(
        "SLIMCKPT_MERGE_JOIN_TIMEOUT",
        "seconds",
        "600",
        "user",
        "seconds every rank of a distributed merge has to join; then one line names the missing ranks",
    ),
    EnvVar(
        "SLIMCKPT_MERGE_PEER_TIMEOUT",
        "seconds",
        "120",
        "user",
        "seconds a rank of a distributed merge may stop answering (killed, stopped) before the others end, "
        "in one line naming it",
    ),
    EnvVar(
        "SLIMCKPT_MERGE_NO_VERL_FALLBACK",
        "flag",
        None,
        "user",
        "`1`: the redirected verl merger refuses, in one line, a checkpoint the streaming merge does not "
        "handle instead of running verl's own merger on it (`slimckpt merge --no_verl_fallback`)",
    ),
    EnvVar(
        "SLIMCKPT_PROGRESS",
        "flag",
        None,
        "user",
        "`1`: progress bars in the redirected verl merger when stderr is not a terminal",
    ),
    EnvVar(
        "SLIMCKPT_TRUST_PICKLE",
        "flag",
        None,
        "user",
        "`1`: unpickle any global a checkpoint names, as `torch.load(weights_only=False)` does (what "
        "`--trust-pickle` and `checkpoint.trust_pickle=true` set; also for the redirected verl merger)",
        on=("1", "true", "yes"),
    ),
    EnvVar(
        "SLIMCKPT_TRUST_INTERNALS",
        "flag",
        None,
        "user",
        "`1`: on a torch or transformers release slimckpt was not checked on, use its internals anyway "
        "where they still import, instead of the public fallback (`slimckpt/internals.py` lists them)",
    ),
    EnvVar(
        "SLIMCKPT_S3_PART_MB",
        "int",
        "32",
        "user",
        "MiB of one part of an s3:// upload (at least 5, S3's rule; an object has at most 10000 parts)",
    ),
    EnvVar(
        "SLIMCKPT_S3_CONCURRENCY",
        "int",
        "4",
        "user",
        "parts an s3:// writing process holds in memory at once (one being filled, the rest uploading): its "
        "upload buffers stay under part size x this",
    ),
    EnvVar(
        "SLIMCKPT_S3_LEASE_S",
        "seconds",
        "60",
        "user",
        "how long an s3:// writer's lease object holds unrenewed (its holder renews it every quarter of this): "
        "a killed writer's lease is taken over this long after the kill, since object stores have no lock that "
        "dies with its holder; a writer that finds a lease held waits up to this long to see which",
    ),
    EnvVar(
        "SLIMCKPT_S3_RETRIES",
        "int",
        "10",
        "user",
        "attempts an s3:// request gets when S3 answers throttling (SlowDown, 503), 500/502/504 or the "
        "connection fails (reset, refused, timed out), with exponential backoff between them; a refusal "
        "(access, credentials, no bucket) is never retried",
    ),
    EnvVar(
        "SLIMCKPT_S3_RETRY_S",
        "seconds",
        "120",
        "user",
        "the time an s3:// request's retries may take in all, from its first attempt: past it, the last "
        "failure fails the save (on every rank) in one line",
    ),
    EnvVar(
        "SLIMCKPT_MERGE_STATS",
        "path",
        None,
        "bench",
        "the merge's writer (one worker) writes where its time went (casting, the last writes and fsyncs) to "
        "this file as JSON",
    ),
    EnvVar(
        "SLIMCKPT_PICKLE_REFUSALS_LOG",
        "path",
        None,
        "test",
        "every pickle global refused is appended to this file (the test suite fails a test whose checkpoints got one)",
    ),
    EnvVar(
        "SLIMCKPT_TEST_MERGE_DELAY",
        "seconds",
        None,
        "test",
        "the merge sleeps a random 0 to this many seconds at each point where its writers, workers or ranks "
        "could race (`slimckpt.engine.race_points`); `make stress-merge` sets it",
    ),
    EnvVar(
        "SLIMCKPT_WRITE_SUPPORT_TABLE",
        "flag",
        None,
        "test",
        "`1`: `tests/merge/test_coverage_matrix.py` rewrites docs/support_matrix.md from its run",
    ),
)

BY_NAME = {v.name: v for v in VARIABLES}

# Variables others own that slimckpt reads: torchrun's (a rank's place in its job), torch elastic's and
# the AWS SDK's endpoint. They are read here too, so that this module is the one place the package
# looks at the environment; their values are taken as set (an empty value is not unset).
FOREIGN = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)


class BadValue(SlimckptError, ValueError):
    """A variable set to something its type does not take; the message is one line naming it."""


def declared(name: str) -> EnvVar:
    """The declaration of `name`; a name nobody declared is a bug in the caller, said in one line."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in slimckpt/env_vars.py: add it to VARIABLES") from None


def _raw(name: str, want: str) -> str | None:
    var = declared(name)
    if var.type != want and not (want == "text" and var.type in ("level", "version")):
        raise TypeError(f"{name} is a {var.type} in slimckpt/env_vars.py, not read as {want}")
    return os.environ.get(name) or None


def foreign(name: str, default: str | None = None) -> str | None:
    """A variable torchrun, torch elastic or the AWS SDK sets (one of FOREIGN), or `default` when unset."""
    if name not in FOREIGN:
        raise KeyError(f"{name} is not in slimckpt/env_vars.py's FOREIGN: add it there")
    return os.environ.get(name, default)


def environment() -> dict[str, str]:
    """A copy of the whole environment: what a child process inherits, or the values a message must not show."""
    return dict(os.environ)


def flag(name: str) -> bool:
    """Whether a flag is on: set to one of its declared `on` values."""
    raw = _raw(name, "flag")
    return raw is not None and raw.strip().lower() in BY_NAME[name].on


def integer(name: str) -> int:
    """A whole number (unset: the declared default)."""
    raw = _raw(name, "int")
    if raw is None:
        return int(BY_NAME[name].default or 0)
    try:
        return int(raw)
    except ValueError:
        raise BadValue(f"{name}={raw!r}: use a whole number (default {BY_NAME[name].default})") from None


def seconds(name: str) -> float:
    """A duration in seconds > 0 (unset: the declared default)."""
    raw = _raw(name, "seconds")
    default = float(BY_NAME[name].default or 0)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise BadValue(f"{name}={raw!r}: use a number of seconds > 0 (default {default:.0f})")
    return value


def path(name: str) -> str | None:
    """A file the user named, or None when unset."""
    return _raw(name, "path")


def text(name: str) -> str | None:
    """The value as set (a `level` or `version`), or the declared default when unset."""
    raw = _raw(name, "text")
    return raw if raw is not None else BY_NAME[name].default


def set_flag(name: str, on: bool) -> None:
    """Turn a flag on (`1`) or back to unset, in this process and the processes it starts."""
    if declared(name).type != "flag":
        raise TypeError(f"{name} is a {BY_NAME[name].type} in slimckpt/env_vars.py, not a flag")
    if on:
        os.environ[name] = "1"
    else:
        os.environ.pop(name, None)


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
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def provenance(commit: str) -> str:
    return (
        f"Generated from `patches/slimckpt/env_vars.py` by `{COMMAND}` at commit {commit}; "
        f"`tests/house/test_env_vars.py` fails when it is out of date."
    )


def block(commit: str) -> str:
    """What lies between the markers: the provenance line and the table."""
    return f"{provenance(commit)}\n\n{markdown_table()}"


def rewrite(path: Path) -> None:
    """Replace the text between the markers of `path`; one line naming the file when they are missing."""
    text = path.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise SystemExit(
            f"slimckpt.env_vars: {path} has no {TABLE_BEGIN} ... {TABLE_END} block: add the two "
            f"markers where the table belongs"
        )
    before, rest = text.split(TABLE_BEGIN, 1)
    after = rest.split(TABLE_END, 1)[1]
    partial = path.with_name(path.name + ".partial")
    partial.write_text(before + TABLE_BEGIN + "\n" + block(_commit(path.resolve().parent)) + TABLE_END + after)
    partial.replace(path)


def table_in(text: str) -> str:
    """The table between the markers of a document (the provenance line left out)."""
    inner = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    return inner[inner.index("| variable |") :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slimckpt.env_vars", description="the SLIMCKPT_* environment variables slimckpt reads"
    )
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
