"""The corpus on disk: parquet shards in nanochat's layout, its metadata file, and the index the loader
deals out. Every other corpus module builds on this one and this one imports none of them.

Layout: `data_dir/shard_00000.parquet ...`, one string column `text` (one document per row), row
groups of 1024 documents. The LAST shard by number is the validation split, all others train. The
unit of data assignment is a row group: small enough to deal evenly across workers, large enough to
read efficiently, and addressable by (shard, row group) without reading any data. The index is
built from parquet footers only, so it is cheap for thousands of shards, and a bad corpus fails at
start-up with one line naming the file, never hours into a run.

`corpus.json` beside the shards says where they came from (`source`; for a Hub download also the
dataset `repo` and the pinned `revision` commit), so a checkpoint can name the exact data it saw and
the plan can tell a sample corpus from a real one. Corpora written before it existed have none.
"""

import json
import os
import random
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from raychat.common import RaychatError
from raychat.corpus.files import (
    Footer,
    corpus_storage,
    list_shard_files,
    object_uri,
    read_footer,
    read_row_group,
)
from raychat.faults import retry_transient
from raychat.locations import is_uri, join_uri, normalize_location
from raychat.records import Record
from raychat.storage import Storage

ROW_GROUP_SIZE = 1024
DEFAULT_DOCS_PER_SHARD = 8 * ROW_GROUP_SIZE
SHARD_NAME = re.compile(r"^shard_(\d+)\.parquet$")
TEXT_TYPES = (pa.string(), pa.large_string(), pa.string_view())
MAKE_CORPUS_HINT = ("make one with `python -m raychat.corpus sample --out DIR` (offline), `download`, "
                    "`ingest` or `synthetic`")


def shard_filename(shard: int) -> str:
    return f"shard_{shard:05d}.parquet"


def list_shards(data_dir: str | Path) -> list[tuple[int, Path]]:
    """(shard number, path) of every shard file in data_dir, in shard order; temp files are not shards."""
    shards = []
    for entry in os.scandir(data_dir):
        match = SHARD_NAME.match(entry.name)
        if match:
            shards.append((int(match.group(1)), Path(entry.path)))
    shards.sort()
    return shards


@dataclass(frozen=True)
class Unit:
    """One row group: the unit of data assignment. A document's id is (epoch, index, row)."""
    index: int      # position of this unit within its split (0..len(split)-1), stable
    shard: int      # shard number from the file name (shard_00042 -> 42)
    path: str       # absolute path of the parquet file
    row_group: int  # row group index inside the file
    num_rows: int
    size: int | None = None  # the shard's size in bytes and footer fingerprint (raychat.corpus.files):
    fingerprint: str = ""    # what a read checks before it trusts the footer's offsets


def check_schema(schema: pa.Schema, uri: str) -> None:
    """A shard needs a `text` column of strings; RaychatError naming the file otherwise."""
    if "text" not in schema.names:
        raise RaychatError(f"{uri} has no `text` column (columns: {', '.join(schema.names) or 'none'}): "
                           "convert it with `python -m raychat.corpus ingest` (which reads a `text` field)")
    if schema.field("text").type not in TEXT_TYPES:
        raise RaychatError(f"{uri}: column `text` has type {schema.field('text').type}, expected strings: "
                           "convert it with `python -m raychat.corpus ingest`")


def open_shard(path: Path) -> pq.ParquetFile:
    """Open a local shard's footer and check its schema; RaychatError naming the file otherwise."""
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise RaychatError(f"{path} is not a readable parquet file ({' '.join(str(e).split())}): delete it "
                           "and re-create it (`python -m raychat.corpus download` re-fetches missing shards)"
                           ) from e
    check_schema(parquet.schema_arrow, str(path))
    return parquet


def _shard_units(footer: Footer, path: str, uri: str, shard: int, first_index: int) -> list[Unit]:
    check_schema(footer.metadata.schema.to_arrow_schema(), uri)
    metadata = footer.metadata
    units = []
    for row_group in range(metadata.num_row_groups):
        num_rows = metadata.row_group(row_group).num_rows
        if num_rows == 0:  # holds nothing to assign; skipping it keeps the other units' ids
            continue
        if num_rows > ROW_GROUP_SIZE:
            raise RaychatError(f"{uri}: row group {row_group} has {num_rows} rows, more than "
                               f"{ROW_GROUP_SIZE}: re-shard it with `python -m raychat.corpus ingest`")
        units.append(Unit(first_index + len(units), shard, path, row_group, num_rows, footer.size,
                          footer.fingerprint))
    return units


FOOTER_THREADS = 32   # footers read at once: a bucket answers each in tens of ms, thousands of shards


def read_footers(location: str, paths: Sequence[str]) -> list[Footer]:
    """The footers of many shards, read concurrently (one range request each, transient faults
    retried by read_footer; StorageUnavailable past the budget, a non-transient OSError as is)."""
    with ThreadPoolExecutor(max_workers=min(FOOTER_THREADS, max(1, len(paths)))) as pool:
        return list(pool.map(lambda path: read_footer(location, path), paths))


