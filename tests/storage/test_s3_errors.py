"""slimckpt.storage.s3's failures as a user meets them: one line naming the s3:// URL and the fix, the
builtin a POSIX caller catches, never a credential. moto stands in for S3 (its IAM refuses, its buckets
go missing); the real server's behaviour is tests/storage/test_s3.py's."""

from __future__ import annotations

import errno
import json
import socket

import pytest

from slimckpt import SlimckptError
from slimckpt.storage import for_path, s3, s3_client, s3_upload
from slimckpt.storage.s3_errors import (
    S3AccessDenied,
    S3BadCredentials,
    S3Error,
    S3NoBucket,
    S3NoConditionalWrites,
    S3NoCredentials,
    S3NotFound,
    S3Unreachable,
    S3WrongRegion,
    mapped,
)
from tests.conftest import run_python

from ..helpers.aws_env import isolate_aws

moto = pytest.importorskip("moto", reason="moto is in the test extra: pip install -e '.[test]'")
boto3 = pytest.importorskip("boto3", reason="boto3 is in the test extra: pip install -e '.[test]'")

SECRET = "sekrit-9f2c7be1d04a-never-shown"


@pytest.fixture
def aws(monkeypatch, tmp_path):
    """An environment with only a test identity in it (no ~/.aws, no endpoint), and a fresh client."""
    isolate_aws(monkeypatch, tmp_path, SECRET)
    s3.after_fork()  # the process's client and caches start over with this environment
    yield monkeypatch
    s3.after_fork()


def one_line_about(exc: BaseException, url: str, *fix: str) -> str:
    text = str(exc)
    assert "\n" not in text and text.startswith(url + ": "), text
    for words in fix:
        assert words in text, text
    assert SECRET not in text and SECRET not in repr(exc.args), text
    assert isinstance(exc, SlimckptError) and isinstance(exc, OSError) and exc.errno, type(exc).__mro__
    return text


def test_importing_slimckpt_its_storage_and_the_cli_help_load_no_s3_client():
    code = (
        "import sys, contextlib, io\n"
        "import slimckpt.storage\n"
        "from slimckpt.storage import for_path\n"
        "store = for_path('s3://bucket/step')\n"
        "from slimckpt import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['--help'])\n"
        "print(type(store).__name__, sorted(m for m in ('boto3', 'botocore', 's3transfer') if m in sys.modules))\n"
    )
    run = run_python(code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[-2] == "S3Storage []"


def test_the_backend_says_what_s3_can_do():
    store = for_path("s3://bucket/x")
    assert isinstance(store, s3.S3Storage) and store is for_path("s3://other/y")
    assert not (store.supports_inplace_writes or store.supports_dir_rename)
    assert not (store.supports_leases_that_die_with_holder or store.is_local)
    assert store.free_bytes("s3://bucket/x") > 1 << 50
    with pytest.raises(NotImplementedError, match="supports_dir_rename"):
        store.atomic_publish("s3://bucket/a.partial", "s3://bucket/a")
    assert s3_client.split("s3://bucket/a/b/") == ("bucket", "a/b/") and s3_client.dir_prefix("a/b/") == "a/b/"
    assert s3_client.dir_prefix("") == ""
    with pytest.raises(ValueError, match="no bucket"):
        s3_client.split("s3:///key")


def test_part_size_and_concurrency_are_checked(aws):
    aws.setenv("SLIMCKPT_S3_PART_MB", "4")
    with pytest.raises(ValueError, match="SLIMCKPT_S3_PART_MB=4: S3 takes parts of 5 to 5120 MiB"):
        s3_client.part_bytes()
    aws.setenv("SLIMCKPT_S3_PART_MB", "8")
    aws.setenv("SLIMCKPT_S3_CONCURRENCY", "0")
    with pytest.raises(ValueError, match="SLIMCKPT_S3_CONCURRENCY=0"):
        s3_client.concurrency()
    aws.delenv("SLIMCKPT_S3_CONCURRENCY")
    assert s3_client.part_bytes() == 8 << 20 and s3_client.concurrency() == 4


def test_a_missing_bucket_or_key_names_the_url_and_the_fix(aws):
    store = s3.S3Storage()
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="have")
        with pytest.raises(S3NoBucket) as raised:
            store.check_access("s3://nope-bucket/run/step")
        one_line_about(raised.value, "s3://nope-bucket/run/step", "create the bucket", "AWS_ENDPOINT_URL")
        for call in (
            lambda: store.size("s3://have/run/missing.pt"),
            lambda: store.remove("s3://have/run/missing.pt"),
            lambda: store.open_read("s3://have/run/missing.pt"),
            lambda: store.list_dir("s3://have/run/missing.pt"),
        ):
            with pytest.raises(FileNotFoundError) as raised:
                call()
            assert isinstance(raised.value, S3NotFound) and raised.value.errno == errno.ENOENT
            one_line_about(raised.value, "s3://have/run/missing.pt")
        assert store.read_range("s3://have/x", 0, 0) == b"" and not store.exists("s3://have/run")
        assert store.used_bytes("s3://have/run") == 0 and store.list_files("s3://have/run") == []
        errors = store.remove_tree("s3://have/run", ignore_errors=True)
        assert len(errors) == 1 and errors[0].startswith("s3://have/run: ")


