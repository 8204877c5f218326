"""The GPU staging paths on a CPU-only machine: the guarded code imports and takes the plain path,
and the GPU check says plainly that it needs CUDA (scripts/gpu_check.sh)."""

import os
import subprocess
import sys

import pytest
import torch

from slimckpt.save.modes.writer import StagingPool, cuda_device_of
from tests.helpers.launch import REPO


def test_cpu_staging_takes_the_plain_path_and_reuses_the_pool():
    state = {
        "model": {"w": torch.randn(33, 7), "b": torch.zeros(0)},
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(33, 7)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
    }
    assert cuda_device_of([state["model"]["w"]]) is None
    pool = StagingPool()
    staged = pool.stage(state)
    pool.wait_ready()  # nothing to wait for on CPU
    assert not pool.pinned and pool._stream is None
    assert torch.equal(staged["model"]["w"], state["model"]["w"])
    assert staged["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()
    assert staged["optim"]["param_groups"] == state["optim"]["param_groups"]
    # a storage of exactly its bytes per tensor: DCP would clone a view into a larger storage
    assert all(
        t.untyped_storage().nbytes() == t.numel() * t.element_size()
        for t in (staged["model"]["w"], staged["optim"]["state"][0]["exp_avg"])
    )
    ptr = staged["model"]["w"].data_ptr()
    state["model"]["w"].add_(1)
    again = pool.stage(state)
    assert again["model"]["w"].data_ptr() == ptr and torch.equal(again["model"]["w"], state["model"]["w"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_check_without_cuda_says_so_and_imports_no_verl(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run(  # without CUDA the script stops before it imports verl: seconds; 120 s is a hang
        ["bash", str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device visible" in proc.stderr and "Nothing was run" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()
    code = (
        "import sys, slimckpt_testing.gpu_check, slimckpt.save.modes.writer; "
        "sys.exit(any(m == 'verl' or m.startswith('verl.') for m in sys.modules))"
    )
    assert (
        subprocess.run(  # the child imports slimckpt's modules (torch, no verl): seconds; 120 s is a hang
            [sys.executable, "-c", code], env={**env, "PYTHONPATH": str(REPO / "patches")}, timeout=120
        ).returncode
        == 0
    )


def test_gpu_check_of_stream_under_offload_passes_with_a_real_move_and_fails_without_one():
    """gpu_check's offload + stream checks on a CPU: with a move that copies (what `.to` does
    between devices) they pass; with `.to("cpu")`, which moves nothing on a CPU, the offload
    releases nothing and its check fails."""
    from slimckpt_testing.gpu_check_stream import check_stream_offload

    checks, times = check_stream_offload(torch.device("cpu"), 3 * 2**20, move=lambda t, to: t.clone())
    assert checks == {"offload_releases_device": True, "offload_read_equal": True, "reload_held_equal": True}
    assert times["held_bytes"] > 0
    checks, _ = check_stream_offload(torch.device("cpu"), 3 * 2**20)
    assert not checks["offload_releases_device"] and checks["offload_read_equal"]
