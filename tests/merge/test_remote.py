"""The offline tools on `s3://`, through their command lines, against a real S3 server (SeaweedFS): an
incremental step written by the engine to the server merges and converts equal to the same step written
to disk; `slimckpt verify` names a flipped byte's object; a kill mid-upload leaves nothing any reader
takes; a wrong endpoint, secret or bucket fails in one line before anything is written; the secret
appears in no output. The mirrors of a remote step: engine/remote_step, convert/remote."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import pytest

from slimckpt_testing.launch import launch

from ..conftest import REPO

pytestmark = pytest.mark.slow


def _cli(env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slimckpt.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=timeout,
        cwd=REPO,
    )


def _no_secret(secret: str, *outputs: object) -> None:
    for out in outputs:
        text = out if isinstance(out, str) else f"{getattr(out, 'stdout', '')}{getattr(out, 'stderr', '')}"
        assert secret not in text


def _save(env: dict, local: str, url: str, *more: str) -> subprocess.CompletedProcess:
    # two gloo ranks, a tiny Llama, one step to each place: ~20 s; 300 s is a hang
    run = launch(
        2,
        "slimckpt_testing.scenarios.s3_engine_step",
        "--local-dir",
        local,
        "--url",
        url,
        *more,
        timeout=300,
        cwd=REPO,
        env={**env, "OMP_NUM_THREADS": "1", "SLIMCKPT_LOG_LEVEL": "WARNING"},
    )
    return run.proc


def _download(client, bucket: str, prefix: str, into) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            dest = into / obj["Key"][len(prefix) + 1 :]
            dest.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, obj["Key"], str(dest))


@pytest.fixture(scope="module")
def saved(s3_server, tmp_path_factory):
    """One step saved by the engine (async_save=stream) to disk and to the server."""
    root = tmp_path_factory.mktemp("s3_tools")
    local = root / "local" / "global_step_1" / "actor"
    url = s3_server.url("run") + "/global_step_1/actor"
    proc = _save(s3_server.env, str(local), url, "--async-save", "stream")
    assert proc.returncode == 0, proc.stderr[-4000:]
    _no_secret(s3_server.secret, proc)
    return root, local, url


def test_a_step_on_s3_merges_and_converts_equal_to_the_same_step_on_disk(s3_server, saved):
    root, local, url = saved
    env = s3_server.env
    verified = _cli(env, "verify", url, "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert json.loads(verified.stdout)["checked"] == [{"path": url, "kind": "incremental"}]

    merged = {}
    for name, src, dst in (
        ("from_disk", str(local), str(root / "m_disk")),
        ("from_s3", url, str(root / "m_s3")),
        ("s3_to_s3", url, s3_server.url("hf")),
    ):
        out = _cli(env, "merge", "--local_dir", src, "--target_dir", dst, "--no_progress")
        assert out.returncode == 0, out.stderr[-3000:]
        _no_secret(s3_server.secret, out)
        merged[name] = dst
    bucket = s3_server.bucket
    prefix = merged["s3_to_s3"].removeprefix(f"s3://{bucket}/")
    _download(s3_server.client(), bucket, prefix, root / "m_s3_down")
    assert _cli(env, "verify", merged["s3_to_s3"]).returncode == 0
    disk = root / "m_disk"
    weights = sorted(p.name for p in disk.iterdir() if p.suffix == ".safetensors" or p.name.endswith(".json"))
    assert "model.safetensors" in weights
    for other in (root / "m_s3", root / "m_s3_down"):
        for name in weights:
            if name == "manifest.json":
                continue  # names its source: the local dir or the URL
            assert filecmp.cmp(disk / name, other / name, shallow=False), (other, name)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(root / "m_s3_down")  # loadable as it came down

    step_url = url.rsplit("/", 1)[0]
    for name, src in (("c_disk", str(local.parent)), ("c_s3", step_url)):
        out = _cli(env, "convert", src, "--to", "verl", "--world-size", "1", "--target_dir", str(root / name))
        assert out.returncode == 0, out.stderr[-3000:]
    files = sorted(p.name for p in (root / "c_disk" / "global_step_1" / "actor").glob("*.pt"))
    assert len(files) == 3
    for name in files:
        a, b = (root / c / "global_step_1" / "actor" / name for c in ("c_disk", "c_s3"))
        assert filecmp.cmp(a, b, shallow=False), name
    assert not [p for p in (root / "c_s3").iterdir() if p.name.startswith(".slimckpt-")]  # scratch removed


def test_verify_names_the_object_of_a_flipped_byte_and_merge_refuses_it(s3_server, saved, tmp_path):
    _root, _local, url = saved
    client, bucket = s3_server.client(), s3_server.bucket
    # a copy of the step, one byte of rank 1's file flipped
    src_prefix = url.removeprefix(f"s3://{bucket}/")
    copy = s3_server.url("flip") + "/global_step_1/actor"
    dst_prefix = copy.removeprefix(f"s3://{bucket}/")
    for obj in client.list_objects_v2(Bucket=bucket, Prefix=src_prefix + "/")["Contents"]:
        body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        rel = obj["Key"][len(src_prefix) + 1 :]
        if rel == "dcp/__1_0.distcp":
            body = body[:1000] + bytes([body[1000] ^ 0x01]) + body[1001:]
        client.put_object(Bucket=bucket, Key=f"{dst_prefix}/{rel}", Body=body)
    out = _cli(s3_server.env, "verify", copy)
    assert out.returncode == 1
    assert f"{copy}/dcp/__1_0.distcp: xxh3_128" in out.stdout, out.stdout
    merged = _cli(s3_server.env, "merge", "--local_dir", copy, "--target_dir", str(tmp_path / "m"), "--no_progress")
    assert merged.returncode == 1 and f"{copy}/dcp/__1_0.distcp" in merged.stderr, merged.stderr
    assert len(merged.stderr.strip().splitlines()) == 1 and not (tmp_path / "m").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".slimckpt-")]


def test_a_kill_mid_upload_leaves_nothing_a_reader_takes(s3_server, tmp_path):
    url = s3_server.url("kill") + "/global_step_1/actor"
    env = {**s3_server.env, "SLIMCKPT_S3_PART_MB": "5"}
    # 8192 tokens: rank files of ~25 MB, several 5 MiB parts each; rank 0's group dies after its first part
    proc = _save(env, "", url, "--vocab", "8192", "--kill-at", "upload")
    assert proc.returncode != 0
    client, bucket = s3_server.client(), s3_server.bucket
    prefix = url.removeprefix(f"s3://{bucket}/")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]
    assert not any(k.endswith("slimckpt_resume.json") for k in keys), keys
    out = _cli(env, "verify", url)
    assert out.returncode == 1 and "has no slimckpt_resume.json: its save never finished" in out.stdout, out.stdout
    merged = _cli(env, "merge", "--local_dir", url, "--target_dir", str(tmp_path / "m"), "--no_progress")
    assert merged.returncode == 1 and "never finished" in merged.stderr and not (tmp_path / "m").exists()
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
    assert uploads, "the kill came after the first part: its upload is unfinished"
    # the next save of the step drops what the killed one left and commits
    again = _save(env, "", url, "--vocab", "8192")
    assert again.returncode == 0, again.stderr[-3000:]
    assert not client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads")
    assert _cli(env, "verify", url).returncode == 0
    # verify --clean drops a dead writer's upload without touching the committed step
    client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/dcp/__0_0.distcp")
    cleaned = _cli(env, "verify", "--clean", url)
    assert "cleaned: 1 unfinished upload(s)" in cleaned.stdout and cleaned.returncode == 0, cleaned.stdout
    assert not client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads")
    _no_secret(s3_server.secret, proc, out, merged, again, cleaned)


def test_a_wrong_endpoint_secret_or_bucket_fails_in_one_line_before_anything_is_written(s3_server, saved, tmp_path):
    _root, _local, url = saved
    good = s3_server.env
    bucket = s3_server.bucket
    cases = {
        "unreachable": ({**good, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, url, "AWS_ENDPOINT_URL"),
        "secret": ({**good, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}, url, "AWS_SECRET_ACCESS_KEY"),
        "bucket": (good, url.replace(f"s3://{bucket}/", "s3://no-such-bucket-here/"), "create the bucket"),
    }
    for name, (env, src, fix) in cases.items():
        target = tmp_path / name
        out = _cli(env, "merge", "--local_dir", src, "--target_dir", str(target), "--no_progress", timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1, (name, out.stderr)
        assert src.split("/")[2] in lines[0] and fix in lines[0], (name, lines)
        assert not target.exists() and not list(tmp_path.glob(".slimckpt-*")), name
        _no_secret(s3_server.secret, out)
        _no_secret("not-the-secret", out)


def test_a_merge_from_s3_holds_the_bound_of_a_merge_from_disk(s3_server, s3_url, tmp_path):
    """416 MB of fp32 tensors in one .distcp file: merged from disk and from the server, in the same test;
    the merge from S3 adds at most the fetch's blocks (FILES_AT_ONCE x READ_BLOCK) and the client."""
    import math

    from slimckpt.engine.remote_step import FILES_AT_ONCE, READ_BLOCK

    from ..helpers.merge_helpers import big_dcp_config, synthetic_dcp_step
    from ..merge.test_memory import peak_rss_anon

    cfg = big_dcp_config()
    step = synthetic_dcp_step(tmp_path / "step", config=cfg)
    client, bucket = s3_server.client(), s3_server.bucket
    prefix = s3_url.removeprefix(f"s3://{bucket}/")
    for path in step.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(step)}")
    common = ["merge", "--no_progress", "--chunk_mb", "16"]
    disk = peak_rss_anon([*common, "--local_dir", str(step), "--target_dir", str(tmp_path / "from_disk")])
    remote = peak_rss_anon([*common, "--local_dir", s3_url, "--target_dir", str(tmp_path / "from_s3")])
    print(f"peak RssAnon: merge from disk {disk / 2**20:.0f} MiB, from S3 {remote / 2**20:.0f} MiB")
    largest = 4 * max(math.prod(s) for s in ((4096, 1024), (1024, 4096)))
    assert remote <= largest + (16 << 20) + (272 << 20) + FILES_AT_ONCE * READ_BLOCK, remote
    assert remote <= disk + FILES_AT_ONCE * READ_BLOCK + (32 << 20), (disk, remote)
    assert filecmp.cmp(tmp_path / "from_disk" / "model.safetensors", tmp_path / "from_s3" / "model.safetensors")
