"""`checkpoint.verify` of the incremental tier reaches the load: true (default) checks every listed
file's checksum, false only sizes. One in-process gloo group of one rank, no torchrun."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

import slimckpt.engine.resume_records as rr
import slimckpt.layout.resume_manifest as rm
import slimckpt.resume.load as resume_load
from slimckpt.resume import step_check
from slimckpt.save.target import SaveTarget, TargetState
from slimckpt.verl.manager_state import config_of


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _committed_role_dir(tmp_path):
    d = tmp_path / "global_step_3" / "actor"
    (d / "dcp").mkdir(parents=True)
    (d / "dcp" / "__0_0.distcp").write_bytes(b"x" * 4096)
    (d / "dcp" / ".metadata").write_bytes(b"m" * 64)
    files = rm.describe_files(str(d), ["dcp/__0_0.distcp", "dcp/.metadata"])
    rr.write_manifest(str(d), rm.Manifest(global_step=3, world_size=1, contents=["model"], files=files))
    return d


class _Stop(Exception):
    pass


@pytest.mark.parametrize("verify", [True, False, None])
def test_load_passes_the_configs_verify_to_the_check(tmp_path, monkeypatch, verify):
    from verl.trainer.config.config import CheckpointConfig

    from slimckpt.verl import features
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    seen = []

    def check(path, group, checksums):
        seen.append(checksums)
        raise _Stop

    monkeypatch.setattr(features, "switch_on", lambda feature: None)  # the config alone, no patches applied
    monkeypatch.setattr(resume_load, "checkpoint_group", lambda state: None)
    monkeypatch.setattr(step_check, "check_committed", check)
    # None: verl's own config, without the field
    config = CheckpointConfig() if verify is None else SlimCheckpointConfig(verify=verify)
    with pytest.raises(_Stop):
        manager = SimpleNamespace(checkpoint_config=config)
        target = SaveTarget(model=None, optimizer=None, options=config_of(manager), state=TargetState())
        resume_load.load_resume_state(target, str(tmp_path))
    assert seen == [True if verify is None else verify]


def test_same_size_damage_is_refused_only_with_verify(tmp_path, group):
    d = _committed_role_dir(tmp_path)
    assert step_check.check_committed(str(d), group, checksums=True).global_step == 3
    with open(d / "dcp" / "__0_0.distcp", "r+b") as f:  # one flipped byte, size unchanged
        f.seek(100)
        f.write(b"y")
    with pytest.raises(rm.UncommittedCheckpoint, match=r"__0_0\.distcp"):
        step_check.check_committed(str(d), group, checksums=True)
    assert step_check.check_committed(str(d), group, checksums=False).global_step == 3
    with open(d / "dcp" / "__0_0.distcp", "r+b") as f:  # a short file fails either way
        f.truncate(100)
    with pytest.raises(rm.UncommittedCheckpoint, match=r"__0_0\.distcp"):
        step_check.check_committed(str(d), group, checksums=False)
