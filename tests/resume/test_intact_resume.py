"""resume_mode=auto goes on from the newest intact step when the tracker's step is damaged
(slimckpt.resume.intact_resume around verl's trainer `_load_checkpoint`), resume_from_path to a
damaged step refuses in one line, and a manifest without its seal or of another format is damaged
for the load and for `slimckpt verify` alike. The multi-process version (verl's real manager and
PPOTrainer._load_checkpoint under torchrun) is test_damaged_newest_step_resumes_the_previous_one."""

from __future__ import annotations

import json
import logging
import os
import random

import pytest
import torch
from omegaconf import OmegaConf

import slimckpt.engine.output_dir as od
import slimckpt.engine.resume_records as rr
import slimckpt.layout.merge_manifest as mm
import slimckpt.layout.resume_manifest as rm
from slimckpt.resume import intact_resume
from slimckpt.verify.command import verify_path
from slimckpt_testing.damage import KINDS, damage_step

from ..conftest import scenario_result


def _step(root, step: int, payload: int = 4096):
    d = root / f"global_step_{step}" / "actor"
    (d / "dcp").mkdir(parents=True)
    (d / "dcp" / "__0_0.distcp").write_bytes(bytes([step]) * payload)
    (d / "dcp" / ".metadata").write_bytes(b"m" * 64)
    (d / "slimckpt_extra_world_size_1_rank_0.pt").write_bytes(b"e" * 128)
    rels = ["dcp/__0_0.distcp", "dcp/.metadata", "slimckpt_extra_world_size_1_rank_0.pt"]
    rr.write_manifest(
        str(d), rm.Manifest(global_step=step, world_size=1, contents=["model"], files=rm.describe_files(str(d), rels))
    )
    torch.save({"step": step}, d.parent / "data.pt")
    return d


class Trainer:
    """What verl's _load_checkpoint reads of the trainer; `loaded` is the step dir verl's own
    find_latest_ckpt_path (or resume_from_path) gives it."""

    def __init__(self, root, mode="auto", path=None, verify=True, target=None):
        checkpoint = {
            "_target_": "slimckpt.verl.checkpoint_config.SlimCheckpointConfig",
            "incremental_save": True,
            "verify": verify,
        }
        if target is not None:
            checkpoint["_target_"] = target
        self.config = OmegaConf.create(
            {
                "actor_rollout_ref": {"actor": {"checkpoint": checkpoint}},
                "trainer": {"default_local_dir": str(root), "resume_mode": mode, "resume_from_path": path},
            }
        )
        self.use_critic = False
        self.loaded = None


