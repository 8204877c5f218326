"""The checkpoint engine's settings, free of verl.

1. `checkpoint_options`: CheckpointOptions, each setting typed and documented once; the verl wing builds
   it from SlimCheckpointConfig and every stage reads it from there.
"""
