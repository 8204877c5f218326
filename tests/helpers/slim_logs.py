"""slimckpt's log lines in a test, read from the logger objects that emit them.

pytest's `caplog` reaches the non-propagating `slimckpt` logger only when it finds that logger in
`logging`'s registry at the start of each test phase; in one CI run out of several it did not (the
lines were on stderr, `caplog.text` was empty), so tests that check a log line attach their own
handler to the module's logger instead.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def lines_of(logger: logging.Logger, level: int | str = logging.INFO) -> Iterator[io.StringIO]:
    """What `logger` (a slimckpt module's `log`) logs at `level` or above inside the block."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setLevel(level)
    old = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield buf
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
