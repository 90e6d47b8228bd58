"""`python -m raychat.corpus ingest`: the user's own .txt/.md/.jsonl/.parquet files as a corpus.

Deterministic: the same input files give byte-identical shards. Input is never trusted to be clean
UTF-8 or free of duplicates, and a problem in one file is reported naming that file and line.
"""

import hashlib
import json
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from raychat.common import RaychatError
from raychat.corpus.check import CorpusSummary, validate_corpus
from raychat.corpus.index import DEFAULT_DOCS_PER_SHARD, ROW_GROUP_SIZE, TEXT_TYPES
from raychat.corpus.writer import CorpusWriter, split_val_count

INGEST_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")


def _input_files(paths: Sequence[str | Path]) -> list[Path]:
    files = []
    for given in paths:
        path = Path(given).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in INGEST_SUFFIXES)
            if not found:
                raise RaychatError(f"{path} holds no {'/'.join(INGEST_SUFFIXES)} files: point ingest at the "
                                   "files to turn into a corpus")
            files += found
        elif path.is_file():
            if path.suffix.lower() not in INGEST_SUFFIXES:
                raise RaychatError(f"{path}: ingest reads {', '.join(INGEST_SUFFIXES)} files, not "
                                   f"'{path.suffix or 'no extension'}': convert it or leave it out")
            files.append(path)
        else:
            raise RaychatError(f"input {path} does not exist: check the path given to ingest")
    return files


class _Decoder:
    """UTF-8 decoding that never fails: invalid bytes become U+FFFD, counted per file for the report."""

    def __init__(self) -> None:
        self.bad_files: dict[Path, int] = {}

    def __call__(self, path: Path, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("utf-8", errors="replace")
            # Real U+FFFD characters in the input were valid; count only the ones decoding introduced.
            replaced = text.count("\ufffd") - data.count("\ufffd".encode())
            self.bad_files[path] = self.bad_files.get(path, 0) + replaced
            return text


def _file_documents(path: Path, decode: _Decoder) -> Iterator[str | None]:
    """The documents in one input file (None for a null parquet value)."""
    suffix = path.suffix.lower()
    if suffix in (".txt", ".md"):
        yield decode(path, path.read_bytes())
    elif suffix == ".jsonl":
        with open(path, "rb") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(decode(path, line))
                except json.JSONDecodeError as e:
                    raise RaychatError(f"{path}:{line_number}: not valid JSON ({e.msg}): fix or remove that "
                                       "line (each line must be an object with a string field `text`)") from e
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise RaychatError(f"{path}:{line_number}: no string field `text`: each line must be a "
                                       "JSON object like {\"text\": \"...\"}")
                yield record["text"]
    else:
        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise RaychatError(f"{path} is not a readable parquet file ({' '.join(str(e).split())}): "
                               "fix or remove it") from e
        schema = parquet.schema_arrow
        if "text" not in schema.names or schema.field("text").type not in TEXT_TYPES:
            raise RaychatError(f"{path} has no string column `text` (columns: {', '.join(schema.names)}): "
                               "rename the document column to `text`")
        for batch in parquet.iter_batches(batch_size=ROW_GROUP_SIZE, columns=["text"]):
            # As bytes, so invalid UTF-8 written by another tool is handled like in text files.
            for data in batch.column(0).cast(pa.large_binary()).to_pylist():
                yield None if data is None else decode(path, data)


def ingest(paths: Sequence[str | Path], out_dir: str | Path, docs_per_shard: int = DEFAULT_DOCS_PER_SHARD,
           val_docs: int | None = None, overwrite: bool = False,
           log: Callable[[str], None] = print) -> CorpusSummary:
    """Turn local .txt/.md (one document per file), .jsonl and .parquet (one per record, field `text`)
    files into a corpus. Empty (or whitespace-only) and exact-duplicate documents are dropped; the
    last documents in input order become the validation shard."""
    files = _input_files(paths)
    decode = _Decoder()
    seen: set[bytes] = set()
    num_docs = num_empty = num_duplicates = 0
    # The val split is the tail of the stream, whose size depends on the final count: hold back enough.
    tail: deque[str] = deque()
    tail_size = val_docs if val_docs is not None else 2 * ROW_GROUP_SIZE
    batch: list[str] = []
    with CorpusWriter(out_dir, docs_per_shard, overwrite, source="ingest") as writer:
        for path in files:
            for text in _file_documents(path, decode):
                if text is None or not text.strip():
                    num_empty += 1
                    continue
                digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
                if digest in seen:
                    num_duplicates += 1
                    continue
                seen.add(digest)
                num_docs += 1
                tail.append(text)
                if len(tail) > tail_size:
                    batch.append(tail.popleft())
                    if len(batch) == ROW_GROUP_SIZE:
                        writer.add_train(batch)
                        batch = []
        if num_docs == 0:
            raise RaychatError(f"no documents found in {len(files)} input files (all empty or duplicates): "
                               "nothing to ingest")
        num_val = split_val_count(num_docs, val_docs)
        tail_docs = list(tail)
        writer.add_train(batch + tail_docs[:len(tail_docs) - num_val])
        writer.add_val(tail_docs[len(tail_docs) - num_val:])
    for path, count in decode.bad_files.items():
        log(f"warning: {path}: {count} invalid UTF-8 byte sequences replaced with U+FFFD")
    log(f"ingest: {len(files)} files -> {num_docs:,} documents ({num_empty:,} empty and {num_duplicates:,} "
        f"duplicate documents dropped; invalid UTF-8 in {len(decode.bad_files)} files)")
    return validate_corpus(out_dir)
