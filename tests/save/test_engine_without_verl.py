"""The engine's seam to what it saves: a caller that is not verl saves and resumes an FSDP2 model through
slimckpt's engine with its own SaveTarget, and the GPU check's FSDP1/FSDP2 save checks run, both in
processes where verl, Ray, omegaconf and hydra cannot be imported (a GPU image with torch alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slimckpt_testing.launch import launch

from ..conftest import REPO
from ..helpers.without_verl import BLOCKED, env_without_verl


@pytest.mark.slow
def test_engine_saves_and_resumes_fsdp2_without_verl(tmp_path):
    env = {**env_without_verl(tmp_path / "hook"), "OMP_NUM_THREADS": "1", "SLIMCKPT_LOG_LEVEL": "WARNING"}
    run = launch(  # two gloo ranks, three saves and loads of a tiny model: ~20 s; 300 s is a hang
        2,
        "slimckpt_testing.scenarios.engine_without_verl",
        "--dir",
        str(tmp_path),
        timeout=300,
        cwd=REPO,
        env=env,
        result=tmp_path / "engine_result.json",
    )
    assert run.proc.returncode == 0, run.proc.stderr[-4000:]
    for rank in run.result:
        assert rank["blocked"] == list(BLOCKED) and rank["stack_loaded"] == []
        for mode, found in rank["modes"].items():
            assert found == {"committed": True, "moved": True, "equal": True, "lr_equal": True, "fsdp_version": 2}, mode


@pytest.mark.slow
def test_gpu_checks_fsdp_save_checks_run_without_verl(tmp_path):
    code = (
        "import json, sys\n"
        "from slimckpt_testing.gpu_check_fsdp import check_fsdp_save\n"
        "checks, figures = check_fsdp_save('cpu', hidden=64)\n"
        "stack = sorted(m for m in sys.modules if m.split('.')[0] in ('verl', 'ray', 'omegaconf', 'hydra'))\n"
        "print(json.dumps({'checks': checks, 'stack': stack}))\n"
    )
    env = {**os.environ, **env_without_verl(tmp_path / "hook"), "OMP_NUM_THREADS": "1"}
    # two spawned ranks per FSDP version over gloo: ~20 s; 300 s is a hang
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["stack"] == []
    assert found["checks"] == {
        "fsdp1_dcp_roundtrip": True,
        "fsdp2_dcp_roundtrip": True,
        "fsdp1_state_dict_is_a_copy": True,
        "fsdp2_state_dict_is_views": True,
    }, proc.stderr[-4000:]
