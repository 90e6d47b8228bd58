"""The corpus on disk: parquet shards in nanochat's layout, the index the loader deals out, validation.

Layout: `data_dir/shard_00000.parquet ...`, one string column `text` (one document per row), row
groups of 1024 documents. The LAST shard by number is the validation split, all others train. The
unit of data assignment is a row group: small enough to deal evenly across workers, large enough to
read efficiently, and addressable by (shard, row group) without reading any data. The index is
built from parquet footers only, so it is cheap for thousands of shards, and a bad corpus fails at
start-up with one line naming the file, never hours into a run.

The commands that produce corpora (download, ingest, sample, synthetic) live in `raychat.download`
and `raychat.corpus_sources`; they all write through `CorpusWriter` below, and this module's CLI
(`python -m raychat.corpus <command>`) fronts them all.
"""

import argparse
import os
import random
import re
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raychat.common import RaychatError, default_data_dir, run_cli

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


@dataclass
class CorpusSummary:
    data_dir: Path
    num_shards: int
    train_row_groups: int
    val_row_groups: int
    train_docs: int
    val_docs: int
    train_bytes: int  # on disk (compressed)
    val_bytes: int
    train_text_bytes: int | None = None  # UTF-8 bytes of the documents, only after a deep check
    val_text_bytes: int | None = None

    def __str__(self) -> str:
        return (f"{self.data_dir}: {self.num_shards} shards ({self.num_shards - 1} train + 1 val), "
                f"{self.train_row_groups + self.val_row_groups:,} row groups, {self.train_docs:,} train + "
                f"{self.val_docs:,} val documents, "
                f"{(self.train_bytes + self.val_bytes) / 1e6:,.1f} MB on disk")

    def format(self) -> str:
        """The multi-line summary `check` prints."""
        def text_size(n: int | None) -> str:
            return "" if n is None else f", {n / 1e6:,.1f} MB of text"
        return "\n".join([
            f"corpus {self.data_dir}: OK",
            f"  shards:     {self.num_shards} ({self.num_shards - 1} train + 1 val)",
            f"  row groups: {self.train_row_groups + self.val_row_groups:,} "
            f"(train {self.train_row_groups:,}, val {self.val_row_groups:,})",
            f"  documents:  {self.train_docs + self.val_docs:,} "
            f"(train {self.train_docs:,}, val {self.val_docs:,})",
            f"  bytes:      {(self.train_bytes + self.val_bytes) / 1e6:,.1f} MB on disk "
            f"(train {self.train_bytes / 1e6:,.1f} MB{text_size(self.train_text_bytes)}; "
            f"val {self.val_bytes / 1e6:,.1f} MB{text_size(self.val_text_bytes)})",
        ])


def _deep_check_unit(unit: Unit) -> int:
    """Read a unit's documents; RaychatError on a null or invalid UTF-8 document. Returns their bytes."""
    column = pq.ParquetFile(unit.path).read_row_group(unit.row_group, columns=["text"]).column(0)
    problem = f"{column.null_count} null documents" if column.null_count else ""
    try:
        column.validate(full=True)  # includes UTF-8 validity
    except pa.ArrowInvalid as e:
        problem = " ".join(str(e).split())
    if problem:
        raise RaychatError(f"{unit.path}: row group {unit.row_group}: {problem}: re-create the shard with "
                           "`python -m raychat.corpus ingest` (it drops nulls and repairs UTF-8)")
    return pc.sum(pc.binary_length(column)).as_py() or 0


