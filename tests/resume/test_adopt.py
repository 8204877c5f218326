"""slimckpt.resume.adopt(_startup): the resume a run gets at start-up, on configs composed as
`python -m verl.trainer.main_ppo` composes them, over step dirs laid out as verl and slimckpt write
them (file names, fsdp_config.json, data.pt and sealed manifests: what is decided here is read from
those, and the walk back over damaged steps is intact_resume's). The runs of verl's real trainer that
exercise the same decisions are tests/e2e/test_adopt_e2e.py's."""

import copy
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

import slimckpt.engine.resume_records as rr
import slimckpt.layout.resume_manifest as rm
from slimckpt.resume.adopt import RoleLoad, RoleState, plan_resume, role_state
from slimckpt.verl.adopt_startup import adopt, recipe_settings_line
from slimckpt.verl.dryrun import compose_config

FULL = ("model", "optimizer", "extra")


def _data_pt(step_dir: Path) -> None:
    """The trainer's dataloader state, as verl's torch.save writes it (the intact check reads its zip records)."""
    import torch

    torch.save({"epoch": 0}, step_dir / "data.pt")


def verl_step(root: Path, step: int, contents=FULL, world: int = 2, track: bool = True) -> Path:
    actor = root / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    prefix = {"model": "model", "optimizer": "optim", "extra": "extra_state"}
    for what in contents:
        for rank in range(world):
            (actor / f"{prefix[what]}_world_size_{world}_rank_{rank}.pt").write_bytes(b"x")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    _data_pt(actor.parent)
    if track:
        (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return actor.parent


def dcp_step(root: Path, step: int, contents=FULL) -> Path:
    """An incremental step as the tier commits it: dcp/ files listed in a sealed manifest."""
    actor = root / f"global_step_{step}" / "actor"
    (actor / "dcp").mkdir(parents=True)
    (actor / "dcp" / "__0_0.distcp").write_bytes(b"x" * 8)
    _data_pt(actor.parent)
    rr.write_manifest(
        str(actor), rm.Manifest(step, 1, list(contents), rm.describe_files(str(actor), ["dcp/__0_0.distcp"]))
    )
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return root / f"global_step_{step}"


@pytest.fixture(scope="module")
def composed() -> dict:
    """Hydra's composition takes seconds: each config once, copied per test."""
    return {
        name: compose_config(overrides)
        for name, overrides in {
            "plain": [],
            "quickstart": ["+recipe=quickstart", "trainer.experiment_name=e"],
            "incremental": ["+recipe=incremental"],
        }.items()
    }


def config(composed: dict, name: str, tmp_path: Path, **settings: str):
    """A copy of a composed config with `default_local_dir` in tmp_path and `settings` ("a.b": value)."""
    cfg = copy.deepcopy(composed[name])
    with open_dict(cfg):
        for key, value in {"trainer.default_local_dir": f"{tmp_path}/ckpt", **settings}.items():
            OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def test_role_state_reads_verl_and_slimckpt_layouts(tmp_path):
    step = verl_step(tmp_path, 2, contents=("model",), world=4)
    assert role_state(str(step / "actor")) == RoleState("verl", ("model",))
    assert role_state(str(verl_step(tmp_path / "full", 1) / "actor")) == RoleState("verl", FULL)
    assert role_state(str(dcp_step(tmp_path, 3) / "actor")).fmt == "slimckpt"
    assert role_state(str(tmp_path / "nothing")) is None


def test_model_only_recipe_continues_from_verls_step(composed, tmp_path):
    verl_step(tmp_path / "ckpt", 1)
    step = verl_step(tmp_path / "ckpt", 2)
    cfg = config(composed, "quickstart", tmp_path, **{"trainer.default_local_dir": f"{tmp_path}/ckpt/model_only"})
    adopt(cfg, use_critic=False)
    assert cfg.trainer.resume_mode == "resume_path" and cfg.trainer.resume_from_path == str(step)
    decision = plan_resume(f"{tmp_path}/ckpt/model_only", "auto", [RoleLoad("actor", ("model",), True)], "quickstart")
    message = decision.message
    assert message.startswith(f"slimckpt: +recipe=quickstart continues from {step}, the newest step of this job")
    assert (
        "does not load actor optimizer+extra: the optimizer state (Adam moments, step count) and the lr "
        "scheduler and RNG state start afresh" in message
    )


def test_model_only_steps_newer_than_verls_win(tmp_path):
    verl_step(tmp_path / "ckpt", 2)
    newer = verl_step(tmp_path / "ckpt" / "model_only", 4, contents=("model",))
    decision = plan_resume(
        str(tmp_path / "ckpt" / "model_only"), "auto", [RoleLoad("actor", ("model",), True)], "quickstart"
    )
    assert decision.action == "keep" and decision.message == ""  # verl's own auto resumes step 4
    # the exact-resume recipe in verl's dir sees the newer model-only step and cannot load its optimizer
    decision = plan_resume(str(tmp_path / "ckpt"), "auto", [RoleLoad("actor", FULL, True)], "incremental")
    assert decision.action == "stop" and decision.step_dir == str(newer)
    assert "holds model only" in decision.message and "load_contents=[model]" in decision.message


def test_nothing_saved_is_a_clean_start(composed, tmp_path):
    cfg = config(composed, "quickstart", tmp_path)
    adopt(cfg, use_critic=False)
    assert cfg.trainer.resume_mode == "auto"


def test_plain_verl_on_a_dcp_step_stops_in_one_line(composed, tmp_path):
    step = dcp_step(tmp_path / "ckpt", 3)
    with pytest.raises(SystemExit) as info:
        adopt(config(composed, "plain", tmp_path), use_critic=False)
    message = str(info.value.code)
    assert "\n" not in message and str(step / "actor") in message and "+recipe=incremental" in message


def test_plain_verl_loading_model_only_goes_no_step_back_silently(composed, tmp_path):
    verl_step(tmp_path / "ckpt", 2)
    verl_step(tmp_path / "ckpt" / "model_only", 5, contents=("model",))
    load = {"actor_rollout_ref.actor.checkpoint.load_contents": ["model"]}
    with pytest.raises(SystemExit) as info:
        adopt(config(composed, "plain", tmp_path, **load), use_critic=False)
    assert f"trainer.resume_from_path={tmp_path}/ckpt/global_step_2" in str(info.value.code)
    assert "where verl would go back to global_step_2" in str(info.value.code)


def test_resume_path_to_a_step_without_the_critic_stops(composed, tmp_path):
    step = verl_step(tmp_path / "ckpt", 2)
    cfg = config(
        composed, "plain", tmp_path, **{"trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(step)}
    )
    with pytest.raises(SystemExit) as info:
        adopt(cfg, use_critic=True)
    assert "holds no saved critic state" in str(info.value.code)


def test_recipe_settings_line_names_what_the_run_keeps(composed, tmp_path):
    line = recipe_settings_line(composed["quickstart"], "quickstart")
    assert line.count("\n") == 0
    assert "trainer.save_freq=10 (verl's default: -1)" in line
    assert (
        "trainer.default_local_dir=checkpoints/verl_examples/e/model_only (verl's default: "
        "checkpoints/verl_examples/e)" in line
    )
    mine = recipe_settings_line(config(composed, "quickstart", tmp_path, **{"trainer.save_freq": 50}), "quickstart")
    assert "save_freq" not in mine and "max_actor_ckpt_to_keep=2" in mine
    # incremental's bounded defaults: retention, the optimizer kept in the newest step, a bf16 export
    line = recipe_settings_line(composed["incremental"], "incremental")
    assert line.count("\n") == 0
    for key in ("trainer.max_actor_ckpt_to_keep=2 (verl's default: null)", "trainer.max_critic_ckpt_to_keep=2"):
        assert key in line, line
    for role in ("actor_rollout_ref.actor", "critic"):
        assert f"{role}.checkpoint.keep_optimizer_last=1 (null keeps every kept step's)" in line, line
    assert "actor_rollout_ref.actor.checkpoint.export_dtype=bf16 (auto exports fp32 as verl)" in line, line
    assert "ray_kwargs" not in line and "save_contents" not in line
    # a value the user set is theirs: not named
    mine = recipe_settings_line(
        config(composed, "incremental", tmp_path, **{"actor_rollout_ref.actor.checkpoint.export_dtype": "auto"}),
        "incremental",
    )
    assert "export_dtype" not in mine and "keep_optimizer_last=1" in mine


def test_the_newest_step_is_the_newest_intact_one_as_intact_resume_walks_back(tmp_path):
    """adopt's latest step is intact_resume's: a damaged step the tracker names (verl's save of it
    did not finish) is passed over for the newest intact one below it, in either directory."""
    from slimckpt.resume.intact_resume import latest_intact_step

    verl_step(tmp_path / "ckpt", 2)
    verl_step(tmp_path / "ckpt", 4)
    (tmp_path / "ckpt" / "global_step_4" / "actor" / "fsdp_config.json").unlink()  # its save never finished
    newer = verl_step(tmp_path / "ckpt" / "model_only", 3, contents=("model",))
    assert latest_intact_step(str(tmp_path / "ckpt"), {"actor": True}) == 2
    decision = plan_resume(str(tmp_path / "ckpt"), "auto", [RoleLoad("actor", ("model",), True)], "quickstart")
    assert decision.action == "resume" and decision.step_dir == str(newer), decision  # 3 beats the intact 2


def test_a_step_whose_optimizer_retention_dropped_is_resumed_not_refused(tmp_path):
    """A run that loads the optimizer, whose newest step lost it to keep_optimizer_last (the record
    next to verl's rank files, or the manifest of a dcp/ step): resumed, saying what it drops."""
    from slimckpt.layout.dropped_optimizer import DROPPED_KEY, NATIVE_MARKER

    step = verl_step(tmp_path / "ckpt", 2, contents=("model", "extra"))
    decision = plan_resume(str(tmp_path / "ckpt"), "auto", [RoleLoad("actor", FULL, True)], "quickstart")
    assert decision.action == "stop"  # no record: an optimizer the run loads is missing
    (step / "actor" / NATIVE_MARKER).write_text(json.dumps({DROPPED_KEY: True, "keep_optimizer_last": 1}))
    decision = plan_resume(str(tmp_path / "ckpt"), "auto", [RoleLoad("actor", FULL, True)], "quickstart")
    assert decision.action == "keep" and "does not load actor optimizer" in decision.message, decision

    dcp = tmp_path / "dcp"
    actor = dcp_step(dcp, 5, contents=("model", "extra")) / "actor"
    manifest = rm.read_manifest(str(actor))
    manifest.extra[DROPPED_KEY] = {"keep_optimizer_last": 1}
    rr.write_manifest(str(actor), manifest)
    decision = plan_resume(str(dcp), "auto", [RoleLoad("actor", FULL, True)], "incremental")
    assert decision.action == "keep" and "does not load actor optimizer" in decision.message, decision


def test_a_model_only_recipe_in_the_users_own_dir_says_what_protects_the_run(composed, tmp_path):
    from slimckpt.verl.adopt_startup import model_only_line

    assert model_only_line(composed["quickstart"]) is None  # the recipe's own <dir>/model_only
    assert model_only_line(composed["incremental"]) is None
    line = model_only_line(config(composed, "quickstart", tmp_path))
    assert line.count("\n") == 0 and f"saves model-only steps in {tmp_path}/ckpt" in line
    assert "stops at start-up in one line" in line
