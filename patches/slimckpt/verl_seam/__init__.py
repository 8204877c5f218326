"""The one seam with verl: the plugin entry point, the patch registry and the list of every patch
(with its verl version guard), verl's helper files loaded by path, SlimCheckpointConfig and the config
keys verl knows, the Hydra config groups and the dry run. Nothing here imports the stages above: the
patch list names its implementations by module path, and the registry imports them when it applies a
patch."""
