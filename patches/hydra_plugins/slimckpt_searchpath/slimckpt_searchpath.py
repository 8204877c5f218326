"""Hydra discovers this module in the `hydra_plugins` namespace package; it puts slimckpt's
config groups (recipe, size, cluster, algo) on the search path of every Hydra app, so that
verl's own `python -m verl.trainer.main_ppo ... +recipe=quickstart` finds them from any directory."""

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

# Resolved without importing slimckpt (which would import verl into every Hydra app).
CONF_DIR = (Path(__file__).resolve().parent.parent.parent / "slimckpt" / "conf").resolve()


class SlimckptSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="slimckpt", path=f"file://{CONF_DIR}")
