"""Deprecated path: installs made before the package was split into stages name `slimckpt.plugin` in
their `verl.plugins` entry point until slimckpt is reinstalled (`make install` or `pip install -e .`);
importing it runs the plugin at its current place, `slimckpt.verl.plugin`."""

from .verl import plugin  # noqa: F401  (importing it applies what the environment asks for)
