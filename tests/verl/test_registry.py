"""The patch registry: apply/revert, lazy application, the plugin's switches, and the frozen set of verl
targets (an upstream rename must fail here, not silently switch a patch off)."""

import builtins
import sys
import textwrap
import types

import pytest

from slimckpt.verl.patch_list import PATCHES
from slimckpt.verl.registry import (
    Patch,
    Registry,
    resolve,
    resolve_table,
)
from slimckpt.verl_files.version import UnsupportedVerlVersion

from ..conftest import REPO, run_python

# Every verl attribute slimckpt replaces. Adding or renaming a patch means updating this set on
# purpose; a verl upgrade that moves one of these fails test_every_target_exists_in_installed_verl.
EXPECTED_TARGETS = {
    "verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager.save_checkpoint",
    # feature "cpu" (slimckpt_cpu, SLIMCKPT_CPU=1)
    "verl.plugin.platform.platform_manager:_detect_platform_name",
    "verl.utils.distributed:initialize_global_process_group_ray",
    "verl.workers.engine_workers:initialize_global_process_group_ray",
    "verl.utils.distributed:initialize_global_process_group",
    "verl.utils.model:load_valuehead_model",
    "verl.workers.engine.fsdp.transformer_impl:CPUOffloadPolicy",
    "verl.experimental.agent_loop.agent_loop:AgentLoopWorker._run_agent_loop",
    "verl.workers.rollout.llm_server:LLMServerClient.generate",
    "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._materialize_batch",
    "verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager.load_checkpoint",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._save_checkpoint",
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._save_checkpoint",
    # the builtin open the trainers write their tracker with (a module global shadows it)
    "verl.trainer.ppo.v1.trainer_base:open",
    "verl.trainer.ppo.ray_trainer:open",
    "verl.trainer.ppo.v1.trainer_base:find_latest_ckpt_path",
    "verl.trainer.ppo.ray_trainer:find_latest_ckpt_path",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._load_checkpoint",
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._load_checkpoint",
    # trainer.default_local_dir=s3://...: the names verl's trainer calls for its step folder and data.pt
    "verl.trainer.ppo.v1.trainer_base:os",
    "verl.trainer.ppo.ray_trainer:os",
    "verl.trainer.ppo.v1.trainer_base:torch",
    "verl.trainer.ppo.ray_trainer:torch",
    "verl.utils.fs:local_mkdir_safe",
    # async_save=stream: guards before verl's FSDP engine moves or merges the shards in place
    "verl.workers.engine.fsdp.transformer_impl:offload_fsdp_model_to_cpu",
    "verl.workers.engine.fsdp.transformer_impl:load_fsdp_model_to_gpu",
    "verl.workers.engine.fsdp.transformer_impl:offload_fsdp_optimizer",
    "verl.workers.engine.fsdp.transformer_impl:load_fsdp_optimizer",
    "verl.workers.engine.fsdp.transformer_impl:merged_lora_context",
    "verl.utils.checkpoint.checkpoint_manager:BaseCheckpointManager.ensure_checkpoint_capacity",
    "verl.utils.checkpoint.checkpoint_manager:BaseCheckpointManager.register_checkpoint",
    # keep_best: the trainer's logged metrics recorded next to each save step
    "verl.utils.tracking:Tracking.__init__",
    "verl.utils.tracking:Tracking.log",
    # feature "adopt" (slimckpt.verl.adopt_startup, always on)
    "verl.utils.config:validate_config",
    # feature "merge" (slimckpt.merge.pipeline)
    "verl.model_merger.fsdp_model_merger:FSDPModelMerger.merge_and_save",
    "verl.model_merger.base_model_merger:BaseModelMerger.save_hf_model_and_tokenizer",
    # feature "flowrl" (slimckpt_flowrl, +algo=flowrl)
    "verl.workers.engine.fsdp.transformer_impl:FSDPEngine._build_module",
    "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_inputs",
    "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_outputs",
    "verl.workers.engine_workers:ppo_loss",
    "verl.workers.engine.fsdp.transformer_impl:FSDPEngine.get_per_tensor_param",
    "verl.workers.engine.fsdp.transformer_impl:FSDPEngine.get_per_tensor_param_shard",
    "verl.utils.checkpoint.fsdp_checkpoint_manager:get_fsdp_full_state_dict",
}
ENGINES = "verl.workers.engine.base:EngineRegistry._engines"
# Every entry slimckpt adds to one of verl's tables: (table, path of keys).
EXPECTED_ENTRIES = {
    # feature "cpu": the platform, the hf rollout's two halves, the FSDP engines on device cpu
    ("verl.plugin.platform.platform_manager:PlatformRegistry._platforms", ("cpu",)),
    ("verl.workers.rollout.replica:RolloutReplicaRegistry._registry", ("hf",)),
    ("verl.workers.rollout.base:_ROLLOUT_REGISTRY", (("hf", "async"),)),
    (ENGINES, ("language_model", "fsdp", "cpu")),
    (ENGINES, ("language_model", "fsdp2", "cpu")),
    (ENGINES, ("value_model", "fsdp", "cpu")),
    (ENGINES, ("value_model", "fsdp2", "cpu")),
    # feature "flowrl": the policy loss
    ("verl.trainer.ppo.core_algos:POLICY_LOSS_REGISTRY", ("flowrl",)),
}


