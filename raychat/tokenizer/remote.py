"""A tokenizer directory in a bucket, read once per node into a local cache.

The tokenizer is a few MB that every rank and every Ray Data read task loads; fetching it from the
bucket in each of them would cost a request storm per attempt, and tiktoken wants local files
anyway. So the files are copied into `$RAYCHAT_HOME/tokenizers/<hash of the URI>/` once per node, and
each process re-reads only the bucket's small marker file (meta.json, which carries the fingerprint)
to see whether the cached copy is still the bucket's. The fingerprint checks downstream (driver
against checkpoint, every rank against the driver) then hold for a bucket exactly as for a path.
"""

import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa

from raychat.common import RaychatError, raychat_home
from raychat.faults import is_missing, retry_transient
from raychat.storage import Storage, _storage_reason


def cache_dir(location: str) -> Path:
    return raychat_home() / "tokenizers" / hashlib.sha256(location.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=8)
def local_copy(location: str, names: tuple[str, ...], marker: str) -> Path:
    """The local directory holding `names` and `marker` as they are under the URI `location`; fetched
    when the cache is absent or its marker differs from the bucket's. Once per process and URI."""
    remote = Storage(location)
    wanted = _read(remote, marker, "train one with `python -m raychat.tokenizer train --tokenizer-dir DIR` "
                   "and copy DIR into the bucket")
    target = cache_dir(location)
    if (target / marker).is_file() and (target / marker).read_bytes() == wanted:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Into a fresh directory, then renamed into place: a process on the same node never sees half a copy.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        for name in names:
            data = _read(remote, name, "copy the whole tokenizer directory into the bucket again")
            (staging / name).write_bytes(data)
        (staging / marker).write_bytes(wanted)  # last, as the trainer writes it
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    except OSError:
        if not (target / marker).is_file():  # another process on this node renamed its copy first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _read(remote: Storage, name: str, fix: str) -> bytes:
    """`name`'s bytes, its faults sorted as every storage read's are (raychat.faults): a transient one
    (throttling, a reset) is retried within the budget, then fails the attempt as StorageUnavailable
    for Ray to restart it; a missing file or a refusal is the user's to fix, in one line."""
    try:
        return retry_transient(lambda: remote.read_bytes(name), f"reading the tokenizer's {name} in {remote}")
    except (OSError, pa.ArrowException) as e:
        if is_missing(e):
            raise RaychatError(f"no tokenizer at {remote} ({name} not found): {fix}") from None
        reason = remote.location.scrub(_storage_reason(e, access="read"))
        raise RaychatError(f"the tokenizer at {remote} cannot be read ({name}: {reason})") from None
