"""The `slimckpt` logger: its own stderr handler, because verl sets the root logger to WARNING
and a patch that was applied must always say so."""

from __future__ import annotations

import logging
import os
import sys

_LOGGER_NAME = "slimckpt"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_ALIASES = ("WARN", "FATAL", "NOTSET")  # what logging also takes


def get_logger(name: str = _LOGGER_NAME) -> logging.Logger:
    root = logging.getLogger(_LOGGER_NAME)
    if not getattr(root, "_slimckpt_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        rank = os.environ.get("RANK")
        where = f" rank {rank}" if rank is not None else ""
        handler.setFormatter(logging.Formatter(f"[slimckpt{where}] %(levelname)s %(message)s"))
        root.addHandler(handler)
        # get_logger runs at import, outside the plugin's try, and verl swallows a plugin's
        # exception at debug level: a bad level must not raise, or slimckpt silently switches off
        wanted = os.environ.get("SLIMCKPT_LOG_LEVEL") or "INFO"  # set but empty: the default
        level = wanted.strip().upper()
        known = level in LEVELS or level in _ALIASES
        root.setLevel(level if known else "INFO")
        root.propagate = False
        root._slimckpt_configured = True  # type: ignore[attr-defined]
        if not known:
            root.warning("SLIMCKPT_LOG_LEVEL=%r is not a log level; using INFO (valid: %s)", wanted, ", ".join(LEVELS))
    return logging.getLogger(name)