def test_patch_targets_are_frozen():
    assert {p.target for p in PATCHES if not p.key} == EXPECTED_TARGETS
    assert {(p.target, p.key) for p in PATCHES if p.key} == EXPECTED_ENTRIES


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_every_implementation_is_named_and_importable(patch):
    """The list names its implementations as `module:function` (it imports none of them)."""
    assert isinstance(patch.make, str) and patch.make.startswith(("slimckpt.", "slimckpt_cpu.", "slimckpt_flowrl.")), (
        patch.make
    )
    assert callable(patch.builder())


def test_patch_names_are_unique_and_features_known():
    names = [p.name for p in PATCHES]
    assert len(names) == len(set(names))
    assert {p.feature for p in PATCHES} <= {"measure", "checkpoint", "merge", "adopt", "cpu", "flowrl"}


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_every_target_exists_in_installed_verl(patch):
    owner, attr, value = resolve(patch.target)
    assert value is not None and getattr(owner, attr, getattr(builtins, attr, None)) is value
    if patch.key:  # the table and every table on the way to the entry exist once `after` is imported
        assert isinstance(resolve_table(patch), dict)


def _fake_module(name: str):
    module = types.ModuleType(name)

    class Thing:
        def hello(self):
            return "original"

    module.Thing = Thing
    sys.modules[name] = module
    return module


def test_apply_and_revert_restore_the_original():
    module = _fake_module("slimckpt_fake_target_a")
    reg = Registry()
    reg.register(
        Patch(
            "fake.hello",
            "slimckpt_fake_target_a:Thing.hello",
            "test",
            make=lambda orig: lambda self: "patched+" + orig(self),
            why="test",
        )
    )
    original = module.Thing.hello
    reg.apply("fake.hello")
    assert module.Thing().hello() == "patched+original"
    assert reg.applied() == ["fake.hello"]
    reg.apply("fake.hello")  # idempotent
    assert module.Thing().hello() == "patched+original"
    reg.revert("fake.hello")
    assert module.Thing.hello is original
    assert reg.applied() == []


