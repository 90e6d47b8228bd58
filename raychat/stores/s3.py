"""S3 and S3-compatible stores, through boto3: pyarrow's S3 filesystem has no conditional write, and
its reads are a HEAD for the size then a ranged GET, which can mix two versions of an object that is
replaced in between. boto3 is imported when a bucket is first used."""

from urllib.parse import parse_qsl, unquote, urlsplit

from raychat.locations import SafeLocation
from raychat.stores.uri import bucket_and_key, endpoint_override


def create_exclusive(location: SafeLocation, path: str, data: bytes, shown: str) -> bool:
    """A PUT with `If-None-Match: *` (AWS S3 since 2024, MinIO, moto 5.2): True if it created `path`,
    False if an object was there. Any other answer is a fault as `fault` sorts it, never "created"
    nor "taken"."""
    bucket, key = bucket_and_key(path)
    try:
        client(location).put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        return True
    except botocore_errors().ClientError as e:
        if _code(e) in ("PreconditionFailed", "412"):
            return False
        raise fault(e, f"creating {shown}") from None
    except botocore_errors().BotoCoreError as e:
        raise fault(e, f"creating {shown}") from None


def read_whole(location: SafeLocation, path: str, shown: str) -> bytes:
    """One GET without a range: one version of the object, whole."""
    bucket, key = bucket_and_key(path)
    try:
        return client(location).get_object(Bucket=bucket, Key=key)["Body"].read()
    except botocore_errors().ClientError as e:
        if _code(e) in ("NoSuchKey", "404") or _status(e) == 404:
            raise FileNotFoundError(f"reading {shown}: not found") from None
        raise fault(e, f"reading {shown}") from None
    except botocore_errors().BotoCoreError as e:
        raise fault(e, f"reading {shown}") from None


endpoint = endpoint_override


def client(location: SafeLocation):
    """A boto3 client for the location's endpoint and credentials. Credentials come from the URI when
    it carries them, else from boto3's own chain (environment, profile, instance role), as pyarrow's do."""
    import boto3

    parts = urlsplit(location.unredacted())  # the client is built here, with the credentials
    query = dict(parse_qsl(parts.query))
    url = query.get("endpoint_override")
    if url and "://" not in url:
        url = f"{query.get('scheme', 'https')}://{url}"
    kwargs: dict = {"endpoint_url": url or None, "region_name": query.get("region") or None}
    if parts.username:
        kwargs.update(aws_access_key_id=unquote(parts.username),
                      aws_secret_access_key=unquote(parts.password or ""))
    return boto3.client("s3", **kwargs)


def fault(e: Exception, doing: str) -> OSError:
    """A boto3 fault of `doing` as raychat.faults sorts storage faults: a racing conditional write still
    in flight (409), throttling, a 5xx and an endpoint unreachable, a read timeout or a reset are
    ConnectionError (transient, retried); any other answer is an OSError."""
    if not isinstance(e, botocore_errors().ClientError):  # BotoCoreError: no answer at all
        return ConnectionError(f"{doing}: {type(e).__name__}")
    code, status = _code(e), _status(e)
    transient = ("ConditionalRequestConflict", "SlowDown", "Throttling")
    # 501: the store does not implement the request (a conditional write, say), now or on a retry.
    if code != "NotImplemented" and (code in transient or status in (409, 429) or (status >= 500
                                                                                   and status != 501)):
        return ConnectionError(f"{doing}: {code or status}")
    return OSError(f"{doing}: {code or e}")


def _code(e) -> str:
    return e.response.get("Error", {}).get("Code", "")


def _status(e) -> int:
    return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0


def botocore_errors():
    """botocore's exceptions module, imported when a bucket is used (boto3 is only needed there)."""
    import botocore.exceptions

    return botocore.exceptions
