"""The `slimckpt` logger, set up as a library's: a NullHandler and propagation to the root logger,
so a user's logging configuration (handlers, format, files) sees slimckpt's lines like any other
library's. Only where slimckpt owns the process (the `slimckpt` command, `python -m slimckpt.*`)
does `cli_logging` add its own `[slimckpt] LEVEL message` handler.

The logger's level is INFO unless SLIMCKPT_LOG_LEVEL says otherwise, and it is set on the
`slimckpt` logger itself: `import verl` sets the root logger to WARNING (with a stderr handler),
and an applied patch must still say so in verl's log. Propagated records reach the root's
handlers whatever the root's own level is.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from slimckpt import env_vars

_LOGGER_NAME = "slimckpt"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_ALIASES = ("WARN", "FATAL", "NOTSET")  # what logging also takes
LEVEL_ENV = "SLIMCKPT_LOG_LEVEL"


def get_logger(name: str = _LOGGER_NAME) -> logging.Logger:
    root = logging.getLogger(_LOGGER_NAME)
    if not getattr(root, "_slimckpt_configured", False):
        root.addHandler(logging.NullHandler())
        root.propagate = True
        # get_logger runs at import, outside the plugin's try, and verl swallows a plugin's
        # exception at debug level: a bad level must not raise, or slimckpt silently switches off
        wanted = env_vars.text(LEVEL_ENV) or "INFO"  # set but empty: the default
        level = wanted.strip().upper()
        known = level in LEVELS or level in _ALIASES
        root.setLevel(level if known else "INFO")
        root._slimckpt_configured = True  # type: ignore[attr-defined]
        if not known:
            root.warning("%s=%r is not a log level; using INFO (valid: %s)", LEVEL_ENV, wanted, ", ".join(LEVELS))
    return logging.getLogger(name)


def cli_format() -> logging.Formatter:
    rank = env_vars.foreign("RANK")
    where = f" rank {rank}" if rank is not None else ""
    return logging.Formatter(f"[slimckpt{where}] %(levelname)s %(message)s")


@contextlib.contextmanager
def cli_logging() -> Iterator[logging.Logger]:
    """slimckpt's own stderr format while one of its commands runs; propagation is off meanwhile so
    that a root handler (verl's, once it is imported) does not print each line twice."""
    root = get_logger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(cli_format())
    root.addHandler(handler)
    root.propagate = False
    try:
        yield root
    finally:
        root.removeHandler(handler)
        root.propagate = True


@contextlib.contextmanager
def quieted(logger: str) -> Iterator[None]:
    """`logger`'s warnings off for a moment (errors still show)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
