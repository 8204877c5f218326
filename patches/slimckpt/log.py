"""The `slimckpt` logger: its own stderr handler, because verl sets the root logger to WARNING
and a patch that was applied must always say so."""

from __future__ import annotations

import logging
import os
import sys

_LOGGER_NAME = "slimckpt"


def get_logger(name: str = _LOGGER_NAME) -> logging.Logger:
    root = logging.getLogger(_LOGGER_NAME)
    if not getattr(root, "_slimckpt_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        rank = os.environ.get("RANK")
        where = f" rank {rank}" if rank is not None else ""
        handler.setFormatter(logging.Formatter(f"[slimckpt{where}] %(levelname)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("SLIMCKPT_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        root._slimckpt_configured = True  # type: ignore[attr-defined]
    return logging.getLogger(name)
