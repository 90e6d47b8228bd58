"""Where in a bucket a location points: its bucket and key, and the endpoint its query names. Shared
by the stores' modules (raychat.stores.s3, raychat.stores.gcs), which read the same URI query keys."""

from urllib.parse import parse_qsl, urlsplit

from raychat.locations import SafeLocation


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
