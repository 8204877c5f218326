"""slimckpt.storage.s3 against a real S3 server (SeaweedFS's `weed mini` on loopback, the `s3_server`
fixture): every Storage method, what a failed write leaves (nothing), the upload's host memory bound,
and no credential in anything the tests print, log or raise. So the backend's parts too: streams
(storage/s3_upload), ranged writes (storage/s3_ranges), reads (storage/s3_read) and leases
(storage/s3_leases); their retries and conditional writes against a scripted client are
tests/storage/test_s3_retries.py's."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from slimckpt.observe.memory import RssSampler
from slimckpt.storage import for_path, s3, s3_client
from slimckpt.storage.s3_errors import S3BadCredentials, S3NotFound

pytestmark = pytest.mark.slow

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _no_secret_in_output(s3_server, capsys, caplog):
    """Whatever a test of this module prints or logs (botocore's DEBUG lines included) holds no secret."""
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="slimckpt")
    yield
    out = capsys.readouterr()
    for where, text in (("stdout", out.out), ("stderr", out.err), ("log", caplog.text)):
        assert s3_server.secret not in text, f"the secret key appeared in the test's {where}"


def pattern(n: int, seed: int) -> bytes:
    """`n` bytes that differ at every offset and per seed, made without holding more than `n`."""
    block = hashlib.sha256(seed.to_bytes(8, "little")).digest() * (1 << 12)  # 128 KiB
    reps = -(-n // len(block))
    return (block * reps)[:n]


def uploads_under(s3_server, url: str) -> list[str]:
    bucket, key = s3_client.split(url)
    out = s3_server.client().list_multipart_uploads(Bucket=bucket, Prefix=key)
    return [u["Key"] for u in out.get("Uploads", [])]


def test_a_stream_of_odd_writes_reads_back_byte_for_byte(s3_url, s3_server, monkeypatch):
    monkeypatch.setenv("SLIMCKPT_S3_PART_MB", "5")  # many parts, the last one short
    store = for_path(s3_url)
    data = os.urandom(80 * MIB + 12345)
    path = f"{s3_url}/dcp/__0_0.distcp"
    sizes = [1, 7, 4096, 5 * MIB - 1, 3, 9 * MIB + 17, 65537]
    with store.open_stream(path) as f:
        assert f.writable() and not f.seekable() and f.tell() == 0
        at, i = 0, 0
        while at < len(data):
            n = min(sizes[i % len(sizes)], len(data) - at)
            assert f.write(memoryview(data)[at : at + n]) == n
            at, i = at + n, i + 1
            f.flush()
            assert f.tell() == at
            if i == 3:
                assert not store.exists(path)  # nothing visible before the upload completes
    assert store.size(path) == len(data) and uploads_under(s3_server, s3_url) == []
    with store.open_read(path) as r:
        assert r.readable() and r.seekable()
        assert r.read() == data
        r.seek(12 * MIB + 5)
        assert r.read(3) == data[12 * MIB + 5 : 12 * MIB + 8] and r.tell() == 12 * MIB + 8
        r.seek(-10, os.SEEK_END)
        assert r.read(100) == data[-10:] and r.read(1) == b""
        buf = bytearray(20 * MIB)  # a large readinto: straight into the caller's buffer, block by block
        r.seek(MIB + 1)
        assert r.readinto(buf) == len(buf) and bytes(buf) == data[MIB + 1 : 21 * MIB + 1]
    assert store.read_range(path, 5 * MIB - 2, 4) == data[5 * MIB - 2 : 5 * MIB + 2]
    assert store.read_range(path, len(data) - 3, 10) == data[-3:]
    assert store.read_range(path, len(data) + 10, 10) == b""
    small = f"{s3_url}/dcp/.metadata"
    with store.open_stream(small) as f:  # below one part: one PUT at the end
        f.write(b"meta")
    with store.open_stream(f"{s3_url}/empty") as f:
        pass
    assert store.read_range(small, 0, 100) == b"meta" and store.size(f"{s3_url}/empty") == 0


def test_a_write_that_raises_leaves_no_object_and_no_upload(s3_url, s3_server, monkeypatch):
    monkeypatch.setenv("SLIMCKPT_S3_PART_MB", "5")
    store = for_path(s3_url)
    for size in (12 * MIB, 100):  # a multipart upload begun, and a file still in its first part
        path = f"{s3_url}/rank_{size}.distcp"
        with pytest.raises(RuntimeError, match="serializer failed"), store.open_stream(path) as f:
            f.write(pattern(size, 1))
            raise RuntimeError("serializer failed")
        assert not store.exists(path) and uploads_under(s3_server, s3_url) == []
    with pytest.raises(RuntimeError), store.open_atomic(f"{s3_url}/extra_state.pt") as f:
        f.write(b"half")
        raise RuntimeError("pickling failed")
    assert store.list_files(s3_url) == []


def test_ranges_in_order_become_one_object_and_out_of_order_is_refused(s3_url, s3_server, monkeypatch):
    monkeypatch.setenv("SLIMCKPT_S3_PART_MB", "5")
    store = for_path(s3_url)
    path = f"{s3_url}/model-00001-of-00001.safetensors"
    body = pattern(11 * MIB, 2)
    head = store.create_ranges(path, 8 + len(body))
    head.write(b"HEADER..", 0)
    head.close()  # the coordinator's header: the file stays open in this process for its writer
    out = store.open_ranges(path)
    with pytest.raises(ValueError, match=r"model-00001-of-00001.safetensors: write of 4 bytes at offset 100.*in order"):
        out.write(b"late", 100)
    with pytest.raises(ValueError, match="bytes written: an S3 object exists only once all of it is"):
        out.sync()
    out.write(memoryview(body)[: 6 * MIB], 8)
    out.write(memoryview(body)[6 * MIB :], 8 + 6 * MIB)
    out.sync()
    out.close()
    assert store.read_range(path, 0, 8) == b"HEADER.." and store.size(path) == 8 + len(body)
    assert store.read_range(path, 8 + 6 * MIB - 1, 2) == body[6 * MIB - 1 : 6 * MIB + 1]
    with pytest.raises(ValueError, match="cannot reopen"):
        store.open_ranges(path)
    store.create_ranges(f"{s3_url}/zero.bin", 0).close()
    assert store.size(f"{s3_url}/zero.bin") == 0
    left = store.create_ranges(f"{s3_url}/left.bin", 6 * MIB)
    left.write(pattern(5 * MIB + 1, 3), 0)  # one part uploaded, then the writer gives up
    left.close()
    assert uploads_under(s3_server, s3_url) != []
    assert store.abort_uploads(s3_url) == 1 and uploads_under(s3_server, s3_url) == []
    assert not store.exists(f"{s3_url}/left.bin")


def test_commits_are_put_once_and_leases_are_exclusive(s3_url, monkeypatch):
    monkeypatch.setenv("SLIMCKPT_S3_LEASE_S", "2")  # renewed every 0.5 s: a second writer learns it is held at once
    store = for_path(s3_url)
    manifest = f"{s3_url}/global_step_1/slimckpt_manifest.json"
    assert store.put_if_absent(manifest, b'{"step": 1}')
    assert not store.put_if_absent(manifest, b'{"step": 2}')
    assert store.read_range(manifest, 0, 100) == b'{"step": 1}'
    assert store.list_files(s3_url) == ["global_step_1/slimckpt_manifest.json"]  # the probe is gone
    key = f"{s3_url}/.global_step_1.slimckpt-lock"
    writer = store.lease(key, exclusive=True)
    assert writer is not None and store.lease(key, exclusive=True) is None
    writer.note("pid 7 on trainer-0: saving step 1\nmore")
    assert store.lease_note(key) == "pid 7 on trainer-0: saving step 1"
    reader = store.lease(key, exclusive=False)  # readers hold no object
    assert reader is not None
    reader.release()
    writer.release()
    writer.release()
    assert not store.exists(key) and store.lease_note(key) == ""
    again = store.lease(key, exclusive=True)
    assert again is not None
    again.release()


def test_a_killed_writers_lease_is_taken_over_once_it_expires_unrenewed(s3_url, monkeypatch):
    monkeypatch.setenv("SLIMCKPT_S3_LEASE_S", "2")
    store = for_path(s3_url)
    key = f"{s3_url}/.global_step_2.slimckpt-lock"
    bucket, k = key[len("s3://") :].split("/", 1)
    # what a SIGKILLed holder leaves: its lease object, renewed no more
    dead = {"holder": "pid 1 on gone", "created": time.time(), "expires": time.time() + 2, "token": "dead"}
    store.client().put_object(Bucket=bucket, Key=k, Body=json.dumps(dead).encode())
    t0 = time.monotonic()
    lease = store.lease(key, exclusive=True)
    assert lease is not None and 0.5 < time.monotonic() - t0 < 6
    time.sleep(1.2)  # renewed meanwhile: still ours, and a third writer is refused
    assert json.loads(store.read_range(key, 0, 4096))["token"] == lease.token
    assert store.lease(key, exclusive=True) is None
    lease.release()
    assert not store.exists(key)


def test_listing_sizes_copies_and_deletes(s3_url, s3_server):
    store = for_path(s3_url)
    files = {"a.json": b"1", "dcp/__0_0.distcp": b"22", "dcp/__1_0.distcp": b"333", "huggingface/config.json": b"{}"}
    for rel, data in files.items():
        store.put_atomic(f"{s3_url}/step/{rel}", data)
    step = f"{s3_url}/step"
    store.make_dirs(f"{step}/nothing/needed", exist_ok=False)
    store.sync(step)
    store.sync_tree(step)
    assert store.list_dir(step) == ["a.json", "dcp", "huggingface"]
    assert store.list_dir(f"{step}/dcp/") == ["__0_0.distcp", "__1_0.distcp"]
    assert store.list_files(step) == sorted(files)
    assert store.exists(step) and store.is_dir(step) and store.exists(f"{step}/a.json")
    assert not store.is_dir(f"{step}/a.json") and not store.exists(f"{step}/nothing")
    assert store.size(f"{step}/dcp/__1_0.distcp") == 3 and store.used_bytes(step) == 8
    store.replace(f"{step}/a.json", f"{step}/b.json")
    assert store.list_dir(step) == ["b.json", "dcp", "huggingface"]
    store.remove(f"{step}/b.json")
    with pytest.raises(S3NotFound):
        store.remove(f"{step}/b.json")
    with pytest.raises(FileNotFoundError):
        store.size(f"{step}/b.json")
    store.put_atomic(step, b"an object named like the prefix")
    many = [f"{s3_url}/step/many/{i:04d}" for i in range(1003)]  # past one DeleteObjects batch
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda u: store.put_atomic(u, b"x"), many))
    assert len(store.list_files(step)) == len(files) - 1 + len(many)
    assert store.remove_tree(step) == []
    assert store.list_files(s3_url) == [] and not store.exists(step)
    with pytest.raises(FileNotFoundError):
        store.remove_tree(step)


