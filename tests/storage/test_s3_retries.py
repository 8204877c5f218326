"""slimckpt.storage.s3's retries, against a scripted client: throttling, 5xx and lost connections are
sent again with backoff, within SLIMCKPT_S3_RETRIES attempts and SLIMCKPT_S3_RETRY_S seconds; a refusal is
never sent twice; a conditional PUT or a completion whose first attempt landed unseen is told apart from
another writer's object (storage/s3_client's requests, storage/s3_conditional's commit). The same against a real
server through a fault proxy: tests/storage/test_s3_faults.py."""

from __future__ import annotations

import hashlib

import pytest

from slimckpt.storage import s3, s3_client, s3_conditional, s3_upload
from slimckpt.storage.s3_errors import S3AccessDenied, S3BadCredentials, S3Failed, retryable

botocore = pytest.importorskip("botocore", reason="boto3 is in the test extra: pip install -e '.[test]'")
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError  # noqa: E402

URL = "s3://ckpts/run/global_step_1/actor/slimckpt_resume.json"


def answer(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")


def lost() -> ConnectionClosedError:
    return ConnectionClosedError(endpoint_url="http://127.0.0.1:1")


class Script:
    """A client whose put_object/get_object/... answer from a list of outcomes (an exception or a value)."""

    def __init__(self, **outcomes: list) -> None:
        self.outcomes = outcomes
        self.calls: dict[str, int] = {}
        self.objects: dict[str, bytes] = {}

    def __getattr__(self, name: str):
        def method(**kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            todo = self.outcomes.get(name) or [None]
            out = todo.pop(0) if len(todo) > 1 else todo[0]
            if callable(out) and not isinstance(out, BaseException):
                out = out(**kwargs)
            if isinstance(out, BaseException):
                raise out
            return out

        return method


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setattr(s3_client, "BACKOFF_BASE_S", 0.001)
    monkeypatch.setenv("SLIMCKPT_S3_RETRIES", "5")

    def use(script: Script) -> Script:
        monkeypatch.setattr(s3_client.CLIENT, "get", lambda: script)
        return script

    return use


def test_what_is_retried():
    for code, status in [("SlowDown", 503), ("InternalError", 500), ("", 502), ("GatewayTimeout", 504), ("", 429)]:
        assert retryable(answer(code, status)), code
    assert retryable(lost()) and retryable(EndpointConnectionError(endpoint_url="http://x"))
    assert retryable(ConnectionResetError())
    for code, status in [("AccessDenied", 403), ("InvalidAccessKeyId", 403), ("NoSuchBucket", 404), ("412", 412)]:
        assert not retryable(answer(code, status)), code


def test_throttling_is_retried_until_it_passes(client):
    script = client(Script(put_object=[answer("SlowDown", 503), lost(), {"ETag": '"e"'}]))
    s3.S3Storage().put_atomic(URL, b"x")
    assert script.calls["put_object"] == 3


def test_a_refusal_is_not_retried_and_names_the_url_and_fix(client):
    script = client(Script(put_object=[answer("InvalidAccessKeyId", 403)]))
    with pytest.raises(S3BadCredentials) as raised:
        s3.S3Storage().put_atomic(URL, b"x")
    assert script.calls["put_object"] == 1
    assert str(raised.value).startswith(URL + ": ") and "AWS_ACCESS_KEY_ID" in str(raised.value)
    client(Script(put_object=[answer("AccessDenied", 403)]))
    with pytest.raises(S3AccessDenied):
        s3.S3Storage().put_atomic(URL, b"x")


def test_retries_are_bounded_in_attempts_and_time(client, monkeypatch):
    script = client(Script(put_object=[answer("SlowDown", 503)]))
    with pytest.raises(S3Failed) as raised:
        s3.S3Storage().put_atomic(URL, b"x")
    assert script.calls["put_object"] == 5
    line = str(raised.value)
    assert "\n" not in line and line.startswith(URL) and "gave up after 5 attempts" in line
    monkeypatch.setenv("SLIMCKPT_S3_RETRIES", "1000")
    monkeypatch.setenv("SLIMCKPT_S3_RETRY_S", "0.05")
    monkeypatch.setattr(s3_client, "BACKOFF_BASE_S", 0.02)
    script = client(Script(put_object=[answer("SlowDown", 503)]))
    with pytest.raises(S3Failed):
        s3.S3Storage().put_atomic(URL, b"x")
    assert script.calls["put_object"] < 10


def test_a_conditional_put_that_landed_unseen_is_ours_only_when_it_holds_our_bytes(client):
    s3_conditional.CONDITIONAL_OK.add("ckpts")
    try:
        # the first attempt landed, its answer was lost; the retry finds the key taken (412)
        ours = client(Script(put_object=[lost(), answer("PreconditionFailed", 412)], get_object=[_body(b"mine")]))
        assert s3.S3Storage().put_if_absent(URL, b"mine")
        assert ours.calls["put_object"] == 2
        client(Script(put_object=[lost(), answer("PreconditionFailed", 412)], get_object=[_body(b"other")]))
        assert not s3.S3Storage().put_if_absent(URL, b"mine")  # another writer's: a conflict
        # a 412 at the first attempt is another writer's, without a look
        first = client(Script(put_object=[answer("PreconditionFailed", 412)]))
        assert not s3.S3Storage().put_if_absent(URL, b"mine") and "get_object" not in first.calls
    finally:
        s3_conditional.CONDITIONAL_OK.discard("ckpts")


def test_a_completion_that_landed_unseen_is_recognised_by_its_etag(client):
    etags = ['"' + hashlib.md5(b"p1").hexdigest() + '"', '"' + hashlib.md5(b"p2").hexdigest() + '"']
    done = s3_upload.multipart_etag(etags)
    script = client(
        Script(
            complete_multipart_upload=[lost(), answer("NoSuchUpload", 404)],
            head_object=[{"ETag": f'"{done}"', "ContentLength": 4}],
        )
    )
    upload = object.__new__(s3_upload.Upload)
    upload.url, upload.bucket, upload.key, upload.upload_id = URL, "ckpts", "k", "u1"
    upload.complete([(1, etags[0]), (2, etags[1])])
    assert script.calls["complete_multipart_upload"] == 2
    client(
        Script(
            complete_multipart_upload=[lost(), answer("NoSuchUpload", 404)],
            head_object=[{"ETag": '"something-else-2"', "ContentLength": 4}],
        )
    )
    with pytest.raises(FileNotFoundError):
        upload.complete([(1, etags[0]), (2, etags[1])])


def _body(data: bytes):
    class Body:
        def read(self, n: int = -1) -> bytes:
            return data

    return lambda **_kw: {"Body": Body()}
