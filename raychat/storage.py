"""Where runs live: a directory on local disk, NFS or an object store, addressed by one string.

Ray Train reads and writes its storage through `pyarrow.fs`, so raychat does too, everywhere: the
driver, the workers, `raychat.sample` and the sweeps. A location is a local path or a URI
(`s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http`, `gs://...`, `abfs://...`); its
query parameters configure the filesystem and must stay at the end, so a child is joined onto the
URI's path, never appended after its `?query` and never through `pathlib` (which folds `s3://` to
`s3:/`).
"""

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs

from raychat.common import RaychatError


def is_uri(location: str) -> bool:
    return "://" in location


def join_uri(location: str, *names: str) -> str:
    """`location`/`names` for a local path or a URI, keeping a URI's ?query at the end."""
    names = tuple(n.strip("/") for n in names if n.strip("/"))
    if not names:
        return location
    if not is_uri(location):
        return str(Path(location, *names))
    parts = urlsplit(location)
    path = "/".join([parts.path.rstrip("/"), *names])
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))


# Query parameters that carry credentials (pyarrow's S3 options access_key, secret_key, session_token,
# and their like on other stores), matched anywhere in the name.
SECRET_PARAM = re.compile(r"key|token|secret|password|credential", re.IGNORECASE)


def redact(location: str) -> str:
    """`location` safe to print, log or store: a URI's user:password@ and credential parameters
    (`s3://KEY:SECRET@bucket/...`, `?secret_key=...`, which pyarrow accepts) become `***`."""
    if not is_uri(location):
        return location
    parts = urlsplit(location)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if SECRET_PARAM.search(k) else v) for k, v in pairs], safe="*:/")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def normalize_location(location: str) -> str:
    """An absolute local path (user and relative paths resolved) or the URI as given."""
    if is_uri(location):
        return location.rstrip("/") if "?" not in location else location
    return str(Path(location).expanduser().resolve())


class Storage:
    """A directory at a local path or URI, with the few operations runs need."""

    def __init__(self, location: str, filesystem: pafs.FileSystem | None = None, root: str | None = None):
        self.location = normalize_location(location)
        if filesystem is None:
            try:
                filesystem, root = pafs.FileSystem.from_uri(self.location)
            except (pa.ArrowException, OSError, ValueError) as e:
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise RaychatError(f"cannot open storage {redact(self.location)}: {reason}; check the URI's "
                                   "scheme, bucket and query parameters") from None
        self.fs = filesystem
        self.root = root.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"Storage({redact(self.location)!r})"

    def __str__(self) -> str:
        """The location without credentials: what every message and log line shows."""
        return redact(self.location)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Storage) and other.location == self.location

    def __hash__(self) -> int:
        return hash(self.location)

    @property
    def name(self) -> str:
        return self.root.rsplit("/", 1)[-1]

    @classmethod
    def of(cls, location: "str | Path | Storage") -> "Storage":
        return location if isinstance(location, Storage) else cls(str(location))

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def child(self, *names: str) -> "Storage":
        """The directory (or file) `names` below this one, on the same filesystem."""
        root = "/".join([self.root.rstrip("/"), *(n.strip("/") for n in names)])
        return Storage(join_uri(self.location, *names), self.fs, root)

    def path(self, name: str = "") -> str:
        """The filesystem path (no scheme, no query) of `name` below this directory."""
        return f"{self.root.rstrip('/')}/{name}" if name else self.root

    def info(self, name: str = "") -> pafs.FileInfo:
        return self.fs.get_file_info(self.path(name))

    def exists(self, name: str = "") -> bool:
        return self.info(name).type != pafs.FileType.NotFound

    def is_dir(self, name: str = "") -> bool:
        return self.info(name).type == pafs.FileType.Directory

    def entries(self) -> list[pafs.FileInfo]:
        """Entries directly below this directory (none when it does not exist)."""
        try:
            return self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except FileNotFoundError:
            return []

    def subdirs(self) -> list[str]:
        return sorted(info.base_name for info in self.entries() if info.type == pafs.FileType.Directory)

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open_input_stream(self.path(name)) as f:
            return f.read()

    def read_text(self, name: str) -> str:
        return self.read_bytes(name).decode()

    @contextmanager
    def open_input(self, name: str) -> Iterator[BinaryIO]:
        with self.fs.open_input_stream(self.path(name)) as f:
            yield f

    @contextmanager
    def open_output(self, name: str) -> Iterator[BinaryIO]:
        """A stream that replaces `name` when it closes (an object store publishes it whole)."""
        self.make_dir()
        with self.fs.open_output_stream(self.path(name)) as f:
            yield f

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.open_output(name) as f:
            f.write(data)

    def make_dir(self) -> None:
        # Object stores have no directories; creating the bucket's prefix is a no-op there.
        self.fs.create_dir(self.root, recursive=True)

    def delete(self, name: str = "") -> None:
        """Delete a file, or this directory with everything below it; gone already is fine."""
        info = self.info(name)
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path(name))
        elif info.type != pafs.FileType.NotFound:
            self.fs.delete_file(self.path(name))

    def check_writable(self, flag: str = "--storage-path") -> None:
        """Write and delete a probe file, or raise one RaychatError line naming the URI and the fix.

        Called before any worker starts, so an unreachable endpoint, a missing bucket, missing
        credentials or a refused write costs seconds, not a run.
        """
        probe = f".raychat_write_test_{uuid.uuid4().hex}"
        try:
            self.write_bytes(probe, b"ok")
            self.delete(probe)
        except (OSError, pa.ArrowException) as e:
            raise RaychatError(f"{flag} {self} is not writable: {_storage_reason(e)}") from None


Location = str | Path | Storage


def _storage_reason(error: BaseException) -> str:
    """One phrase for why storage refused, and what to do about it."""
    text = " ".join(str(error).split())
    lowered = text.lower()
    if any(s in lowered for s in ("nosuchbucket", "bucket does not exist", "no such bucket", "not found")) \
            and "bucket" in lowered:
        return "the bucket does not exist; create it or fix the bucket name"
    if any(s in lowered for s in ("accessdenied", "access denied", "forbidden", "invalidaccesskeyid",
                                  "signaturedoesnotmatch", "credentials")):
        return ("access denied (missing or wrong credentials); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                "or the provider's credentials, and grant write access")
    if any(s in lowered for s in ("curl", "connect", "resolve host", "timed out", "unreachable")):
        return "the endpoint cannot be reached; check endpoint_override, the network and the server"
    if isinstance(error, PermissionError) or "permission denied" in lowered:
        return "permission denied; choose a directory you can write to"
    if "not a directory" in lowered or "file exists" in lowered or "is a file" in lowered:
        return "a file is in the way; choose a directory path"
    return f"{text[:200]}; check the path or URI and its credentials"
