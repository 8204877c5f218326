"""merge/verl_fallback: a checkpoint the streaming merge cannot reproduce goes to verl's own merger, its
host memory said in the log line, or is refused in one line (--no_verl_fallback,
SLIMCKPT_MERGE_NO_VERL_FALLBACK=1); verl's merger failing is one line too."""

from __future__ import annotations

import os

import pytest
import torch

from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_tokenizer

from ..helpers.merge_cli import (
    error_line,
    log_lines,
    merge_cli,
)
from ..helpers.merge_helpers import (
    synthetic_checkpoint,
)

slim_log = pytest.fixture(autouse=True, name="slim_log")(log_lines)


def force_verl_fallback(monkeypatch) -> None:
    """The streaming merge's planner says this model needs verl's merger (as for a save-time
    conversion that is not a slice of one tensor)."""
    import slimckpt.hf.naming as hf_side

    def needs_verl(self, names, shapes):
        raise hf_side.NeedsVerlMerger(
            "transformers converts tensors of X on save (e.g. 'c' is not a part of one checkpoint tensor)"
        )

    monkeypatch.setattr(hf_side.HfSide, "output_sources", needs_verl)


def test_verl_fallback_failure_is_one_line(tmp_path, capsys, monkeypatch):
    """verl's own merger failing inside the fallback (here: no tokenizer) is one line, exit 1."""
    root = synthetic_checkpoint(tmp_path / "actor")
    force_verl_fallback(monkeypatch)
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 1 and "verl's FSDPModelMerger (which this checkpoint needs) failed" in error_line(err)


def test_verl_fallback_says_its_memory_or_is_refused(tmp_path, capsys, monkeypatch):
    """The fallback line gives verl's merger's host memory: the rank model files it reads whole plus
    the model in bf16; --no_verl_fallback (and SLIMCKPT_MERGE_NO_VERL_FALLBACK=1 through verl's own
    command) refuses in one line, with nothing written."""
    root = synthetic_checkpoint(tmp_path / "actor")
    build_tokenizer(96).save_pretrained(root / "huggingface")
    sd = torch.load(root / "model_world_size_1_rank_0.pt")
    force_verl_fallback(monkeypatch)
    shards = os.path.getsize(root / "model_world_size_1_rank_0.pt")
    params = sum(t.numel() for t in sd.values())
    from slimckpt.merge.verl_fallback import human_bytes

    want = (
        f"about {human_bytes(shards + 2 * params)} of host memory (the {human_bytes(shards)} of rank model "
        f"files, read whole, + {params:,} parameters x 2 bytes in bf16)"
    )
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"), "--no_verl_fallback")
    assert rc == 1, err
    line = error_line(err)
    assert "'c' is not a part" in line and want in line and "not run, as --no_verl_fallback asks" in line, line
    assert "running verl's own" not in err and not (tmp_path / "o").exists()
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 0 and want in err and "--no_verl_fallback refuses instead" in err, err
    # verl's own command, redirected: the env var stands in for the flag
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    from slimckpt.merge import verl_merger

    ran = []
    patched = verl_merger.wrap_merge_and_save(lambda self: ran.append(self))
    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(root),
        target_dir=str(tmp_path / "v"),
        hf_model_config_path=str(root / "huggingface"),
    )
    monkeypatch.setenv(verl_merger.NO_FALLBACK_ENV, "1")
    with pytest.raises(SystemExit) as exc:
        patched(FSDPModelMerger(config))
    assert "not run, as SLIMCKPT_MERGE_NO_VERL_FALLBACK=1 asks" in str(exc.value) and not ran
    monkeypatch.delenv(verl_merger.NO_FALLBACK_ENV)
    patched(FSDPModelMerger(config))
    assert len(ran) == 1  # verl's original merge_and_save
