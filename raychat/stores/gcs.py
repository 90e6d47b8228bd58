"""Google Cloud Storage natively (`gs://bucket/prefix`): pyarrow's GcsFileSystem for every read and
write (what Ray Train and Ray Data use for gs:// too), google-cloud-storage for what pyarrow does not
offer: a create with `ifGenerationMatch=0` (GCS's atomic "only if absent", what a run's lease rests
on), one whole read of one generation, and lookups, listings and deletes by prefix (pyarrow's see a
"directory" only where a marker object was written, and take a failed listing for "not there").

Why these two clients: pyarrow's is already in every process and streams large objects well;
google-cloud-storage is Google's own client for the JSON API's preconditions (obstore has them too,
but would be a third client for one request). Both find credentials the same way, Application
Default Credentials: GOOGLE_APPLICATION_CREDENTIALS naming a service-account key file, the gcloud
CLI's `application-default login`, or the VM's or GKE pod's service account. A URI never carries
them (so none is ever printed); `anonymous=true` goes without (public buckets, emulators).

The URI's query configures both clients: `endpoint_override=host:port` and `scheme=http` (an
emulator), `anonymous=true`, `project_id=...`, `retry_limit_seconds=N` (how long pyarrow's client
retries a transient fault itself before raychat.faults takes over with its budget and its log lines;
default 20, as pyarrow's S3 client gives up after a few tries).
"""

import functools
import os
from contextlib import suppress
from datetime import timedelta
from urllib.parse import parse_qsl, unquote, urlsplit

import pyarrow.fs as pafs

from raychat.common import RaychatError, require_extra
from raychat.locations import SafeLocation
from raychat.stores.uri import bucket_and_key, endpoint_override

QUERY = ("endpoint_override", "scheme", "anonymous", "project_id", "retry_limit_seconds")
RETRY_LIMIT_S = 20.0
CREDENTIALS_HINT = ("set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, run `gcloud auth "
                    "application-default login`, or run where a service account is attached (a GCE VM, a GKE "
                    "pod with Workload Identity); for an emulator or a public bucket add anonymous=true")


def options(location: SafeLocation) -> dict[str, str]:
    """The URI's query as the clients' settings; a parameter raychat does not know, a malformed one or
    credentials in the URI are refused in one line (a typo must not fall back to other settings)."""
    parts = urlsplit(location.unredacted())
    if parts.username or parts.password:
        raise RaychatError(f"{location}: a gs:// URI carries no credentials; {CREDENTIALS_HINT}")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    if unknown := sorted(set(query) - set(QUERY)):
        raise RaychatError(f"{location}: unknown query parameter {unknown[0]!r} for gs://; the known ones "
                           f"are {', '.join(QUERY)}")
    if query.get("scheme", "https") not in ("http", "https"):
        raise RaychatError(f"{location}: scheme={query['scheme']!r} must be http or https")
    if query.get("anonymous", "false").lower() not in ("true", "false", "1", "0"):
        raise RaychatError(f"{location}: anonymous={query['anonymous']!r} must be true or false")
    try:
        if not 0 <= float(query.get("retry_limit_seconds", RETRY_LIMIT_S)) <= 3600:  # (nan fails too)
            raise ValueError
    except ValueError:
        raise RaychatError(f"{location}: retry_limit_seconds={query['retry_limit_seconds']!r} must be a "
                           "number of seconds from 0 to 3600") from None
    return query


def _check_key_file(location: SafeLocation) -> None:
    """GOOGLE_APPLICATION_CREDENTIALS, when set, must name a readable file: pyarrow's client aborts the
    process (an uncaught C++ exception) on a directory, as a Kubernetes secret mounted at that path is."""
    path = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
        what = "a directory" if os.path.isdir(path) else "not a readable file"
        raise RaychatError(f"{location}: GOOGLE_APPLICATION_CREDENTIALS={path} is {what}: point it at the "
                           "service account's key file (a mounted secret's file, not its directory), or "
                           "unset it to use the machine's own credentials")


def _anonymous(query: dict[str, str]) -> bool:
    return query.get("anonymous", "false").lower() in ("true", "1")


