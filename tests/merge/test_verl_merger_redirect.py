"""merge/verl_merger, in-process: verl's patched FSDPModelMerger.merge_and_save runs the streaming merge and
then verl's own uploader on the committed dir, hands `test` to verl's original, and merges distributed only
when asked. Its runs on real checkpoints: tests/merge/test_verl_merger.py (slow)."""

from __future__ import annotations

import pytest

from slimckpt.layout.merge_manifest import verify

from ..helpers.merge_cli import (
    log_lines,
    ws2_checkpoint,
)

slim_log = pytest.fixture(autouse=True, name="slim_log")(log_lines)
ckpt = pytest.fixture(scope="module", name="ckpt")(ws2_checkpoint)


def test_redirect_uploads_after_commit_and_delegates_test(ckpt, tmp_path, monkeypatch, capsys):
    """The patched FSDPModelMerger.merge_and_save: merge -> streaming merge, then verl's own uploader on
    the committed dir (--hf_upload_path); `test` -> verl's original."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    from slimckpt.merge.verl_merger import wrap_merge_and_save

    calls = []
    monkeypatch.setattr(
        FSDPModelMerger, "upload_to_huggingface", lambda self: calls.append(("upload", verify(self.config.target_dir)))
    )
    patched = wrap_merge_and_save(lambda self: calls.append(("original", self.config.operation)))
    target = tmp_path / "o"
    target.mkdir()  # as verl's generate_config_from_args leaves it
    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(ckpt),
        target_dir=str(target),
        hf_upload_path="someone/model",
        hf_model_config_path=str(ckpt / "huggingface"),
        use_cpu_initialization=True,
    )
    patched(FSDPModelMerger(config))
    assert calls == [("upload", [])]  # uploaded once, after the commit verified clean
    config = ModelMergerConfig(
        operation="test",
        backend="fsdp",
        local_dir=str(ckpt),
        test_hf_dir=str(target),
        hf_model_config_path=str(ckpt / "huggingface"),
    )
    patched(FSDPModelMerger(config))
    assert calls[-1] == ("original", "test")


def test_redirect_goes_distributed_only_when_asked(ckpt, tmp_path, monkeypatch):
    """verl's merger command in a shell with WORLD_SIZE/RANK (any torchrun, SLURM or PyTorchJob shell)
    merged distributed and init_process_group waited up to 4 hours for ranks that never came:
    the ranks share the merge only with SLIMCKPT_MERGE_DISTRIBUTED=1."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    from slimckpt.merge import verl_merger
    from slimckpt.merge.plan import MergeResult

    seen = []
    monkeypatch.setattr(
        verl_merger, "merge", lambda opts, verl_fallback: seen.append(opts) or MergeResult(opts.target_dir)
    )
    patched = verl_merger.wrap_merge_and_save(lambda self: None)
    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(ckpt),
        target_dir=str(tmp_path / "o"),
        hf_model_config_path=str(ckpt / "huggingface"),
    )
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(verl_merger.DISTRIBUTED_ENV, raising=False)
    patched(FSDPModelMerger(config))
    monkeypatch.setenv(verl_merger.DISTRIBUTED_ENV, "1")
    patched(FSDPModelMerger(config))
    assert [o.distributed for o in seen] == [False, True]
    assert seen[1].distributed_hint == "SLIMCKPT_MERGE_DISTRIBUTED=1"
