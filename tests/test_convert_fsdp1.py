"""`slimckpt convert` with FSDP1 (verl's actor.strategy=fsdp, use_orig_params=false: one flat
parameter per decoder layer and the root's): steps saved through verl's real FSDPCheckpointManager
under torchrun (gloo, CPU), converted and resumed by unpatched verl (SLIMCKPT_DISABLE=1)."""

from __future__ import annotations

import json

import pytest

from .test_convert import STEP, convert, resume, torchrun


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved_fsdp1")
    torchrun(2, "save", "--dir", str(d), "--fsdp", "1")
    return d


def _reference(d) -> list[float]:
    return json.loads((d / "save_ws2_result.json").read_text())["reference"]


@pytest.mark.slow
def test_incremental_fsdp1_step_resumes_bitwise_and_reshards(saved, tmp_path):
    convert(saved / "ours" / f"global_step_{STEP}", 2, tmp_path / "same")
    r = resume(saved, tmp_path / "same", 2, "same", fsdp=1)
    assert r["diffs"] == [] and r["n_model"] > 0, r
    assert r["losses"] == _reference(saved)
    convert(saved / "ours" / f"global_step_{STEP}", 1, tmp_path / "one")  # one rank: FSDP1 runs NO_SHARD
    r = resume(saved, tmp_path / "one", 1, "one", fsdp=1)
    assert r["diffs"] == [] and r["n_model"] > 0, r


@pytest.mark.slow
def test_verl_fsdp1_step_resharded_two_to_three(saved, tmp_path):
    """verl's own flat optimizer shards, split by parameter and laid out again for three ranks."""
    convert(saved / "verl" / f"global_step_{STEP}", 3, tmp_path / "three")
    r = resume(saved, tmp_path / "three", 3, "verl3", fsdp=1)
    assert r["diffs"] == [] and r["n_model"] > 0, r


@pytest.mark.slow
def test_fsdp1_step_written_for_fsdp2(saved, tmp_path):
    """A strategy=fsdp step resumed with strategy=fsdp2: --fsdp 2, the optimizer renumbered in module order."""
    convert(saved / "ours" / f"global_step_{STEP}", 2, tmp_path / "fsdp2", fsdp=2)
    actor = tmp_path / "fsdp2" / f"global_step_{STEP}" / "actor"
    assert json.loads((actor / "fsdp_config.json").read_text())["FSDP_version"] == 2
    r = resume(saved, tmp_path / "fsdp2", 2, "as_fsdp2", fsdp=2)
    assert r["diffs"] == [] and r["n_model"] > 0, r
