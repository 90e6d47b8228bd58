"""Which documents each rank reads, and the small record that lets any number of ranks resume.

Units (row groups of the train split) form one global sequence over epochs: position g is unit
`epoch_order(epoch)[i]` with epoch = g // U + 1 and i = g % U (U train units; epochs count from 1
as in nanochat's log). A document is named (epoch, unit index, row). Rank r of W reads, after any
documents it was handed on resume, the units at positions next_position, next_position + W, ...;
ranks never share a unit, so each rank reads only its own row groups.

A rank's state is its `next_position` and the documents it still owes: those it has taken from its
sequence but not yet put into a returned row (the packer's buffer, the rest of a half-taken unit,
hand-over documents not reached yet), in sequence order and by id, never by tokens. Ids are stored
as runs [epoch, unit, first_row, stop_row) so a 1000-document buffer stays a few hundred bytes.

`merge_cursor` turns the W rank states into the record saved in checkpoints. Resuming at the same W,
each rank takes back exactly its own state, so the document stream, the packer's buffer and hence
every row are identical to an uninterrupted run. Resuming at another W', the documents in flight
(plus the units below the frontier that their owner had not started) are cut into W' contiguous
parts, one per new rank, and units continue from the frontier dealt round-robin over W'. Every
document is then in exactly one place: trained on, in flight, or in a unit not yet reached; so each
train document is consumed exactly once per epoch whatever the sequence of world sizes.
"""

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby

import numpy as np

from raychat.common import RaychatError
from raychat.records import Record

DocId = tuple[int, int, int]                    # (epoch, unit index, row)
Run = list[int]                                 # [epoch, unit index, first row, stop row)
UnitAt = Callable[[int], tuple[int, int, int]]  # global position -> (epoch, unit index, num_rows)


def compress(ids: Iterable[DocId]) -> list[Run]:
    """Runs of consecutive rows of the same unit, order kept."""
    runs: list[Run] = []
    for epoch, unit, row in ids:
        last = runs[-1] if runs else None
        if last and last[0] == epoch and last[1] == unit and last[3] == row:
            last[3] += 1
        else:
            runs.append([epoch, unit, row, row + 1])
    return runs


def count(runs: Iterable[Sequence[int]]) -> int:
    return sum(stop - start for _, _, start, stop in runs)


@dataclass
class RankCursor(Record):
    """One rank's place in the data: the documents it owes, then its units from next_position."""
    rank: int
    world_size: int
    next_position: int
    pending: list[Run]


@dataclass
class Cursor(Record):
    """Where W ranks stand, independent of W: what every checkpoint saves (`merge_cursor`).
    `in_flight` and `unstarted` are what a resume at another world size deals out; `ranks` is what
    a resume at the same one takes back; `num_units` and `shuffle_seed` name the unit order."""
    world_size: int
    frontier: int  # no position at or above it was started
    epoch: int | None  # of the frontier, for people reading it
    in_flight: list[Run]
    unstarted: list[int]  # positions below the frontier whose owner had not started them
    num_units: int | None
    shuffle_seed: int | None
    ranks: list[RankCursor]


@dataclass(frozen=True)
class Source:
    """One read: rows of one unit (all of them for a dealt unit; a selection for handed-over docs)."""
    epoch: int
    unit: int
    rows: tuple[int, ...]

    def doc_ids(self) -> list[DocId]:
        return [(self.epoch, self.unit, row) for row in self.rows]


class RankSequence:
    """The deterministic sequence of reads of one rank: owed documents grouped by unit, then units."""

    def __init__(self, cursor: RankCursor, unit_at: UnitAt):
        self.cursor = cursor
        self.unit_at = unit_at
        self.handover: list[Source] = []
        for (epoch, unit), runs in groupby(cursor.pending, key=lambda run: (run[0], run[1])):
            rows = tuple(row for _, _, start, stop in runs for row in range(start, stop))
            self.handover.append(Source(epoch, unit, rows))

    def unit_position(self, k: int) -> int:
        """Global position of the k-th unit this rank reads."""
        return self.cursor.next_position + k * self.cursor.world_size

    def source(self, k: int) -> Source:
        if k < len(self.handover):
            return self.handover[k]
        position = self.unit_position(k - len(self.handover))
        epoch, unit, num_rows = self.unit_at(position)
        return Source(epoch, unit, tuple(range(num_rows)))

    def sources(self, start: int = 0) -> Iterator[Source]:
        k = start
        while True:
            yield self.source(k)
            k += 1

    def cursor_after(self, buffered: list[DocId], source_k: int, taken: int) -> RankCursor:
        """The cursor once `taken` documents of source `source_k` (and all before it) were taken and
        `buffered` of those taken are still unconsumed."""
        owed = list(buffered)
        if source_k >= 0:
            owed += self.source(source_k).doc_ids()[taken:]
        owed += [doc for s in self.handover[source_k + 1:] for doc in s.doc_ids()]
        units_started = max(0, source_k + 1 - len(self.handover))
        return RankCursor(self.cursor.rank, self.cursor.world_size, self.unit_position(units_started),
                          compress(owed))


