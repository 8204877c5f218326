"""Measuring: anonymous RSS sampling, commands measured from outside, disk speed, the `ckpt/*`
metrics callback and reading wandb history. Observes; changes nothing verl decides."""
