"""What an S3 client's failure means to the user: one line naming the `s3://bucket/key` URL and the fix.

Each class is an OSError with an errno (what the engine and the tools already catch and describe), a
SlimckptError, and, for a missing object or a refusal, the builtin a POSIX caller catches the same case
by (FileNotFoundError, PermissionError). str() is `<url>: <what happened>; <what to do>`.

The text is made here from the error's code, never from the client's configuration or environment, so
no credential reaches a message: the server's own message is quoted only for codes without a mapping,
cut to one line, with any AWS credential value of the environment blanked out.

botocore is imported only when a failure is mapped (importing slimckpt stays free of it).
"""

# lazy imports: botocore loads only when an s3:// failure is mapped, never when slimckpt is imported

from __future__ import annotations

import errno
import re

from slimckpt import SlimckptError, env_vars

ENDPOINT_FIX = "set AWS_ENDPOINT_URL to the server's URL (http://host:port) and check that it is running"
CREDENTIALS_FIX = "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
REGION_IN_TEXT = re.compile(r"expecting '([a-z0-9-]+)'")


class S3Error(SlimckptError, OSError):
    """An S3 request failed; `filename` is the URL, `strerror` what happened and the fix. Built as
    OSError is (errno, text, url), so it pickles across processes unchanged."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


class S3NotFound(S3Error, FileNotFoundError):
    """No object at the URL (a missing file, as a POSIX caller expects it)."""


class S3AccessDenied(S3Error, PermissionError):
    """The credentials are valid but may not do this to the bucket or key."""


class S3NoBucket(S3Error):
    """The bucket does not exist at this endpoint."""


class S3NoCredentials(S3Error):
    """The client found no credentials at all."""


class S3BadCredentials(S3Error):
    """The server rejected the credentials (unknown key id, wrong secret)."""


class S3Unreachable(S3Error):
    """Nothing answered at the endpoint (closed port, wrong host, a connect timeout)."""


class S3WrongRegion(S3Error):
    """The bucket lives in another region than the client signs for."""


class S3NoConditionalWrites(S3Error):
    """The server accepts `If-None-Match: *` but ignores it: a commit could be overwritten."""


class S3Failed(S3Error):
    """Any other S3 failure (after the client's retries)."""


def one_line(text: str, limit: int = 200) -> str:
    """`text` on one line, at most `limit` characters, with any credential of the environment blanked."""
    for name, value in env_vars.environment().items():
        if name in SECRET_VARS and len(value) >= 4:
            text = text.replace(value, "***")
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def region_named(exc: BaseException) -> str | None:
    """The region a wrong-region answer names (its Region field, its x-amz-bucket-region header or its text)."""
    response = getattr(exc, "response", None) or {}
    error = response.get("Error", {})
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    region = error.get("Region") or headers.get("x-amz-bucket-region")
    if region:
        return str(region)
    m = REGION_IN_TEXT.search(str(error.get("Message", "")))
    return m.group(1) if m else None


def bucket_of(url: str) -> str:
    return url.split("://", 1)[-1].split("/", 1)[0]


def no_conditional_writes(url: str) -> S3NoConditionalWrites:
    return S3NoConditionalWrites(
        errno.EOPNOTSUPP,
        "this bucket/endpoint ignores conditional writes (a second PUT with If-None-Match: * was accepted), so "
        "two writers could both commit a step; use a server that enforces them (AWS S3, MinIO, SeaweedFS, R2) "
        "or a local or shared filesystem path",
        url,
    )


def mapped(exc: BaseException, url: str, *, bucket_level: bool = False) -> BaseException:
    """The S3Error for a botocore failure of a request about `url`; anything else as it is.
    `bucket_level`: the request was about the bucket itself (a 404 there is a missing bucket)."""
    from botocore import exceptions as bx

    if isinstance(exc, S3Error):
        return exc
    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
        return S3NoCredentials(
            errno.ENOKEY,
            "no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
            url,
        )
    if isinstance(exc, bx.EndpointConnectionError | bx.ConnectTimeoutError):
        timed_out = isinstance(exc, bx.ConnectTimeoutError)
        endpoint = one_line(str(getattr(exc, "kwargs", {}).get("endpoint_url", "") or ""), 120)
        at = f" at {endpoint}" if endpoint else ""
        return S3Unreachable(
            errno.ETIMEDOUT if timed_out else errno.ECONNREFUSED,
            f"cannot reach the S3 endpoint{at} ({'connect timeout' if timed_out else 'connection refused'}); "
            f"{ENDPOINT_FIX}",
            url,
        )
    if isinstance(exc, bx.ClientError):
        return from_code(exc, url, bucket_level=bucket_level)
    if isinstance(exc, bx.BotoCoreError):
        return S3Failed(errno.EIO, f"S3 client error ({one_line(str(exc))}); retry, or check the endpoint", url)
    return exc


# an answer that says "not now": the same request may succeed later (throttling, a server's transient failure)
RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "BadGateway",
        "GatewayTimeout",
    }
)
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


