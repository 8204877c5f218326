"""async_save's modes: how a save of the incremental tier hands its write to the writer.

1. `registry` picks the mode; 2. the mode stages (`base.AsyncMode.stage`); 3. `writer` runs the write
(in the background for pool and stream); 4. the next change to the shards waits until it is safe.

One protocol, `base.AsyncMode`, in three calls that step_save makes in this order, whatever the
mode: `stage` (in the foreground, take what the write will read), `wait_until_safe_to_step` (armed
by the writer as it takes the write: what the next change to the shards waits on until the write
has read them) and `finish` (hand the write to the writer's thread, or run it now). One file per
mode, and `registry.MODES` (name -> class) is the one place a config's `async_save` picks a mode
(`registry.mode_for`):

    sync.py    async_save=false: nothing staged, the shards written now from the live state
    pool.py    async_save=true|pool: a copy in the host staging pool (writer.StagingPool),
               written in the background; over host_memory_budget_gb it saves as sync does
    stream.py  async_save=stream: the live shards, read by the writer through a StreamCapture
               (stream_capture), guarded (stream_guards) until read

To add a mode, write one file, `<name>.py`, with a subclass of `base.AsyncMode` (its `name` is the
config's word for it; `stage` returns a `base.Staged`, `finish` runs or submits the write, and
`wait_until_safe_to_step` arms its guard if the write reads what training may change), and add its
line to `registry.MODES`. The config must spell it too: the name in AsyncSave and its YAML words in
ASYNC_WORDS (options.checkpoint_options), which the registry checks at import, and `slimckpt plan`
its cost (plan.cost.ASYNC_STRATEGY, keyed by the same names; tests/save/test_modes.py holds
the three sets equal).
"""
