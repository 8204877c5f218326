"""What each rank of an S3 fault trial runs: a small model trained a step at a time, saved through the engine to
the bucket (sync incremental, 5 MiB parts), with the trial's fault installed in the rank (a SIGKILL at a chosen part
or at the manifest PUT, a wait for the campaign to stop or revoke the server), then a resume that loads the newest
committed step straight from the bucket and compares its state. scripts/faults/s3.py forks the ranks and judges."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

# lazy imports: torch and slimckpt's engine load in the ranks, after s3.py's arguments are read

WORLD = 2
WIDTH = 768
LAYERS = 4
GROUP_TIMEOUT_S = 20.0
SEND_FRAMES = ("chunk_readable", "send")  # urllib3 2's body reader, http.client's send: the body going out


def step_url(root: str, step: int) -> str:
    return f"{root}/global_step_{step}/actor"


def build():
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model, optimizer, step: int, rank: int) -> None:
    import torch

    torch.manual_seed(1000 * step + rank)
    model(torch.randn(8, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state_hash(model, optimizer) -> str:
    """SHA-256 of this rank's parameter shards and optimizer state, in a fixed order."""
    import torch

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.to_local().detach().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    for i, state in enumerate(optimizer.state.values()):
        for key in sorted(state):
            value = state[key]
            local = value.to_local() if hasattr(value, "to_local") else value
            h.update(f"{i}/{key}".encode())
            h.update(local.detach().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def make_target(model, optimizer, state, rank: int):
    import torch

    from slimckpt.options.checkpoint_options import CheckpointOptions
    from slimckpt.save.target import SaveTarget, fsdp_version_of

    options = CheckpointOptions(
        recipe="incremental", incremental_save=True, async_save="off", measure=False, export_hf=False
    )
    return SaveTarget(
        model=model,
        optimizer=optimizer,
        options=options,
        state=state,
        rank=rank,
        world_size=WORLD,
        save_contents=["model", "optimizer", "extra"],
        fsdp_version=fsdp_version_of(model),
        get_rng_state=torch.get_rng_state,
        load_rng_state=torch.set_rng_state,
    )


def kill_group() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)


def wait_for(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def install_fault(fault: dict, rank: int, trial_dir: str) -> None:
    """The trial's moment, as a hook on this rank's S3 writes (installed before the faulted save)."""
    from slimckpt.layout.resume_manifest import MANIFEST_NAME
    from slimckpt.storage import s3, s3_upload

    kind, k = fault["kind"], fault.get("part", 1)
    if kind == "kill-manifest" and rank == 0:
        put = s3.S3Storage.put_if_absent

        def at_manifest(self, path, data, **kw):
            if not path.endswith(MANIFEST_NAME):
                return put(self, path, data, **kw)
            if fault["variant"] == "before":
                kill_group()
            out = put(self, path, data, **kw)
            kill_group()
            return out

        s3.S3Storage.put_if_absent = at_manifest
        return
    if fault.get("rank") != rank:
        return
    if kind == "kill-mid-part":
        made = s3_upload.PartBody.__init__
        read = s3_upload.PartBody.read
        count = [0]

        def numbered(self, buf, n):
            made(self, buf, n)
            count[0] += 1
            self.number = count[0]

        def reading(self, size=-1):
            out = read(self, size)
            # the k-th part's body half sent: a read by the HTTP layer's send (the client reads the body
            # first for its checksums, then seeks back and sends it), past the middle
            sender = sys._getframe(1).f_code.co_name in SEND_FRAMES
            if getattr(self, "number", 0) == k and sender and self.pos >= self.length // 2:
                kill_group()
            return out

        s3_upload.PartBody.__init__, s3_upload.PartBody.read = numbered, reading
        return
    sent = s3_upload.Upload.put_part
    count = [0]

    def after_part(self, number, buf, n):
        out = sent(self, number, buf, n)
        count[0] += 1
        if count[0] != k:
            return out
        if kind == "kill-between":
            kill_group()
        elif kind == "kill-rank":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind in ("restart", "revoke"):
            open(os.path.join(trial_dir, kind), "w").close()  # the campaign stops (or revokes) the server
            wait_for(os.path.join(trial_dir, kind + ".done"))
        return out

    s3_upload.Upload.put_part = after_part


def rank_body(spec: dict, rank: int) -> None:
    """One rank of a group: (load a committed step,) train and save steps, record hashes and errors."""
    import torch.distributed as dist

    import slimckpt.save.modes.writer as resume_async
    from slimckpt.resume.load import load_resume_state
    from slimckpt.save.errors import guarded_save
    from slimckpt.save.step_save import save_resume_state
    from slimckpt.save.target import TargetState

    result: dict[str, Any] = {"rank": rank, "saved": [], "loaded": None, "equal": {}, "error": None}
    out = os.path.join(spec["dir"], f"{spec['tag']}.rank{rank}.json")
    try:
        store = dist.FileStore(os.path.join(spec["dir"], spec["tag"] + ".store"), WORLD)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=GROUP_TIMEOUT_S)
        )
        model, optimizer = build()
        state = TargetState()
        root = spec["root"]

        def record(step: int) -> None:
            path = os.path.join(spec["dir"], f"expected.{step}.rank{rank}")
            mine = state_hash(model, optimizer)
            if os.path.exists(path):
                result["equal"][f"trained {step}"] = open(path).read() == mine
            else:
                with open(path, "w") as f:
                    f.write(mine)

        def load(step: int, what: str) -> None:
            # straight from the bucket, as a resume does: the ranks check sizes and checksums first
            load_resume_state(make_target(model, optimizer, state, rank), step_url(root, step))
            expected = open(os.path.join(spec["dir"], f"expected.{step}.rank{rank}")).read()
            result["equal"][f"{what} {step}"] = state_hash(model, optimizer) == expected

        start = 1
        if spec.get("load"):
            load(spec["load"], "loaded")
            result["loaded"] = spec["load"]
            start = spec["load"] + 1
        for step in range(start, spec["last"] + 1):
            train(model, optimizer, step, rank)
            record(step)
            if spec.get("fault") and step == spec["last"]:
                install_fault(spec["fault"], rank, spec["dir"])
            target, url = make_target(model, optimizer, state, rank), step_url(root, step)
            guarded_save(target, url, step, lambda: save_resume_state(target, url, step))  # as verl's save patch
            resume_async.writer_for(state).wait()
            result["saved"].append(step)
        if spec.get("load") and result["saved"]:
            load(result["saved"][-1], "reloaded")
    except BaseException as exc:  # noqa: BLE001 - the rank's one line is the record
        result["error"] = str(exc)
        result["error_type"] = type(exc).__name__
        result["trace"] = traceback.format_exc()[-3000:]
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
