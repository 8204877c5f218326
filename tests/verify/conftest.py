"""The verify wing's shared helpers: a bit flipped in place, and a report's bad lines."""

from __future__ import annotations


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 1]))


def lines(report) -> list[str]:
    return [p.message for p in report.bad]
