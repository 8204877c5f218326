"""slimckpt plan --storage s3: the upload arithmetic (slimckpt.plan.upload), the report's rows, and the
command run as a user runs it, reading no credentials and importing no client library."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

from slimckpt.plan import build, command, printers, upload
from tests.helpers.launch import REPO

from .conftest import TINY, plan_args  # every dim 0 is even, so two ranks hold equal halves

MiB = 2**20


def test_defaults_are_the_backends_and_the_buffers_are_part_times_concurrency_plus_slack():
    s = upload.upload_settings(None, None, None)
    assert (s.gbps, s.part_bytes, s.concurrency) == (1.25, 32 * MiB, 4)
    assert s.gbps_source.startswith("default")
    assert s.buffer_bytes == 32 * MiB * 4 + 64 * MiB == 192 * MiB
    given = upload.upload_settings(10, 8, 16)
    assert (given.gbps, given.part_bytes, given.concurrency, given.gbps_source) == (10.0, 8 * MiB, 16, "--upload-gbps")
    assert given.buffer_bytes == 8 * MiB * 16 + 64 * MiB


@pytest.mark.parametrize(
    "args,says",
    [
        ((0, None, None), "^slimckpt plan: --upload-gbps 0: give a bandwidth above 0 GB/s$"),
        ((-1, None, None), "--upload-gbps -1"),
        ((None, 4, None), "^slimckpt plan: --s3-part-mb 4: S3 parts are 5 MiB to 5120 MiB"),
        ((None, 5121, None), "--s3-part-mb 5121"),
        ((None, None, 0), "^slimckpt plan: --s3-concurrency 0: give 1 or more parts in flight$"),
    ],
)
def test_bad_settings_are_one_line_naming_the_option(args, says):
    with pytest.raises(ValueError, match=says):
        upload.upload_settings(*args)


def test_the_defaults_are_the_backends_own():
    from slimckpt.storage import s3

    assert upload.DEFAULT_PART_MB * MiB == 32 * MiB and upload.DEFAULT_CONCURRENCY == 4
    assert (upload.MIN_PART_MB, upload.MAX_PART_MB, upload.MAX_PARTS) == (5, 5120, 10_000)
    # the plan refuses the in-training export where the backend has no in-place writes, as the save does
    assert s3.S3Storage.supports_inplace_writes is False


def test_backend_defaults_when_its_variables_are_unset(monkeypatch):
    from slimckpt.storage import s3_client

    monkeypatch.delenv("SLIMCKPT_S3_PART_MB", raising=False)
    monkeypatch.delenv("SLIMCKPT_S3_CONCURRENCY", raising=False)
    assert (s3_client.part_bytes(), s3_client.concurrency()) == (
        upload.DEFAULT_PART_MB * MiB,
        upload.DEFAULT_CONCURRENCY,
    )


def _save(s, **kw):
    return upload.save_upload(
        rank_state=30 * 10**9,
        all_state=100 * 10**9,
        rank_export=5 * 10**9,
        all_export=20 * 10**9,
        largest_file=30 * 10**9,
        host_peak=100 * MiB,
        settings=s,
        **kw,
    )


def test_a_save_is_durable_after_its_bytes_at_the_bandwidth_and_one_commit():
    s = upload.upload_settings(2.0, None, None)
    u = _save(s, inplace_writes=True)
    assert u["supported"] and u["export_refused"] is None
    assert (u["rank0_upload_bytes"], u["total_upload_bytes"]) == (35 * 10**9, 120 * 10**9)
    assert (u["rank0_export_upload_bytes"], u["export_upload_bytes"]) == (5 * 10**9, 20 * 10**9)
    assert u["upload_seconds"] == pytest.approx(60.0)  # 120 GB at 2 GB/s
    assert u["commit_seconds"] == upload.COMMIT_SECONDS == 0.1
    assert u["durable_seconds"] == pytest.approx(60.1)
    assert u["upload_buffer_bytes"] == 192 * MiB
    assert u["host_peak_with_upload_bytes"] == 100 * MiB + 192 * MiB
    assert u["notes"] == []  # 30 GB is 895 parts of 32 MiB

    # a medium without in-place writes (S3): the export is not uploaded, the run turns it off
    no = _save(s)
    assert no["export_refused"] == upload.EXPORT_REFUSED and "export_hf=false" in no["export_refused"]
    assert (no["rank0_upload_bytes"], no["total_upload_bytes"], no["export_upload_bytes"]) == (30 * 10**9, 10**11, 0)
    assert no["durable_seconds"] == pytest.approx(50.1)

    # two write threads: two files open at once, one more part being filled
    two = _save(s, streams=2)
    assert two["upload_buffer_bytes"] == 32 * MiB * 5 + 64 * MiB
    assert two["host_peak_with_upload_bytes"] == 100 * MiB + two["upload_buffer_bytes"]


def test_a_rank_file_over_s3s_part_limit_names_the_part_size_that_fits():
    s = upload.upload_settings(None, None, None)
    limit = upload.MAX_PARTS * 32 * MiB
    assert upload.part_notes(limit, s, "a rank file") == []
    (note,) = upload.part_notes(limit + 1, s, "a rank file")
    assert "more than 10,000 parts of 32.00 MiB" in note and "SLIMCKPT_S3_PART_MB=33" in note
    assert upload.min_part_bytes(limit + 1) == 33 * MiB
    assert upload.min_part_bytes(1) == 5 * MiB  # never below S3's smallest part
    assert "buffers grow to 196.00 MiB" in note  # 33 MiB x 4 + 64 MiB


def test_rank_share_rounds_up_in_proportion_to_the_rows_held():
    assert upload.rank_share(100, 1, 2) == 50
    assert upload.rank_share(101, 1, 2) == 51
    assert upload.rank_share(10, 1, 3) == 4
    assert upload.rank_share(0, 1, 2) == 0 and upload.rank_share(10, 0, 0) == 0


def test_a_merge_uploads_the_hf_model_at_the_bandwidth_it_is_given():
    s = upload.upload_settings(None, 16, 2)
    m = upload.merge_upload(10 * 10**9, 5 * 10**9, 0.5, "the default over 4 nodes", s)
    assert m["durable_seconds"] == pytest.approx(20.1) and m["upload_seconds"] == pytest.approx(20.0)
    assert m["upload_buffer_bytes"] == 16 * MiB * 2 + 64 * MiB and m["notes"] == []


def _args(cfg, **kw):
    """The wing's plan options with a 2 GB/s disk and a node of 2 GPUs and 64 GB."""
    return plan_args(cfg, **{"disk_gbps": 2.0, "gpus_per_node": 2, "node_memory_gb": 64, **kw})


