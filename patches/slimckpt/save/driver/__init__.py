"""The driver's side of a save (verl's trainer process, not the ranks).

1. `driver_state`: what slimckpt keeps on verl's driver-side objects.
2. `tracker` / `tracker_write`: verl's tracker file only ever names a committed step, written atomically.
3. `trainer_storage`: a trainer whose default_local_dir is on object storage.
"""
