"""The corpus's files wherever they live: a local directory or a bucket (`s3://`, `gs://`, `abfs://`,
query parameters such as `endpoint_override` kept), always through `raychat.storage.Storage`.

On a cluster the corpus sits in one bucket that every node reads by range: a read fetches the
shard's footer and then only the column chunk of its row group, never the whole shard. The footer is
also the shard's fingerprint (a hash of its bytes, with the file size): the driver records the
fingerprints of all shards once (the corpus identity), every read checks its shard against them, so
a shard replaced under a running job or a node-local copy that differs is named in one line instead
of silently feeding other documents. A transient fault (throttling, a reset, a 5xx) is retried within
the budget of raychat.faults, then fails the attempt for Ray to restart; a shard that is gone,
refused or damaged fails in one line naming the object.
"""

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from raychat.common import RaychatError
from raychat.faults import is_missing, retry_transient
from raychat.locations import join_uri
from raychat.storage import FileInfo, Storage

TAIL_BYTES = 64 * 1024    # one range request fetches the footer of a shard of ClimbMix's layout
CHECK_HINT = "check it with `python -m raychat.corpus check --deep DATA_DIR`"


@functools.lru_cache(maxsize=8)
def corpus_storage(location: str) -> Storage:
    """The corpus directory's Storage, one per location and process: a read task reuses its S3 client,
    and indexing thousands of shards does not resolve a bucket's region once per shard."""
    return Storage(location)


def shard_name(path: str) -> str:
    """A shard's name in its corpus directory, from its filesystem path (shards sit directly in it)."""
    return path.rsplit("/", 1)[-1]


def object_uri(location: str, path: str) -> str:
    """What a message names: the shard's URI (or local path), without the location's ?query (which
    configures the filesystem and may carry credentials)."""
    return join_uri(location.split("?", 1)[0], shard_name(path))


@dataclass(frozen=True)
class Footer:
    """A shard's parquet footer as read from its tail, and what identifies the shard."""
    metadata: pq.FileMetaData
    size: int
    fingerprint: str   # sha256 of the footer's bytes (row group offsets and sizes, schema), 16 hex digits


def _parse_tail(tail: bytes, size: int, uri: str) -> tuple[int, bytes] | None:
    """(footer length, footer bytes) from the file's last bytes; None when the tail is too short."""
    if size < 12 or tail[-4:] != b"PAR1":
        raise RaychatError(f"{uri} is not a readable parquet file (no PAR1 magic at its end): delete it and "
                           "re-create it (`python -m raychat.corpus download` re-fetches missing shards)")
    (length,) = struct.unpack("<I", tail[-8:-4])
    if length + 12 > size:
        raise RaychatError(f"{uri} is not a readable parquet file (its footer is longer than the file: "
                           "truncated): delete it and re-create it")
    if length + 8 > len(tail):
        return None
    return length, tail[-8 - length:-8]


def read_footer(location: str, path: str) -> Footer:
    """The footer of one shard in one range request (two for a footer over TAIL_BYTES), transient
    faults retried (raychat.faults); a shard that is gone or refused raises its OSError."""
    storage, uri = corpus_storage(location), object_uri(location, path)

    def read() -> Footer:
        with storage.open_random(shard_name(path)) as f:
            return footer_of(f, uri)

    return retry_transient(read, f"reading the footer of {uri}")


def footer_of(f: pa.NativeFile, uri: str) -> Footer:
    """The footer of an open shard, from its tail."""
    size = f.size()
    tail = f.read_at(min(size, TAIL_BYTES), max(0, size - TAIL_BYTES))
    parsed = _parse_tail(tail, size, uri)
    if parsed is None:
        (length,) = struct.unpack("<I", tail[-8:-4])
        tail = f.read_at(length + 8, size - length - 8)
        parsed = _parse_tail(tail, size, uri)
    length, footer = parsed
    # The footer alone, framed as a file: pyarrow parses it without another request.
    framed = b"PAR1" + footer + struct.pack("<I", length) + b"PAR1"
    try:
        metadata = pq.read_metadata(pa.BufferReader(framed))
    except (pa.ArrowException, OSError) as e:
        raise RaychatError(f"{uri} is not a readable parquet file ({' '.join(str(e).split())}): delete it "
                           "and re-create it (`python -m raychat.corpus download` re-fetches missing shards)"
                           ) from e
    return Footer(metadata, size, hashlib.sha256(footer).hexdigest()[:16])


def _reason(error: BaseException) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__


def read_row_group(location: str, path: str, row_group: int, rows: Sequence[int] | None = None,
                   fingerprint: str = "") -> pa.ChunkedArray:
    """The `text` column of one row group (or `rows` of it), by range reads: the footer, then the
    row group's column chunk. Transient faults are retried (raychat.faults: StorageUnavailable past
    the budget); a shard that is gone, refused or damaged, or whose footer no longer matches
    `fingerprint`, is one RaychatError naming the object (no retry can fix it)."""
    uri = object_uri(location, path)
    storage = corpus_storage(location)

    def read() -> pa.Table:
        with storage.open_random(shard_name(path)) as f:
            footer = footer_of(f, uri)
            if fingerprint and footer.fingerprint != fingerprint:
                raise RaychatError(f"{uri} changed since the corpus was indexed (footer fingerprint "
                                   f"{footer.fingerprint}, expected {fingerprint}): a shard must not "
                                   "change under a run; restore it, or start a new run (--run-name) on the "
                                   "new corpus")
            return pq.ParquetFile(f, metadata=footer.metadata).read_row_group(row_group, columns=["text"])

    try:
        table = retry_transient(read, f"reading {uri} row group {row_group}")
    except (OSError, pa.ArrowException) as e:   # not transient: gone, refused, or bytes that do not parse
        if is_missing(e):
            raise RaychatError(f"{uri} is gone: a shard must not be removed under a run; restore it, or "
                               "start a new run (--run-name) on the new corpus") from None
        raise RaychatError(f"{uri}: row group {row_group} cannot be read ({_reason(e)}); "
                           f"{CHECK_HINT.replace('DATA_DIR', location)}") from e
    column = table.column(0)
    if rows is not None:
        column = column.take(pa.array(rows, type=pa.int64()))
    return column


def list_shard_files(storage: Storage, pattern) -> list[tuple[int, FileInfo]]:
    """(shard number, file info) of every file whose name matches `pattern`, in shard order."""
    shards = []
    for info in storage.files():
        match = pattern.match(info.base_name)
        if match:
            shards.append((int(match.group(1)), info))
    shards.sort(key=lambda s: s[0])
    return shards
