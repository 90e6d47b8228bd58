"""The best-fit packer: hand-worked cases, and row-for-row equality with nanochat's linear scan."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raychat.data.packer import BestFitPacker

pytestmark = pytest.mark.unit

BOS = 99


def make_doc(k: int, length: int) -> np.ndarray:
    """Document k: BOS then tokens 1000*k+1, 1000*k+2, ... so every token names its document."""
    return np.array([BOS] + [1000 * k + j for j in range(1, length)], dtype=np.int32)


def stream_of(lengths):
    docs = iter([(k, make_doc(k, n)) for k, n in enumerate(lengths)])
    return lambda: next(docs)


def reference_pack(lengths, num_rows, capacity, buffer_size):
    """nanochat's loop, transcribed: a plain list, a linear scan per placement."""
    source = stream_of(lengths)
    buffer, rows, consumed = [], [], []
    for _ in range(num_rows):
        row = []
        while len(row) < capacity:
            while len(buffer) < buffer_size:
                buffer.append(source())
            space = capacity - len(row)
            best, best_len = -1, 0
            for i, (_, tokens) in enumerate(buffer):
                if best_len < len(tokens) <= space:
                    best, best_len = i, len(tokens)
            if best >= 0:
                doc_id, tokens = buffer.pop(best)
                row.extend(tokens.tolist())
            else:
                shortest = min(range(len(buffer)), key=lambda i: len(buffer[i][1]))
                doc_id, tokens = buffer.pop(shortest)
                row.extend(tokens[:space].tolist())
            consumed.append(doc_id)
        rows.append(row)
    return np.array(rows), consumed, [doc_id for doc_id, _ in buffer]


def test_hand_worked_rows():
    # capacity 10, buffer 3. Worked by hand:
    # row 0: buffer {A6,B4,C5}: A6 fits best; +D3 -> {B4,C5,D3}, space 4: B4.        row = A B
    # row 1: +E12 -> {C5,D3,E12}: C5; +F2 -> {D3,E12,F2}, space 5: D3; +G7 -> {E12,F2,G7},
    #        space 2: F2.                                                         row = C D F
    # row 2: +H9 -> {E12,G7,H9}: H9; +I8 -> {E12,G7,I8}, space 1: nothing fits, crop the
    #        shortest, G7, to 1 token.                                            row = H G[:1]
    lengths = [6, 4, 5, 3, 12, 2, 7, 9, 8]
    A, B, C, D, E, F, G, H, I = (make_doc(k, n) for k, n in enumerate(lengths))
    packer = BestFitPacker(row_capacity=10, buffer_size=3)
    rows = np.zeros((3, 10), dtype=np.int64)
    consumed = packer.fill(rows, stream_of(lengths))
    assert consumed == [0, 1, 2, 3, 5, 7, 6]
    assert rows[0].tolist() == [*A, *B]
    assert rows[1].tolist() == [*C, *D, *F]
    assert rows[2].tolist() == [*H, *G[:1]]
    assert packer.buffered_ids() == [4, 8]           # E and I, in arrival order
    assert packer.tokens_in == 36 and packer.tokens_out == 30
    assert packer.cropped_fraction() == pytest.approx(6 / 36)


def test_ties_go_to_the_earliest_document():
    # X4 and Y4 tie; Z6 is placed first (largest fit), then X (it arrived before Y).
    lengths = [4, 4, 6, 10]
    packer = BestFitPacker(row_capacity=10, buffer_size=3)
    rows = np.zeros((1, 10), dtype=np.int64)
    assert packer.fill(rows, stream_of(lengths)) == [2, 0]
    assert packer.buffered_ids() == [1, 3]


def test_every_row_starts_a_document_and_holds_whole_prefixes():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=5000).tolist()
    docs = {k: make_doc(k, n) for k, n in enumerate(lengths)}
    packer = BestFitPacker(row_capacity=129, buffer_size=100)
    rows = np.zeros((400, 129), dtype=np.int64)
    consumed = packer.fill(rows, stream_of(lengths))
    assert (rows[:, 0] == BOS).all()
    # Walk the rows: each is a run of document prefixes, whole documents except possibly the last.
    it = iter(consumed)
    for row in rows:
        pos = 0
        while pos < len(row):
            doc = docs[next(it)]
            piece = row[pos:pos + len(doc)]
            assert (piece == doc[:len(piece)]).all()
            pos += len(piece)
    assert next(it, None) is None
    used = sum(lengths[k] for k in consumed)
    assert packer.tokens_in == used
    assert packer.cropped_fraction() == pytest.approx((used - rows.size) / used)
    assert len(set(consumed)) == len(consumed)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=300, max_size=300),
       capacity=st.integers(2, 33), buffer_size=st.integers(1, 25), num_rows=st.integers(1, 12))
def test_same_rows_as_linear_scan(lengths, capacity, buffer_size, num_rows):
    expected_rows, expected_consumed, expected_buffer = reference_pack(lengths, num_rows, capacity,
                                                                       buffer_size)
    packer = BestFitPacker(capacity, buffer_size)
    rows = np.zeros((num_rows, capacity), dtype=np.int64)
    source = stream_of(lengths)
    consumed = []
    for i in range(num_rows):      # one row per call: the state carries over between calls
        consumed += packer.fill(rows[i:i + 1], source)
    assert (rows == expected_rows).all()
    assert consumed == expected_consumed
    assert packer.buffered_ids() == expected_buffer


def test_realistic_lengths_match_linear_scan():
    # Long-tailed lengths around and above T, nanochat's buffer size.
    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.lognormal(6.0, 1.0, size=20000).astype(int) + 1, 20000).tolist()
    expected_rows, expected_consumed, _ = reference_pack(lengths, 64, 513, 1000)
    packer = BestFitPacker(513, 1000)
    rows = np.zeros((64, 513), dtype=np.int64)
    assert packer.fill(rows, stream_of(lengths)) == expected_consumed
    assert (rows == expected_rows).all()


def test_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="columns"):
        BestFitPacker(10, 3).fill(np.zeros((1, 9), dtype=np.int64), stream_of([1] * 10))
