"""tests/ mirrors the wings, so the test of a module is found by its name: the tests of
patches/slimckpt/<wing>/.../<module>.py are in tests/<wing>/test_<module>.py (a module of a sub-package may
also spell its sub-package: save/export/direct in tests/save/test_export_direct.py), the ground modules'
(log, env_vars, internals, cli, cli_flags) in tests/house/. A module tested from a file named otherwise (an
end-to-end test, a file named for a behaviour that runs several modules) is in COVERED_BY with that file,
which names the module or something it defines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ..conftest import REPO

PKG = REPO / "patches" / "slimckpt"

# module (its path under patches/slimckpt/, without .py) -> the test file that covers it
COVERED_BY: dict[str, str] = {
    "convert/cli": "tests/house/test_cli.py",  # every subcommand's parser: both spellings, help, torch-free
    "convert/command": "tests/convert/test_convert.py",
    "convert/layout": "tests/convert/test_convert.py",
    "convert/rank_file": "tests/convert/test_convert.py",
    "convert/remote": "tests/merge/test_remote.py",
    "convert/source": "tests/convert/test_convert.py",
    "convert/write": "tests/convert/test_convert.py",
    "dist/lost_rank": "tests/save/test_errors.py",
    "engine/checkpoint_dir": "tests/engine/test_dcp_source.py",
    "engine/dcp_pickle": "tests/engine/test_dcp_source.py",
    "engine/dcp_step": "tests/merge/test_merge_dcp.py",
    "engine/manifest_put": "tests/layout/test_manifest_schema.py",
    "engine/out_files": "tests/engine/test_share_writer.py",
    "engine/pt_tensors": "tests/engine/test_pt_index.py",
    "engine/resume_records": "tests/layout/test_resume_manifest.py",
    "engine/safe_load": "tests/engine/test_pickle_policy.py",
    "engine/step_pickles": "tests/engine/test_pickle_policy.py",
    "engine/upload": "tests/engine/test_remote_step.py",
    "engine/verl_sources": "tests/engine/test_pt_index.py",
    "hf/lay_out": "tests/merge/test_verl_merger.py",
    "layout/dropped_optimizer": "tests/resume/test_adopt.py",
    "layout/flowrl_names": "tests/slimckpt_flowrl/test_flowrl.py",
    "layout/retention_plan": "tests/e2e/test_retention_disk.py",
    "merge/command": "tests/merge/test_verl_merger.py",
    "merge/plan": "tests/merge/test_coverage_matrix.py",
    "merge/steps": "tests/merge/test_pipeline.py",
    "merge/workers": "tests/merge/test_verl_merger.py",
    "observe/diskspeed_cli": "tests/house/test_cli.py",
    "observe/save_reports": "tests/observe/test_save_measure.py",
    "observe/wandb_history": "tests/e2e/test_compare_runs.py",
    "plan/__main__": "tests/house/test_house.py",  # `python -m slimckpt.plan --help`
    "plan/assumed": "tests/plan/test_upload.py",
    "plan/cli": "tests/plan/test_plan_measured.py",
    "plan/dryrun": "tests/e2e/test_dryrun_plan.py",
    "plan/dryrun_cli": "tests/e2e/test_dryrun_plan.py",
    "plan/printers": "tests/plan/test_build.py",
    "resume/load": "tests/resume/test_step_check.py",
    "resume/pickle_gate": "tests/engine/test_pickle_policy.py",
    "save/driver/driver_state": "tests/e2e/test_retention_disk.py",
    "save/export/direct_write": "tests/save/test_export_direct.py",
    "save/export/intermediate": "tests/save/test_resume_state.py",
    "save/extra_state": "tests/save/test_resume_state.py",
    "save/modes/base": "tests/save/test_modes.py",
    "save/modes/pool": "tests/save/test_modes.py",
    "save/modes/registry": "tests/save/test_modes.py",
    "save/modes/stream": "tests/save/test_modes.py",
    "save/modes/stream_guards": "tests/save/test_stream_offload.py",
    "save/modes/stream_planner": "tests/save/test_stream_capture.py",
    "save/modes/sync": "tests/save/test_modes.py",
    "save/modes/writer": "tests/save/test_modes.py",
    "save/optim_capture": "tests/save/test_resume_state.py",
    "save/os_fixes": "tests/save/test_errors.py",
    "save/process_group": "tests/resume/test_step_check.py",
    "save/retention/best_metric": "tests/e2e/test_retention_disk.py",
    "save/retention/earlier_steps": "tests/save/test_prune.py",
    "save/retention/optimizer_drop": "tests/e2e/test_retention_disk.py",
    "save/save_context": "tests/save/test_modes.py",
    "save/state_dicts": "tests/save/test_resume_state.py",
    "save/step_commit": "tests/save/test_prune.py",
    "save/step_write": "tests/save/test_modes.py",
    "save/target": "tests/save/test_prune.py",
    "storage/base": "tests/storage/test_storage.py",
    "storage/os_errors": "tests/save/test_errors.py",
    "storage/posix": "tests/storage/test_storage.py",
    "storage/s3_client": "tests/storage/test_s3_retries.py",
    "storage/s3_conditional": "tests/storage/test_s3_retries.py",
    "storage/s3_leases": "tests/storage/test_s3.py",
    "storage/s3_ranges": "tests/storage/test_s3.py",
    "storage/s3_read": "tests/storage/test_s3.py",
    "storage/s3_upload": "tests/storage/test_s3.py",
    "verify/cli": "tests/house/test_cli.py",
    "verl/adopt_startup": "tests/resume/test_adopt.py",
    "verl/checkpoint_patches": "tests/save/test_prune.py",
    "verl/config_keys": "tests/verl/test_recipes.py",
    "verl/dryrun": "tests/verl/test_recipes.py",
    "verl/dryrun_args": "tests/verl/test_recipes.py",
    "verl/dryrun_checks": "tests/verl/test_recipes.py",
    "verl/dryrun_report": "tests/verl/test_recipes.py",
    "verl/features": "tests/verl/test_registry.py",
    "verl/import_hooks": "tests/verl/test_registry.py",
    "verl/patch_list": "tests/verl/test_registry.py",
    "verl/plugin": "tests/verl/test_registry.py",
    "verl/save_target": "tests/save/test_resume_state.py",
    "verl_files/in_process_merger": "tests/merge/test_verl_merger_regressions.py",
}


def package_modules(pkg: Path = PKG) -> list[str]:
    """Every module of the package as its path under it without .py (`save/modes/pool`), packages' __init__ aside."""
    return sorted(str(p.relative_to(pkg).with_suffix("")) for p in pkg.rglob("*.py") if p.name != "__init__.py")


