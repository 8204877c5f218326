"""The Hydra config groups slimckpt ships (recipe, size, cluster, algo) and their one-line
descriptions, read from the files themselves so that a new YAML shows up without code changes.

A group file looks like:

    # @package _global_
    # quickstart: save the model only ...      <- the description (text after "name:")
    # ... more header comment, with the command that uses it ...

The groups live in recipes/ and overrides/<group>/ and reach Hydra through the symlinks in
slimckpt/conf/ (see hydra_plugins/slimckpt_searchpath).
"""

# lazy imports: OmegaConf and the config class (verl's) only when a recipe is loaded (listing them reads file names)
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimckpt.options.checkpoint_options import ROLE_KEYS

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("recipe", "size", "cluster", "algo")
HELP = "list slimckpt's Hydra config groups (recipes and overrides) with their descriptions"
PACKAGE_LINE = "# @package _global_"


@dataclass(frozen=True)
class GroupOption:
    group: str
    name: str
    path: Path
    description: str

    @property
    def override(self) -> str:
        return f"+{self.group}={self.name}"


def header_comment(path: Path) -> list[str]:
    """The comment lines after the `# @package` line, up to the first non-comment line,
    without their leading '#'."""
    lines = path.read_text().splitlines()
    header: list[str] = []
    for line in lines[1:]:
        if not line.startswith("#"):
            break
        header.append(line[1:].strip())
    return header


def describe(path: Path) -> str:
    """First header line, with a leading '<name>:' dropped."""
    header = [line for line in header_comment(path) if line]
    if not header:
        return ""
    first = header[0]
    prefix = f"{path.stem}:"
    return first[len(prefix) :].strip() if first.startswith(prefix) else first


def list_group(group: str) -> list[GroupOption]:
    """Every option of one group, sorted by name; empty if the group folder is missing."""
    if group not in GROUPS:
        raise ValueError(f"unknown slimckpt config group {group!r}; groups are {', '.join(GROUPS)}")
    folder = CONF_DIR / group
    if not folder.is_dir():
        return []
    return [
        GroupOption(group=group, name=p.stem, path=p, description=describe(p)) for p in sorted(folder.glob("*.yaml"))
    ]


def list_recipes() -> list[GroupOption]:
    return list_group("recipe")


def recipe_checkpoint_block(name: str, role: str = "actor", recipes_dir: str | Path | None = None) -> dict[str, Any]:
    """The `checkpoint:` block recipe `name` sets for `role` (actor or critic), `_target_`
    included, read from the file as shipped (`recipes_dir`: another tree's recipes/)."""
    from omegaconf import OmegaConf

    folder = Path(recipes_dir) if recipes_dir is not None else CONF_DIR / "recipe"
    block = OmegaConf.select(OmegaConf.load(folder / f"{name}.yaml"), ROLE_KEYS[role])
    if block is None:
        raise ValueError(f"slimckpt: {folder / f'{name}.yaml'} sets no {ROLE_KEYS[role]}")
    return OmegaConf.to_container(block, resolve=True)


def recipe_checkpoint_config(
    name: str, role: str = "actor", recipes_dir: str | Path | None = None, **overrides: Any
) -> Any:
    """The SlimCheckpointConfig a run with `+recipe=<name>` gets for `role`, plus `overrides`."""
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    block = recipe_checkpoint_block(name, role, recipes_dir)
    return SlimCheckpointConfig(**{k: v for k, v in {**block, **overrides}.items() if k != "_target_"})


def format_options(group: str) -> str:
    """A few indented lines naming every option of `group` with its description."""
    options = list_group(group)
    if not options:
        return f"  (no {group} files in {CONF_DIR / group})"
    width = max(len(o.override) for o in options)
    return "\n".join(f"  {o.override:<{width}}  {o.description}" for o in options)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`slimckpt recipes [GROUP]`."""
    p.add_argument("group", nargs="?", choices=GROUPS, help="list only this group (default: all)")


def run(args: argparse.Namespace) -> int:
    for group in [args.group] if args.group else GROUPS:
        print(f"{group}:")
        print(format_options(group))
    return 0