def _missing_corpus(location: str, storage: Storage) -> RaychatError:
    if is_uri(location):
        return RaychatError(f"corpus {location} has no shard_*.parquet files: fill the bucket with "
                            f"`python -m raychat.corpus download --shards N --data-dir {location}` (or "
                            "`ingest`/`synthetic` with --out), or check the URI and its endpoint")
    what = "is not a directory" if storage.exists() else "does not exist"
    if storage.is_dir():
        what = "has no shard_*.parquet files"
    return RaychatError(f"corpus directory {location} {what}: {MAKE_CORPUS_HINT.replace('DIR', location)}")


@dataclass
class CorpusIndex:
    """Every unit of a corpus, split into train and val, from the parquet footers alone; built once by
    the driver and shipped to the workers, whose reads check each shard against it."""
    data_dir: str   # an absolute local path or a URI (query kept)
    train: list[Unit]
    val: list[Unit]
    shards: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (size, fingerprint)

    @classmethod
    def load(cls, data_dir: str | Path) -> "CorpusIndex":
        location = normalize_location(data_dir)
        storage = corpus_storage(location)
        try:
            shards = retry_transient(lambda: list_shard_files(storage, SHARD_NAME),
                                     f"listing the corpus {location}")
        except (OSError, pa.ArrowException) as e:
            reason = location.scrub(" ".join(str(e).split())[:300])
            raise RaychatError(f"corpus {location} cannot be listed ({reason}): check the path or URI, its "
                               "endpoint and credentials") from None
        if not shards:
            raise _missing_corpus(location, storage)
        if len(shards) == 1:
            raise RaychatError(f"corpus directory {location} has only one shard ({shards[0][1].base_name}), "
                               "which is the validation split, so there is nothing to train on: add "
                               "training shards (`ingest` and `sample` write at least two)")
        try:
            footers = read_footers(location, [info.path for _, info in shards])
        except (OSError, pa.ArrowException) as e:   # not transient (read_footer retries those): refused
            reason = location.scrub(" ".join(str(e).split())[:300])
            raise RaychatError(f"a shard of corpus {location} cannot be read ({reason}): check the URI, its "
                               "credentials, and that no shard is being replaced") from None
        train: list[Unit] = []
        for (shard, info), footer in zip(shards[:-1], footers, strict=False):
            train += _shard_units(footer, info.path, object_uri(location, info.path), shard, len(train))
        (val_shard, val_info), val_footer = shards[-1], footers[-1]
        val_uri = object_uri(location, val_info.path)
        val = _shard_units(val_footer, val_info.path, val_uri, val_shard, 0)
        if not train:
            first, last = (object_uri(location, shards[i][1].path) for i in (0, -2))
            raise RaychatError(f"the training shards {first} .. {last} hold zero documents: re-create the "
                               "corpus")
        if not val:
            raise RaychatError(f"{val_uri} (the validation shard: the last one) holds zero documents: "
                               "re-create the corpus or add a non-empty last shard")
        identity = {info.base_name: (footer.size, footer.fingerprint)
                    for (_, info), footer in zip(shards, footers, strict=True)}
        return cls(location, train, val, identity)

    @property
    def num_train_docs(self) -> int:
        return sum(unit.num_rows for unit in self.train)

    @property
    def num_val_docs(self) -> int:
        return sum(unit.num_rows for unit in self.val)

    def identity(self) -> dict[str, list]:
        """What the run's data depends on, kept in checkpoints: shard name -> [size, fingerprint]."""
        return {name: list(self.shards[name]) for name in sorted(self.shards)}

    def uri(self, unit: Unit) -> str:
        return object_uri(self.data_dir, unit.path)

    def split(self, name: str) -> list[Unit]:
        if name not in ("train", "val"):
            raise RaychatError(f"unknown split {name!r}: use 'train' or 'val'")
        return self.train if name == "train" else self.val

    def epoch_order(self, epoch: int, shuffle_seed: int | None = None) -> list[int]:
        """Train unit indices in the order epoch `epoch` visits them: file order without a seed, else a
        permutation that depends only on (seed, epoch, number of units), the same on every machine."""
        order = list(range(len(self.train)))
        if shuffle_seed is not None:
            # A string seed is hashed with SHA-512 by `random`, stable across Python versions and platforms.
            random.Random(f"raychat-epoch-order:{shuffle_seed}:{epoch}").shuffle(order)
        return order


def identity_difference(recorded: dict, current: dict) -> str | None:
    """The first shard (by name) that differs between two corpus identities, as a phrase; None if equal."""
    for name in sorted(set(recorded) | set(current)):
        if name not in current:
            return f"{name} is missing"
        if name not in recorded:
            return f"{name} was added"
        (size0, print0), (size1, print1) = recorded[name], current[name]
        if (size0, print0) != (size1, print1):
            return (f"{name} changed (size {size0:,} -> {size1:,} bytes, footer fingerprint {print0} -> "
                    f"{print1})")
    return None