def same_named_tests(module: str, tests: Path = REPO / "tests") -> list[Path]:
    """Where the test named after `module` may be: tests/<wing>/test_<module>.py, or with its sub-package."""
    parts = module.split("/")
    if len(parts) == 1:
        return [tests / "house" / f"test_{parts[0]}.py"]
    return [tests / parts[0] / f"test_{parts[-1]}.py", tests / parts[0] / f"test_{'_'.join(parts[1:])}.py"]


def has_same_named_test(module: str, tests: Path = REPO / "tests") -> bool:
    return any(path.is_file() for path in same_named_tests(module, tests))


def telling_names(path: Path) -> set[str]:
    """The public top-level names a module defines that say which module they are from: with an underscore or
    in CamelCase (`run`, `log` or `HELP` could be any module's)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {
        n
        for n in names
        if not n.startswith("_") and ("_" in n.strip("_") or (n[:1].isupper() and any(c.islower() for c in n)))
    }


def mentions(text: str, module: str, pkg: Path = PKG) -> bool:
    """Whether a test file's text names `module`: its dotted name (`python -m` spells a __main__ by its
    package's), its path under the package, the import of it from its package, or a telling name it defines."""
    parts = module.split("/")
    dotted = ".".join(["slimckpt", *parts[:-1]] if parts[-1] == "__main__" else ["slimckpt", *parts])
    parent = ".".join(["slimckpt", *parts[:-1]])
    spelled = [
        re.escape(dotted) + r"(?![\w.])" if parts[-1] == "__main__" else re.escape(dotted) + r"\b",
        r"(?<![\w])" + re.escape(module) + r"\b",
        rf"from {re.escape(parent)} import [^\n]*\b{re.escape(parts[-1])}\b",
    ]
    if any(re.search(p, text) for p in spelled):
        return True
    return any(re.search(rf"\b{re.escape(n)}\b", text) for n in telling_names(pkg / f"{module}.py"))


def test_every_module_has_a_test_named_after_it_or_an_entry_naming_the_file_that_covers_it():
    missing = [m for m in package_modules() if not has_same_named_test(m) and m not in COVERED_BY]
    assert missing == [], "add tests/<wing>/test_<module>.py, or the module and the test file covering it to COVERED_BY"


def test_every_entry_names_a_file_that_exists_and_names_the_module():
    bad = []
    for module, test in sorted(COVERED_BY.items()):
        path = REPO / test
        if not path.is_file():
            bad.append(f"{module}: {test} does not exist")
        elif not mentions(path.read_text(), module):
            bad.append(f"{module}: {test} names neither the module nor what it defines (say it in the docstring)")
    assert bad == []


def test_no_entry_for_a_module_gone_or_with_a_test_named_after_it():
    modules = set(package_modules())
    assert sorted(m for m in COVERED_BY if m not in modules) == [], "the module is gone: drop its entry"
    assert sorted(m for m in COVERED_BY if has_same_named_test(m)) == [], "its own test file exists: drop its entry"


def test_the_checks_see_a_missing_test_and_a_file_that_does_not_name_its_module(tmp_path):
    pkg, tests = tmp_path / "slimckpt", tmp_path / "tests"
    (pkg / "save" / "modes").mkdir(parents=True)
    (tests / "save").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "log.py").write_text("def get_logger(name):\n    pass\n")
    (pkg / "save" / "modes" / "pool.py").write_text("class PoolMode:\n    pass\n\n\ndef run():\n    pass\n")
    (pkg / "save" / "modes" / "sync.py").write_text("")
    (tests / "save" / "test_pool.py").write_text("")
    (tests / "save" / "test_modes_sync.py").write_text("")
    assert package_modules(pkg) == ["log", "save/modes/pool", "save/modes/sync"]
    assert [has_same_named_test(m, tests) for m in package_modules(pkg)] == [False, True, True]
    assert mentions("from slimckpt.save.modes.pool import run", "save/modes/pool", pkg)
    assert mentions("from slimckpt.save.modes import base, pool", "save/modes/pool", pkg)
    assert mentions("`PoolMode` stages a copy", "save/modes/pool", pkg)
    assert mentions("the pool (save/modes/pool)", "save/modes/pool", pkg)
    assert not mentions("run() it; the pool of save/modes/pooled", "save/modes/pool", pkg)
    assert not mentions("slimckpt.save.modes.pooled", "save/modes/pool", pkg)