def test_an_entry_patch_adds_and_reverts_a_table_entry():
    module = types.ModuleType("slimckpt_fake_target_tables")
    module.TABLES = {"outer": {"cuda": "engine", "npu": "other"}, "flat": {"kept": 1}}
    sys.modules[module.__name__] = module
    reg = Registry()
    reg.register(
        Patch(
            "fake.nested",
            "slimckpt_fake_target_tables:TABLES",
            "test",
            key=("outer", "cpu"),
            make=lambda table: table["cuda"],
            why="t",
        )
    )
    reg.register(
        Patch(
            "fake.replace",
            "slimckpt_fake_target_tables:TABLES",
            "test",
            key=("flat", "kept"),
            make=lambda table: table["kept"] + 1,
            why="t",
        )
    )
    reg.apply_feature("test", lazy=False)
    assert module.TABLES == {"outer": {"cuda": "engine", "npu": "other", "cpu": "engine"}, "flat": {"kept": 2}}
    reg.revert_all()
    assert module.TABLES == {"outer": {"cuda": "engine", "npu": "other"}, "flat": {"kept": 1}}


def test_a_patch_names_its_implementation_and_imports_it_only_when_applied(tmp_path, monkeypatch):
    (tmp_path / "slimckpt_fake_impl.py").write_text(
        "def wrap(original):\n    return lambda self: 'impl+' + original(self)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = _fake_module("slimckpt_fake_target_c")
    reg = Registry()
    reg.register(Patch("fake.c", "slimckpt_fake_target_c:Thing.hello", "test", make="slimckpt_fake_impl:wrap", why="t"))
    assert "slimckpt_fake_impl" not in sys.modules
    reg.apply("fake.c")
    assert module.Thing().hello() == "impl+original"
    reg.revert("fake.c")
    assert module.Thing().hello() == "original"
    with pytest.raises(ValueError, match="module:function"):
        reg.register(Patch("fake.bad", "m:a", "test", make="no_colon", why="t"))


def test_apply_refuses_unsupported_verl_version():
    _fake_module("slimckpt_fake_target_b")
    reg = Registry()
    reg.register(
        Patch(
            "fake.b", "slimckpt_fake_target_b:Thing.hello", "test", make=lambda o: o, why="t", verl_versions="==0.0.1"
        )
    )
    with pytest.raises(UnsupportedVerlVersion):
        reg.apply("fake.b")
    assert reg.applied() == []


def test_register_rejects_duplicates_and_bad_targets():
    reg = Registry()
    reg.register(Patch("x", "m:a", "f", make=lambda o: o, why="t"))
    with pytest.raises(ValueError):
        reg.register(Patch("x", "m:a", "f", make=lambda o: o, why="t"))
    with pytest.raises(ValueError):
        reg.register(Patch("y", "no_colon", "f", make=lambda o: o, why="t"))


def test_apply_on_import_waits_for_the_module(tmp_path, monkeypatch):
    pkg = tmp_path / "slimckpt_lazy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "heavy.py").write_text(
        textwrap.dedent("""
        def answer():
            return 1
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry()
    reg.register(Patch("lazy", "slimckpt_lazy_pkg.heavy:answer", "test", make=lambda o: lambda: o() + 41, why="t"))
    reg.apply_on_import("lazy")
    assert "slimckpt_lazy_pkg.heavy" not in sys.modules
    assert not reg.is_applied("lazy")
    import slimckpt_lazy_pkg.heavy as heavy  # noqa: E402

    assert heavy.answer() == 42
    assert reg.is_applied("lazy")
    reg.revert_all()
    assert heavy.answer() == 1


def test_plain_verl_is_untouched_without_a_recipe():
    """With slimckpt installed but no recipe and no SLIMCKPT_* switch, verl's classes are verl's."""
    res = run_python(
        textwrap.dedent("""
        import verl
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager as M
        from slimckpt.verl.registry import REGISTRY
        print("MODULE", M.save_checkpoint.__code__.co_filename.rsplit("/", 1)[-1])
        print("APPLIED", REGISTRY.applied())
    """),
        env={"SLIMCKPT_MEASURE": "", "SLIMCKPT_CPU": ""},
    )
    assert res.returncode == 0, res.stderr
    assert "MODULE fsdp_checkpoint_manager.py" in res.stdout
    assert "APPLIED ['adopt.startup']" in res.stdout  # the start-up check of the resume, nothing in training


def test_without_a_recipe_exactly_this_changes():
    """docs/configuration.md's list "What changes without a recipe", item by item."""
    res = run_python(
        textwrap.dedent("""
        import logging, os, sys
        for k in [k for k in os.environ if k.startswith("SLIMCKPT_")]:
            del os.environ[k]
        before = list(sys.meta_path)
        import verl
        from slimckpt.verl import import_hooks
        from slimckpt.verl.registry import REGISTRY
        print("APPLIED", REGISTRY.applied())
        print("PENDING", sorted(REGISTRY._pending))
        print("FINDERS", [type(f).__name__ for f in sys.meta_path if f not in before])
        print("HOOKED", sorted(import_hooks._hooks))
        print("MODULES", sorted(m for m in sys.modules if m.startswith("slimckpt")))
        log = logging.getLogger("slimckpt")
        print("LOGGER", [type(h).__name__ for h in log.handlers], log.propagate, logging.getLevelName(log.level))
    """)
    )
    assert res.returncode == 0, res.stderr
    out = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    assert out["APPLIED"] == "['adopt.startup']"
    assert out["PENDING"] == "['merge.drop_flowrl', 'merge.fsdp']"
    assert out["FINDERS"] == "['_PostImportFinder']"
    assert out["HOOKED"] == "['verl.model_merger.base_model_merger', 'verl.model_merger.fsdp_model_merger']"
    assert out["MODULES"] == str(
        [
            "slimckpt",
            "slimckpt.env_vars",
            "slimckpt.log",
            "slimckpt.verl",
            "slimckpt.verl.adopt_startup",
            "slimckpt.verl.features",
            "slimckpt.verl.import_hooks",
            "slimckpt.verl.patch_list",
            "slimckpt.verl.plugin",
            "slimckpt.verl.registry",
            "slimckpt.verl_files",
            "slimckpt.verl_files.version",
        ]
    )
    assert out["LOGGER"] == "['NullHandler'] True INFO"
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert "tests/verl/test_registry.py::test_without_a_recipe_exactly_this_changes" in doc


def test_disable_switch_applies_nothing():
    res = run_python(
        textwrap.dedent("""
        import verl
        from slimckpt.verl.registry import REGISTRY
        print("PATCHES", len(REGISTRY.patches()), "APPLIED", REGISTRY.applied())
    """),
        env={"SLIMCKPT_DISABLE": "1", "SLIMCKPT_MEASURE": "1"},
    )
    assert res.returncode == 0, res.stderr
    assert "PATCHES 0 APPLIED []" in res.stdout


def test_bad_log_level_falls_back_to_info_and_keeps_slimckpt_on():
    """An invalid SLIMCKPT_LOG_LEVEL raised at import, outside the plugin's try; verl swallowed it
    and slimckpt (SLIMCKPT_MEASURE, SLIMCKPT_CPU) silently switched off."""
    res = run_python(
        textwrap.dedent("""
        import verl
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager as M
        print("MODULE", M.save_checkpoint.__code__.co_filename.rsplit("/", 1)[-1])
    """),
        env={"SLIMCKPT_LOG_LEVEL": "verbose", "SLIMCKPT_MEASURE": "1"},
    )
    assert res.returncode == 0, res.stderr
    assert "MODULE checkpoint_patches.py" in res.stdout  # SLIMCKPT_MEASURE=1 still took effect
    warnings = [line for line in res.stderr.splitlines() if "SLIMCKPT_LOG_LEVEL" in line]
    assert len(warnings) == 1, res.stderr
    assert "WARNING" in warnings[0] and "'verbose'" in warnings[0] and "using INFO" in warnings[0]
    assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in warnings[0]
    # INFO, not WARNING: the patch lines still show
    assert "patched verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager.save_checkpoint" in res.stderr
