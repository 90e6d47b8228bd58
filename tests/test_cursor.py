"""The loader cursor without Ray: dealing, merging, re-dealing, exactly-once under any resizes.

Ranks are simulated with the real packer and the real DocFeed over a made-up corpus whose
documents have lengths derived from their ids, so only the bookkeeping is under test here.
"""

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_audit import expand

from raychat.data.cursor import (
    Cursor,
    DocFeed,
    RankCursor,
    RankSequence,
    compress,
    count,
    merge_cursor,
    rank_cursor,
    split_runs,
)
from raychat.data.packer import BestFitPacker

pytestmark = pytest.mark.unit

CAPACITY, BUFFER = 12, 4


class FakeCorpus:
    """U units with 1..5 rows each; a seeded permutation of units per epoch."""

    def __init__(self, num_units: int, seed: int):
        rng = random.Random(seed)
        self.rows = [rng.randint(1, 5) for _ in range(num_units)]
        self.seed = seed

    def unit_at(self, position: int) -> tuple[int, int, int]:
        epoch, i = divmod(position, len(self.rows))
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1000 + epoch).shuffle(order)
        return epoch + 1, order[i], self.rows[order[i]]

    def docs_below(self, position: int) -> set:
        return {(e, u, r) for p in range(position) for e, u, n in [self.unit_at(p)] for r in range(n)}


def doc_tokens(doc_id) -> np.ndarray:
    length = 1 + hash(doc_id) % 17          # some longer than a row: those only ever get cropped
    return np.full(length, sum(doc_id) % 97, dtype=np.int32)


class SimRank:
    """One rank as TrainLoader runs it, with tokens made up from the doc ids."""

    def __init__(self, corpus: FakeCorpus, merged: Cursor | None, rank: int, world_size: int):
        self.sequence = RankSequence(rank_cursor(merged, rank, world_size, corpus.unit_at), corpus.unit_at)
        batches = ((k, [doc_tokens(d) for d in s.doc_ids()]) for k, s in enumerate(self.sequence.sources()))
        self.feed = DocFeed(self.sequence, batches)
        self.packer = BestFitPacker(CAPACITY, BUFFER)

    def rows(self, n: int) -> tuple[np.ndarray, list]:
        rows = np.zeros((n, CAPACITY), dtype=np.int64)
        return rows, self.packer.fill(rows, self.feed)

    def state(self) -> RankCursor:
        return self.feed.cursor(self.packer.buffered_ids())


def merged_through_json(corpus: FakeCorpus, ranks: list[SimRank]) -> Cursor:
    """The ranks' merged cursor through JSON, as a checkpoint stores it."""
    merged = merge_cursor([rank.state() for rank in ranks], len(corpus.rows), corpus.seed)
    return Cursor.from_dict(json.loads(json.dumps(merged.to_dict())))


def run_segment(corpus, merged, world_size, steps, consumed):
    ranks = [SimRank(corpus, merged, r, world_size) for r in range(world_size)]
    for _ in range(steps):
        for rank in ranks:
            consumed += rank.rows(1)[1]
    return merged_through_json(corpus, ranks)


def assert_every_doc_once(corpus, merged, consumed):
    """Below the frontier every document is consumed, in flight or in an unstarted unit: once."""
    in_flight = list(expand(merged.in_flight))
    unstarted = [d for p in merged.unstarted for e, u, n in [corpus.unit_at(p)] for d in
                 ((e, u, r) for r in range(n))]
    everything = consumed + in_flight + unstarted
    assert len(everything) == len(set(everything)), "a document is in two places"
    assert set(everything) == corpus.docs_below(merged.frontier)


def test_runs_round_trip_and_split():
    ids = [(1, 3, 0), (1, 3, 1), (1, 3, 2), (1, 5, 7), (2, 3, 3), (2, 3, 4), (1, 3, 3)]
    runs = compress(ids)
    assert runs == [[1, 3, 0, 3], [1, 5, 7, 8], [2, 3, 3, 5], [1, 3, 3, 4]]
    assert list(expand(runs)) == ids and count(runs) == 7
    assert split_runs(runs, 2, 5) == [[1, 3, 2, 3], [1, 5, 7, 8], [2, 3, 3, 4]]


