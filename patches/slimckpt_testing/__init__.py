"""Builders of real verl checkpoints for tests and benchmarks (no pytest dependency)."""
