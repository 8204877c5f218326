"""Every YAML in recipes/ and overrides/<group>/ composes with verl 0.9.1's real config, sets only
keys verl has, composes with every file of every other group, and passes `slimckpt dryrun`'s
validation (verl's own validate_config and config dataclasses) in full recipe + size + cluster +
algo combinations chosen so that every file meets every file of every other group (all pairs).
Files are discovered by globbing, so a new recipe or override is covered without editing this file.

Composition runs in-process (Hydra's compose API, ~0.2 s a case). Validation builds verl's
dataclasses, which applies slimckpt's checkpoint patches in that process, and the `cpu` cluster
needs SLIMCKPT_CPU=1 before verl is imported: so the validation matrix runs in one fresh
interpreter and reports JSON. `slimckpt dryrun`'s options are read by verl/dryrun_args, its refusals
worded by verl/dryrun_report.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slimckpt.verl.config_keys import unknown_keys_in_file
from slimckpt.verl.dryrun import DryRunError, compose_config, main
from slimckpt.verl.recipes import GROUPS, PACKAGE_LINE, header_comment, list_group
from tests.helpers.launch import REPO

GROUP_DIRS = {"recipe": REPO / "recipes", **{g: REPO / "overrides" / g for g in ("size", "cluster", "algo")}}
ALL_FILES = sorted(p for d in GROUP_DIRS.values() for p in d.glob("*.yaml"))
OPTIONS = {g: list_group(g) for g in GROUPS}


def _pairs(combo: tuple) -> set:
    return {((i, combo[i]), (j, combo[j])) for i, j in itertools.combinations(range(len(combo)), 2)}


def _sets_rollout_name(combo) -> bool:
    from omegaconf import OmegaConf

    return any(OmegaConf.select(OmegaConf.load(o.path), "actor_rollout_ref.rollout.name") for o in combo)


def _all_pairs(groups: list[list]) -> list[tuple]:
    """A small set of combinations (one option per group) in which every option of every group
    meets every option of every other group at least once. The full product grows as the product
    of the group sizes (recipes x sizes x clusters x algos); this stays near the largest pair
    product, so adding a file keeps the test fast and still pairs it with every other file.

    Only combinations that name a rollout backend can pass (verl's `rollout.name` is `???`): pairs
    are covered by those; one combination without a backend is added to check that the dry run
    rejects it (a CPU-only size with a GPU cluster, say)."""
    product = [tuple(g[k] for g, k in zip(groups, idx)) for idx in itertools.product(*(range(len(g)) for g in groups))]
    viable = [c for c in product if _sets_rollout_name(c)]
    uncovered = set().union(*(_pairs(c) for c in viable)) if viable else set()
    chosen = []
    while uncovered:
        best = max(viable, key=lambda c: len(_pairs(c) & uncovered))  # first of the best: deterministic
        chosen.append(best)
        uncovered -= _pairs(best)
    chosen += [c for c in product if c not in viable][:1]
    return chosen


COMBOS = _all_pairs([OPTIONS[g] for g in GROUPS])


def _option_id(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


@pytest.fixture(scope="module")
def base_cfg():
    return compose_config([])


def test_groups_are_discovered_from_the_repo():
    # the conf/ symlinks point at the repo folders this test globs; a broken link would hide files
    for group, folder in GROUP_DIRS.items():
        assert sorted(o.path.resolve() for o in OPTIONS[group]) == sorted(p.resolve() for p in folder.glob("*.yaml"))
    assert OPTIONS["recipe"], "no recipes found"
    assert all(OPTIONS[g] for g in ("size", "cluster", "algo"))


@pytest.mark.parametrize("path", ALL_FILES, ids=_option_id)
def test_yaml_header(path: Path):
    lines = path.read_text().splitlines()
    assert lines[0] == PACKAGE_LINE, f"{path}: first line must be '{PACKAGE_LINE}'"
    assert lines[1].startswith("# "), f"{path}: the package line must be followed by a header comment"
    header = "\n".join(header_comment(path))
    assert lines[1].startswith(f"# {path.stem}: "), f"{path}: header must open with '{path.stem}: <what it does>'"
    assert re.search(r"(python -m [\w.]+|slimckpt \w+|bash scripts/\w+\.sh)[^\n]*\+\w+=", header), (
        f"{path}: header must show the exact command that uses it"
    )
    assert re.search(r"[Oo]verride", header), f"{path}: header must give an override example"


@pytest.mark.parametrize("path", ALL_FILES, ids=_option_id)
def test_each_file_alone_composes_with_only_verl_keys(path: Path, base_cfg):
    group = next(g for g, d in GROUP_DIRS.items() if path.parent == d)
    cfg = compose_config([f"+{group}={path.stem}"])
    assert "recipe" not in cfg and group not in cfg, "the group was added as a plain key: search path missing"
    assert unknown_keys_in_file(base_cfg, path) == []


@pytest.mark.parametrize(
    "recipe,other",
    [(r, o) for r in OPTIONS["recipe"] for g in ("size", "cluster", "algo") for o in OPTIONS[g]],
    ids=lambda o: o.override,
)
def test_each_recipe_composes_with_each_override(recipe, other):
    cfg = compose_config([recipe.override, other.override])
    # the recipe's checkpoint target survives whatever the override sets
    assert cfg.actor_rollout_ref.actor.checkpoint._target_ == "slimckpt.verl.checkpoint_config.SlimCheckpointConfig"


def test_unknown_key_in_a_group_file_is_caught(tmp_path, base_cfg):
    typo = tmp_path / "typo.yaml"
    typo.write_text("# @package _global_\ntrainer:\n  save_freqq: 10\n  save_freq: 5\n")
    assert unknown_keys_in_file(base_cfg, typo) == ["trainer.save_freqq"]


def test_quickstart_effective_keys():
    from omegaconf import OmegaConf

    cfg = compose_config(["+recipe=quickstart"])
    default = compose_config([])
    for role in ("actor_rollout_ref.actor", "critic"):
        ckpt = OmegaConf.select(cfg, f"{role}.checkpoint")
        assert ckpt._target_ == "slimckpt.verl.checkpoint_config.SlimCheckpointConfig"
        assert ckpt.recipe == "quickstart"
        assert list(ckpt.save_contents) == ["model"]
        assert list(ckpt.load_contents) == ["model"]
        # verl's own default for comparison: the recipe really changed it
        assert list(OmegaConf.select(default, f"{role}.checkpoint.save_contents")) == ["model", "optimizer", "extra"]
    assert cfg.trainer.save_freq == 10
    assert cfg.trainer.max_actor_ckpt_to_keep == 2
    assert cfg.trainer.max_critic_ckpt_to_keep == 2
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k/model_only"
    assert cfg.trainer.default_local_dir != default.trainer.default_local_dir
    text = (REPO / "recipes" / "quickstart.yaml").read_text()
    assert "hf_model" not in "".join(line for line in text.splitlines() if not line.startswith("#"))
    assert re.search(r"RESTARTS the optimizer", text), "quickstart must state its trade-off"


def test_incremental_is_bounded_by_default():
    """The one adoption line cannot fill a 70B disk: the newest 2 steps per role, the optimizer in the newest
    only, a bf16 export; FSDP1's device copy is checked at start-up unless allowed."""
    from omegaconf import OmegaConf

    cfg = compose_config(["+recipe=incremental"])
    assert cfg.trainer.max_actor_ckpt_to_keep == 2 and cfg.trainer.max_critic_ckpt_to_keep == 2
    for role in ("actor_rollout_ref.actor", "critic"):
        ckpt = OmegaConf.select(cfg, f"{role}.checkpoint")
        assert ckpt.keep_optimizer_last == 1 and ckpt.allow_fsdp1_device_copy is False
    assert cfg.actor_rollout_ref.actor.checkpoint.export_dtype == "bf16"
    # keeping everything, as verl does, is one override per key
    kept = compose_config(
        ["+recipe=incremental", "trainer.max_actor_ckpt_to_keep=null", "critic.checkpoint.keep_optimizer_last=null"]
    )
    assert kept.trainer.max_actor_ckpt_to_keep is None and kept.critic.checkpoint.keep_optimizer_last is None


def test_unknown_recipe_lists_the_recipes(capsys):
    with pytest.raises(DryRunError) as err:
        compose_config(["+recipe=does_not_exist"])
    assert "no such recipe" in err.value.reason
    for recipe in OPTIONS["recipe"]:
        assert recipe.override in err.value.details
        assert recipe.description in err.value.details
    # the CLI prints it as a one-line reason plus the list, exit status 2
    assert main(["--no-print", "+recipe=does_not_exist"]) == 2
    stderr = capsys.readouterr().err
    assert stderr.splitlines()[0].startswith("slimckpt.dryrun: config error: +recipe=does_not_exist: no such recipe")
    assert all(r.override in stderr for r in OPTIONS["recipe"])


def test_misspelt_key_names_the_likely_one():
    with pytest.raises(DryRunError) as err:
        compose_config(["+recipe=quickstart", "trainer.save_frq=3"])
    assert err.value.reason.startswith(
        "trainer.save_frq is not a key of verl's config (did you mean trainer.save_freq?)"
    )


_MATRIX_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from slimckpt.verl.dryrun import DryRunError, check_added_keys, compose_config
    from slimckpt.verl.dryrun_checks import validate
    results = {}
    for case in json.loads(sys.argv[1]):
        try:
            cfg = compose_config(case)
            check_added_keys(case, composed=cfg)
            report = validate(cfg)
            results[" ".join(case)] = {"ok": True, "checks": report.checks,
                                       "target": cfg.actor_rollout_ref.actor.checkpoint._target_}
        except DryRunError as e:
            results[" ".join(case)] = {"ok": False, "reason": e.reason}
    print("RESULTS " + json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def matrix() -> dict:
    cases = [[o.override for o in combo] for combo in COMBOS]
    env = {**os.environ, "SLIMCKPT_CPU": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _MATRIX_SCRIPT, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        # one interpreter composes every combination (~40 s on a loaded host); 600 s is a hang
        timeout=600,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[len("RESULTS ") :])


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: " ".join(o.override for o in c))
def test_every_combination_validates(combo, matrix):
    result = matrix[" ".join(o.override for o in combo)]
    if not _sets_rollout_name(combo):
        # e.g. a CPU-only size with a GPU cluster: verl's `rollout.name: ???` stays unset, and the
        # dry run must say so instead of passing
        assert not result["ok"] and "actor_rollout_ref.rollout.name" in result["reason"], result
        return
    assert result["ok"], result.get("reason")
    assert result["target"] == "slimckpt.verl.checkpoint_config.SlimCheckpointConfig"
    assert any(c.startswith("verl validate_config") for c in result["checks"])


def test_same_config_as_verls_own_entry_point():
    """`python -m verl.trainer.main_ppo --cfg job` prints the config Hydra hands to main_ppo and exits:
    the dry run must compose exactly that."""
    import yaml
    from omegaconf import OmegaConf

    overrides = ["+recipe=quickstart", "+size=70b", "+cluster=4x8", "+algo=grpo", "trainer.save_freq=3"]
    proc = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "--cfg", "job", *overrides],
        capture_output=True,
        text=True,
        cwd=REPO,
        # verl's entry point imports verl and prints the config: seconds; 300 s is a hang
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = OmegaConf.to_container(compose_config(overrides), resolve=False)
    assert yaml.safe_load(proc.stdout) == ours
