"""Tests whose ranks are processes: torchrun, mp.spawn or forked ranks over gloo on the CPU."""