def test_abort_uploads_drops_what_a_killed_writer_left(s3_url, s3_server):
    store = for_path(s3_url)
    bucket, key = s3_client.split(s3_url)
    client = s3_server.client()
    for name in ("step/dcp/__0_0.distcp", "step/dcp/__1_0.distcp"):
        up = client.create_multipart_upload(Bucket=bucket, Key=f"{key}/{name}")
        client.upload_part(Bucket=bucket, Key=f"{key}/{name}", UploadId=up["UploadId"], PartNumber=1, Body=b"x" * 100)
    other = client.create_multipart_upload(Bucket=bucket, Key=f"{key}/stepX/f")  # a neighbour's: kept
    assert store.abort_uploads(f"{s3_url}/step") == 2
    assert uploads_under(s3_server, s3_url) == [f"{key}/stepX/f"]
    client.abort_multipart_upload(Bucket=bucket, Key=f"{key}/stepX/f", UploadId=other["UploadId"])
    assert store.abort_uploads(s3_url) == 0 and store.list_files(s3_url) == []


def test_wrong_credentials_name_the_fix_and_never_the_secret(s3_url, s3_server, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret[::-1])
    s3.after_fork()
    with pytest.raises(S3BadCredentials) as raised:
        for_path(s3_url).check_access(s3_url)
    text = str(raised.value)
    assert text.startswith(s3_url + ": ") and "AWS_SECRET_ACCESS_KEY" in text and "\n" not in text
    assert s3_server.secret not in text and s3_server.secret[::-1] not in text


