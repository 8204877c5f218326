"""verl's trainer with trainer.default_local_dir=s3://...: the names its driver code calls hand a URL to the
storage (slimckpt.save.driver.trainer_storage), the step a resume loads is the newest committed one there
whatever the tracker says (the start-up's checks: tests/verl/test_storage_startup.py).
moto stands in for S3; the trainer end to end is tests/e2e/test_s3_trainer_e2e.py."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from slimckpt.engine.pickle_policy import PickleRefused
from slimckpt.layout.resume_manifest import FAILED_PREFIX, MANIFEST_NAME, TRACKER_NAME, saved_steps
from slimckpt.resume import tracker_recovery
from slimckpt.save.driver import trainer_storage
from slimckpt.storage import for_path, s3

from ..helpers.aws_env import isolate_aws

moto = pytest.importorskip("moto", reason="moto is in the test extra: pip install -e '.[test]'")
boto3 = pytest.importorskip("boto3", reason="boto3 is in the test extra: pip install -e '.[test]'")

BUCKET = "ckpts"
ROOT = f"s3://{BUCKET}/run"


@pytest.fixture
def bucket(monkeypatch, tmp_path):
    isolate_aws(monkeypatch, tmp_path, "test-secret")
    s3.after_fork()
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield for_path(ROOT)
    s3.after_fork()


def _put(path: str, data: bytes = b"x") -> None:
    for_path(path).put_atomic(path, data)


def _step(step: int, *, data: bool = True, roles=("actor",), committed=("actor",)) -> str:
    step_dir = f"{ROOT}/global_step_{step}"
    for role in roles:
        _put(f"{step_dir}/{role}/dcp/__0_0.distcp")
        if role in committed:
            _put(f"{step_dir}/{role}/{MANIFEST_NAME}", b"{}")
    if data:
        _put(f"{step_dir}/data.pt")
    return step_dir


# --------------------------------------------------------------------------- the path join and the step folder


def test_a_url_is_absolute_and_its_folder_is_the_storages(tmp_path):
    verl_os = trainer_storage.wrap_os(os)
    assert verl_os.path.isabs(ROOT) and verl_os.path.isabs("/x") and not verl_os.path.isabs("rel/dir")
    assert verl_os.path.join(ROOT, "global_step_3") == f"{ROOT}/global_step_3"  # the rest is os's own
    assert verl_os.environ is os.environ and verl_os.getcwd() == os.getcwd()
    made: list[str] = []
    mkdir = trainer_storage.wrap_local_mkdir_safe(lambda p: made.append(p) or p)
    assert mkdir(f"{ROOT}/global_step_1") == f"{ROOT}/global_step_1" and made == []  # no <cwd>/s3:/...
    assert mkdir(str(tmp_path / "a")) == str(tmp_path / "a") and made == [str(tmp_path / "a")]


def test_verls_own_join_would_put_the_url_under_the_working_dir():
    """What the os patch is for: verl's _load_checkpoint joins any path os.path.isabs denies onto the cwd."""
    assert not os.path.isabs(ROOT)


# --------------------------------------------------------------------------- data.pt


def test_data_pt_is_put_whole_and_read_back_by_the_restricted_unpickler(bucket):
    verl_torch = trainer_storage.wrap_torch(torch)
    verl_os = trainer_storage.wrap_os(os)
    state = {"_num_yielded": 3, "_sampler_iter_state": {"generator": torch.Generator().manual_seed(1).get_state()}}
    path = f"{ROOT}/global_step_1/data.pt"
    assert not verl_os.path.exists(path)
    verl_torch.save(state, path)
    assert verl_os.path.exists(path) and bucket.size(path) > 0
    back = verl_torch.load(path, weights_only=False)
    assert back["_num_yielded"] == 3
    assert torch.equal(back["_sampler_iter_state"]["generator"], state["_sampler_iter_state"]["generator"])
    assert verl_torch.Tensor is torch.Tensor  # everything else is torch's own


