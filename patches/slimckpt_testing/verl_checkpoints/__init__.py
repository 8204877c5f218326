"""Checkpoints and saves made by verl's own code, for tests, benchmarks and fault campaigns: verl's
FSDPCheckpointManager on real FSDP1/FSDP2 ranks (`fsdp_checkpoint`), rank by rank over torch's fake
process group at any world size (`fake_pg_checkpoint`). With `slimckpt_testing.scenarios`, the only testing
modules that import verl."""