@pytest.mark.parametrize("part,parts", [(8, 4), (None, None)], ids=["8MiBx4", "defaults"])
def test_an_upload_holds_at_most_part_size_times_concurrency(s3_url, s3_server, monkeypatch, part, parts):
    if part is not None:
        monkeypatch.setenv("SLIMCKPT_S3_PART_MB", str(part))
        monkeypatch.setenv("SLIMCKPT_S3_CONCURRENCY", str(parts))
    store = for_path(s3_url)
    part, parts = s3_client.part_bytes() // MIB, s3_client.concurrency()
    with store.open_stream(f"{s3_url}/warm") as f:  # the client, its models and threads made before measuring
        f.write(b"w" * (part * MIB + 1))  # two parts: a multipart upload's calls too
    store.remove(f"{s3_url}/warm")
    chunk = bytearray(pattern(8 * MIB, 4))
    digest = hashlib.sha256()
    with RssSampler(interval_s=0.002) as sampler, store.open_stream(f"{s3_url}/big.distcp") as f:
        for i in range(64):  # 512 MiB, one 8 MiB chunk at a time (a different first byte each)
            chunk[0] = i
            digest.update(chunk)
            f.write(chunk)
    extra = sampler.result.extra
    bound = part * parts * MIB + 64 * MIB
    print(f"512 MiB streamed: RssAnon rose {extra / MIB:.0f} MiB (bound {bound / MIB:.0f} MiB)")
    assert extra <= bound, f"an upload's host memory rose {extra / MIB:.0f} MiB, above {bound / MIB:.0f} MiB"
    assert store.size(f"{s3_url}/big.distcp") == 512 * MIB
    check = hashlib.sha256()
    with store.open_read(f"{s3_url}/big.distcp") as r:
        while block := r.read(16 * MIB):
            check.update(block)
    assert check.hexdigest() == digest.hexdigest()
    store.remove_tree(s3_url)


