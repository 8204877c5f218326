"""slimckpt logs as a library: a user's logging config sees its lines; its own format only in its commands."""

from __future__ import annotations

import logging
import textwrap

from ..conftest import run_python


def test_a_users_logging_config_receives_slimckpt_lines():
    res = run_python(
        textwrap.dedent("""
        import logging, sys
        logging.basicConfig(stream=sys.stdout, format="USER %(name)s %(levelname)s %(message)s", level=logging.INFO)
        from slimckpt.log import get_logger
        get_logger("slimckpt.merge").info("hello")
        get_logger("slimckpt.merge").debug("hidden")
    """),
        env={"SLIMCKPT_LOG_LEVEL": ""},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["USER slimckpt.merge INFO hello"]
    assert "hello" not in res.stderr  # no handler of our own besides the user's


def test_info_lines_still_show_under_verls_warning_root():
    """`import verl` sets the root logger to WARNING; an applied patch must still say so."""
    res = run_python(
        textwrap.dedent("""
        import verl, logging
        assert logging.getLogger().level == logging.WARNING
        from slimckpt.log import get_logger
        get_logger("slimckpt.registry").info("patched something")
    """),
        env={"SLIMCKPT_LOG_LEVEL": ""},
    )
    assert res.returncode == 0, res.stderr
    assert "patched something" in res.stderr
    assert res.stderr.count("patched something") == 1


def test_library_setup_and_cli_format(capsys):
    from slimckpt.log import cli_logging, get_logger

    root = get_logger()
    assert root.propagate
    assert any(isinstance(h, logging.NullHandler) for h in root.handlers)
    before = list(root.handlers)
    with cli_logging():
        assert not root.propagate
        get_logger("slimckpt.cli").warning("in the command")
    assert root.propagate and root.handlers == before
    assert "[slimckpt] WARNING in the command" in capsys.readouterr().err
