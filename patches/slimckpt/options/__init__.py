"""The checkpoint engine's settings, free of verl: CheckpointOptions."""
