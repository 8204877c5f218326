"""`slimckpt convert`: steps saved through verl's real FSDPCheckpointManager (torchrun, gloo, CPU,
FSDP2, a tiny Llama) as +recipe=incremental saves them and as verl saves them, converted to verl's
rank files at other world sizes and resumed by unpatched verl (SLIMCKPT_DISABLE=1): at the same
world size the losses that follow are bitwise those of the run that never stopped, at another the
model, Adam state and scheduler equal the saved ones tensor for tensor. Then the refusals.
FSDP1 (verl's strategy=fsdp): tests/convert/test_convert_fsdp1.py. The modules this runs: convert/command,
convert/source, convert/layout, convert/rank_file, convert/write (convert/plan's pure tests: test_plan.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slimckpt.convert import plan
from tests.helpers.launch import scenario

# every test reads the steps `saved` makes in two torchruns
pytestmark = pytest.mark.slow

STEP = 3


def torchrun(nproc: int, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return scenario(nproc, "slimckpt_testing.scenarios.convert", *args, env=env, check=check)


def convert(step_dir: Path, world: int, target: Path, fsdp: int | None = None, overwrite: bool = False) -> str:
    """The command's own entry point, in this process (torch imported once for the whole module)."""
    from slimckpt.convert.write import convert as run_convert

    _, summary = run_convert(str(step_dir), world, fsdp, str(target), overwrite)
    return summary


def resume(world: int, name: str, cases: dict[str, tuple[Path, Path]], fsdp: int = 2, *extra: str) -> dict:
    """Unpatched verl at `world` ranks, in one torchrun: for each case (saved dir, checkpoint root),
    resume what the root's tracker names and compare with the saved full state."""
    out = next(iter(cases.values()))[0]
    args = [a for case, (saved_dir, root) in cases.items() for a in ("--case", f"{case}:{saved_dir}:{root}")]
    torchrun(
        world,
        "resume",
        "--dir",
        str(out),
        "--name",
        name,
        "--fsdp",
        str(fsdp),
        *args,
        *extra,
        env={"SLIMCKPT_DISABLE": "1"},
    )
    return json.loads((out / f"resume_{name}_ws{world}_result.json").read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, Path]:
    """Step 3 saved at 2 ranks and at 1 rank, each in both formats, with the state at the save."""
    out = {}
    for world in (2, 1):
        d = tmp_path_factory.mktemp(f"saved_ws{world}")
        torchrun(world, "save", "--dir", str(d))
        out[world] = d
    return out


@pytest.fixture(scope="module")
def resumed(saved, tmp_path_factory) -> dict:
    """Every convert of this module, then unpatched verl's resumes, one torchrun per world size."""
    t = tmp_path_factory.mktemp("converted")
    ours = {w: saved[w] / "ours" / f"global_step_{STEP}" for w in saved}
    summaries = {
        "same": convert(ours[2], 2, t / "same"),
        "ours_1to2": convert(ours[1], 2, t / "ours_1to2"),
        "ours_2to1": convert(ours[2], 1, t / "ours_2to1"),
        "verl_2to3": convert(saved[2] / "verl" / f"global_step_{STEP}", 3, t / "verl_2to3"),
    }
    results = {
        **resume(2, "ws2", {"same": (saved[2], t / "same"), "ours_1to2": (saved[1], t / "ours_1to2")}),
        # unconverted: verl's own loader on slimckpt's step
        **resume(1, "ws1", {"ours_2to1": (saved[2], t / "ours_2to1"), "plain": (saved[1], saved[1] / "ours")}),
        **resume(3, "ws3", {"verl_2to3": (saved[2], t / "verl_2to3")}),
    }
    return {"dir": t, "summaries": summaries, "results": results}


def _reference(d: Path, world: int) -> list[float]:
    return json.loads((d / f"save_ws{world}_result.json").read_text())["reference"]


