"""Corpus validation: everything the trainer checks before a worker starts, and the summary it prints.

Footers alone catch a missing column, a wrong type, oversized row groups or an empty split in
seconds for thousands of shards; `deep` also reads every document (nulls, invalid UTF-8).
"""

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from raychat.common import RaychatError
from raychat.corpus.files import read_row_group
from raychat.corpus.index import CorpusIndex, Unit, read_corpus_meta


def describe_source(meta: dict) -> str:
    """One phrase for corpus.json: 'karpathy/climbmix-400b-shuffle @ <commit>', 'sample', ..."""
    if not meta:
        return "unknown (no corpus.json: written before raychat recorded it, or by hand)"
    if meta.get("source") == "hub":
        return f"{meta.get('repo')} @ {meta.get('revision')}"
    return str(meta.get("source"))


@dataclass
class CorpusSummary:
    data_dir: str  # local path or URI
    num_shards: int
    train_row_groups: int
    val_row_groups: int
    train_docs: int
    val_docs: int
    train_bytes: int  # on disk (compressed)
    val_bytes: int
    train_text_bytes: int | None = None  # UTF-8 bytes of the documents, only after a deep check
    val_text_bytes: int | None = None
    meta: dict = field(default_factory=dict)  # corpus.json: where the shards came from

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
            f"  source:     {describe_source(self.meta)}",
        ])


def _deep_check_unit(index: CorpusIndex, unit: Unit) -> int:
    """Read a unit's documents; RaychatError on a null or invalid UTF-8 document. Returns their bytes."""
    column = read_row_group(index.data_dir, unit.path, unit.row_group, None, unit.fingerprint)
    problem = f"{column.null_count} null documents" if column.null_count else ""
    try:
        column.validate(full=True)  # includes UTF-8 validity
    except pa.ArrowInvalid as e:
        problem = " ".join(str(e).split())
    if problem:
        raise RaychatError(f"{index.uri(unit)}: row group {unit.row_group}: {problem}: re-create the shard "
                           "with `python -m raychat.corpus ingest` (it drops nulls and repairs UTF-8)")
    return pc.sum(pc.binary_length(column)).as_py() or 0


def validate_corpus(data_dir: str | Path, deep: bool = False) -> CorpusSummary:
    """Check every shard (opens as parquet, `text` column of strings, row groups of 1..1024 documents,
    non-empty train and val splits) from the footers; `deep` also reads every document (null check,
    text bytes). RaychatError naming the file and the fix on the first problem."""
    return summarize(CorpusIndex.load(data_dir), deep)


def summarize(index: CorpusIndex, deep: bool = False) -> CorpusSummary:
    """validate_corpus on an index already built (the driver's: the footers are read once)."""
    train_sizes = {unit.path: unit.size or 0 for unit in index.train}
    summary = CorpusSummary(
        data_dir=index.data_dir, num_shards=len(train_sizes) + 1,
        train_row_groups=len(index.train), val_row_groups=len(index.val),
        train_docs=index.num_train_docs, val_docs=index.num_val_docs,
        train_bytes=sum(train_sizes.values()), val_bytes=index.val[0].size or 0,
        meta=read_corpus_meta(index.data_dir))
    if deep:
        summary.train_text_bytes = sum(_deep_check_unit(index, unit) for unit in index.train)
        summary.val_text_bytes = sum(_deep_check_unit(index, unit) for unit in index.val)
    return summary
