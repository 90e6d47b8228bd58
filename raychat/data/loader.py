"""The data feed of one training rank: Ray Data reads and tokenizes, the rank packs rows.

Each rank reads only its own units (see raychat.data.cursor for who reads what). For every read (a row
group, or chosen rows of one on resume) a Ray Data task on the cluster's CPU pool reads the parquet
row group and tokenizes it, prepending BOS to every document; the tokenizer is loaded from its
directory once per worker process. Blocks come back in order (`preserve_order`), a background
thread turns them into per-document token arrays and keeps a few reads queued ahead, and the rank's
best-fit packer (raychat.data.packer) fills rows of T+1 tokens only when the step loop asks, so the
cursor is exact for the rows returned so far. Tokenizing is the expensive part and runs in
parallel, off the step loop; packing is a bisect and a copy per document.

Start-up and run-ahead: the first ~2000 documents are tokenized in the rank's own process (Ray
Data's first tasks wait seconds for worker processes), so step 0 does not wait for Ray Data. A
Ray Data dataset tokenizes to its end as fast as the CPUs allow, so the first ones are small
(4 reads, then 8, ... up to 64): the first steps keep their CPU on a small machine, and in the
steady state a pipeline restart comes only every 64 reads. (An object-store cap on Ray Data's
run-ahead would do the same but made its executor spin at a full core while capped.)

Resources: the read/tokenize tasks ask Ray for no CPU of their own, prefer the rank's own node, and
run at most `data_tasks` at a time. A task that needs a free logical CPU waits behind the cluster's
other work, and after a node loss or on a tightly packed cluster that can be forever (the training
workers hold their CPUs while they wait for data). Zero-CPU tasks always schedule; the cores they
run on are the rank's own node's, which `--cpus-per-worker` reserves (and the cap keeps Ray from
starting a worker process per block, which zero-CPU tasks otherwise allow). If no data arrives for
DATA_TIMEOUT_S anyway, the rank fails, and Ray restarts the attempt from the latest checkpoint
instead of hanging.

Validation rows are read and packed once per attempt in the rank's own process (raychat.data.validation).
"""

import contextlib
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import pyarrow as pa

from raychat.common import RaychatError
from raychat.corpus.index import CorpusIndex, Unit, read_unit_texts
from raychat.data.cursor import (
    Cursor,
    DocFeed,
    DocId,
    RankCursor,
    RankSequence,
    Source,
    UnitSchedule,
    merge_cursor,
    rank_cursor,
)
from raychat.data.packer import BestFitPacker
from raychat.faults import StorageUnavailable, is_transient, short_reason
from raychat.tokenizer.core import Tokenizer

if TYPE_CHECKING:
    import torch

__all__ = ["TrainLoader", "merge_cursor"]

FIRST_DATASET_READS = 4   # reads in the first Ray Data dataset; each next one doubles, up to
MAX_DATASET_READS = 64    # (a dataset runs ahead to its end; a new one costs a pipeline restart)
READS_AHEAD = 4           # tokenized reads queued in this process ahead of the packer
WARM_START_DOCS = 2048    # documents tokenized in this process before Ray Data takes over,
WARM_START_READS = 2      # in at most this many reads (a read runs single-threaded either way),
WARM_START_S = 1.0        # or more while reading them has taken less than this (small row groups)
WAIT_WARNING_S = 60       # say so when the packer has waited this long for a read
DATA_TIMEOUT_S = float(os.environ.get("RAYCHAT_DATA_TIMEOUT_S", "600"))  # then fail the attempt
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray puts on every node (placement_group.NODE_ID_LABEL_KEY)


