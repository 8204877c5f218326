"""Which verl is installed, and whether slimckpt was checked against it: the one version guard.

Read from the installed package's metadata, never by importing verl (the plugin runs while `import verl`
is under way, and the offline tools run where importing verl costs seconds). Every patch and every
file of verl read by path goes through `check_verl_version`; an untested verl fails in one line.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .. import SUPPORTED_VERL, SlimckptError, __version__, env_vars
from ..log import get_logger

log = get_logger("slimckpt.registry")

ALLOW_ENV = "SLIMCKPT_ALLOW_UNTESTED_VERL"


class UnsupportedVerlVersion(SlimckptError, RuntimeError):
    pass


def installed_verl_version() -> str:
    """verl's version without importing verl (the plugin runs while `import verl` is under way)."""
    try:
        return version("verl")
    except PackageNotFoundError as exc:  # pragma: no cover - slimckpt depends on verl
        raise UnsupportedVerlVersion("verl is not installed; slimckpt needs verl" + SUPPORTED_VERL) from exc


def check_verl_version(spec: str = SUPPORTED_VERL, installed: str | None = None) -> str:
    installed = installed or installed_verl_version()
    if Version(installed) in SpecifierSet(spec):
        return installed
    if env_vars.text(ALLOW_ENV) == installed:
        log.warning(
            "verl %s is outside slimckpt %s's tested range (verl%s); %s=%s says go ahead",
            installed,
            __version__,
            spec,
            ALLOW_ENV,
            installed,
        )
        return installed
    raise UnsupportedVerlVersion(
        f"slimckpt {__version__} supports verl{spec} but verl {installed} is installed: "
        f"install verl{spec}, or set SLIMCKPT_DISABLE=1 to run plain verl "
        f"(or {ALLOW_ENV}={installed} to try anyway)"
    )


__all__ = ["ALLOW_ENV", "UnsupportedVerlVersion", "check_verl_version", "installed_verl_version"]
