"""verl 0.9.1's real trainer (`python -m verl.trainer.main_ppo` through scripts/train_small.sh, CPU, GRPO,
2 ranks) saving to object storage with one argument: `+recipe=incremental trainer.default_local_dir=s3://...`
against the session's SeaweedFS. Every step is committed on the bucket; the run is SIGKILLed (driver, Ray and
ranks) once step 3 is committed; `resume_mode=auto` on the same URL goes on from the newest committed step
there and logs what the run that never stopped (`incremental`, local disk) logged; retention
(max_actor_ckpt_to_keep=1) deleted step 1 from the bucket. Nothing is written under `<cwd>/s3:`.

Both runs are tests/helpers/verl_runs.py's (`s3_killed`, `s3_resumed`), started in the background when the
session starts; `incremental` is shared with tests/e2e/test_incremental_e2e.py.
"""

from __future__ import annotations

import math
import re

import pytest

from slimckpt.layout.resume_manifest import MANIFEST_NAME, TRACKER_NAME

from ..helpers.verl_runs import step_metrics
from .test_incremental_e2e import AFTER_UPDATE

pytestmark = [pytest.mark.slow, pytest.mark.trainer]


def _keys(server, url: str) -> set[str]:
    bucket, prefix = url[len("s3://") :].split("/", 1)
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return {obj["Key"][len(prefix) + 1 :] for page in pages for obj in page.get("Contents", [])}


def test_a_run_on_s3_is_killed_and_resumes_exactly(s3_runs, incremental_run):
    killed, resumed, url = s3_runs.killed, s3_runs.resumed, s3_runs.url
    # one argument was enough: the recipe's export and optimizer drop are switched off, each in one line
    assert f"slimckpt merge --local_dir {url}/global_step_N/actor" in killed
    assert f"actor_rollout_ref.actor.checkpoint.keep_optimizer_last=null on {url}" in killed
    for step in (1, 2, 3):
        assert f"committed step {step} at {url}/global_step_{step}/actor" in killed, step
    assert f"retention deleted {url}/global_step_1/actor" in killed  # max_actor_ckpt_to_keep=1, on the bucket

    loaded = re.search(rf"loaded step (\d+) from {re.escape(url)}/global_step_(\d+)/actor", resumed)
    assert loaded and loaded.group(1) == loaded.group(2), resumed[-3000:]
    start = int(loaded.group(1))
    assert start in (2, 3)  # the newest committed step at the kill: 3, or 2 when data.pt of 3 was not yet put
    assert f"committed step 4 at {url}/global_step_4/actor" in resumed

    keys = _keys(s3_runs.server, url)
    step = 4  # the newest (older ones are retention's: max_actor_ckpt_to_keep=1, the tracker's step spared)
    assert {f"global_step_{step}/actor/{MANIFEST_NAME}", f"global_step_{step}/data.pt"} <= keys
    assert f"global_step_{step}/actor/dcp/.metadata" in keys and f"global_step_{step}/actor/fsdp_config.json" in keys
    assert f"global_step_{step}/actor/huggingface/config.json" in keys  # verl's side files, put from scratch
    assert not any(k.startswith("global_step_1/actor/") for k in keys)
    assert TRACKER_NAME in keys
    assert not (s3_runs.cwd / "s3:").exists()  # verl's driver and ranks wrote nothing under <cwd>/s3:/...

    # losses equal to the run that never stopped: before the kill, and after the resume (which restores
    # the AdamW moments, the lr scheduler, the RNG and the dataloader's position)
    reference, before, after = (step_metrics(t) for t in (incremental_run.text, killed, resumed))
    assert sorted(after) == list(range(start + 1, 5)), sorted(after)
    for got in (before, after):
        for step, metrics in got.items():
            for key in AFTER_UPDATE:
                assert math.isclose(float(metrics[key]), float(reference[step][key]), rel_tol=1e-5), (
                    step,
                    key,
                    metrics[key],
                    reference[step][key],
                )


def test_no_secret_in_the_runs_output(s3_runs):
    """The runs print verl's config and Ray's arguments: the AWS_* variables reach the workers without the secret."""
    secret = s3_runs.server.secret
    assert secret not in s3_runs.killed and secret not in s3_runs.resumed
    assert "AWS_ENDPOINT_URL" in s3_runs.killed  # forwarded to every Ray worker
