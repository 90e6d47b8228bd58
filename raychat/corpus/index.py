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
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from raychat.common import RaychatError

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


def open_shard(path: Path) -> pq.ParquetFile:
    """Open a shard's footer and check its schema; RaychatError naming the file otherwise."""
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise RaychatError(f"{path} is not a readable parquet file ({' '.join(str(e).split())}): delete it "
                           "and re-create it (`python -m raychat.corpus download` re-fetches missing shards)"
                           ) from e
    schema = parquet.schema_arrow
    if "text" not in schema.names:
        raise RaychatError(f"{path} has no `text` column (columns: {', '.join(schema.names) or 'none'}): "
                           "convert it with `python -m raychat.corpus ingest` (which reads a `text` field)")
    if schema.field("text").type not in TEXT_TYPES:
        raise RaychatError(f"{path}: column `text` has type {schema.field('text').type}, expected strings: "
                           "convert it with `python -m raychat.corpus ingest`")
    return parquet


def _shard_units(path: Path, shard: int, first_index: int) -> list[Unit]:
    metadata = open_shard(path).metadata
    units = []
    for row_group in range(metadata.num_row_groups):
        num_rows = metadata.row_group(row_group).num_rows
        if num_rows == 0:  # holds nothing to assign; skipping it keeps the other units' ids
            continue
        if num_rows > ROW_GROUP_SIZE:
            raise RaychatError(f"{path}: row group {row_group} has {num_rows} rows, more than "
                               f"{ROW_GROUP_SIZE}: re-shard it with `python -m raychat.corpus ingest`")
        units.append(Unit(first_index + len(units), shard, str(path), row_group, num_rows))
    return units


@dataclass
class CorpusIndex:
    """Every unit of a corpus, split into train and val, from the parquet footers alone."""
    data_dir: Path
    train: list[Unit]
    val: list[Unit]

    @classmethod
    def load(cls, data_dir: str | Path) -> "CorpusIndex":
        data_dir = Path(data_dir).expanduser().resolve()
        if not data_dir.is_dir():
            what = "is not a directory" if data_dir.exists() else "does not exist"
            raise RaychatError(f"corpus directory {data_dir} {what}: "
                               f"{MAKE_CORPUS_HINT.replace('DIR', str(data_dir))}")
        shards = list_shards(data_dir)
        if not shards:
            raise RaychatError(f"corpus directory {data_dir} has no shard_*.parquet files: "
                               f"{MAKE_CORPUS_HINT.replace('DIR', str(data_dir))}")
        if len(shards) == 1:
            raise RaychatError(f"corpus directory {data_dir} has only one shard ({shards[0][1].name}), which "
                               "is the validation split, so there is nothing to train on: add training "
                               "shards (`ingest` and `sample` write at least two)")
        train: list[Unit] = []
        for shard, path in shards[:-1]:
            train += _shard_units(path, shard, len(train))
        val_shard, val_path = shards[-1]
        val = _shard_units(val_path, val_shard, 0)
        if not train:
            raise RaychatError(f"the training shards {shards[0][1]} .. {shards[-2][1].name} hold zero "
                               "documents: re-create the corpus")
        if not val:
            raise RaychatError(f"{val_path} (the validation shard: the last one) holds zero documents: "
                               "re-create the corpus or add a non-empty last shard")
        return cls(data_dir, train, val)

    @property
    def num_train_docs(self) -> int:
        return sum(unit.num_rows for unit in self.train)

    @property
    def num_val_docs(self) -> int:
        return sum(unit.num_rows for unit in self.val)

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


def read_unit_texts(unit: Unit, rows: Sequence[int] | None = None) -> list[str]:
    """The documents of one unit, or just `rows` of it (in the order given)."""
    table = pq.ParquetFile(unit.path).read_row_group(unit.row_group, columns=["text"])
    column = table.column(0)
    if rows is not None:
        column = column.take(pa.array(rows, type=pa.int64()))
    return column.to_pylist()


def iter_split_texts(data_dir: str | Path, split: str = "train", max_chars: int | None = None,
                     doc_cap: int | None = None) -> Iterator[str]:
    """Documents of a split in file order, each cut to `doc_cap` characters; stops after the document
    that brings the running total to `max_chars` (so the total is at least max_chars if the split has it)."""
    total = 0
    for unit in CorpusIndex.load(data_dir).split(split):
        for text in read_unit_texts(unit):
            if doc_cap is not None:
                text = text[:doc_cap]
            yield text
            total += len(text)
            if max_chars is not None and total >= max_chars:
                return


CORPUS_META_FILE = "corpus.json"


def read_corpus_meta(data_dir: str | Path) -> dict:
    """The corpus's metadata (`source`, and `repo`/`revision` for a Hub download); {} when it has none."""
    path = Path(data_dir).expanduser() / CORPUS_META_FILE
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RaychatError(f"{path} is not readable JSON ({e}): delete it, or re-create the corpus") from e
    if not isinstance(meta, dict):
        raise RaychatError(f"{path} must hold a JSON object: delete it, or re-create the corpus")
    return meta


def write_corpus_meta(data_dir: str | Path, meta: dict) -> None:
    """Replace the corpus's metadata atomically (a reader sees the old file or the new one)."""
    path = Path(data_dir) / CORPUS_META_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