def test_merge_and_redeal_by_hand():
    # U = 10 units of 4 rows, identity order; world of 2. Rank 0 reads positions 0, 2, 4, ...
    # and is about to start 4; rank 1 is about to start 7. Frontier = 7; positions 4 and 6 (rank
    # 0's) are below it but unstarted.
    def unit_at(p):
        return 1 + p // 10, p % 10, 4
    states = [RankCursor(1, 2, 7, [[1, 1, 0, 2]]), RankCursor(0, 2, 4, [[1, 0, 3, 5]])]
    merged = merge_cursor(states, num_units=10, shuffle_seed=None)
    assert (merged.frontier, merged.epoch, merged.unstarted) == (7, 1, [4, 6])
    assert merged.in_flight == [[1, 0, 3, 5], [1, 1, 0, 2]]
    # Same world size: each rank gets exactly its own state back.
    assert rank_cursor(merged, 1, 2, unit_at) == RankCursor(1, 2, 7, [[1, 1, 0, 2]])
    # Three ranks: 2 + 2 + 4 + 4 = 12 owed docs, 4 each, contiguous; units resume at 7, 8, 9.
    assert rank_cursor(merged, 0, 3, unit_at) == RankCursor(0, 3, 7, [[1, 0, 3, 5], [1, 1, 0, 2]])
    assert rank_cursor(merged, 1, 3, unit_at) == RankCursor(1, 3, 8, [[1, 4, 0, 4]])
    assert rank_cursor(merged, 2, 3, unit_at) == RankCursor(2, 3, 9, [[1, 6, 0, 4]])
    # Fresh start: rank r begins at position r.
    assert rank_cursor(None, 2, 3, unit_at) == RankCursor(2, 3, 2, [])


def test_merge_rejects_missing_ranks():
    with pytest.raises(ValueError, match="one state per rank"):
        merge_cursor([RankCursor(0, 3, 0, []), RankCursor(2, 3, 2, [])], num_units=10, shuffle_seed=None)


def test_state_names_buffer_then_rest_of_unit_then_next_unit():
    corpus = FakeCorpus(6, seed=3)
    rank = SimRank(corpus, None, rank=1, world_size=2)
    rank.rows(2)
    cursor = rank.state()
    k, taken = rank.feed._source_k, rank.feed._taken
    rest = rank.sequence.source(k).doc_ids()[taken:]
    assert list(expand(cursor.pending)) == rank.packer.buffered_ids() + rest
    assert cursor.next_position == 1 + 2 * (k + 1)


def test_same_world_size_resume_gives_the_same_rows():
    corpus = FakeCorpus(7, seed=5)
    straight = [SimRank(corpus, None, r, 3) for r in range(3)]
    expected = [[rank.rows(2)[0] for _ in range(9)] for rank in straight]
    first = [SimRank(corpus, None, r, 3) for r in range(3)]
    for rank in first:
        for _ in range(4):
            rank.rows(2)
    merged = merged_through_json(corpus, first)
    resumed = [SimRank(corpus, merged, r, 3) for r in range(3)]
    for r, rank in enumerate(resumed):
        for step in range(4, 9):
            assert (rank.rows(2)[0] == expected[r][step]).all()


@settings(max_examples=40, deadline=None)
@given(segments=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 12)), min_size=1, max_size=6),
       num_units=st.integers(1, 9), seed=st.integers(0, 10_000))
def test_every_document_exactly_once_under_resizes(segments, num_units, seed):
    corpus = FakeCorpus(num_units, seed)
    merged, consumed = None, []
    for world_size, steps in segments:
        merged = run_segment(corpus, merged, world_size, steps, consumed)
        assert_every_doc_once(corpus, merged, consumed)


def test_two_epochs_at_changing_sizes_consume_each_epoch_once():
    # Long enough that the frontier passes two epochs; nothing of epoch 1 may come back in epoch 1.
    corpus = FakeCorpus(5, seed=11)
    merged, consumed = None, []
    for world_size, steps in [(2, 5), (3, 4), (1, 9), (4, 3), (2, 6)]:
        merged = run_segment(corpus, merged, world_size, steps, consumed)
    assert merged.frontier >= 2 * 5
    assert_every_doc_once(corpus, merged, consumed)
    epochs = {e for e, _, _ in consumed}
    assert {1, 2} <= epochs
