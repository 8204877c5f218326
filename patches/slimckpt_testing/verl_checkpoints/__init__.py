"""Checkpoints and saves made by verl's own code, for tests, benchmarks and fault campaigns: verl's
FSDPCheckpointManager on real FSDP1/FSDP2 ranks (`fsdp_checkpoint`), rank by rank over torch's fake
process group at any world size (`fake_pg_checkpoint`), and the tiny model, optimizer and verl manager
the multi-rank scenarios build on (`resume_scenarios`). The only testing modules that import verl."""
