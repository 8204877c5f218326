"""Several torchrun scenarios of the incremental tier in ONE torchrun (gloo, CPU, 2 ranks), for
tests/conftest.py's `ws2_scenarios`: each torchrun pays ~10 s of start-up (torch, transformers and
verl imported on every rank) before seconds of work, so the tests share one.

    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.batch --dir D [NAME ...]

NAME (default all of SCENARIOS) runs in its own directory D/NAME with the settings its test had
as a torchrun of its own (slimckpt_testing.scenarios.resume and .driver, slimckpt_testing/scenarios/hf_direct_export.py,
slimckpt_testing/scenarios/critic_save.py, presave.py, stream.py); every
module-level switch a scenario sets or patches is put back before the next one starts. A scenario
that raises on every rank leaves D/NAME/error.txt (rank 0's traceback) and the next one runs;
one that hangs a collective ends the batch at the process group's timeout.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import traceback
from types import SimpleNamespace

import torch.distributed as dist

from slimckpt_testing.scenarios import driver as driver_scenarios
from slimckpt_testing.scenarios import resume as resume_scenarios
from slimckpt_testing.scenarios import tiny_run

from . import critic_save as critic_save_scenario
from . import hf_direct_export as hf_direct_export_scenario
from . import presave as presave_scenario
from . import stream as stream_scenario

# lazy imports: verl and slimckpt's save path load once the scenarios' module settings are in place
# far above any healthy wait (a rank failing alone ends in < 30 s); under the batch's 540 s
COLLECTIVE_TIMEOUT_S = 240

# name -> (function, its args besides dir, tiny_run.MODEL, tiny_run.FSDP_VERSION)
SCENARIOS = {
    "resume": (resume_scenarios.scenario_resume, {"async_save": False}, "llama", 2),
    "resume_fsdp1": (resume_scenarios.scenario_resume, {"async_save": False}, "llama", 1),
    "resume_async": (resume_scenarios.scenario_resume, {"async_save": True}, "qwen2-tied", 2),
    "stream": (stream_scenario.scenario, {}, "qwen2-tied", 2),
    "stream_raced": (stream_scenario.scenario_raced, {}, "llama", 2),
    "stream_raced_fsdp1": (stream_scenario.scenario_raced, {}, "llama", 1),
    "tracker": (driver_scenarios.scenario_tracker, {}, "llama", 2),
    "refuse": (resume_scenarios.scenario_refuse, {}, "llama", 2),
    "damaged_newest": (driver_scenarios.scenario_damaged_newest, {}, "llama", 2),
    "hf_export": (hf_direct_export_scenario.scenario, {"models": "llama,qwen2-tied"}, "llama", 2),
    "moe_export": (
        hf_direct_export_scenario.scenario_moe,
        {"models": "qwen3-moe,deepseek-v3,qwen3-moe:divisible"},
        "qwen3-moe",
        2,
    ),
    "lora_export": (hf_direct_export_scenario.scenario_lora, {}, "llama", 2),
    "lora_only": (resume_scenarios.scenario_lora_only, {}, "llama", 2),
    "critic_save": (critic_save_scenario.scenario, {}, "llama", 2),
    "presave": (presave_scenario.scenario, {}, "llama", 2),
    "presave_fsdp1": (presave_scenario.scenario, {}, "llama", 1),
}


def _module_state() -> dict:
    """Every module attribute a scenario sets or monkeypatches, to put back after it."""
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    import slimckpt.save.export.direct_write as hf_direct_write
    from slimckpt.hf.naming import HfSide
    from slimckpt.save import step_commit, step_write
    from slimckpt.save.modes import stream_capture

    return {
        (tiny_run, "MODEL"): tiny_run.MODEL,
        (tiny_run, "FSDP_VERSION"): tiny_run.FSDP_VERSION,
        (tiny_run, "PLACEMENT"): tiny_run.PLACEMENT,
        (tiny_run, "LORA_RANK"): tiny_run.LORA_RANK,
        (step_write, "storage_writer"): step_write.storage_writer,
        (stream_capture, "READ_HOOK"): stream_capture.READ_HOOK,
        (step_write, "_after_shards"): step_write._after_shards,
        (step_commit, "commit"): step_commit.commit,
        (hf_direct_write, "write_export"): hf_direct_write.write_export,
        (hf_direct_write._BoxWriter, "write_box"): hf_direct_write._BoxWriter.write_box,
        (HfSide, "output_sources"): HfSide.output_sources,
        (FSDPModelMerger, "_load_and_merge_state_dicts"): FSDPModelMerger._load_and_merge_state_dicts,
    }


def run_one(name: str, root: str) -> None:
    from slimckpt.save.resume_state import finish_pending

    fn, extra, model, fsdp = SCENARIOS[name]
    out = os.path.join(root, name)
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
    dist.barrier()
    saved = _module_state()
    tiny_run.MODEL, tiny_run.FSDP_VERSION = model, fsdp
    try:
        fn(SimpleNamespace(dir=out, **extra))
        finish_pending()
    except Exception:  # noqa: BLE001 - the test names the scenario and shows this
        if dist.get_rank() == 0:
            with open(os.path.join(out, "error.txt"), "w") as f:
                f.write(traceback.format_exc())
        traceback.print_exc()
    finally:
        for (owner, attr), value in saved.items():
            setattr(owner, attr, value)
    dist.barrier()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("names", nargs="*", help=f"scenarios to run (default all: {' '.join(SCENARIOS)})")
    # under conftest's 600 s for the torchrun: the stacks are dumped before the test kills the tree
    p.add_argument("--timeout", type=int, default=540, help="seconds the batch may run before it dumps its stacks")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    return args


# a collective that one rank never joins fails after this instead of gloo's 30 minutes
PG_TIMEOUT_S = COLLECTIVE_TIMEOUT_S
BARRIER_AT_EXIT = False  # run_one ends each scenario with a barrier


def run(args: argparse.Namespace) -> None:
    faulthandler.dump_traceback_later(args.timeout, exit=True)  # a hang shows its stacks before the test times out
    for name in args.names or SCENARIOS:
        run_one(name, args.dir)
