"""Where runs live: a directory on local disk, NFS or an object store, addressed by one string.

Ray Train reads and writes its storage through `pyarrow.fs`, so raychat does too, everywhere: the
driver, the workers, `raychat.sample` and the sweeps. A location is a local path or a URI
(`s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http`, `gs://bucket/runs`, `abfs://...`); its
query parameters configure the filesystem and must stay at the end, so a child is joined onto the
URI's path, never appended after its `?query` and never through `pathlib` (which folds `s3://` to
`s3:/`).
"""

import errno
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import ModuleType
from typing import BinaryIO, TypeVar
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from raychat.common import RaychatError, StorageUnavailable, check_name, default_storage_path, unreachable
from raychat.locations import (
    join_uri,
    normalize_location,
)
from raychat.stores import bucket_api, gcs

T = TypeVar("T")
FileInfo = pafs.FileInfo  # what listings return: base_name, path, size, type


class Storage:
    """A directory at a local path or URI, with the few operations runs need."""

    def __init__(self, location: str, filesystem: pafs.FileSystem | None = None, root: str | None = None):
        self.location = normalize_location(location)
        if filesystem is None and self._scheme == "gs":
            filesystem, root = gcs.filesystem(self.location)  # pyarrow's parsing knows no anonymous=true
        elif filesystem is None:
            try:
                filesystem, root = pafs.FileSystem.from_uri(self.location.unredacted())
            except (pa.ArrowException, OSError, ValueError) as e:
                reason = self.location.scrub((str(e).strip().splitlines() or [type(e).__name__])[0])
                raise RaychatError(f"cannot open storage {self.location}: {reason}; check the URI's "
                                   "scheme, bucket and query parameters") from None
        self.fs = filesystem
        self.root = root.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"Storage({self.location!r})"

    def __str__(self) -> str:
        """The location without credentials: what every message and log line shows."""
        return str(self.location)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Storage) and other.location == self.location

    def __hash__(self) -> int:
        return hash(self.location)

    @property
    def name(self) -> str:
        return self.root.rsplit("/", 1)[-1]

    @classmethod
    def of(cls, location: "str | Path | Storage") -> "Storage":
        return location if isinstance(location, Storage) else cls(location)

    @property
    def _local(self) -> bool:
        # Every difference between local disk (and NFS) and an object store stays in this class:
        # callers ask for an operation (write_whole, sync, open_append, create_exclusive), not a backend.
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def _scheme(self) -> str:
        return urlsplit(self.location).scheme

    @property
    def _bucket_api(self) -> ModuleType | None:
        """The requests pyarrow lacks, for an S3 or GCS bucket (raychat.stores); None elsewhere."""
        return None if self._local else bucket_api(self.location)

    @property
    def creates_exclusively(self) -> bool:
        """Whether `create_exclusive` can work here: local disk, NFS, S3 and GCS."""
        return self._local or self._bucket_api is not None

    @property
    def appends_in_place(self) -> bool:
        """Whether `open_append` adds to a file where it is (local disk, NFS) or rewrites it whole (an
        object store cannot append): a writer batches its appends where each costs a whole upload."""
        return self._local

    def child(self, *names: str) -> "Storage":
        """The directory (or file) `names` below this one, on the same filesystem."""
        root = "/".join([self.root.rstrip("/"), *(n.strip("/") for n in names)])
        return Storage(join_uri(self.location, *names), self.fs, root)

    def path(self, name: str = "") -> str:
        """The filesystem path (no scheme, no query) of `name` below this directory."""
        return f"{self.root.rstrip('/')}/{name}" if name else self.root

    def info(self, name: str = "") -> pafs.FileInfo:
        if self._scheme == "gs":
            return gcs.info(self.location, self.path(name))  # pyarrow's takes a fault for "not there"
        return self.fs.get_file_info(self.path(name))

    def exists(self, name: str = "") -> bool:
        return self.info(name).type != pafs.FileType.NotFound

    def is_dir(self, name: str = "") -> bool:
        return self.info(name).type == pafs.FileType.Directory

    def is_file(self, name: str = "") -> bool:
        return self.info(name).type == pafs.FileType.File

    def entries(self) -> list[pafs.FileInfo]:
        """Entries directly below this directory (none when it does not exist)."""
        if self._scheme == "gs":
            return gcs.entries(self.location, self.root)  # pyarrow's: no directory without a marker
        try:
            return self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except FileNotFoundError:
            return []

    def subdirs(self) -> list[str]:
        return sorted(info.base_name for info in self.entries() if info.type == pafs.FileType.Directory)

    def files(self) -> list[FileInfo]:
        """The files directly below this directory (base_name, path, size)."""
        return [info for info in self.entries() if info.type == pafs.FileType.File]

    # Bytes are bytes: pyarrow would otherwise (de)compress a name ending in .gz, .bz2, .zst...

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open_input_stream(self.path(name), compression=None) as f:
            return f.read()

    def read_text(self, name: str) -> str:
        return self.read_bytes(name).decode()

    def read_replaceable(self, name: str, tries: int = 5) -> bytes:
        """`name`'s bytes, all of one version, for a file `replace_atomically` may replace while it is
        read (a lease record, the stop note, the corpus meta). pyarrow reads an object as a HEAD for
        its size, then a ranged GET: a replacement between the two came back as the old size's prefix
        of the new object (a heartbeat's beat 9 -> 10 cut a lease record's closing brace) or the new
        one padded with NULs. On S3 this is one GET without a range, which returns one version whole;
        on GCS one GET of the live generation; on other stores the size is asked again after the read
        and the read repeated until they agree (a ConnectionError, retried as a storage fault, if they
        never do)."""
        if self._local:
            return self.read_bytes(name)
        if (api := self._bucket_api) is not None:
            return api.read_whole(self.location, self.path(name), str(self.child(name)))
        for _ in range(tries):
            data = self.read_bytes(name)
            if self.fs.get_file_info(self.path(name)).size == len(data):
                return data
        raise ConnectionError(f"reading {self.child(name)}: it was replaced during each of {tries} reads")

    @contextmanager
    def read_faults_as_errors(self, flag: str = "--storage-path") -> Iterator[None]:
        """For a command that reads a run once (report, evaluate, sample, export): a storage fault
        inside becomes one RaychatError line naming `flag` and the fix (nothing is lost: the user's
        rerun is the retry), never a traceback with the filesystem's text."""
        try:
            yield
        except (OSError, pa.ArrowException) as e:
            reason = self.location.scrub(_storage_reason(e, "read", self._scheme))
            raise RaychatError(f"{flag} {self} cannot be read: {reason}") from None

    @contextmanager
    def open_input(self, name: str) -> Iterator[BinaryIO]:
        with self.fs.open_input_stream(self.path(name), compression=None) as f:
            yield f

    def open_random(self, name: str) -> pa.NativeFile:
        """`name` opened for reads at any offset (a ranged GET per read in a bucket); close it after."""
        return self.fs.open_input_file(self.path(name))

    @contextmanager
    def open_output(self, name: str) -> Iterator[BinaryIO]:
        """A stream that replaces `name` when it closes (an object store publishes it whole)."""
        self.make_dir()
        with self.fs.open_output_stream(self.path(name), compression=None) as f:
            yield f

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.open_output(name) as f:
            f.write(data)

    def make_dir(self) -> None:
        # Object stores have no directories. On GCS pyarrow would write a marker object per level,
        # after two metadata requests each, before every write: raychat lists by prefix instead.
        if self._scheme != "gs":
            self.fs.create_dir(self.root, recursive=True)

    def delete(self, name: str = "") -> None:
        """Delete a file, or this directory with everything below it; gone already is fine."""
        info = self.info(name)
        if info.type == pafs.FileType.Directory and self._scheme == "gs":
            gcs.delete_tree(self.location, self.path(name))
        elif info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path(name))
        elif info.type != pafs.FileType.NotFound:
            self.fs.delete_file(self.path(name))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create `name` holding `data` if nothing is there yet, atomically: True if this call
        created it, False if it existed. Two callers racing never both get True, and a reader sees
        the whole file or none (what a run's lease epochs rest on, raychat.checkpoint.fence).

        Local disk and NFS: the data goes to a private temporary file, then `link` publishes it
        under `name`, which fails if `name` exists (atomic on POSIX and NFSv3+, like O_EXCL). S3: a
        PUT with `If-None-Match: *`; GCS: an upload with `ifGenerationMatch=0` (raychat.stores).
        Other stores are refused: a lease that rests on timing is not a lease."""
        if self._local:
            self.make_dir()
            tmp = self.path(f".{name}.{uuid.uuid4().hex}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.path(name))
                return True
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                raise RaychatError(
                    f"{self} is on a filesystem without hard links (a FUSE mount of a bucket, some SMB "
                    "shares): raychat cannot take the run's lease there atomically; use the bucket itself "
                    "(s3://...) or a local disk or NFS path") from None
            finally:
                os.unlink(tmp)
        if (api := self._bucket_api) is None:
            raise RaychatError(f"{self}: {_NO_ATOMIC_CREATE}")
        return api.create_exclusive(self.location, self.path(name), data, str(self.child(name)))

    def replace_atomically(self, name: str, data: bytes) -> None:
        """Overwrite `name` with `data` so that a reader (`read_replaceable`) sees the old or the new
        content, never a torn or empty file (`write_whole`)."""
        self.write_whole(name, lambda f: f.write(data))

    def write_whole(self, name: str, write: Callable[[BinaryIO], T]) -> T:
        """Write `name` through `write(stream)` (its result returned) so that a reader sees the old
        content, the new or nothing, never a torn file. Local disk: a private temporary file, fsynced,
        then renamed over `name` (removed if `write` fails); an object store publishes an upload whole
        when it closes. The rename is durable once `sync` has run."""
        if not self._local:
            with self.open_output(name) as f:
                return write(f)
        self.make_dir()
        tmp = self.path(f".{name}.{uuid.uuid4().hex}.tmp")  # private: two writers never share one
        try:
            with open(tmp, "wb") as f:
                result = write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(name))
        except BaseException:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return result

    def sync(self) -> None:
        """Make the renames into this directory durable (fsync of the directory on local disk and NFS);
        an object store has nothing to do: each object is durable when its upload completes."""
        if not self._local:
            return
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, name: str, new_name: str) -> None:
        """Give file `name` the name `new_name` (replacing it): a rename on disk, a copy and delete in a
        bucket (so a reader of a bucket may briefly see both)."""
        self.fs.move(self.path(name), self.path(new_name))

    def open_append(self, name: str) -> "tuple[bytes, AppendFile]":
        """What `name` holds now (empty when it does not exist) and a handle that appends to it."""
        existing = self.read_bytes(name) if self.exists(name) else b""
        return existing, AppendFile(self, name, existing)

    def check_endpoint(self, flag: str) -> None:
        """Refuse, in one line naming `flag`, the host and the fix, an endpoint_override whose host does
        not resolve or that nothing answers at. A pre-flight for a command's start only: mid-run the
        same faults are transient (raychat.faults), retried for minutes, which a typo must not cost."""
        if (api := self._bucket_api) is None or (endpoint := api.endpoint(self.location)) is None:
            return
        host, port = endpoint
        if (why := unresolvable(host, budget_s=ENDPOINT_BUDGET_S)) is not None:
            raise RaychatError(f"{flag} {self}: the endpoint's host {host} cannot be resolved ({why}); fix "
                               "the host in endpoint_override (a typo?) or this machine's DNS")
        # A typed endpoint that nothing answers at fails here in seconds; a write or read would retry
        # it for its whole budget, and pyarrow's client for as long again.
        if (why := unreachable(host, port, budget_s=ENDPOINT_BUDGET_S)) is not None:
            raise RaychatError(f"{flag} {self}: the endpoint cannot be reached "
                               f"({host}:{port}: {why}); check endpoint_override, the network and the server")

    def check_writable(self, flag: str = "--storage-path", lease: bool = True) -> None:
        """Write and delete a probe file, or raise one RaychatError line naming the URI and the fix;
        with `lease` (a run's storage), also prove that the store creates a file atomically.

        Called before any worker starts, so an unreachable endpoint, a missing bucket, missing
        credentials, a refused write or a store that cannot give a run its lease costs seconds, not a run.
        """
        from raychat.faults import check_settings, retry_transient, short_reason  # (imports no storage)

        check_settings()  # the retry budget below, and the run's, read from the environment
        if lease and not self.creates_exclusively:
            # Before any request: no credentials, network or time are needed to know this.
            raise RaychatError(f"{flag} {self}: {_NO_ATOMIC_CREATE}")
        self.check_endpoint(flag)
        probe = f".raychat_write_test_{uuid.uuid4().hex}"
        try:
            if self._scheme == "gs":
                gcs.check_credentials(self.location)
            # A short budget: before any worker starts, a typo in the endpoint must cost seconds,
            # while a moment of throttling is still ridden out.
            retry_transient(lambda: self.write_bytes(probe, b"ok"), f"writing a probe file in {self}",
                            budget_s=PROBE_BUDGET_S)
            # A run lists its directory (checkpoints, lease epochs): credentials that may write but
            # not list would fail the first driver step after Ray has started.
            retry_transient(self.entries, f"listing {self}", budget_s=PROBE_BUDGET_S)
            retry_transient(lambda: self.delete(probe), f"deleting the probe file in {self}",
                            budget_s=PROBE_BUDGET_S)
            if lease:
                self._check_atomic_create(flag, retry_transient)
        except StorageUnavailable as e:
            last = self.location.scrub(short_reason(e.__cause__ or e))
            raise RaychatError(f"{flag} {self} is not writable now: it answered with transient faults only "
                               f"(throttling, 5xx, resets) for {PROBE_BUDGET_S:.0f} s, the last {last}; "
                               "retry when the store recovers") from None
        except (OSError, pa.ArrowException) as e:
            reason = self.location.scrub(_storage_reason(e, "write", self._scheme))
            raise RaychatError(f"{flag} {self} is not writable: {reason}") from None

    def _check_atomic_create(self, flag: str, retry_transient: Callable) -> None:
        """Create one scratch file exclusively twice: the second must find it there. A store that
        ignores the precondition (S3's If-None-Match, which some S3-compatible servers and proxies
        drop; GCS's ifGenerationMatch, which emulators ignore) answers both as created, and two
        drivers would each take the run's lease and write it at once."""
        scratch = f".raychat_lease_test_{uuid.uuid4().hex}"
        try:
            for data in (b"1", b"2"):
                # A first create whose answer was lost and is retried may find its own file: False
                # then, and still right. Only a second create that says "created" disproves the store.
                created = retry_transient(lambda data=data: self.create_exclusive(scratch, data),
                                          f"creating a scratch file in {self}", budget_s=PROBE_BUDGET_S)
            if created:
                raise RaychatError(f"{flag} {self} cannot give the run its lease (one writer per run): "
                                   "the store let one file be created exclusively twice (it ignores "
                                   "the create-only-if-absent precondition), so two drivers could both "
                                   "write the run; use S3, GCS, an S3-compatible store that honours "
                                   "If-None-Match, local disk or NFS")
        finally:
            with suppress(OSError, pa.ArrowException, StorageUnavailable):
                retry_transient(lambda: self.delete(scratch), f"deleting the scratch file in {self}",
                                budget_s=PROBE_BUDGET_S)

    @contextmanager
    def write_faults_as_errors(self, flag: str) -> Iterator[None]:
        """For a command that writes here once (a corpus): a storage fault inside becomes one
        RaychatError line naming `flag` and the fix, never a traceback with the filesystem's text."""
        try:
            yield
        except (OSError, pa.ArrowException, StorageUnavailable) as e:
            cause = e.__cause__ if isinstance(e, StorageUnavailable) and e.__cause__ is not None else e
            reason = self.location.scrub(_storage_reason(cause, "write", self._scheme))
            raise RaychatError(f"{flag} {self} cannot be written: {reason}") from None


class AppendFile:
    """A file that only grows (a log). On local disk and NFS each append adds to the file in place; an
    object store cannot append, so there each append rewrites the object whole from the copy kept here
    (the file as read when it was opened, and every append since: one writer per file). An append
    that fails adds nothing: a write cut short in place (a full disk) is cut off again, where the
    filesystem still allows it (a torn line, and what the retry writes again, would follow)."""

    def __init__(self, storage: Storage, name: str, existing: bytes):
        self._storage, self._name = storage, name
        self._content = b"" if storage.appends_in_place else existing

    def append(self, data: bytes) -> None:
        if self._storage.appends_in_place:
            self._storage.make_dir()
            path = self._storage.path(self._name)
            size = self._storage.fs.get_file_info(path).size or 0  # None: not there yet
            try:
                with self._storage.fs.open_append_stream(path) as f:
                    f.write(data)
            except BaseException:
                with suppress(OSError):
                    os.truncate(path, size)
                raise
        else:
            self._storage.write_bytes(self._name, self._content + data)
            self._content += data


Location = str | Path | Storage
# Why a run's storage must be one of these: its lease rests on an atomic create (raychat.checkpoint.fence).
_NO_ATOMIC_CREATE = ("raychat cannot give a run its lease (one writer per run) on this store today: it "
                     "creates a file atomically only on local disk, NFS, GCS (gs://) and S3 or S3-compatible "
                     "stores that honour If-None-Match; use one of those for --storage-path")
PROBE_BUDGET_S = 20.0  # how long the pre-flight write probe rides out transient faults
ENDPOINT_BUDGET_S = 10.0  # how long an endpoint that refuses connections may take to come (back) up


def unresolvable(host: str, budget_s: float) -> str | None:
    """Why `host` does not resolve (the resolver's words), or None once it does. A name the resolver
    says does not exist is a typo, answered at once; a resolver that fails for the moment
    (EAI_AGAIN) is asked again, a second apart, for `budget_s`."""
    deadline = time.monotonic() + budget_s
    while True:
        try:
            socket.getaddrinfo(host, None)
            return None
        except socket.gaierror as e:
            why = (e.strerror or str(e)).lower()
            if e.errno != socket.EAI_AGAIN or time.monotonic() + 1.0 >= deadline:
                return why
        time.sleep(1.0)


def run_directory(storage_path: str, run_name: str) -> Storage:
    """The directory of the run a command reads (--run-name under --storage-path, default
    $RAYCHAT_HOME/runs); a --run-name that is not a name is refused first."""
    return Storage(storage_path or default_storage_path()).child(check_name(run_name, "--run-name"))


def _storage_reason(error: BaseException, access: str = "write", scheme: str = "") -> str:
    """One phrase for why storage refused `access` (to a location with this URI `scheme`), and what to
    do about it."""
    text = " ".join(str(error).split())
    lowered = text.lower()
    if any(s in lowered for s in ("notimplemented", "not_implemented", "not implemented", "status 501")):
        return ("the store does not implement a request raychat makes (501 NotImplemented; a conditional "
                "write, say): use S3, or an S3-compatible store that implements it")
    # (GCS answers a write into a bucket that does not exist with NOT_FOUND: no object is needed)
    if (any(s in lowered for s in ("nosuchbucket", "bucket does not exist", "no such bucket", "not found"))
            and "bucket" in lowered) or (scheme == "gs" and access == "write" and "not_found" in lowered):
        return "the bucket does not exist; create it or fix the bucket name"
    if any(s in lowered for s in ("accessdenied", "access denied", "forbidden", "invalidaccesskeyid",
                                  "signaturedoesnotmatch", "credentials")):
        if scheme == "gs":
            return (f"access denied (missing or wrong credentials); {gcs.CREDENTIALS_HINT}; and grant "
                    f"{access} access")
        return ("access denied (missing or wrong credentials); set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                f"or the provider's credentials, and grant {access} access")
    if any(s in lowered for s in ("curl", "connect", "resolve host", "timed out", "unreachable")):
        return "the endpoint cannot be reached; check endpoint_override, the network and the server"
    if isinstance(error, PermissionError) or "permission denied" in lowered:
        return "permission denied; choose a directory you can write to"
    if "not a directory" in lowered or "file exists" in lowered or "is a file" in lowered:
        return "a file is in the way; choose a directory path"
    return f"{text[:200]}; check the path or URI and its credentials"
