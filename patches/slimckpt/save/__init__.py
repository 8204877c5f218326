"""The save pipeline of the in-training tiers, over a `SaveTarget` (what verl's manager hands in).

1. `target` (the SaveTarget), `options` resolved per save, `host_budget` / `device_budget` (what a save
   may take of host and GPU memory).
2. Plan and stage: `step_save` plans the incremental step and asks its async mode (`modes/`: sync,
   pool, stream) to stage what the write will read; `state_dicts`, `optim_capture`, `extra_state`,
   `resume_state` say what a step holds.
3. Write: `step_write` (DCP shards, then the gather-free HF export in `export/`), in the foreground or on
   the mode's writer thread (`modes/writer`).
4. Commit: `step_commit` (every rank at once, or none), then `retention/` prunes old steps and old
   optimizer states; `driver/` keeps verl's tracker naming committed steps only.
5. Failure: `errors` and `os_fixes` (a save that fails stops training in one line, no half step left).
"""
