"""The run's fixed validation rows, read and packed in one pass in the rank's own process.

Validation needs a few thousand rows once per attempt, not a stream. Going through Ray Data meant
one small dataset after another, each paying Ray Data's start-up, which made reading even a small
val split a large part of every attempt's start. Here the rank reads the val split's row groups
itself (range reads, the same as a read task's), tokenizes each on all its cores and packs as it
goes, stopping when the rows are full. The rows are the val split's documents in corpus order,
through the same best-fit packer (raychat.data.packer) as training, the same on every rank and every
world size.

At most one pass of documents: when the val split is smaller than --eval-tokens asks for, the rows
stop once as many documents as the split holds have been packed, instead of evaluating its
documents again and again (nanochat cycles its val loader; on a small corpus with the default 42M
eval tokens that is hours of CPU for the same number). The buffer still reads later passes to stay
full, so the rows kept are exactly an uncapped packing's first rows.
"""

from collections.abc import Iterator

import numpy as np

from raychat.common import RaychatError
from raychat.corpus.index import CorpusIndex, read_unit_texts
from raychat.data.packer import BestFitPacker
from raychat.tokenizer.core import Tokenizer

DocId = tuple[int, int, int]


def _val_documents(index: CorpusIndex, tokenizer: Tokenizer) -> Iterator[tuple[DocId, np.ndarray]]:
    """((pass, unit, row), tokens) of the val split, BOS first, pass after pass (as nanochat's val
    loader cycles it)."""
    if not index.num_val_docs:
        raise RaychatError(f"the validation split of {index.data_dir} is empty: add a non-empty last shard")
    passes = 0
    while True:
        passes += 1
        for unit in index.val:
            texts = read_unit_texts(unit, location=index.data_dir)
            for row, ids in enumerate(tokenizer.encode_batch(texts, prepend_bos=True)):
                yield (passes, unit.index, row), np.asarray(ids, dtype=np.int32)


def pack_validation_rows(index: CorpusIndex, tokenizer_dir: str, seq_len: int, num_rows: int,
                         buffer_size: int = 1000, min_rows: int = 1) -> np.ndarray:
    """The first `num_rows` packed val rows of seq_len + 1 tokens (int64), as one worker packs them,
    or fewer (but at least `min_rows`) when the split's documents are used up before that."""
    documents = _val_documents(index, Tokenizer.load(tokenizer_dir))
    packer = BestFitPacker(seq_len + 1, buffer_size)
    rows, consumed = [], 0
    while len(rows) < num_rows:
        row = np.empty((1, seq_len + 1), dtype=np.int64)
        consumed += len(packer.fill(row, lambda: next(documents)))
        rows.append(row)
        if consumed >= index.num_val_docs and len(rows) >= min_rows:
            break
    documents.close()
    return np.concatenate(rows)