def test_access_denied_is_a_permission_error_with_the_fix(aws):
    from moto.core import set_initial_no_auth_action_count

    store = s3.S3Storage()

    @set_initial_no_auth_action_count(4)  # the setup's calls; then moto's IAM decides
    @moto.mock_aws
    def denied() -> None:
        boto3.client("s3").create_bucket(Bucket="locked")
        iam = boto3.client("iam")
        iam.create_user(UserName="reader")
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        deny = {"Version": "2012-10-17", "Statement": [{"Effect": "Deny", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="reader", PolicyName="deny", PolicyDocument=json.dumps(deny))
        aws.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        aws.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        s3.after_fork()
        for call in (lambda: store.check_access("s3://locked/run"), lambda: store.put_atomic("s3://locked/run", b"x")):
            with pytest.raises(PermissionError) as raised:
                call()
            assert isinstance(raised.value, S3AccessDenied)
            text = one_line_about(raised.value, "s3://locked/run", "access denied", "AWS_PROFILE")
            assert key["SecretAccessKey"] not in text

    denied()


def test_no_credentials_names_the_variables(aws):
    aws.delenv("AWS_ACCESS_KEY_ID")
    aws.delenv("AWS_SECRET_ACCESS_KEY")
    aws.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never reached: signing fails first
    with pytest.raises(S3NoCredentials) as raised:
        s3.S3Storage().check_access("s3://bucket/run")
    one_line_about(raised.value, "s3://bucket/run", "AWS_ACCESS_KEY_ID", "AWS_PROFILE")
    assert raised.value.errno == errno.ENOKEY


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


def test_an_unreachable_endpoint_says_to_set_the_endpoint(aws):
    aws.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(S3Unreachable) as raised:
        s3.S3Storage().check_access("s3://bucket/run")
    one_line_about(raised.value, "s3://bucket/run", "cannot reach", "set AWS_ENDPOINT_URL")


def test_a_wrong_region_names_the_region_to_set(aws):
    from botocore.stub import Stubber

    store = s3.S3Storage()
    client = s3_client.CLIENT.get()
    with Stubber(client) as stub:
        stub.add_client_error("head_bucket", service_error_code="400", http_status_code=400)  # a HEAD: no body
        stub.add_client_error(
            "list_objects_v2",
            service_error_code="AuthorizationHeaderMalformed",
            service_message="The authorization header is malformed; the region 'us-east-1' is wrong; "
            "expecting 'eu-west-3'",
            http_status_code=400,
        )
        with pytest.raises(S3WrongRegion) as raised:
            store.check_access("s3://far/run")
        one_line_about(raised.value, "s3://far/run", "set AWS_REGION=eu-west-3")
        stub.add_client_error(
            "head_object",
            service_error_code="PermanentRedirect",
            http_status_code=301,
            response_meta={"HTTPHeaders": {"x-amz-bucket-region": "ap-south-1"}},
        )
        with pytest.raises(S3WrongRegion, match="set AWS_REGION=ap-south-1"):
            store.size("s3://far/run/a.pt")


def test_bad_credentials_never_show_the_secret(aws):
    from botocore.exceptions import ClientError

    for code in ("SignatureDoesNotMatch", "InvalidAccessKeyId"):
        exc = ClientError(
            {
                "Error": {"Code": code, "Message": f"the key {SECRET} is bad"},
                "ResponseMetadata": {"HTTPStatusCode": 403},
            },
            "PutObject",
        )
        err = mapped(exc, "s3://b/k")
        assert isinstance(err, S3BadCredentials) and err.errno == errno.EKEYREJECTED
        one_line_about(err, "s3://b/k", "AWS_SECRET_ACCESS_KEY")
    odd = ClientError(
        {"Error": {"Code": "SlowDown", "Message": f"busy\n{SECRET}"}, "ResponseMetadata": {"HTTPStatusCode": 503}},
        "PutObject",
    )
    text = one_line_about(mapped(odd, "s3://b/k"), "s3://b/k", "SlowDown", "busy")
    assert "***" in text


def test_errors_pickle_across_processes_unchanged():
    import pickle

    err = S3NotFound(errno.ENOENT, "no such object; check the URL", "s3://b/k")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is S3NotFound and str(back) == str(err) == "s3://b/k: no such object; check the URL"
    assert isinstance(back, S3Error) and back.filename == "s3://b/k"


def test_commits_and_leases_are_conditional_puts(aws):
    aws.setenv("SLIMCKPT_S3_LEASE_S", "2")  # renewed every 0.5 s: a second writer sees it held at once
    store = s3.S3Storage()
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="ckpts")
        assert store.put_if_absent("s3://ckpts/run/step_1/manifest.json", b"1")
        assert not store.put_if_absent("s3://ckpts/run/step_1/manifest.json", b"2")
        assert store.read_range("s3://ckpts/run/step_1/manifest.json", 0, 10) == b"1"
        assert store.list_files("s3://ckpts/run") == ["step_1/manifest.json"]  # the probe is gone
        lease = store.lease("s3://ckpts/run/.step_1.lock", exclusive=True)
        assert lease is not None and store.lease("s3://ckpts/run/.step_1.lock", exclusive=True) is None
        assert store.lease_note("s3://ckpts/run/.step_1.lock").startswith("pid ")
        lease.release()
        assert not store.exists("s3://ckpts/run/.step_1.lock")


def test_an_expired_lease_is_taken_over(aws):
    aws.setenv("SLIMCKPT_S3_LEASE_S", "1")  # a lease expiring past our watch is held: watched 1 s
    store = s3.S3Storage()
    key = "s3://ckpts/run/.step_2.lock"
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="ckpts")
        stale = {"holder": "pid 1 on gone", "created": 0, "expires": 1, "token": "old"}
        store.put_atomic(key, json.dumps(stale).encode())
        lease = store.lease(key, exclusive=True)
        assert lease is not None and lease.token != "old"
        stale["expires"] = 4e9  # held, not expired: refused
        lease.release()
        store.put_atomic(key, json.dumps(stale).encode())
        assert store.lease(key, exclusive=True) is None
        assert store.lease_note(key).startswith("pid 1 on gone (lease expires")
        assert store.lease(key, exclusive=False) is not None  # readers need no object