def validate_corpus(data_dir: str | Path, deep: bool = False) -> CorpusSummary:
    """Check every shard (opens as parquet, `text` column of strings, row groups of 1..1024 documents,
    non-empty train and val splits) from the footers; `deep` also reads every document (null check,
    text bytes). RaychatError naming the file and the fix on the first problem."""
    index = CorpusIndex.load(data_dir)
    train_paths = sorted({unit.path for unit in index.train})
    summary = CorpusSummary(
        data_dir=index.data_dir, num_shards=len(train_paths) + 1,
        train_row_groups=len(index.train), val_row_groups=len(index.val),
        train_docs=index.num_train_docs, val_docs=index.num_val_docs,
        train_bytes=sum(os.path.getsize(p) for p in train_paths),
        val_bytes=os.path.getsize(index.val[0].path))
    if deep:
        summary.train_text_bytes = sum(_deep_check_unit(unit) for unit in index.train)
        summary.val_text_bytes = sum(_deep_check_unit(unit) for unit in index.val)
    return summary


def _write_shard_file(path: Path, texts: pa.ChunkedArray) -> None:
    # nanochat's shard settings: zstd level 3, no dictionary or statistics (useless for text).
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())]), compression="zstd", compression_level=3,
                          use_dictionary=False, write_statistics=False) as writer:
        for start in range(0, len(texts), ROW_GROUP_SIZE):
            row_group = texts.slice(start, ROW_GROUP_SIZE).combine_chunks()
            writer.write_table(pa.table({"text": row_group}), row_group_size=ROW_GROUP_SIZE)


class _SplitWriter:
    """Cuts one split's document stream into shards, each written (compressed) on the shared thread
    pool under a temporary name while the caller produces the next; at most a few shards in flight."""

    def __init__(self, name_of: Callable[[int], Path], docs_per_shard: int, pool: ThreadPoolExecutor,
                 max_in_flight: int):
        self.name_of, self.docs_per_shard = name_of, docs_per_shard
        self.pool, self.max_in_flight = pool, max_in_flight
        self.pending: list[pa.Array] = []
        self.num_pending = 0
        self.files: list[Path] = []
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
        self.in_flight.append(self.pool.submit(_write_shard_file, self.files[-1], pending.slice(0, size)))
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
            tmp.unlink(missing_ok=True)


class CorpusWriter:
    """Writes a corpus in the layout above: train documents into shard_00000.. in order, val documents
    into the shard after the last train shard. Files carry temporary names until `close()`, so an
    interrupted write never leaves something that looks like a complete corpus. Shards are compressed
    on `workers` threads (default: CPU count, at most 8) while the caller produces the next ones.

        with CorpusWriter(out_dir) as writer:
            writer.add_train(texts); writer.add_val(more_texts)
    """

    def __init__(self, out_dir: str | Path, docs_per_shard: int = DEFAULT_DOCS_PER_SHARD,
                 overwrite: bool = False, workers: int | None = None):
        if docs_per_shard < 1:
            raise RaychatError(f"--docs-per-shard must be at least 1, got {docs_per_shard}")
        self.out_dir = Path(out_dir).expanduser().resolve()
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise RaychatError(f"output {self.out_dir} exists and is not a directory: choose another --out")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.existing = [path for _, path in list_shards(self.out_dir)]
        if self.existing and not overwrite:
            raise RaychatError(f"{self.out_dir} already holds {len(self.existing)} shard files: choose an "
                               "empty --out directory or pass --overwrite to replace them")
        for stale in self.out_dir.glob("shard_*.parquet.tmp*"):  # left by an interrupted write
            stale.unlink()
        workers = workers or min(8, os.cpu_count() or 1)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="corpus-writer")
        self.train = _SplitWriter(lambda i: self.out_dir / f"shard_{i:05d}.parquet.tmp", docs_per_shard,
                                  self.pool, workers + 1)
        self.val = _SplitWriter(lambda i: self.out_dir / f"shard_val{i}.parquet.tmp", 1 << 62, self.pool, 1)

    def add_train(self, texts: Sequence[str] | pa.Array) -> None:
        self.train.add(pa.array(texts, type=pa.string()) if not isinstance(texts, pa.Array) else texts)

    def add_val(self, texts: Sequence[str] | pa.Array) -> None:
        self.val.add(pa.array(texts, type=pa.string()) if not isinstance(texts, pa.Array) else texts)

    def close(self) -> list[Path]:
        """Finish both splits and give the files their shard names; returns the shard paths."""
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
        for path in self.existing:
            path.unlink(missing_ok=True)
        final = []
        for i, tmp in enumerate(self.train.files + self.val.files):
            final.append(self.out_dir / shard_filename(i))
            os.replace(tmp, final[-1])
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


