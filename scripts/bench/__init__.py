"""`make bench` and `make bench-scale`: merge, save, training-loop and scale benchmarks vs verl 0.9.1, written to
BENCHMARKS.md (`python -m scripts.bench.merge --help`, `.save`, `.loop`, `.scale`, `.plan_check`, `.pickle_check`)."""
