"""An environment with only a test identity in it (no ~/.aws, no endpoint), for the S3 tests run on moto."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TEST_KEY_ID = "AKIATESTSLIMCKPT"


def isolate_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, secret: str) -> None:
    """Drop every AWS_* variable, point the config files nowhere, and set the test identity."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
