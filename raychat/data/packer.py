"""BOS-aligned best-fit packing of tokenized documents into training rows.

nanochat's algorithm, same choices, faster bookkeeping. Every row holds T+1 tokens and starts at a
document start (so every token can attend back to its document's BOS). To fill a row: place the
LARGEST buffered document that fits the space left; when none fits, crop the SHORTEST buffered
document to fill the row exactly (its tail is dropped; the document counts as consumed). Rows are
100% utilised, no padding. Ties go to the document that entered the buffer first, as in nanochat's
list scan. Before every placement the buffer is topped up to exactly `buffer_size` documents, one at
a time (nanochat adds a whole 128-document tokenizer batch, so its buffer holds 1000-1127); with
that one rule fixed, the rows are identical to a linear scan's (tests/test_packer.py checks it), and
the buffer's content is a function of the document stream alone, which a resume relies on.

nanochat scans its whole 1000-document buffer in Python for every placement (twice when cropping).
Here documents are bucketed by length: a sorted list of the distinct lengths present (bisect finds
the largest that fits) and, per length, a FIFO of documents in arrival order. A placement costs a
bisect and a deque pop; tokens are copied into a preallocated numpy row array.
"""

from bisect import bisect_right, insort
from collections import deque
from collections.abc import Callable, Hashable

import numpy as np

DocSource = Callable[[], tuple[Hashable, np.ndarray]]   # returns (doc id, tokens starting with BOS)


class BestFitPacker:
    """Packs documents into rows of `row_capacity` tokens; remembers which documents it consumed."""

    def __init__(self, row_capacity: int, buffer_size: int = 1000):
        if row_capacity < 2 or buffer_size < 1:
            raise ValueError(f"need row_capacity >= 2 and buffer_size >= 1, "
                             f"got {row_capacity} and {buffer_size}")
        self.row_capacity = row_capacity
        self.buffer_size = buffer_size
        self._lengths: list[int] = []                      # distinct lengths present, ascending
        self._by_length: dict[int, deque] = {}             # length -> deque of (seq, doc id, tokens)
        self._arrivals: dict[int, Hashable] = {}           # seq -> doc id, in arrival order (dicts keep it)
        self._next_seq = 0
        self.tokens_in = 0     # tokens of consumed documents (placed whole or cropped)
        self.tokens_out = 0    # tokens written into rows

    def __len__(self) -> int:
        return len(self._arrivals)

    def add(self, doc_id: Hashable, tokens: np.ndarray) -> None:
        """Buffer one document (its tokens start with BOS and are not copied)."""
        length = len(tokens)
        if length == 0:
            raise ValueError(f"document {doc_id!r} has no tokens (it should at least hold BOS)")
        bucket = self._by_length.get(length)
        if bucket is None:
            bucket = self._by_length[length] = deque()
            insort(self._lengths, length)
        bucket.append((self._next_seq, doc_id, tokens))
        self._arrivals[self._next_seq] = doc_id
        self._next_seq += 1

    def buffered_ids(self) -> list[Hashable]:
        """Ids of the buffered documents in arrival order (what a resume must buffer again, in order)."""
        return list(self._arrivals.values())

    def cropped_fraction(self) -> float:
        """Share of consumed tokens that were cut off by crops and never trained on."""
        return 1.0 - self.tokens_out / self.tokens_in if self.tokens_in else 0.0

    def _take(self, position: int) -> tuple[Hashable, np.ndarray]:
        length = self._lengths[position]
        bucket = self._by_length[length]
        seq, doc_id, tokens = bucket.popleft()   # the earliest arrival of this length: nanochat's tie-break
        if not bucket:
            del self._by_length[length]
            del self._lengths[position]
        del self._arrivals[seq]
        self.tokens_in += length
        return doc_id, tokens

    def fill(self, rows: np.ndarray, next_doc: DocSource) -> list[Hashable]:
        """Fill every row of `rows` ([n, row_capacity], any integer dtype) in place.

        `next_doc` is called whenever the buffer is below `buffer_size` before a placement. Returns
        the ids of the documents consumed, in the order they were placed.
        """
        n, capacity = rows.shape
        if capacity != self.row_capacity:
            raise ValueError(f"rows have {capacity} columns, the packer fills {self.row_capacity}")
        consumed = []
        for row in rows:
            pos = 0
            while pos < capacity:
                while len(self._arrivals) < self.buffer_size:
                    self.add(*next_doc())
                space = capacity - pos
                fits = bisect_right(self._lengths, space) - 1
                if fits >= 0:   # the largest document that fits entirely
                    doc_id, tokens = self._take(fits)
                    row[pos:pos + len(tokens)] = tokens
                    pos += len(tokens)
                else:           # nothing fits: crop the shortest to fill the row exactly
                    doc_id, tokens = self._take(0)
                    row[pos:] = tokens[:space]
                    pos = capacity
                consumed.append(doc_id)
        self.tokens_out += n * capacity
        return consumed