def retryable(exc: BaseException) -> bool:
    """Whether the request that raised `exc` may succeed if sent again: throttling, a 5xx, a connection
    refused, reset or timed out (the server restarting, a proxy's hiccup). A refusal (access, credentials,
    a missing bucket or key, a failed condition) is not: sending it again gets the same answer."""
    from botocore import exceptions as bx

    if isinstance(exc, S3Error):
        return False
    if isinstance(exc, bx.ClientError):
        response = getattr(exc, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code in RETRYABLE_CODES or status in RETRYABLE_STATUS
    transient = (
        bx.ConnectionError,  # refused, closed by the server, a proxy's
        bx.HTTPClientError,
        bx.ReadTimeoutError,
        bx.ConnectTimeoutError,
        bx.ResponseStreamingError,
        bx.IncompleteReadError,
        ConnectionError,  # a reset or broken pipe while a response body is read
        TimeoutError,
    )
    return isinstance(exc, transient) and not isinstance(exc, bx.SSLError)


def gave_up(err: BaseException, attempts: int, seconds: float) -> BaseException:
    """`err` (an S3Error) saying that it is the last of `attempts` tries over `seconds`, and what bounds them."""
    if not isinstance(err, S3Error):
        return err
    note = (
        f" (gave up after {attempts} attempts in {seconds:.0f} s; SLIMCKPT_S3_RETRIES and SLIMCKPT_S3_RETRY_S "
        f"bound the retries)"
    )
    return type(err)(err.errno, f"{err.strerror}{note}", err.filename)


def from_code(exc: BaseException, url: str, *, bucket_level: bool = False) -> S3Error:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    bucket = bucket_of(url)
    if code == "NoSuchBucket" or (bucket_level and (code in ("404", "NotFound") or status == 404)):
        return S3NoBucket(
            errno.ENOENT,
            f"no bucket {bucket!r} at this endpoint; create the bucket, fix the URL, or set AWS_ENDPOINT_URL "
            f"to the server that has it",
            url,
        )
    if code in ("NoSuchKey", "404", "NotFound", "NoSuchUpload") or status == 404:
        return S3NotFound(errno.ENOENT, "no such object; check the URL (is the step committed?)", url)
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "InvalidSecurity"):
        return S3BadCredentials(
            errno.EKEYREJECTED, f"the server rejected the credentials ({code}); {CREDENTIALS_FIX}", url
        )
    if code in ("AuthorizationHeaderMalformed", "PermanentRedirect", "IllegalLocationConstraintException") or (
        status == 301
    ):
        region = region_named(exc)
        fix = f"set AWS_REGION={region}" if region else "set AWS_REGION to the bucket's region"
        return S3WrongRegion(errno.EREMOTE, f"the bucket is in another region ({code or status}); {fix}", url)
    if code in ("AccessDenied", "403", "Forbidden", "AllAccessDisabled") or status == 403:
        return S3AccessDenied(
            errno.EACCES,
            f"access denied ({code or status}); grant this identity read, write, list and delete on "
            f"s3://{bucket}, or {CREDENTIALS_FIX}",
            url,
        )
    message = one_line(str(response.get("Error", {}).get("Message", "")))
    said = f": {message}" if message else ""
    return S3Failed(errno.EIO, f"S3 request failed ({code or status}{said}); retry, or check the server", url)


__all__ = [
    "S3AccessDenied",
    "S3BadCredentials",
    "S3Error",
    "S3Failed",
    "S3NoBucket",
    "S3NoConditionalWrites",
    "S3NoCredentials",
    "S3NotFound",
    "S3Unreachable",
    "S3WrongRegion",
    "gave_up",
    "mapped",
    "no_conditional_writes",
    "one_line",
    "retryable",
]
