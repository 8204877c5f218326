"""The in-training tiers around verl's FSDPCheckpointManager: the save hook, the incremental tier's
reshardable resume state (DCP) and its async staging, the gather-free and the streaming HF exports,
retention, the async tracker watcher, and what a failed save does."""