def test_incremental_step_resumes_under_unpatched_verl_at_the_same_world_size(saved, resumed):
    d = saved[2]
    root = resumed["dir"] / "same"
    step = root / f"global_step_{STEP}"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == str(STEP)
    assert sorted(p.name for p in (step / "actor").iterdir()) == sorted(
        p.name for p in (d / "verl" / f"global_step_{STEP}" / "actor").iterdir()
    )  # exactly verl's files
    assert json.loads((step / "actor" / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 2}
    assert f"trainer.default_local_dir={root}" in resumed["summaries"]["same"]
    r = resumed["results"]["same"]
    assert r["slimckpt_patched"] is False
    assert r["step_dir"] == str(step)
    assert r["diffs"] == [] and r["n_model"] > 0, r
    assert r["losses"] == _reference(d, 2)  # bitwise: the run continues as if never stopped


@pytest.mark.parametrize("case", ["ours_2to1", "ours_1to2"])
def test_incremental_step_resharded_loads_exactly(resumed, case):
    r = resumed["results"][case]
    assert r["diffs"] == [] and r["n_model"] > 0, r


def test_verl_step_resharded_two_to_three_resumes(resumed):
    assert "verl at 2 ranks" in resumed["summaries"]["verl_2to3"]
    actor = resumed["dir"] / "verl_2to3" / f"global_step_{STEP}" / "actor"
    assert {f"optim_world_size_3_rank_{r}.pt" for r in range(3)} <= {p.name for p in actor.iterdir()}
    r = resumed["results"]["verl_2to3"]
    assert r["diffs"] == [] and r["n_model"] > 0, r
    assert len(r["losses"]) == 3


def test_unpatched_verl_fails_loudly_on_an_incremental_step(resumed):
    """Without slimckpt's patches nothing of ours runs: verl's own loader stops on the step the
    tracker names (never a silent restart from step 0)."""
    r = resumed["results"]["plain"]
    assert r["step_dir"].endswith(f"global_step_{STEP}")
    assert "model_world_size_1_rank_0.pt" in r["error"], r


# --------------------------------------------------------------------------- the run without the recipe


def test_a_run_without_the_recipe_names_the_convert_command(saved, tmp_path):
    """slimckpt's start-up check (on whenever slimckpt is installed) stops a plain verl run whose
    newest step is in slimckpt's format, with one line naming the command."""
    import torch

    from slimckpt.engine.resume_records import write_tracker
    from slimckpt.resume.adopt import RoleLoad, plan_resume

    step = _copy_step(saved[2], tmp_path)
    torch.save({}, step / "data.pt")  # the trainer's dataloader state: a trainer's step is intact only with it
    root = step.parent
    write_tracker(str(root), STEP)
    decision = plan_resume(str(root), "auto", [RoleLoad("actor", ("model", "optimizer", "extra"), False)], world_size=4)
    assert decision.action == "stop"
    assert "\n" not in decision.message
    assert f"slimckpt convert {root / f'global_step_{STEP}'} --to verl --world-size 4" in decision.message


# --------------------------------------------------------------------------- bad input


def _copy_step(saved: Path, tmp_path: Path, fmt: str = "ours") -> Path:
    step = tmp_path / fmt / f"global_step_{STEP}"
    shutil.copytree(saved / fmt / f"global_step_{STEP}", step)
    return step


def _refusal(argv: list[str], capsys) -> str:
    from slimckpt.cli import main

    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("slimckpt convert: error: "), err
    return err


def test_half_written_step_is_refused_naming_the_file(saved, tmp_path, capsys):
    step = _copy_step(saved[2], tmp_path)
    distcp = step / "actor" / "dcp" / "__1_0.distcp"
    with open(distcp, "r+b") as f:
        f.truncate(distcp.stat().st_size // 2)
    err = _refusal(
        ["convert", str(step), "--to", "verl", "--world-size", "2", "--target_dir", str(tmp_path / "t")], capsys
    )
    assert str(distcp) in err
    (step / "actor" / "slimckpt_resume.json").unlink()
    err = _refusal(
        ["convert", str(step), "--to", "verl", "--world-size", "2", "--target_dir", str(tmp_path / "t")], capsys
    )
    assert "slimckpt_resume.json" in err and "never finished" in err
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("fmt", ["ours", "verl"])
def test_other_model_is_refused_naming_the_file(saved, tmp_path, capsys, fmt):
    step = _copy_step(saved[2], tmp_path, fmt)
    config = step / "actor" / "huggingface" / "config.json"
    data = json.loads(config.read_text())
    data["intermediate_size"] *= 2  # the config of another model beside these shards
    config.write_text(json.dumps(data))
    if fmt == "ours":  # committed as it is now: the manifest lists the new config's checksum
        import slimckpt.engine.resume_records as rr
        import slimckpt.layout.resume_manifest as rm

        manifest = rm.read_manifest(str(step / "actor"))
        manifest.files = rm.describe_files(str(step / "actor"), [f.path for f in manifest.files])
        rr.write_manifest(str(step / "actor"), manifest)
    err = _refusal(
        ["convert", str(step), "--to", "verl", "--world-size", "2", "--target_dir", str(tmp_path / "t")], capsys
    )
    assert "another model" in err and "mlp" in err and str(step / "actor") in err
    assert not (tmp_path / "t").exists()


def test_world_size_that_cannot_hold_the_shapes_says_why(saved, tmp_path, capsys):
    step = saved[2] / "ours" / f"global_step_{STEP}"
    err = _refusal(
        ["convert", str(step), "--to", "verl", "--world-size", "0", "--target_dir", str(tmp_path / "t")], capsys
    )
    assert "at least one rank" in err
    with pytest.raises(plan.ConvertError, match="0-d"):
        plan.check_world_size({"scale": (), "w": (4, 2)}, 2, 2, "config.json")
    plan.check_world_size({"w": (1, 2)}, 3, 2, "config.json")  # empty shards: FSDP pads them


def test_existing_target_is_kept_without_overwrite(saved, tmp_path, capsys):
    step = saved[2] / "ours" / f"global_step_{STEP}"
    target = tmp_path / "t"
    convert(step, 1, target)
    marker = target / f"global_step_{STEP}" / "actor" / "model_world_size_1_rank_0.pt"
    before = marker.stat().st_mtime_ns
    err = _refusal(["convert", str(step), "--to", "verl", "--world-size", "1", "--target_dir", str(target)], capsys)
    assert "--overwrite" in err and str(target / f"global_step_{STEP}") in err
    assert marker.stat().st_mtime_ns == before
    convert(step, 1, target, overwrite=True)
    assert marker.stat().st_mtime_ns != before
    assert sorted(p.name for p in target.iterdir()) == [f"global_step_{STEP}", "latest_checkpointed_iteration.txt"]


KILLED = """
import os, signal, sys
from slimckpt.convert import rank_file
real = rank_file.write
def write(path, *a, **k):
    real(path, *a, **k)
    os.kill(os.getpid(), signal.SIGKILL)  # dies after its first rank file, as a killed convert does
rank_file.write = write
from slimckpt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_killed_convert_leaves_nothing_verl_would_load(saved, tmp_path):
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    step = saved[2] / "ours" / f"global_step_{STEP}"
    target = tmp_path / "t"
    argv = ["convert", str(step), "--to", "verl", "--world-size", "2", "--target_dir", str(target)]
    # the child imports torch and dies after its first rank file: seconds; 300 s is a hang
    proc = subprocess.run([sys.executable, "-c", KILLED, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert sorted(p.name for p in target.iterdir()) == [f"global_step_{STEP}.partial"]
    assert find_latest_ckpt_path(str(target)) is None  # no tracker, no step dir: verl starts nothing from it
    convert(step, 2, target)  # a rerun replaces what the killed one left
    assert sorted(p.name for p in target.iterdir()) == [f"global_step_{STEP}", "latest_checkpointed_iteration.txt"]