def test_a_process_using_the_backend_prints_and_logs_no_secret(s3_server, tmp_path):
    """A fresh interpreter with every logger at DEBUG (botocore's request dumps included) writes, reads,
    commits, fails on a missing key, a wrong secret and a dead endpoint: its whole output, and each
    error's str and repr, hold no secret."""
    url = s3_server.url("secrets")
    code = f"""
import logging, os
logging.basicConfig(level=logging.DEBUG)
os.environ["SLIMCKPT_LOG_LEVEL"] = "DEBUG"
from slimckpt.storage import s3
from slimckpt.storage import for_path
store = for_path({url!r})
store.check_access({url!r})
with store.open_stream({url!r} + "/f") as f:
    f.write(b"x" * (6 << 20))
store.put_if_absent({url!r} + "/m", b"1")
lease = store.lease({url!r} + "/.lock", exclusive=True)
lease.release()
def show(fn):
    try:
        fn()
    except Exception as exc:
        print("ERROR", exc, repr(exc))
show(lambda: store.size({url!r} + "/missing"))
os.environ["AWS_SECRET_ACCESS_KEY"] = "x" + os.environ["AWS_SECRET_ACCESS_KEY"][1:]
s3.after_fork()
show(lambda: store.put_atomic({url!r} + "/g", b"1"))
os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
s3.after_fork()
show(lambda: store.size({url!r} + "/f"))
print("DONE")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**env, **s3_server.env}, timeout=300
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "DONE" in run.stdout, output[-3000:]
    assert output.count("ERROR s3://") == 3, run.stdout
    assert len(output) > 10_000  # botocore's DEBUG lines were there to search
    assert s3_server.secret not in output
    assert s3_server.secret[1:] not in output  # nor the altered one


def test_s3_writes_from_threads_share_the_process_budget(s3_url, monkeypatch):
    monkeypatch.setenv("SLIMCKPT_S3_PART_MB", "5")
    monkeypatch.setenv("SLIMCKPT_S3_CONCURRENCY", "2")
    store = for_path(s3_url)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            with store.open_stream(f"{s3_url}/rank_{i}") as f:
                for j in range(4):
                    f.write(pattern(3 * MIB, i * 10 + j))
        except BaseException as exc:  # noqa: BLE001 - collected for the assert
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    for i in range(4):
        expect = b"".join(pattern(3 * MIB, i * 10 + j) for j in range(4))
        assert store.read_range(f"{s3_url}/rank_{i}", 0, 12 * MIB) == expect
