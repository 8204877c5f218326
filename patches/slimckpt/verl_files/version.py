"""Which verl is installed, and whether slimckpt was checked against it: the one version guard.

Read from the installed package's metadata, never by importing verl (the plugin runs while `import verl`
is under way, and the offline tools run where importing verl costs seconds). Every patch and every
file of verl read by path goes through `check_verl_version`; an untested verl fails in one line.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, distribution, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from slimckpt import SUPPORTED_VERL, SlimckptError, __version__, env_vars
from slimckpt.log import get_logger

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


def build_note(installed: str | None = None, direct_url: str | None = None) -> str:
    """One line when the installed verl is not the release from the package index that slimckpt was
    tested on: a local build (a `+label`, an editable or VCS or directory install) passes the version
    guard as the release it says it is, so a change of its checkpoint classes shows only here. ""
    for a release."""
    installed = installed or installed_verl_version()
    if direct_url is None:
        try:
            direct_url = distribution("verl").read_text("direct_url.json")
        except Exception:  # noqa: BLE001 - no metadata to read: treated as a release
            direct_url = None
    where = ""
    if direct_url:
        try:
            info = json.loads(direct_url)
        except ValueError:
            info = {}
        if (info.get("dir_info") or {}).get("editable"):
            where = f"an editable install of {info.get('url', '?')}"
        elif "vcs_info" in info:
            where = f"a build of {info.get('url', '?')} at {(info['vcs_info'] or {}).get('commit_id', '?')[:12]}"
        elif info.get("url", "").startswith("file:"):
            where = f"a local build from {info['url']}"
    local = Version(installed).local
    if not where and not local:
        return ""
    what = where or f"a local build (+{local})"
    return (
        f"slimckpt: verl {installed} is {what}, not the verl{SUPPORTED_VERL} release slimckpt {__version__} was "
        f"tested on: its patches apply as to that release; if its checkpoint code differs, run "
        f"`slimckpt dryrun <your args>` and SLIMCKPT_DISABLE=1 to compare (docs/configuration.md)"
    )


__all__ = ["ALLOW_ENV", "UnsupportedVerlVersion", "build_note", "check_verl_version", "installed_verl_version"]