def _verl_load(self):
    """verl's _load_checkpoint: the step its tracker (or resume_from_path) names, then the ranks' load,
    which refuses a damaged role dir before reading it (step_check: checksums unless verify: false)."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    trainer = self.config.trainer
    self.loaded = (
        find_latest_ckpt_path(trainer.default_local_dir) if trainer.resume_mode == "auto" else trainer.resume_from_path
    )
    checkpoint = self.config.actor_rollout_ref.actor.checkpoint
    if "SlimCheckpointConfig" not in checkpoint._target_:
        return  # verl's own load checks nothing
    self.rank_checks = getattr(self, "rank_checks", 0) + 1
    verify = bool(checkpoint.verify)
    _, damage = rm.role_damage(os.path.join(self.loaded, "actor"), checksums=verify)
    if damage:
        self.loaded = None
        raise rm.UncommittedCheckpoint(damage[0].message)


load = intact_resume.wrap_trainer_load_checkpoint(_verl_load)


@pytest.fixture
def warnings(caplog):
    caplog.set_level(logging.INFO, logger="slimckpt")
    return lambda: [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("slimckpt")
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_newest_step_resumes_from_the_previous_intact_one(tmp_path, kind, warnings):
    _step(tmp_path, 2)
    newest = _step(tmp_path, 4)
    rr.write_tracker(str(tmp_path), 4)
    damage_step(str(newest), kind, random.Random(0))
    before = sorted(os.listdir(newest))
    t = Trainer(tmp_path)
    load(t)
    assert t.loaded == str(tmp_path / "global_step_2")
    assert rm.read_tracker(str(tmp_path)) == 2  # names the step the run goes on from
    assert sorted(os.listdir(newest)) == before  # nothing deleted
    [line] = warnings()
    assert "\n" not in line and str(newest) in line and "resuming from global_step_2" in line
    # the walk back names the file verify names first
    first = verify_path(str(newest)).bad[0]
    assert line.startswith(f"slimckpt: {first.file}: {first.reason}; ")


def test_an_intact_newest_step_changes_nothing(tmp_path, warnings):
    _step(tmp_path, 2)
    _step(tmp_path, 4)
    rr.write_tracker(str(tmp_path), 4)
    t = Trainer(tmp_path)
    load(t)
    assert t.loaded == str(tmp_path / "global_step_4") and warnings() == []


def test_the_walk_back_skips_every_damaged_step_and_refuses_when_none_is_left(tmp_path, warnings):
    _step(tmp_path, 2)
    for s in (4, 6):
        damage_step(str(_step(tmp_path, s)), "flip", random.Random(s))
    rr.write_tracker(str(tmp_path), 6)
    t = Trainer(tmp_path)
    load(t)
    assert t.loaded == str(tmp_path / "global_step_2")
    # the ranks checksum each step they load: a flipped bit is found one load at a time, a line each
    assert t.rank_checks == 3
    first, second = warnings()
    assert "global_step_6/actor" in first and "resuming from global_step_4" in first
    assert "global_step_4/actor" in second and "resuming from global_step_2" in second
    damage_step(str(tmp_path / "global_step_2" / "actor"), "truncate", random.Random(2))
    rr.atomic_write_text(str(tmp_path / rm.TRACKER_NAME), "6")
    with pytest.raises(rm.UncommittedCheckpoint) as info:
        load(Trainer(tmp_path))
    msg = str(info.value)
    assert "\n" not in msg and "global_step_6" in msg and "no step" in msg and "resume_mode=disable" in msg


def test_resume_from_path_to_a_damaged_step_refuses_naming_the_file_and_an_intact_step(tmp_path):
    _step(tmp_path, 2)
    newest = _step(tmp_path, 4)
    os.remove(newest / "dcp" / ".metadata")
    t = Trainer(tmp_path, mode="resume_path", path=str(tmp_path / "global_step_4"))
    with pytest.raises(rm.UncommittedCheckpoint) as info:
        load(t)
    msg = str(info.value)
    assert "\n" not in msg and str(newest / "dcp" / ".metadata") in msg
    assert f"resume_from_path={tmp_path / 'global_step_2'} (intact)" in msg
    load(ok := Trainer(tmp_path, mode="resume_path", path=str(tmp_path / "global_step_2")))
    assert ok.loaded == str(tmp_path / "global_step_2")


def test_verify_false_checks_sizes_only_and_data_pt_counts(tmp_path):
    _step(tmp_path, 2)
    newest = _step(tmp_path, 4)
    rr.write_tracker(str(tmp_path), 4)
    damage_step(str(newest), "flip", random.Random(0))  # same size: only a checksum sees it
    load(t := Trainer(tmp_path, verify=False))
    assert t.loaded == str(tmp_path / "global_step_4")
    load(t := Trainer(tmp_path))
    assert t.loaded == str(tmp_path / "global_step_2")
    _step(tmp_path, 6)
    rr.atomic_write_text(str(tmp_path / rm.TRACKER_NAME), "6")
    os.truncate(tmp_path / "global_step_6" / "data.pt", 10)  # the dataloader's position
    load(t := Trainer(tmp_path))
    assert t.loaded == str(tmp_path / "global_step_2")


def test_an_empty_tracker_names_the_newest_intact_step_and_plain_verl_is_untouched(tmp_path, warnings):
    _step(tmp_path, 2)
    damage_step(str(_step(tmp_path, 4)), "delete", random.Random(1))
    (tmp_path / rm.TRACKER_NAME).write_text("")
    load(t := Trainer(tmp_path))
    assert t.loaded == str(tmp_path / "global_step_2") and rm.read_tracker(str(tmp_path)) == 2
    rr.atomic_write_text(str(tmp_path / rm.TRACKER_NAME), "4")
    load(t := Trainer(tmp_path, target="verl.trainer.config.CheckpointConfig"))
    assert t.loaded == str(tmp_path / "global_step_4")  # verl's own config: verl's own choice


# --------------------------------------------------------------------------- seal required


def _unsealed(data: dict) -> dict:
    return {k: v for k, v in data.items() if k != mm.SEAL_KEY}


CHANGES = {  # what was done to the manifest -> the reason verify and the load give
    "seal stripped": (lambda d: _unsealed(d), "has no manifest_checksum"),
    "format changed, seal kept": (lambda d: {**d, "format": "slimckpt-resume/0"}, "unknown format"),
    "a size changed, seal kept": (
        lambda d: {**d, "files": [{**f, "size": f["size"] + 1} for f in d["files"]]},
        "manifest itself is damaged",
    ),
    "another format, resealed": (lambda d: mm.seal({**_unsealed(d), "format": "slimckpt-resume/9"}), "unknown format"),
    "no checksum_algo, resealed": (
        lambda d: mm.seal({k: v for k, v in _unsealed(d).items() if k != "checksum_algo"}),
        "KeyError",
    ),
    "CRC32 entries, resealed": (
        lambda d: mm.seal(
            {**_unsealed(d), "files": [{"path": f["path"], "size": f["size"], "crc32": 1} for f in d["files"]]}
        ),
        "KeyError",
    ),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_manifest_without_its_seal_or_of_another_format_is_damaged(tmp_path, change):
    d = _step(tmp_path, 3)
    make, reason = CHANGES[change]
    path = d / rm.MANIFEST_NAME
    path.write_text(json.dumps(make(json.loads(path.read_text()))))
    report = verify_path(str(d))
    assert not report.ok and reason in report.bad[0].reason
    with pytest.raises(rm.UncommittedCheckpoint) as info:
        rm.check_committed(str(d))
    assert str(info.value) == report.bad[0].message and "\n" not in str(info.value)


def test_a_merge_manifest_without_its_seal_or_of_another_version_is_damaged(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    od.write_manifest(str(out), mm.Manifest(kind="hf_export", files=mm.build_entries(str(out))))
    assert mm.verify(str(out)) == []
    data = json.loads((out / mm.MANIFEST_NAME).read_text())
    for changed in (
        _unsealed(data),
        mm.seal({**_unsealed(data), "format_version": 0}),
        mm.seal({k: v for k, v in _unsealed(data).items() if k != "format_version"}),
    ):
        (out / mm.MANIFEST_NAME).write_text(json.dumps(changed))
        [bad] = mm.verify(str(out))
        assert bad.name == mm.MANIFEST_NAME and ("seal" in bad.reason or "format_version" in bad.reason)


# --------------------------------------------------------------------------- torchrun (slow)


@pytest.mark.slow
def test_damaged_newest_step_resumes_the_previous_one(ws2_scenarios):
    """verl's real manager (async, the export on) and PPOTrainer._load_checkpoint: each damage of
    the newest step resumes exactly from the previous one with one line; resume_from_path refuses."""
    r = scenario_result(ws2_scenarios, "damaged_newest", "damaged_newest_result.json")
    assert [t["kind"] for t in r["trials"]] == list(KINDS)
    for t in r["trials"]:
        assert t["error"] is None, t
        assert t["global_steps"] == 2 and t["data"] == {"step": 2} and t["diffs"] == [], t
        assert t["loss_equal"] and t["tracker"] == 2 and t["step4_kept"], t
        [line] = t["lines"]
        assert "\n" not in line and "global_step_4/actor" in line and "resuming from global_step_2" in line, t
        assert t["refused"] and "\n" not in t["refused"] and "global_step_4/actor" in t["refused"], t
        assert "global_step_2 (intact)" in t["refused"], t
    assert r["trials"][0]["tracker_after_saving_3"] == 3


def test_the_driver_reads_no_role_file_the_ranks_checksum_it(tmp_path, monkeypatch):
    """resume_mode=auto at 70B: the driver checks sizes and seals only (one host reading the whole step
    would take longer the larger the cluster); the ranks' load checksums, each its share."""
    calls = []
    real = intact_resume.role_damage

    def recorded(role_dir, checksums=True, **kw):
        calls.append(checksums)
        return real(role_dir, checksums=checksums, **kw)

    monkeypatch.setattr(intact_resume, "role_damage", recorded)
    _step(tmp_path, 2)
    _step(tmp_path, 4)
    rr.write_tracker(str(tmp_path), 4)
    load(t := Trainer(tmp_path))
    assert t.loaded == str(tmp_path / "global_step_4") and calls and not any(calls)