class DocFeed:
    """Hands documents to the packer one at a time from per-source batches, remembering how far
    it got so that `cursor()` is exact at any moment."""

    def __init__(self, sequence: RankSequence, batches: Iterator[tuple[int, list[np.ndarray]]]):
        self.sequence = sequence
        self._batches = batches    # (source index, token arrays of that source's next docs), in order
        self._source_k = -1        # source of the last document taken
        self._taken = 0            # documents taken from that source
        self._ids: list[DocId] = []
        self._docs: list[np.ndarray] = []
        self._next = 0
        self.last_taken: DocId | None = None

    def __call__(self) -> tuple[DocId, np.ndarray]:
        while self._next == len(self._docs):
            k, docs = next(self._batches)
            if k != self._source_k:
                skipped = range(self._source_k + 1, k)   # sources without rows send no batch
                if (k < self._source_k or self._taken != len(self._ids)
                        or any(self.sequence.source(j).rows for j in skipped)):
                    raise RuntimeError(f"document batches out of order: got source {k} after "
                                       f"{self._taken} docs of source {self._source_k}")
                self._source_k, self._taken = k, 0
                self._ids = self.sequence.source(k).doc_ids()
            self._docs, self._next = docs, 0
        tokens = self._docs[self._next]
        self._next += 1
        doc_id = self._ids[self._taken]
        self._taken += 1
        self.last_taken = doc_id
        return doc_id, tokens

    def cursor(self, buffered: list[DocId]) -> RankCursor:
        return self.sequence.cursor_after(buffered, self._source_k, self._taken)


class UnitSchedule:
    """Global unit position -> (epoch, unit index, num_rows) for a corpus index and shuffle seed."""

    def __init__(self, index, shuffle_seed: int | None):
        self.index = index
        self.shuffle_seed = shuffle_seed
        self.num_units = len(index.train)
        if self.num_units == 0:
            raise RaychatError(f"the corpus at {index.data_dir} has no train row groups: it needs at least "
                               f"two shards (the last one is validation)")
        # The loader's reader thread plans ahead while the step loop asks about the current epoch:
        # lru_cache keeps both epochs' orders and is safe to call from both threads.
        self._order = lru_cache(maxsize=4)(lambda epoch: index.epoch_order(epoch, shuffle_seed))

    def __call__(self, position: int) -> tuple[int, int, int]:
        epoch = position // self.num_units + 1
        unit = self._order(epoch)[position % self.num_units]
        return epoch, unit, self.index.train[unit].num_rows


def merge_cursor(rank_states: list[RankCursor], num_units: int, shuffle_seed: int | None) -> Cursor:
    """The world-size-independent record of where W ranks stand (saved in every checkpoint), on a
    train split of `num_units` units in the order of `shuffle_seed`."""
    if not rank_states:
        raise ValueError("merge_cursor needs the state of every rank, got none")
    world_size = len(rank_states)
    cursors = sorted(rank_states, key=lambda c: c.rank)
    ranks = [c.rank for c in cursors]
    if ranks != list(range(world_size)) or any(c.world_size != world_size for c in cursors):
        raise ValueError(f"merge_cursor needs one state per rank of a world of {world_size}, got ranks "
                         f"{ranks} with world sizes {[c.world_size for c in cursors]}")
    # Every position below the frontier was started by some rank, except the ones listed as
    # unstarted (their owner had not reached them); no position at or above it was started.
    frontier = max(c.next_position for c in cursors)
    unstarted = sorted(p for c in cursors for p in range(c.next_position, frontier, world_size))
    epoch = frontier // num_units + 1 if num_units else None
    return Cursor(world_size=world_size, frontier=frontier, epoch=epoch,
                  in_flight=[run for c in cursors for run in c.pending], unstarted=unstarted,
                  num_units=num_units, shuffle_seed=shuffle_seed, ranks=cursors)


def split_runs(runs: list[Run], start: int, stop: int) -> list[Run]:
    """Documents [start, stop) of the sequence the runs describe, as runs."""
    out, seen = [], 0
    for epoch, unit, first, end in runs:
        n = end - first
        lo, hi = max(start - seen, 0), min(stop - seen, n)
        if lo < hi:
            out.append([epoch, unit, first + lo, first + hi])
        seen += n
    return out


def rank_cursor(merged: Cursor | None, rank: int, world_size: int, unit_at: UnitAt) -> RankCursor:
    """This rank's cursor when `world_size` ranks resume from `merged` (None: a fresh start)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if merged is None:
        return RankCursor(rank, world_size, rank, [])
    if merged.world_size == world_size:
        return merged.ranks[rank]
    # Another world size: hand the documents in flight out in contiguous parts, then deal units
    # from the frontier.
    owed = list(merged.in_flight)
    for position in merged.unstarted:
        epoch, unit, num_rows = unit_at(position)
        owed.append([epoch, unit, 0, num_rows])
    total = count(owed)
    start, stop = rank * total // world_size, (rank + 1) * total // world_size
    return RankCursor(rank, world_size, merged.frontier + rank, split_runs(owed, start, stop))