def test_a_bucket_without_conditional_writes_is_refused_at_the_first_write(aws):
    store = s3.S3Storage()
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="lax")
        client = s3_client.CLIENT.get()
        plain_put = client.put_object

        def ignores_if_none_match(**kwargs):
            kwargs.pop("IfNoneMatch", None)  # what a server without conditional writes does with the header
            return plain_put(**kwargs)

        aws.setattr(client, "put_object", ignores_if_none_match)
        for url, call in (
            ("s3://lax/run/step_1/manifest.json", lambda u: store.put_if_absent(u, b"1")),
            ("s3://lax/run/.step_1.lock", lambda u: store.lease(u, exclusive=True)),
        ):
            with pytest.raises(S3NoConditionalWrites) as raised:
                call(url)
            text = one_line_about(raised.value, url, "conditional writes", "two writers could both commit")
            assert "filesystem path" in text
        assert store.list_files("s3://lax/run") == []  # nothing committed, the probes removed


def test_a_failed_stream_leaves_no_object_and_no_upload(aws):
    store = s3.S3Storage()
    aws.setenv("SLIMCKPT_S3_PART_MB", "5")
    with moto.mock_aws():
        client = boto3.client("s3")
        client.create_bucket(Bucket="ckpts")
        with pytest.raises(RuntimeError, match="serializer failed"), store.open_stream("s3://ckpts/r/a") as f:
            f.write(b"x" * (11 << 20))  # two parts uploaded, a third being filled
            raise RuntimeError("serializer failed")
        aws.setattr(s3_upload, "MAX_PARTS", 2)
        with pytest.raises(ValueError, match="more than 2 parts of 5 MiB.*raise SLIMCKPT_S3_PART_MB"):
            with store.open_stream("s3://ckpts/r/b") as f:
                f.write(b"y" * (16 << 20))
        assert store.list_files("s3://ckpts/r") == []
        assert client.list_multipart_uploads(Bucket="ckpts").get("Uploads", []) == []
        with store.open_stream("s3://ckpts/r/c") as f:
            f.write(b"z" * (10 << 20))  # exactly two parts
        assert store.size("s3://ckpts/r/c") == 10 << 20
