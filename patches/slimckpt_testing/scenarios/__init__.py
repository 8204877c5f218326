"""Scenarios that run on N ranks under torchrun, one module each, every one started by slimckpt_testing.launch
(`python -m torch.distributed.run ... -m slimckpt_testing.launch slimckpt_testing.scenarios.NAME ...`): the tests,
`make faults` and the probes read the JSON they write on rank 0. `resume` is the tiny model, optimizer and verl
manager the others build on; `batch` runs several in one torchrun. They live in the package, not in tests/,
because scripts run them too and scripts never import tests/."""
