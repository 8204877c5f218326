"""The repository's benchmark, fault-campaign and training-comparison tools (`make bench`, `make faults`,
`make compare`, `make quickstart`), run from the repository root as modules: `python -m scripts.bench.merge`.

Not part of the installed package: they import `slimckpt` and each other, never `tests/`. verl 0.9.1 installs
a top-level `scripts` package of its own; `python -m` from the repository root puts this one first.
"""
