"""The requests raychat makes of a bucket that pyarrow's filesystems do not expose: an exclusive
create (what a run's lease rests on), one whole read of one version, and the endpoint a URI names.

raychat.storage reads and writes everything else through pyarrow (as Ray Train and Ray Data do); it
turns to the module for the location's scheme (`bucket_api`) only for these. Each module offers
the same functions, so Storage never asks which store it is on beyond that lookup:

    create_exclusive(location, path, data, shown) -> bool   # False: something is there already
    read_whole(location, path, shown) -> bytes             # FileNotFoundError when it is not there
    endpoint(location) -> (host, port) | None              # the endpoint_override, for the pre-flight
"""

from types import ModuleType
from urllib.parse import parse_qsl, urlsplit

from raychat.locations import SafeLocation

SCHEMES = ("s3", "gs")


def bucket_api(location: SafeLocation) -> ModuleType | None:
    """raychat.stores.s3 or raychat.stores.gcs for a location in such a bucket, None for anything else
    (local disk, NFS, a store raychat only reads and writes through pyarrow)."""
    scheme = urlsplit(location).scheme
    if scheme == "s3":
        from raychat.stores import s3

        return s3
    if scheme == "gs":
        from raychat.stores import gcs

        return gcs
    return None


def endpoint_override(location: SafeLocation) -> tuple[str, int] | None:
    """The host and port of the endpoint a bucket URI names in its query (`endpoint_override`, with
    `scheme` deciding the default port), if it names one."""
    query = dict(parse_qsl(urlsplit(location.unredacted()).query))
    endpoint = query.get("endpoint_override")
    if not endpoint:
        return None
    scheme = query.get("scheme", "https")
    parts = urlsplit(endpoint if "://" in endpoint else f"{scheme}://{endpoint}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # not a port: the filesystem's own error says so
        return None
    return (parts.hostname, port) if parts.hostname else None


def bucket_and_key(path: str) -> tuple[str, str]:
    """A filesystem path in a bucket ("bucket/prefix/name") as (bucket, key)."""
    bucket, _, key = path.lstrip("/").partition("/")
    return bucket, key