def test_the_report_uploads_only_the_incremental_rows(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    posix = build.build_report(_args(cfg))
    assert "s3" not in posix and "storage" not in posix  # a POSIX plan's report as it was
    assert all("s3" not in e for e in posix["estimates"])

    r = build.build_report(_args(cfg, storage="s3", upload_gbps=4.0, s3_part_mb=8, s3_concurrency=2))
    assert r["storage"] == "s3"
    assert (r["s3"]["upload_gbps"], r["s3"]["part_bytes"], r["s3"]["concurrency"]) == (4.0, 8 * MiB, 2)
    by = {e["strategy"]: e for e in r["estimates"]}
    for name in ("verl default", "verl + hf_model", "+recipe=quickstart"):
        assert by[name]["s3"] == {"supported": False, "reason": upload.REFUSED}
        assert by[name]["write_seconds"] is not None  # the disk time stays
    inc = by["+recipe=incremental"]
    u = inc["s3"]
    assert u["supported"] and inc["hf_export_bytes"] > 0  # the recipe exports: not to s3:// (in place)
    assert u["export_refused"] == upload.EXPORT_REFUSED and u["export_upload_bytes"] == 0
    assert u["total_upload_bytes"] == inc["total_write_bytes"]
    assert u["rank0_upload_bytes"] == inc["rank0_write_bytes"]
    assert u["durable_seconds"] == pytest.approx(u["total_upload_bytes"] / 4e9 + 0.1)
    assert u["host_peak_with_upload_bytes"] == inc["host_peak_bytes"] + 8 * MiB * 2 + 64 * MiB
    assert u["largest_file_bytes"] == inc["rank0_write_bytes"]  # one write thread: one DCP file per rank
    assert inc["write_seconds"] == posix["estimates"][2]["write_seconds"]  # beside the disk time, not instead
    merge = r["s3"]["merge"]
    assert merge["total_upload_bytes"] == r["hf_export"]["bytes"] and merge["gbps"] == 4.0  # one node
    assert merge["durable_seconds"] == pytest.approx(r["hf_export"]["bytes"] / 4e9 + 0.1)

    # where the export could be written in place, rank 0 uploads its half of the rows
    monkeypatch.setattr(build.S3Storage, "supports_inplace_writes", True)
    inc = {e["strategy"]: e for e in build.build_report(_args(cfg, storage="s3"))["estimates"]}["+recipe=incremental"]
    assert inc["s3"]["export_upload_bytes"] == inc["hf_export_bytes"]
    assert inc["s3"]["rank0_export_upload_bytes"] == -(-inc["hf_export_bytes"] // 2)
    assert inc["s3"]["total_upload_bytes"] == inc["total_write_bytes"] + inc["hf_export_bytes"]
    monkeypatch.undo()

    out = io.StringIO()
    printers.print_report(r, out)
    text = out.getvalue()
    head = text.splitlines()[2]
    assert "time @2 GB/s  S3 durable @4 GB/s" in head  # the S3 time beside the disk time
    assert "incremental only: verl's own rank files" in text and "slimckpt merge (bf16)" in text
    assert "(export_hf=false)" in text and "not uploaded" in text

    assert command.run(_args(cfg, storage="s3", upload_gbps=4.0)) == 0  # --json: the same fields
    printed = json.loads(capsys.readouterr().out)
    assert printed["s3"]["merge"]["durable_seconds"] == pytest.approx(merge["durable_seconds"])
    assert [e["s3"]["supported"] for e in printed["estimates"]] == [False, False, True, False]


def test_upload_options_without_storage_s3_are_refused(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    for kw, option in (({"upload_gbps": 1.0}, "--upload-gbps"), ({"s3_part_mb": 8}, "--s3-part-mb")):
        with pytest.raises(ValueError, match=f"^slimckpt plan: {option} plans an upload .*: add --storage s3$"):
            build.build_report(_args(cfg, **kw))


SECRET = "plan-must-never-read-this-secret"
# the command as a user runs it, with AWS credentials in the environment: every read of a key is
# recorded (os.getenv and os.environ[...] alike, botocore's credential lookup too), and no client
# session is made
RUN = """
import os, sys
seen = set()
class Recording(dict):
    def __getitem__(self, k):
        seen.add(k)
        return super().__getitem__(k)
    def get(self, k, default=None):
        seen.add(k)
        return super().get(k, default)
    def __contains__(self, k):
        seen.add(k)
        return super().__contains__(k)
os.environ = Recording(os.environ)
from slimckpt.cli import main
rc = main(sys.argv[1:])
clients = sorted(m for m in ("obstore", "s3fs", "s3torchconnector") if m in sys.modules)
# transformers imports accelerate, which imports boto3 where it is installed: no session made is what counts
clients += ["a boto3 session"] if getattr(sys.modules.get("boto3"), "DEFAULT_SESSION", None) is not None else []
print("RECORD", sorted(k for k in seen if k.startswith("AWS_")), clients, rc, file=sys.stderr)
"""


def test_the_cli_plans_an_s3_upload_without_reading_credentials():
    argv = [
        "plan",
        "--config",
        str(REPO / "docs/configs/llama3-70b.json"),
        "--world-size",
        "32",
        "--recipe",
        "incremental",
        "--storage",
        "s3",
        "--upload-gbps",
        "10",
        "--gpus-per-node",
        "8",
        "--node-memory-gb",
        "1024",
    ]
    env = {
        "AWS_ACCESS_KEY_ID": "AKIAPLANTEST",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
        "AWS_REGION": "us-east-1",
    }
    # builds the 70B meta model in one interpreter: seconds; 300 s is a hang
    proc = subprocess.run(
        [sys.executable, "-c", RUN, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert SECRET not in proc.stdout + proc.stderr and "AKIAPLANTEST" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "RECORD [] [] 0"
    lines = proc.stdout.splitlines()
    assert re.search(r"\btime +S3 durable @10 GB/s +training blocked for$", lines[2])  # beside the disk time
    s3 = lines[lines.index(next(x for x in lines if x.startswith("S3 (--storage s3): 10 GB/s"))) :]
    row = next(x for x in s3 if x.startswith("+recipe=incremental "))
    # 788.50 GiB of resume state (the fp32 export is not uploaded: export_hf=false): 847 GB at 10 GB/s + the commit
    assert row.split()[1:8] == ["24.64", "GiB", "788.50", "GiB", "not", "uploaded", "84.8"]
    assert "84.8 s (export_hf=false)" in row and "192.00 MiB" in row
    assert "+recipe=incremental: the in-training HF export needs in-place writes" in proc.stdout
    assert next(x for x in s3 if x.startswith("verl default ")).split()[2:] == [*"---", "incremental", "only", *"--"]
    # the recipe's export_dtype=bf16: 141 GB at 10/4 GB/s
    merge = next(x for x in s3 if x.startswith("slimckpt merge (bf16)"))
    assert merge.split()[4:8] == ["131.42", "GiB", "131.42", "GiB"] and "56.5 s" in merge
    assert "uploaded by one process at 2.5 GB/s (--upload-gbps over 4 nodes" in proc.stdout