def prepare_default_corpus(data_dir: str | Path, log: Callable[[str], None] = print) -> str:
    """The trainer's embedded default when data_dir holds no shards: download a few ClimbMix shards if
    the network is allowed (RAYCHAT_OFFLINE unset) and reachable, else write the offline sample corpus.
    Returns "download" or "sample"."""
    from raychat import corpus_sources, download

    data_dir = Path(data_dir).expanduser().resolve()
    if data_dir.is_dir() and list_shards(data_dir):
        raise RaychatError(f"{data_dir} already holds shards: prepare_default_corpus only fills an empty "
                           "corpus directory; check it with `python -m raychat.corpus check`")
    if os.environ.get("RAYCHAT_OFFLINE", "") not in ("", "0"):
        log(f"corpus: RAYCHAT_OFFLINE is set, writing the offline sample corpus to {data_dir}")
    elif not download.reachable(download.DEFAULT_BASE_URL):
        log(f"corpus: {download.DEFAULT_BASE_URL} is not reachable, writing the offline sample corpus to "
            f"{data_dir} (set RAYCHAT_OFFLINE=1 to skip this check)")
    else:
        log(f"corpus: downloading {download.DEFAULT_SHARDS} ClimbMix train shards + the val shard to "
            f"{data_dir}")
        download.download_shards(data_dir, download.DEFAULT_SHARDS, log=log)
        return "download"
    summary = corpus_sources.write_sample_corpus(data_dir, log=log)
    log(f"corpus: sample corpus of {summary.train_docs + summary.val_docs:,} documents written")
    return "sample"


# ----------------------------------------------------------------------------- command line

DESCRIPTION = """\
Create, check and inspect raychat corpora: directories of parquet shards in nanochat's layout
(shard_00000.parquet, ... with one string column `text`, row groups of 1024 documents; the last
shard is the validation split). Pick one way to get a corpus, then check it:

  python -m raychat.corpus download --shards 8          # ClimbMix from Hugging Face (8 train + val)
  python -m raychat.corpus sample --out DIR             # offline: text already on this machine
  python -m raychat.corpus ingest my_texts/ --out DIR   # your .txt/.md/.jsonl/.parquet files
  python -m raychat.corpus synthetic --out DIR --docs 100000 --seed 0   # generated, for tests/benchmarks
  python -m raychat.corpus check DIR
"""


def _add_writer_flags(parser: argparse.ArgumentParser, out_default: Path | None = None,
                      docs_per_shard: int = DEFAULT_DOCS_PER_SHARD) -> None:
    where = f" (default: {out_default})" if out_default else ""
    parser.add_argument("--out", required=out_default is None, default=out_default,
                        help=f"output corpus directory{where}; created if missing, must hold no shards")
    parser.add_argument("--docs-per-shard", type=int, default=docs_per_shard,
                        help=f"documents per train shard (default: {docs_per_shard})")
    parser.add_argument("--val-docs", type=int, default=None,
                        help="documents in the validation shard (default: 10%% of the documents, at most "
                             f"{2 * ROW_GROUP_SIZE})")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards already in --out")


