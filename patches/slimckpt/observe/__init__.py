"""Measuring, never deciding.

1. `memory`: anonymous RSS (RssAnon), sampled; `measure`: a command run and measured from outside.
2. `diskspeed`: a filesystem's sequential bandwidth, measured the way checkpoints use it (`diskspeed_cli`:
   `slimckpt diskspeed`'s arguments).
3. `save_measure` / `save_reports`: a save of verl's manager, measured per rank without changing it.
4. `wandb_history`: logged runs read back for the plots and comparisons.
"""
