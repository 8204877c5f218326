"""verl_files/version: the version guard names both versions and takes an explicit override; a local verl build
is named in one line."""

import pytest

from slimckpt import SUPPORTED_VERL
from slimckpt.verl_files.version import UnsupportedVerlVersion, check_verl_version


def test_version_guard_names_both_versions():
    assert check_verl_version(installed="0.9.1") == "0.9.1"
    with pytest.raises(UnsupportedVerlVersion) as info:
        check_verl_version(installed="0.10.0")
    msg = str(info.value)
    assert "0.10.0" in msg and SUPPORTED_VERL in msg and "SLIMCKPT_DISABLE=1" in msg


def test_version_guard_explicit_override(monkeypatch):
    monkeypatch.setenv("SLIMCKPT_ALLOW_UNTESTED_VERL", "0.9.2")
    assert check_verl_version(installed="0.9.2") == "0.9.2"
    with pytest.raises(UnsupportedVerlVersion):
        check_verl_version(installed="0.9.3")


def test_a_local_verl_build_is_named_in_one_line():
    import json

    from slimckpt.verl_files.version import build_note

    assert build_note("0.9.1", "") == ""  # the release from the index
    assert build_note("0.9.1", json.dumps({"url": "https://files.pythonhosted.org/x.whl", "archive_info": {}})) == ""
    local = build_note("0.9.1+corp.3", "")
    assert local.count("\n") == 0 and "a local build (+corp.3)" in local and "verl==0.9.1" in local
    editable = build_note("0.9.1", json.dumps({"url": "file:///src/verl", "dir_info": {"editable": True}}))
    assert "an editable install of file:///src/verl" in editable
    vcs = build_note("0.9.1", json.dumps({"url": "https://github.com/x/verl", "vcs_info": {"commit_id": "a" * 40}}))
    assert "a build of https://github.com/x/verl at aaaaaaaaaaaa" in vcs