class Payload:  # a global no checkpoint of verl's or torch's names
    def __reduce__(self):
        return (os.getpid, ())


@pytest.mark.pickle_refusals
def test_a_data_pt_naming_another_global_is_refused(bucket, tmp_path):
    local = tmp_path / "data.pt"
    torch.save({"x": Payload()}, local, pickle_module=pickle)
    path = f"{ROOT}/global_step_1/data.pt"
    _put(path, local.read_bytes())
    with pytest.raises(PickleRefused, match="global_step_1/data.pt"):
        trainer_storage.wrap_torch(torch).load(path, weights_only=False)


# --------------------------------------------------------------------------- which step a resume loads


@pytest.fixture
def find():
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    return tracker_recovery.wrap_find_latest_ckpt_path(find_latest_ckpt_path)


def test_the_newest_committed_step_is_found_from_the_manifests(bucket, find, caplog):
    _step(1)
    _step(2, roles=("actor", "critic"), committed=("actor", "critic"))
    _step(3, roles=("actor", "critic"), committed=("actor",))  # the critic never committed
    _step(4, data=False)  # the trainer had not written data.pt: its save did not finish
    _step(5, committed=())  # no manifest
    assert saved_steps(ROOT) == [1, 2, 3, 4, 5]
    assert find(ROOT) == f"{ROOT}/global_step_2"
    assert "global_step_5 (actor/ is not committed (no manifest))" in caplog.text
    assert "global_step_3 (critic/ is not committed" in caplog.text


def test_a_tracker_naming_an_uncommitted_step_is_not_trusted(bucket, find, caplog):
    _step(1)
    _step(2, committed=())
    _put(f"{ROOT}/{TRACKER_NAME}", b"2")
    assert find(ROOT) == f"{ROOT}/global_step_1"
    assert "names global_step_2; resuming from global_step_1, the newest committed step" in caplog.text


def test_a_failed_step_and_an_empty_root_are_no_resume(bucket, find):
    assert find(ROOT) is None  # nothing there yet: a start from scratch
    step = _step(1)
    _put(f"{step}/actor/{FAILED_PREFIX}0.txt", b"disk full\n")
    assert find(ROOT) is None
    _step(2)
    _put(f"{ROOT}/{TRACKER_NAME}", b"1")  # behind the newest commit (a kill before its write)
    assert find(ROOT) == f"{ROOT}/global_step_2"


# --------------------------------------------------------------------------- retention on the bucket


def test_retention_and_keep_best_prune_on_the_bucket(bucket):
    """max_keep=1 with keep_best=1 by a metric the driver recorded next to each step: the best old step
    and the newest stay, the tracker's step too, the rest is deleted from the bucket, manifest first."""
    import slimckpt.save.retention.prune as retention
    from slimckpt.layout.retention_plan import RetentionPolicy
    from slimckpt.save.retention import best_metric

    roles = [f"{_step(s)}/actor" for s in (1, 2, 3, 4)]
    for step, score in ((1, 0.9), (2, 0.1), (3, 0.2), (4, 0.3)):
        best_metric.record(f"{ROOT}/global_step_{step}", step, {"score": score})
    assert best_metric.step_metric(f"{ROOT}/global_step_1", "score") == 0.9
    _put(f"{ROOT}/{TRACKER_NAME}", b"3")
    policy = RetentionPolicy(max_keep=1, keep_best=1, best_metric="score")
    kept, deleted = retention.apply(roles, 1, policy)
    assert kept == [roles[0], roles[2], roles[3]] and deleted == [roles[1]]
    assert not bucket.exists(roles[1]) and bucket.exists(f"{ROOT}/global_step_2/data.pt")  # verl's retention: role dirs
    assert all(bucket.exists(f"{r}/{MANIFEST_NAME}") for r in kept)
    assert not any(k.endswith("slimckpt-lock") for k in bucket.list_files(ROOT))  # the delete's lease is gone
