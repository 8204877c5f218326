"""The one wing that imports verl: where slimckpt meets verl 0.9.1.

1. `plugin`: verl's `verl.plugins` entry point; `import_hooks` runs the switch-on when verl loads.
2. `registry` and `patch_list`: every change slimckpt makes to verl, with its version guard; `features`
   switches a feature on; `checkpoint_patches` holds the checkpoint patches' bodies.
3. The typed config: `checkpoint_config` (SlimCheckpointConfig), `config_keys`, `recipes` (the Hydra
   groups), `manager_state` and `save_target` (verl's manager as the engine's SaveTarget).
4. At start-up in the driver: `adopt_startup`, `storage_startup`, `fsdp1_note`; `dryrun` composes a
   config without starting a run; `ckpt_metrics` logs `ckpt/*` to verl's tracker.
Nothing here imports the patch implementations of the packages outside the stack (slimckpt_cpu,
slimckpt_flowrl): the patch list names them by module path and the registry imports them on apply.
"""
