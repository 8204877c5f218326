"""The points where a merge's output could depend on which writer, worker or rank gets there first,
and the test hook that shakes them: with SLIMCKPT_TEST_MERGE_DELAY=S set, each point sleeps a random
0-S seconds, so a stress run (`make stress-merge`) tries many orders of the same merge. Unset, a
point costs one environment lookup.

What orders each point (docs/merge.md, "What orders a distributed merge's bytes"):
  laid_out    rank 0 has created every output file at its final size with its header, and written
              config, tokenizer and index; the others learn the plan only from rank 0's broadcast after it
  write       a writer's pwrite of its own byte range; shares are disjoint (`layout.partition`), so
              no two writers touch one byte, whichever writes first
  close       a writer's fsync and close of its files, before it reports done
  written     a rank's writers have all closed; the outcome collective after it waits for every rank
  read_back   the checksums of files several writers shared, read once every rank has passed that collective
  commit      rank 0 writes the manifest and renames, once every rank's checksums are gathered
"""

from __future__ import annotations

import random
import time

from slimckpt import env_vars

DELAY_ENV = "SLIMCKPT_TEST_MERGE_DELAY"
POINTS = ("laid_out", "write", "close", "written", "read_back", "commit")


def pause(point: str) -> None:
    """Sleep a random part of SLIMCKPT_TEST_MERGE_DELAY at `point` (nothing when it is unset)."""
    if point not in POINTS:
        raise ValueError(f"unknown race point {point!r}: add it to slimckpt.engine.race_points.POINTS")
    limit = env_vars.seconds(DELAY_ENV)
    if limit > 0:
        time.sleep(random.uniform(0.0, limit))