def filesystem(location: SafeLocation) -> tuple[pafs.GcsFileSystem, str]:
    """pyarrow's filesystem for the location, and the location's path in it ("bucket/prefix")."""
    query = options(location)
    if not _anonymous(query):
        _check_key_file(location)
    parts = urlsplit(location.unredacted())
    fs = pafs.GcsFileSystem(
        anonymous=_anonymous(query), scheme=query.get("scheme"),
        endpoint_override=query.get("endpoint_override"), project_id=query.get("project_id"),
        retry_time_limit=timedelta(seconds=float(query.get("retry_limit_seconds", RETRY_LIMIT_S))))
    # The path percent-decoded, as pyarrow's own URI parsing does for s3:// (a %23 names a '#')
    return fs, f"{parts.netloc}{unquote(parts.path)}".rstrip("/")


endpoint = endpoint_override


def create_exclusive(location: SafeLocation, path: str, data: bytes, shown: str) -> bool:
    """An upload with `ifGenerationMatch=0`: True if it created `path`, False if a live object was
    there (412). Any other answer is a fault as `fault` sorts it, never "created" nor "taken"; it is
    not retried here (raychat.faults retries, and a retry that finds its own lost-answer create
    reads False, which the lease's callers already take as "look at what is there")."""
    from google.api_core import exceptions

    bucket, key = bucket_and_key(path)
    blob = client(location).bucket(bucket).blob(key)
    try:
        blob.upload_from_string(data, if_generation_match=0, retry=None, timeout=60)
        return True
    except exceptions.PreconditionFailed:
        return False
    except Exception as e:
        raise fault(e, f"creating {shown}") from None


def read_whole(location: SafeLocation, path: str, shown: str) -> bytes:
    """One GET of the live generation, whole (never a mix of two generations)."""
    from google.api_core import exceptions

    bucket, key = bucket_and_key(path)
    try:
        return client(location).bucket(bucket).blob(key).download_as_bytes(retry=None, timeout=60)
    except exceptions.NotFound:
        raise FileNotFoundError(f"reading {shown}: not found") from None
    except Exception as e:
        raise fault(e, f"reading {shown}") from None


def entries(location: SafeLocation, path: str) -> list[pafs.FileInfo]:
    """What lies directly below `path` ("bucket/prefix"), files with their sizes and "directories" from
    the listing's common prefixes. pyarrow's own non-recursive listing on GCS shows a directory only
    where a marker object ("prefix/") was written for it, which nothing writing by name (raychat's
    ranks, Ray, gcloud storage cp) does: a run's checkpoints would be invisible."""
    bucket, key = bucket_and_key(path)
    prefix = f"{key.rstrip('/')}/" if key else ""
    try:
        listing = client(location).list_blobs(bucket, prefix=prefix, delimiter="/", retry=None, timeout=60)
        found = [pafs.FileInfo(f"{bucket}/{blob.name}", pafs.FileType.File, size=blob.size,
                               mtime=blob.updated)
                 for blob in listing if not blob.name.endswith("/")]  # the markers pyarrow writes
        found += [pafs.FileInfo(f"{bucket}/{sub.rstrip('/')}", pafs.FileType.Directory)
                  for sub in listing.prefixes]  # known once the pages are read
    except Exception as e:
        raise fault(e, f"listing gs://{path}") from None
    return sorted(found, key=lambda info: info.path)


def info(location: SafeLocation, path: str) -> pafs.FileInfo:
    """What `path` ("bucket/prefix") is: a file (an object of that name), a directory (objects below
    it), or not found. pyarrow's answer for a prefix without a marker object lists it, and takes a
    listing that failed past its own retries for "nothing there": a checkpoint hit by a moment of
    503s would read as missing, and be skipped or deleted. Here a fault stays a fault."""
    bucket, key = bucket_and_key(path)
    try:
        gcs = client(location)
        if key and not key.endswith("/"):
            blob = gcs.bucket(bucket).get_blob(key, retry=None, timeout=60)
            if blob is not None:
                return pafs.FileInfo(path, pafs.FileType.File, size=blob.size, mtime=blob.updated)
        prefix = f"{key.rstrip('/')}/" if key else ""
        below = gcs.list_blobs(bucket, prefix=prefix, max_results=1, retry=None, timeout=60)
        if next(iter(below), None) is not None or not key:  # the bucket itself is there: it answered
            return pafs.FileInfo(path, pafs.FileType.Directory)
    except Exception as e:
        raise fault(e, f"looking up gs://{path}") from None
    return pafs.FileInfo(path, pafs.FileType.NotFound)