def confirm_identity(index: "CorpusIndex", who: str) -> None:
    """Re-read every shard's footer here and compare with the identity the driver recorded in `index`;
    one RaychatError naming the first shard that differs. `who` names the reader (e.g. "rank 3")."""
    storage = corpus_storage(index.data_dir)
    names = sorted(index.shards)
    try:
        footers = read_footers(index.data_dir, [storage.path(n) for n in names])
    except (OSError, pa.ArrowException) as e:
        raise RaychatError(f"{who} cannot read the corpus {index.data_dir} that the driver indexed "
                           f"({' '.join(str(e).split())[:300]}): every node must reach the same corpus "
                           "(put it in a bucket: --data-dir s3://...)") from None
    seen = {name: (f.size, f.fingerprint) for name, f in zip(names, footers, strict=True)}
    difference = identity_difference(index.shards, seen)
    if difference is not None:
        raise RaychatError(f"{who} sees another corpus at {index.data_dir} than the driver indexed: "
                           f"{difference}; every node must read the same shards (put the corpus in a "
                           "bucket, --data-dir s3://..., or copy the same files to every node)")


@dataclass
class CorpusRecord(Record):
    """What checkpoints keep under "corpus": corpus.json's source (and a Hub download's repo and
    revision), where the corpus was (without a URI's query, which may carry credentials) and its
    identity (shard name -> [size, fingerprint]; None in checkpoints from before it was kept)."""

    location: str
    source: str | None = None
    repo: str | None = None
    revision: str | None = None
    identity: dict[str, list[int | str]] | None = None


def corpus_record(index: "CorpusIndex") -> CorpusRecord:
    """This corpus's record, for the checkpoints trained on it."""
    meta = read_corpus_meta(index.data_dir)
    return CorpusRecord(location=index.data_dir.split("?", 1)[0], source=meta.get("source"),
                        repo=meta.get("repo"), revision=meta.get("revision"), identity=index.identity())


def check_checkpoint_corpus(record: CorpusRecord | None, index: "CorpusIndex", checkpoint: str) -> None:
    """Refuse in one line to resume a checkpoint whose corpus identity differs from this corpus's:
    its data cursor counts row groups of those shards. Checkpoints from before identities were kept
    (no record) pass."""
    recorded = record.identity if record is not None else None
    if recorded is None:
        return
    difference = identity_difference(recorded, index.identity())
    if difference is not None:
        raise RaychatError(f"the corpus {index.data_dir} is not the one {checkpoint} was trained on: "
                           f"{difference} since then; resume with the run's original shards, or start a "
                           "new --run-name")


def read_unit_texts(unit: Unit, rows: Sequence[int] | None = None, location: str | None = None) -> list[str]:
    """The documents of one unit, or just `rows` of it (in the order given), by range reads of the
    shard at `location` (its directory or bucket URI; default: the unit's local directory)."""
    location = location or os.path.dirname(unit.path)
    return read_row_group(location, unit.path, unit.row_group, rows, unit.fingerprint).to_pylist()


def iter_split_texts(data_dir: str | Path, split: str = "train", max_chars: int | None = None,
                     doc_cap: int | None = None) -> Iterator[str]:
    """Documents of a split in file order, each cut to `doc_cap` characters; stops after the document
    that brings the running total to `max_chars` (so the total is at least max_chars if the split has it)."""
    total = 0
    index = CorpusIndex.load(data_dir)
    for unit in index.split(split):
        for text in read_unit_texts(unit, location=index.data_dir):
            if doc_cap is not None:
                text = text[:doc_cap]
            yield text
            total += len(text)
            if max_chars is not None and total >= max_chars:
                return


CORPUS_META_FILE = "corpus.json"


def read_corpus_meta(data_dir: str | Path) -> dict:
    """The corpus's metadata (`source`, and `repo`/`revision` for a Hub download); {} when it has none."""
    storage = corpus_storage(normalize_location(data_dir))
    where = join_uri(storage.location, CORPUS_META_FILE)

    def read() -> bytes | None:
        if not storage.is_file(CORPUS_META_FILE):
            return None
        return storage.read_replaceable(CORPUS_META_FILE)

    try:
        data = retry_transient(read, f"reading {where}")
        if data is None:
            return {}
        meta = json.loads(data)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise RaychatError(f"{where} is not readable JSON ({storage.location.scrub(str(e))}): delete it, or "
                           "re-create the corpus") from e
    if not isinstance(meta, dict):
        raise RaychatError(f"{where} must hold a JSON object: delete it, or re-create the corpus")
    return meta


def write_corpus_meta(data_dir: str | Path, meta: dict) -> None:
    """Replace the corpus's metadata atomically (a reader sees the old file or the new one: a rename on
    disk; an object store publishes an object whole)."""
    storage = corpus_storage(normalize_location(data_dir))
    storage.replace_atomically(CORPUS_META_FILE, (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
