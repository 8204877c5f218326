"""engine/output_dir: <target>.partial, the manifest written last, the publish that never goes over what someone
else put in the target meanwhile; and `slimckpt merge` in-process against its target: a non-empty target
refused unless --overwrite, a stale partial replaced (and counted as free room), a disk too small refused
before anything is written, a full or read-only one in one line."""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys

import pytest

from slimckpt.engine import output_dir
from slimckpt.engine.output_dir import commit
from slimckpt.layout.merge_manifest import CommitError, verify

from ..helpers.merge_cli import (
    assert_nothing_committed,
    error_line,
    log_lines,
    merge_cli,
    ws2_checkpoint,
)
from ..helpers.merge_helpers import (
    run_cli,
)

slim_log = pytest.fixture(autouse=True, name="slim_log")(log_lines)
ckpt = pytest.fixture(scope="module", name="ckpt")(ws2_checkpoint)


def test_commit_refuses_a_target_filled_meanwhile(tmp_path):
    partial = output_dir.prepare_partial(str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "other").write_text("someone else's")
    with pytest.raises(CommitError, match="became non-empty"):
        commit(partial, str(tmp_path / "out"))
    assert (tmp_path / "out" / "other").exists() and os.path.isdir(partial)


def test_non_empty_target_refused_unless_overwrite(ckpt, tmp_path, capsys):
    target = tmp_path / "o"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    rc, err = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(target))
    assert rc == 1 and "is not empty; pass --overwrite" in error_line(err)
    assert (target / "keep.txt").read_text() == "mine"
    rc, _ = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(target), "--overwrite")
    assert rc == 0
    assert not (target / "keep.txt").exists() and verify(str(target)) == []
    assert not [p for p in os.listdir(tmp_path) if ".old-" in p or p.endswith(".partial")]


def test_empty_target_dir_is_fine(ckpt, tmp_path, capsys):
    # verl's generate_config_from_args creates the target dir before merging
    (tmp_path / "o").mkdir()
    rc, _ = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "o"))
    assert rc == 0 and verify(str(tmp_path / "o")) == []


def test_stale_partial_is_replaced(ckpt, tmp_path, capsys):
    (tmp_path / "o.partial").mkdir()
    (tmp_path / "o.partial" / "model.safetensors").write_bytes(b"junk")
    rc, _ = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "o"))
    assert rc == 0 and verify(str(tmp_path / "o")) == [] and not (tmp_path / "o.partial").exists()


def _limit_file_size(limit: int):
    def set_limit():
        # SIGXFSZ would kill before the error can be reported; slimckpt ignores it too
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def test_disk_full_rlimit(ckpt, tmp_path):
    """A file-size limit below the weights file: EFBIG while reserving/writing it."""
    target = tmp_path / "o"
    proc = run_cli(
        ["merge", "--no_progress", "--local_dir", str(ckpt), "--target_dir", str(target)],
        preexec_fn=_limit_file_size(20_000),
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = error_line(proc.stderr)
    assert "model.safetensors" in line and "no space left" in line and "--target_dir" in line
    assert_nothing_committed(target)


def _unshare_ok() -> bool:
    if not shutil.which("unshare") or sys.platform != "linux":
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


def _merge_in_tmpfs(
    ckpt, mount, size: str, readonly: bool, before: str = "", distributed: bool = False
) -> subprocess.CompletedProcess:
    """Run the merge in a private mount namespace with a small tmpfs at `mount` (no global mount);
    `before` runs in the mount first; what the mount holds afterwards is printed as `left: ...`."""
    mount.mkdir()
    remount = f" && mount -o remount,ro {mount}" if readonly else ""
    launch = (
        f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 2 -m slimckpt.cli"
        if distributed
        else f"{sys.executable} -m slimckpt.cli"
    )
    script = (
        f"mount -t tmpfs -o size={size} tmpfs {mount}{remount} && {before or 'true'} && "
        f"{launch} merge --no_progress --local_dir {ckpt} --target_dir {mount}/out "
        f"{'--distributed_merge' if distributed else ''}; rc=$?; "
        f"echo left: $(cd {mount} && find . -mindepth 1 | sort); exit $rc"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the tiny merge may start a 2-rank torchrun (torch imported per rank); 300 s is a hang
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=300)


def _left(proc: subprocess.CompletedProcess) -> list[str]:
    return next(ln for ln in proc.stdout.splitlines() if ln.startswith("left:")).split()[1:]


def _output_bytes(ckpt) -> int:
    """The weight files' planned size: what the refusal must name."""
    from slimckpt.engine.merge_input import open_source
    from slimckpt.hf.naming import HfSide, default_max_shard_size
    from slimckpt.hf.plan import make_plan

    source = open_source(str(ckpt))
    try:
        return make_plan(source, HfSide(str(ckpt), "bf16", False), "bf16", default_max_shard_size()).weight_bytes
    finally:
        source.close()


@pytest.mark.skipif(not _unshare_ok(), reason="needs `unshare -rm` and tmpfs mounts")
@pytest.mark.parametrize("how", ["single", pytest.param("distributed", marks=pytest.mark.slow)])
def test_disk_too_small_is_refused_before_writing(ckpt, tmp_path, monkeypatch, how):
    """A filesystem that cannot hold the output: refused up front, naming the bytes needed and free,
    and nothing is created there (no partial, no empty files at their final size)."""
    proc = _merge_in_tmpfs(
        ckpt,
        tmp_path / "mnt",
        f"{max(4, _output_bytes(ckpt) // 2048)}k",
        readonly=False,
        distributed=how == "distributed",
    )
    assert proc.returncode != 0 if how == "distributed" else proc.returncode == 1, proc.stderr[-2000:]
    lines = {ln for ln in proc.stderr.splitlines() if ln.startswith("slimckpt merge: error:")}
    assert len(lines) == 1, proc.stderr[-3000:]  # every rank says the same line
    line = lines.pop()
    need = _output_bytes(ckpt)
    assert "no space left" in line and "nothing was written" in line and "--target_dir" in line, line
    found = re.search(r"needs (\d+) KiB, the filesystem has (\d+) KiB free", line)
    assert found, line
    needed, free = int(found[1]), int(found[2])
    assert needed >= round(need / 1024) and free < needed, line  # the weights and the configs beside them
    assert _left(proc) == []


@pytest.mark.skipif(not _unshare_ok(), reason="needs `unshare -rm` and tmpfs mounts")
def test_stale_partial_counts_as_free(ckpt, tmp_path):
    """A merge killed midway leaves `<target>.partial`, which the next run deletes first: its blocks
    count as free, so the rerun on a disk that holds one output (and not two) goes through."""
    need = _output_bytes(ckpt)
    size_kib = (need * 3 // 2) // 1024 + 256  # room for one output and its configs, not for two
    stale = f"mkdir {tmp_path}/mnt/out.partial && head -c {need} /dev/urandom > {tmp_path}/mnt/out.partial/model.safetensors"
    proc = _merge_in_tmpfs(ckpt, tmp_path / "mnt", f"{size_kib}k", readonly=False, before=stale)
    assert proc.returncode == 0, proc.stderr[-2000:]
    left = _left(proc)
    assert "./out/manifest.json" in left and not any(p.startswith("./out.partial") for p in left), left


@pytest.mark.skipif(not _unshare_ok(), reason="needs `unshare -rm` and tmpfs mounts")
def test_read_only_target(ckpt, tmp_path):
    proc = _merge_in_tmpfs(ckpt, tmp_path / "mnt", "10m", readonly=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = error_line(proc.stderr)
    assert "not writable" in line and "out.partial" in line
