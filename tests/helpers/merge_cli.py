"""`slimckpt merge` run in-process by the tests of its input, its output and its options: the exit code and
stderr with slimckpt's log lines, the one error line, nothing committed; the tiny Mixtral config they share."""

from __future__ import annotations

import os
import shutil

from slimckpt import cli
from slimckpt.layout.merge_manifest import MANIFEST_NAME

from .merge_helpers import synthetic_checkpoint


def slim_log_buffer():
    """slimckpt's log lines, whichever stderr its handler was bound to when first configured: a test file's
    autouse `slim_log` fixture (below) yields from it, and merge_cli reads the lines back."""
    import io
    import logging

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("slimckpt")
    logger.addHandler(handler)
    yield buf
    logger.removeHandler(handler)


# The bodies of two fixtures the files that run `slimckpt merge` in-process share; each file declares
# them, e.g. `slim_log = pytest.fixture(autouse=True, name="slim_log")(log_lines)`.
def log_lines(capsys):
    """slimckpt's log lines, whichever stderr its handler was bound to when first configured."""
    yield from slim_log_buffer()


def ws2_checkpoint(tmp_path_factory):
    """A 2-rank synthetic checkpoint (declared module-scoped: made once per test module)."""
    return synthetic_checkpoint(tmp_path_factory.mktemp("syn") / "actor", world_size=2)


def merge_cli(capsys, *args: str) -> tuple[int, str]:
    """Exit code and stderr (printed lines plus slimckpt's log lines) of `slimckpt merge ...` in-process."""
    import logging

    rc = cli.main(["merge", "--no_progress", *args])
    err = capsys.readouterr().err
    for h in logging.getLogger("slimckpt").handlers:
        if isinstance(getattr(h, "stream", None), __import__("io").StringIO):
            err += h.stream.getvalue()
    return rc, err


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("slimckpt merge: error:")]
    assert len(lines) == 1, err
    return lines[0]


def assert_nothing_committed(target):
    assert not os.path.exists(str(target) + ".partial"), "partial dir left behind"
    if os.path.exists(target):
        assert not os.path.exists(os.path.join(target, MANIFEST_NAME))
        assert not any(n.endswith(".safetensors") for n in os.listdir(target))


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def tiny_mixtral_config(**overrides):
    from transformers import MixtralConfig

    kw = dict(
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        num_local_experts=3,
        architectures=["MixtralForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    return MixtralConfig(**kw)
