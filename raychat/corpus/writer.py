"""Writing a corpus: documents in, shards in the layout of `raychat.corpus.index` out.

Every way of making a corpus (ingest, sample, the synthetic fixture) writes through `CorpusWriter`, so
they share the layout, the row-group size and the temp-name protocol that keeps a half-written corpus
from ever looking complete.
"""

import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from raychat.common import RaychatError
from raychat.corpus.files import list_shard_files
from raychat.corpus.index import (
    DEFAULT_DOCS_PER_SHARD,
    ROW_GROUP_SIZE,
    SHARD_NAME,
    shard_filename,
    write_corpus_meta,
)
from raychat.storage import Storage


def _write_shard_file(storage: Storage, name: str, texts: pa.ChunkedArray) -> None:
    # nanochat's shard settings: zstd level 3, no dictionary or statistics (useless for text).
    with storage.open_output(name) as f, pq.ParquetWriter(
            f, pa.schema([("text", pa.string())]), compression="zstd", compression_level=3,
            use_dictionary=False, write_statistics=False) as writer:
        for start in range(0, len(texts), ROW_GROUP_SIZE):
            row_group = texts.slice(start, ROW_GROUP_SIZE).combine_chunks()
            writer.write_table(pa.table({"text": row_group}), row_group_size=ROW_GROUP_SIZE)


class _SplitWriter:
    """Cuts one split's document stream into shards, each written (compressed) on the shared thread
    pool under a temporary name while the caller produces the next; at most a few shards in flight."""

    def __init__(self, storage: Storage, name_of: Callable[[int], str], docs_per_shard: int,
                 pool: ThreadPoolExecutor, max_in_flight: int):
        self.storage, self.name_of, self.docs_per_shard = storage, name_of, docs_per_shard
        self.pool, self.max_in_flight = pool, max_in_flight
        self.pending: list[pa.Array] = []
        self.num_pending = 0
        self.files: list[str] = []   # temporary names, below the output directory
        self.in_flight: deque[Future] = deque()
        self.num_docs = 0

    def add(self, texts: pa.Array) -> None:
        if not len(texts):  # an empty slice would still pin its parent's buffers until close()
            return
        self.pending.append(texts if texts.type == pa.string() else texts.cast(pa.string()))
        self.num_pending += len(texts)
        while self.num_pending >= self.docs_per_shard:
            self._write_shard(self.docs_per_shard)

    def _write_shard(self, size: int) -> None:
        pending = pa.chunked_array(self.pending, type=pa.string())
        rest = pending.slice(size)
        self.pending, self.num_pending = list(rest.chunks), len(rest)
        self.files.append(self.name_of(len(self.files)))
        while len(self.in_flight) >= self.max_in_flight:
            self.in_flight.popleft().result()
        self.in_flight.append(self.pool.submit(_write_shard_file, self.storage, self.files[-1],
                                               pending.slice(0, size)))
        self.num_docs += size

    def close(self) -> None:
        if self.num_pending:
            self._write_shard(self.num_pending)
        while self.in_flight:
            self.in_flight.popleft().result()

    def abort(self) -> None:
        for future in self.in_flight:
            future.cancel()
        wait(self.in_flight)
        self.in_flight.clear()
        for tmp in self.files:
            self.storage.delete(tmp)


class CorpusWriter:
    """Writes a corpus in the layout above: train documents into shard_00000.. in order, val documents
    into the shard after the last train shard, and `source` into corpus.json (what made it: "sample",
    "ingest", ...). Files carry temporary names until `close()`, so an
    interrupted write never leaves something that looks like a complete corpus. Shards are compressed
    on `workers` threads (default: CPU count, at most 8) while the caller produces the next ones.

        with CorpusWriter(out_dir) as writer:
            writer.add_train(texts); writer.add_val(more_texts)
    """

    def __init__(self, out_dir: str | Path, docs_per_shard: int = DEFAULT_DOCS_PER_SHARD,
                 overwrite: bool = False, workers: int | None = None, source: str = "custom"):
        if docs_per_shard < 1:
            raise RaychatError(f"--docs-per-shard must be at least 1, got {docs_per_shard}")
        self.out = Storage(out_dir)   # a local directory or a bucket URI
        self.out_dir = self.out.location
        if self.out.is_file():
            raise RaychatError(f"output {self.out_dir} exists and is not a directory: choose another --out")
        self.out.make_dir()
        self.source = source
        self.existing = [info.base_name for _, info in list_shard_files(self.out, SHARD_NAME)]
        if self.existing and not overwrite:
            raise RaychatError(f"{self.out_dir} already holds {len(self.existing)} shard files: choose an "
                               "empty --out directory or pass --overwrite to replace them")
        for stale in self.out.entries():  # left by an interrupted write
            if stale.base_name.startswith("shard_") and ".parquet.tmp" in stale.base_name:
                self.out.delete(stale.base_name)
        workers = workers or min(8, os.cpu_count() or 1)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="corpus-writer")
        self.train = _SplitWriter(self.out, lambda i: f"shard_{i:05d}.parquet.tmp", docs_per_shard,
                                  self.pool, workers + 1)
        self.val = _SplitWriter(self.out, lambda i: f"shard_val{i}.parquet.tmp", 1 << 62, self.pool, 1)

    def add_train(self, texts: Sequence[str] | pa.Array) -> None:
        self.train.add(pa.array(texts, type=pa.string()) if not isinstance(texts, pa.Array) else texts)

    def add_val(self, texts: Sequence[str] | pa.Array) -> None:
        self.val.add(pa.array(texts, type=pa.string()) if not isinstance(texts, pa.Array) else texts)

    def close(self) -> list[str]:
        """Finish both splits and give the files their shard names (a rename on disk, a copy in a
        bucket); returns the shards' paths (local) or filesystem paths (bucket)."""
        try:
            self.train.close()
            self.val.close()
        except BaseException:
            self.abort()
            raise
        self.pool.shutdown()
        if not self.train.num_docs or not self.val.num_docs:
            self.abort()
            raise RaychatError(f"nothing written to {self.out_dir}: the corpus would have "
                               f"{self.train.num_docs} train and {self.val.num_docs} val documents, and both "
                               "splits need at least one (give more input documents or fewer --val-docs)")
        for name in self.existing:
            self.out.delete(name)
        final = []
        for i, tmp in enumerate(self.train.files + self.val.files):
            final.append(self.out.path(shard_filename(i)))
            self.out.rename(tmp, shard_filename(i))
        write_corpus_meta(self.out_dir, {"source": self.source})  # replaces an overwritten corpus's
        return final

    def abort(self) -> None:
        """Drop everything written so far (the corpus that was there before stays)."""
        self.train.abort()
        self.val.abort()
        self.pool.shutdown()

    def __enter__(self) -> "CorpusWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def split_val_count(num_docs: int, val_docs: int | None) -> int:
    """How many of num_docs documents go to validation: `val_docs` if given, else ~10% capped at
    2 row groups; always leaves at least one document on each side."""
    if num_docs < 2:
        raise RaychatError(f"a corpus needs at least 2 documents (one train, one val), got {num_docs}")
    if val_docs is None:
        return max(1, min(num_docs // 10, 2 * ROW_GROUP_SIZE))
    if not 1 <= val_docs < num_docs:
        raise RaychatError(f"--val-docs must be between 1 and {num_docs - 1} for {num_docs} documents, "
                           f"got {val_docs}")
    return val_docs