def delete_tree(location: SafeLocation, path: str) -> None:
    """Delete every object below `path` ("bucket/prefix"), the directory markers pyarrow writes
    included. pyarrow's delete_dir ends by deleting the directory's own marker and fails (404) where
    there is none, as below a prefix written by name."""
    from google.api_core import exceptions

    bucket, key = bucket_and_key(path)
    try:
        for blob in client(location).list_blobs(bucket, prefix=f"{key.rstrip('/')}/", retry=None, timeout=60):
            with suppress(exceptions.NotFound):  # gone already: a concurrent delete
                blob.delete(retry=None, timeout=60)
    except Exception as e:
        raise fault(e, f"deleting gs://{path}") from None


def check_credentials(location: SafeLocation) -> None:
    """Find the credentials the location's clients will use now (a PermissionError saying how to give
    them when there are none), so a node without them is told at start, not after pyarrow's client has
    retried the metadata server for its whole retry limit."""
    client(location)


def client(location: SafeLocation):
    """google-cloud-storage's client for the location's endpoint and credentials, one per process and
    endpoint (it keeps its connections)."""
    query = options(location)
    require_extra("google.cloud.storage", "gcs", str(location))
    return _client(query.get("endpoint_override"), query.get("scheme", "https"), _anonymous(query),
                   query.get("project_id"))


@functools.lru_cache(maxsize=8)
def _client(endpoint_url: str | None, scheme: str, anonymous: bool, project: str | None):
    import google.auth.exceptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client_options = None
    if endpoint_url:
        client_options = {"api_endpoint": endpoint_url if "://" in endpoint_url else f"{scheme}://{endpoint_url}"}
    if anonymous:
        return storage.Client(project=project or "anonymous", credentials=AnonymousCredentials(),
                              client_options=client_options)
    try:
        return storage.Client(project=project, client_options=client_options)
    except google.auth.exceptions.DefaultCredentialsError:
        raise PermissionError(f"no Google credentials found (access denied); {CREDENTIALS_HINT}") from None


def fault(e: Exception, doing: str) -> OSError:
    """A google-cloud-storage fault of `doing` as raychat.faults sorts storage faults: throttling (429),
    a 5xx (but 501), a conflict of racing writes (409), no answer at all (a reset, a refused
    connection, a timeout) are ConnectionError (transient, retried); any other answer is an OSError
    (PermissionError for 401/403), with the service's own message."""
    from google.api_core import exceptions

    if isinstance(e, exceptions.GoogleAPICallError):
        status = int(e.code or 0)
        message = " ".join(str(e.message).split())[:200]
        if status in (408, 409, 429) or (status >= 500 and status != 501):
            return ConnectionError(f"{doing}: HTTP {status} {message}")
        if status in (401, 403):
            return PermissionError(f"{doing}: access denied (HTTP {status} {message})")
        if status == 404:
            return OSError(f"{doing}: not found, the bucket does not exist (HTTP 404 {message})")
        return OSError(f"{doing}: HTTP {status} {message}")
    import google.auth.exceptions
    import requests

    if isinstance(e, PermissionError):
        return e
    if isinstance(e, google.auth.exceptions.RefreshError):
        # Exchanging the credentials for a token failed. Its message may quote what the token
        # endpoint echoed (a signed assertion, good for a token while it lasts): never shown.
        if getattr(e, "retryable", False):
            return ConnectionError(f"{doing}: the token endpoint failed (RefreshError)")
        return PermissionError(f"{doing}: access denied: the credentials were refused when exchanged for "
                               "a token (RefreshError)")
    # requests' ConnectionError/Timeout/ChunkedEncodingError, google-auth's TransportError, a socket's
    # own: the request got no whole answer.
    if isinstance(e, (requests.RequestException, google.auth.exceptions.TransportError, ConnectionError,
                      TimeoutError)):
        return ConnectionError(f"{doing}: {type(e).__name__}")
    return OSError(f"{doing}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