def build_parser() -> argparse.ArgumentParser:
    from raychat import corpus_sources, download

    parser = argparse.ArgumentParser(prog="python -m raychat.corpus", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("download", help="fetch ClimbMix shards from Hugging Face (parallel, resumable)",
                            description="Fetch the first N train shards of karpathy/climbmix-400b-shuffle "
                            f"plus its validation shard (shard_{download.MAX_SHARD:05d}). Complete files are "
                            "skipped, so re-running resumes; each file is verified before it is kept.")
    p.add_argument("--shards", type=int, required=True,
                   help=f"train shards to fetch (1..{download.MAX_SHARD})")
    p.add_argument("--data-dir", default=None, help=f"where to put them (default: {default_data_dir()})")
    p.add_argument("--base-url", default=download.DEFAULT_BASE_URL, help="where the shard files live")
    p.add_argument("--workers", type=int, default=8, help="parallel downloads (default: 8)")
    p.add_argument("--retries", type=int, default=5, help="attempts per file (default: 5)")

    p = commands.add_parser("ingest", help="turn .txt/.md/.jsonl/.parquet files into a corpus",
                            description="Each .txt/.md file is one document; each .jsonl line and each "
                            "parquet row is one document (field/column `text`). Directories are read "
                            "recursively in name order. Empty and exact-duplicate documents are dropped; "
                            "invalid UTF-8 is replaced with U+FFFD and reported per file. The last "
                            "--val-docs documents become the validation shard.")
    p.add_argument("paths", nargs="+", help="files or directories to read")
    _add_writer_flags(p)

    p = commands.add_parser("sample", help="offline corpus of human-written text already on this machine",
                            description="Package descriptions of installed Python distributions, Python's "
                            "help topics and the docstrings of the standard library and installed packages; "
                            "the same installed packages give the same corpus. Needs no network.")
    _add_writer_flags(p, out_default=default_data_dir(), docs_per_shard=corpus_sources.SAMPLE_DOCS_PER_SHARD)
    p.add_argument("--max-mb", type=float, default=corpus_sources.SAMPLE_MAX_MB,
                   help=f"stop at this many MB of text (default: {corpus_sources.SAMPLE_MAX_MB})")

    p = commands.add_parser("synthetic", help="seeded generated documents, for tests and benchmarks",
                            description="Generated documents with a realistic length distribution (short "
                            "and very long ones), several scripts, numbers and punctuation. The same --seed "
                            "and --docs give the same documents, whatever the shard size.")
    _add_writer_flags(p)
    p.add_argument("--docs", type=int, required=True, help="number of documents (train + val)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--workers", type=int, default=None,
                   help="threads generating and compressing (default: CPU count, at most 8)")

    p = commands.add_parser("check", help="validate a corpus and print its summary",
                            description="Checks every shard's footer (opens as parquet, string column "
                            "`text`, row groups of 1..1024 documents, non-empty train and val splits); "
                            "--deep also reads every document. Exit code 2 with one line naming the file "
                            "on the first problem.")
    p.add_argument("data_dir", nargs="?", default=None,
                   help=f"corpus directory (default: {default_data_dir()})")
    p.add_argument("--deep", action="store_true", help="also read every document (slower)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from raychat import corpus_sources, download

    args = build_parser().parse_args(argv)
    if args.command == "check":
        print(validate_corpus(args.data_dir or default_data_dir(), deep=args.deep).format())
        return 0
    if args.command == "download":
        download.download_shards(args.data_dir or default_data_dir(), args.shards, base_url=args.base_url,
                                 workers=args.workers, retries=args.retries)
        print(validate_corpus(args.data_dir or default_data_dir()).format())
        return 0
    writer_args = dict(docs_per_shard=args.docs_per_shard, val_docs=args.val_docs, overwrite=args.overwrite)
    if args.command == "ingest":
        summary = corpus_sources.ingest(args.paths, args.out, **writer_args)
    elif args.command == "sample":
        summary = corpus_sources.write_sample_corpus(args.out, max_mb=args.max_mb, **writer_args)
    else:
        summary = corpus_sources.write_synthetic_corpus(args.out, args.docs, args.seed, workers=args.workers,
                                                        **writer_args)
    print(summary.format())
    return 0


if __name__ == "__main__":
    run_cli(main)