def _tokenize_reads(reads: Iterable[tuple[int, Unit, list[int] | None]], tokenizer_dir: str,
                    location: str) -> pa.Table:
    """Read (range reads of the corpus at `location`) and tokenize (k, unit, rows or None for all)
    reads into a table of (k, tokens) with one row per document, BOS first."""
    tokenizer = Tokenizer.load(tokenizer_dir)   # cached per process by raychat.tokenizer.core
    keys, lengths, tokens = [], [0], []
    for k, unit, rows in reads:
        # Transient faults retried, then StorageUnavailable; a user-fixable one is a RaychatError.
        texts = read_unit_texts(unit, rows, location)
        for doc in tokenizer.encode_batch(texts, prepend_bos=True, threads=1):
            keys.append(k)
            lengths.append(len(doc))
            tokens.append(np.asarray(doc, dtype=np.int32))
    offsets = np.cumsum(lengths, dtype=np.int32)
    flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32)
    return pa.table({"k": pa.array(keys, type=pa.int64()),
                     "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))})


def _read_and_tokenize(batch: dict[str, np.ndarray], tokenizer_dir: str, location: str) -> pa.Table:
    """Ray Data task: _tokenize_reads over a batch of planned reads (SourceReader._item rows)."""
    reads = []
    for i, k in enumerate(batch["k"]):
        unit = Unit(int(batch["index"][i]), int(batch["shard"][i]), str(batch["path"][i]),
                    int(batch["row_group"][i]), int(batch["num_rows"][i]), int(batch["size"][i]),
                    str(batch["fingerprint"][i]))
        rows = None if batch["whole"][i] else [int(r) for r in batch["rows"][i]]
        reads.append((int(k), unit, rows))
    return _tokenize_reads(reads, tokenizer_dir, location)


def _inputs_and_targets(rows: np.ndarray) -> tuple["torch.Tensor", "torch.Tensor"]:
    # torch is imported here, not at the top: Ray Data's worker processes import this module to run
    # _read_and_tokenize, and importing torch there would add seconds to every worker's start.
    import torch

    return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())


class _Stop(Exception):
    """Raised inside the reader thread when close() asked it to stop."""


class SourceReader:
    """Streams the tokenized documents of a sequence of reads, in order, ahead of the consumer.

    Yields (read number k, [token arrays of some of its documents]); a background thread runs one
    Ray Data dataset after another, of FIRST_DATASET_READS reads doubling up to MAX_DATASET_READS.
    """

    def __init__(self, source: Callable[[int], Source], units: list[Unit], tokenizer_dir: str,
                 location: str, data_tasks: int = 1, owed_reads: int = 0):
        self._source = source
        self._owed_reads = owed_reads  # the first reads, of the documents a resume's cursor owes
        self.warm_reads = 0  # how many of the first reads were read in this process so far
        self._units = units
        self._location = location
        self._tokenizer_dir = str(tokenizer_dir)
        self._data_tasks = data_tasks
        # Room for the reads a resume owes besides, during the warm start: they are read while the
        # model is built, before the packer takes any (at most WARM_START_DOCS documents).
        self._queue: queue.Queue = queue.Queue(maxsize=READS_AHEAD + owed_reads)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raychat-loader", daemon=True)
        self._thread.start()

    def _read(self, k: int) -> tuple[int, Unit, list[int] | None]:
        """Read k as (k, unit, its rows to read, None for all of them)."""
        s = self._source(k)
        unit = self._units[s.unit]
        return k, unit, None if s.rows == tuple(range(unit.num_rows)) else list(s.rows)

    def _item(self, k: int) -> dict:
        """Read k as one row of _read_and_tokenize's input."""
        _, unit, rows = self._read(k)
        return {"k": k, **asdict(unit), "whole": rows is None, "rows": rows or []}

    def _dataset(self, first: int, size: int):
        import ray
        import ray.data

        items = [self._item(k) for k in range(first, first + size)]
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        context = ds.context   # this dataset's own copy: the process-wide settings stay untouched
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        # Ray 2.60's named arguments (ray_remote_args and concurrency are deprecated): at most
        # data_tasks tasks, on this worker's node where it has room (its own node-id label), else
        # anywhere (the empty fallback selector): a soft node affinity.
        here = {NODE_ID_LABEL: ray.get_runtime_context().get_node_id()}
        kwargs = {"tokenizer_dir": self._tokenizer_dir, "location": self._location}
        return ds.map_batches(_read_and_tokenize, fn_kwargs=kwargs,
                              batch_size=1, num_cpus=0, batch_format="numpy",
                              compute=ray.data.TaskPoolStrategy(size=self._data_tasks),
                              label_selector=here, fallback_strategy=[{"label_selector": {}}])

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        raise _Stop

    def _warm_start(self) -> int:
        """Tokenize the first reads in this process; returns how many. Ray Data's first tasks wait
        seconds for worker processes to start and import, while the packer needs its buffer of
        ~1000 documents before the first row. Tokenizing those here is quick by comparison, so it takes
        that wait off step 0, and Ray Data continues from the next read.

        A resume's first reads are the documents its cursor owes, the packer's buffer when it was
        saved: a few dozen from each of a dozen units or more. The packer needs nearly all of them for
        its first row, so they are read here too, as Ray Data would read them, up to WARM_START_DOCS
        documents (a shrink from many ranks owes far more; Ray Data reads the rest). A restarted group
        then does not wait for Ray Data's processes to start on its node before its first step, which
        was most of that step's wait for rows (bench/RESULTS.md, "Goodput").

        Units of a few dozen documents (a corpus written in small row groups) hold far fewer than the
        packer's buffer in two reads, so the warm start goes on while its reads have taken less than
        WARM_START_S, not counting time blocked on a full queue. Without that, step 0 spent most of
        its time waiting for Ray Data's pipeline (bench/RESULTS.md, "Start-up")."""
        k = docs = 0
        reading_s = 0.0
        while docs < WARM_START_DOCS and (k < self._owed_reads + WARM_START_READS
                                          or reading_s < WARM_START_S):
            started = time.monotonic()
            table = _tokenize_reads([self._read(k)], self._tokenizer_dir, self._location)
            reading_s += time.monotonic() - started
            k += 1
            self.warm_reads = k  # before its documents are handed over: a consumer of them sees it
            for read, docs_of_read in _split_by_read(table):
                self._put((read, docs_of_read))
            docs += table.num_rows
        with self._queue.mutex:  # the owed reads' room is theirs: ahead of the packer, READS_AHEAD
            self._queue.maxsize = READS_AHEAD
        return k

    def _run(self) -> None:
        try:
            first, size = self._warm_start(), FIRST_DATASET_READS
            while True:
                dataset = self._dataset(first, size)
                batches = iter(dataset.iter_batches(batch_size=None, batch_format="pyarrow",
                                                    prefetch_batches=2))
                try:
                    for table in batches:
                        for k, docs in _split_by_read(table):
                            self._put((k, docs))
                finally:
                    batches.close()   # stops the dataset's executor now, not when garbage collected
                first, size = first + size, min(2 * size, MAX_DATASET_READS)
        except _Stop:
            pass
        except BaseException as e:  # handed to the consumer, which raises it in its own thread
            with contextlib.suppress(_Stop):
                self._put(e)

    def __iter__(self) -> Iterator[tuple[int, list[np.ndarray]]]:
        return self

    def __next__(self) -> tuple[int, list[np.ndarray]]:
        waited = 0
        while True:
            try:
                item = self._queue.get(timeout=WAIT_WARNING_S)
                break
            except queue.Empty:
                waited += WAIT_WARNING_S
                if waited >= DATA_TIMEOUT_S:
                    # Not a RaychatError: a plain failure, which Ray answers by restarting the attempt.
                    limit = f"RAYCHAT_DATA_TIMEOUT_S={DATA_TIMEOUT_S:.0f}"
                    raise TimeoutError(f"raychat loader: no data for {waited}s ({limit}); failing the "
                                       "attempt for Ray to restart") from None
                print(f"raychat loader: waited {waited}s for Ray Data to read and tokenize "
                      f"(failing the attempt at {DATA_TIMEOUT_S:.0f}s)", file=sys.stderr, flush=True)
        if isinstance(item, BaseException):
            _raise_read_failure(item)
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _raise_read_failure(error: BaseException) -> NoReturn:
    """Re-raise a failed read as what it is (raychat.faults): a user-fixable one as its one line, a
    storage fault that outlasted its retries or a task lost with its worker or node as
    StorageUnavailable (a plain exception: Ray restarts the attempt), anything else (a bug) as is."""
    if isinstance(error, (RaychatError, StorageUnavailable)):   # from this process's warm start
        raise error
    # Ray Data re-raises a task's exception as RayTaskError(UserCodeException): the original
    # object does not survive, only the remote traceback's text, whose last line ours is.
    text = str(error)
    ours = re.findall(r"RaychatError: ([^\n]+)", text)
    if ours:
        raise RaychatError(ours[-1].strip()) from error
    unavailable = re.findall(r"StorageUnavailable: ([^\n]+)", text)
    if unavailable or is_transient(error):
        reason = unavailable[-1].strip() if unavailable else short_reason(error)
        raise StorageUnavailable(f"reading the corpus: {reason}") from error
    raise error


def _split_by_read(table: pa.Table) -> Iterator[tuple[int, list[np.ndarray]]]:
    """(k, one standalone array per document) for each run of equal k in a block.

    Documents are copied out of the block: a long document can wait in the packer's buffer for a
    long time, and a view would pin its whole block in memory meanwhile."""
    keys = table.column("k").to_numpy()
    tokens = table.column("tokens").combine_chunks()
    values = tokens.values.to_numpy()
    offsets = tokens.offsets.to_numpy()
    start = 0
    while start < len(keys):
        stop = start + int(np.searchsorted(keys[start:], keys[start], side="right"))
        yield int(keys[start]), [values[offsets[i]:offsets[i + 1]].copy() for i in range(start, stop)]
        start = stop


class TrainLoader:
    """Rows of T+1 BOS-aligned best-fit packed tokens for one rank, resumable from a cursor."""

    def __init__(self, index: CorpusIndex, tokenizer_dir: str, seq_len: int, rank: int, world_size: int,
                 cursor: Cursor | None = None, shuffle_seed: int | None = None, buffer_size: int = 1000,
                 data_tasks: int = 1, record_consumed: bool = False):
        self.index = index
        self.seq_len = seq_len
        Tokenizer.load(tokenizer_dir)   # a missing tokenizer fails here, in one line, not inside Ray Data
        schedule = UnitSchedule(index, shuffle_seed)
        self.num_units, self.shuffle_seed = schedule.num_units, shuffle_seed  # what a merged cursor names
        if cursor is not None:
            check_cursor_fits(cursor, schedule.num_units, shuffle_seed, index.data_dir)
        self._sequence = RankSequence(rank_cursor(cursor, rank, world_size, schedule), schedule)
        self._reader = SourceReader(self._sequence.source, index.train, tokenizer_dir, index.data_dir,
                                    data_tasks, owed_reads=len(self._sequence.handover))
        self._feed = DocFeed(self._sequence, self._reader)
        self._packer = BestFitPacker(seq_len + 1, buffer_size)
        # Consumed ids for consumed_doc_ids(), 12 bytes each for the whole run: kept only for an
        # audit that asks (a step observer: raychat.worker.observer).
        self._record_consumed = record_consumed
        self._consumed: list[np.ndarray] = []

    def next_rows(self, n: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        """n rows as (inputs, targets), int64 [n, seq_len] each: x = row[:-1], y = row[1:]."""
        rows = np.empty((n, self.seq_len + 1), dtype=np.int64)
        consumed = self._packer.fill(rows, self._feed)
        if self._record_consumed:
            self._consumed.append(np.array(consumed, dtype=np.int32).reshape(-1, 3))
        return _inputs_and_targets(rows)

    def state(self) -> RankCursor:
        """This rank's part of the cursor as of the rows returned so far (merge_cursor joins them)."""
        return self._feed.cursor(self._packer.buffered_ids())

    def consumed_doc_ids(self) -> list[DocId]:
        """(epoch, unit, row) of the documents placed into rows returned since the last call."""
        if not self._record_consumed:
            raise ValueError("this loader keeps no consumed ids: make it with record_consumed=True")
        consumed, self._consumed = self._consumed, []
        return [tuple(doc) for chunk in consumed for doc in chunk.tolist()]

    def cropped_fraction(self) -> float:
        """Share of the consumed documents' tokens dropped by crops so far."""
        return self._packer.cropped_fraction()

    def position(self) -> tuple[int, int, int]:
        """(epoch, shard, row group) of the newest document read, for the log line."""
        if self._feed.last_taken is not None:
            epoch, unit_index = self._feed.last_taken[:2]
        else:
            first = self._sequence.source(0)
            epoch, unit_index = first.epoch, first.unit
        unit = self.index.train[unit_index]
        return epoch, unit.shard, unit.row_group

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "TrainLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_cursor_fits(cursor: Cursor, num_units: int, shuffle_seed: int | None, data_dir: str) -> None:
    """A saved cursor names units by their place in the corpus: it continues only on a corpus of as
    many train row groups, in the same order. The driver checks this before any worker starts."""
    saved_units = cursor.num_units
    if saved_units != num_units:
        raise RaychatError(f"the checkpoint's data cursor was saved for a corpus of {saved_units} train "
                           f"row groups, but {data_dir} has {num_units}: resume with the corpus the run "
                           "started on, or train the new corpus as a new --run-name")
    saved_seed = cursor.shuffle_seed
    if saved_seed != shuffle_seed:
        raise RaychatError(f"the checkpoint's data cursor was saved with --shuffle-seed {saved_seed}, this "
                           f"run uses {shuffle_seed}: resume with the same seed or a new --run-name")