class RayTaskError(Exception):
    """What ray.get raises for a worker's exception: the original travels as `cause`."""

    def __init__(self, cause):
        super().__init__("ray.exceptions.RayTaskError: traceback ...\n" + str(cause))
        self.cause = cause


def test_a_refusal_is_recognised_wrapped_or_chained_and_nothing_else_is():
    line = "slimckpt: /c/global_step_4/actor/dcp/__0_0.distcp: xxh3_128 mismatch"
    refusal = rm.UncommittedCheckpoint(f"{line}; {rm.DAMAGED_FIX}")
    assert intact_resume.load_refusal(refusal) == line
    assert intact_resume.load_refusal(RayTaskError(refusal)) == line
    try:
        try:
            raise refusal
        except rm.UncommittedCheckpoint as inner:
            raise RuntimeError("worker group call failed") from inner
    except RuntimeError as outer:
        assert intact_resume.load_refusal(outer) == line
    assert intact_resume.load_refusal(RayTaskError(OSError(5, "I/O error"))) is None
    assert intact_resume.load_refusal(ValueError("x")) is None


def test_a_load_failing_for_another_reason_is_not_walked_back(tmp_path):
    _step(tmp_path, 2)
    _step(tmp_path, 4)
    rr.write_tracker(str(tmp_path), 4)

    def broken(self):
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError):
        intact_resume.wrap_trainer_load_checkpoint(broken)(Trainer(tmp_path))
    assert rm.read_tracker(str(tmp_path)) == 4
