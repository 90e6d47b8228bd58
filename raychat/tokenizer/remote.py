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
from raychat.storage import Storage, redact


def cache_dir(location: str) -> Path:
    return raychat_home() / "tokenizers" / hashlib.sha256(location.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=8)
def local_copy(location: str, names: tuple[str, ...], marker: str) -> Path:
    """The local directory holding `names` and `marker` as they are under the URI `location`; fetched
    when the cache is absent or its marker differs from the bucket's. Once per process and URI."""
    remote = Storage(location)
    try:
        wanted = remote.read_bytes(marker)
    except (OSError, pa.ArrowException) as e:
        raise RaychatError(f"no tokenizer at {redact(location)} ({marker} unreadable: {e}): train one "
                           "with `python -m raychat.tokenizer train --tokenizer-dir DIR` and copy DIR into "
                           "the bucket") from e
    target = cache_dir(location)
    if (target / marker).is_file() and (target / marker).read_bytes() == wanted:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Into a fresh directory, then renamed into place: a process on the same node never sees half a copy.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        for name in names:
            try:
                data = remote.read_bytes(name)
            except (OSError, pa.ArrowException) as e:
                raise RaychatError(f"tokenizer at {redact(location)} is incomplete ({name} unreadable: "
                                   f"{e}): copy the whole tokenizer directory into the bucket again") from e
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
