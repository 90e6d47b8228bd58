"""TrainLoader and the validation rows on real Ray Data, real parquet shards and a real trained tokenizer.

Expected rows are computed in this process without Ray: read the same row groups with pyarrow,
encode with the same tokenizer, pack with the packer. Two loaders in one process act as ranks 0
and 1 of a world of 2.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from trace_audit import expand

from raychat.common import RaychatError
from raychat.corpus.fixture import write_synthetic_corpus
from raychat.corpus.index import CorpusIndex, read_unit_texts
from raychat.data import loader as loader_module
from raychat.data.cursor import Cursor, RankCursor, UnitSchedule
from raychat.data.loader import WARM_START_READS, TrainLoader, merge_cursor
from raychat.data.packer import BestFitPacker
from raychat.data.validation import pack_validation_rows
from raychat.tokenizer.core import Tokenizer
from raychat.tokenizer.train import train_tokenizer

pytestmark = [pytest.mark.ray,
              # Ray Data warns about its own deprecated settings when it copies its context.
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")]

T, BUFFER = 64, 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """11 train units (10 of 50 documents, 1 of 20), a val shard of 80; a 1024-token vocabulary."""
    root = tmp_path_factory.mktemp("loader")
    write_synthetic_corpus(root / "data", 600, seed=0, docs_per_shard=50, val_docs=80)
    train_tokenizer(root / "data", root / "tokenizer", vocab_size=1024, log=lambda _: None)
    return CorpusIndex.load(root / "data"), str(root / "tokenizer")


def direct_rows(tokenizer, units_and_rows, num_rows, buffer_size=BUFFER):
    """Rows packed in this process from the documents (unit, rows) in the order given."""
    def docs():
        for unit, rows in units_and_rows:
            texts = read_unit_texts(unit, rows)
            for tokens in tokenizer.encode_batch(texts, prepend_bos=True):
                yield None, np.array(tokens, dtype=np.int32)
    it = docs()
    rows = np.zeros((num_rows, T + 1), dtype=np.int64)
    BestFitPacker(T + 1, buffer_size).fill(rows, lambda: next(it))
    return rows


def recording_loader(*args, **kwargs) -> TrainLoader:
    """A loader that keeps the ids of the documents it consumed, for `collect`'s audit."""
    return TrainLoader(*args, record_consumed=True, **kwargs)


def collect(loader, steps, n=3):
    """Rows of `steps` calls (as one [steps*n, T+1] array) and the documents they consumed."""
    rows, ids = [], []
    for _ in range(steps):
        x, y = loader.next_rows(n)
        rows.append(torch.cat([x, y[:, -1:]], dim=1).numpy())
        ids += loader.consumed_doc_ids()
    return np.concatenate(rows), ids


def test_rows_are_the_packed_documents_of_the_units_in_order(corpus, ray_session):
    index, tokenizer_dir = corpus
    with recording_loader(index, tokenizer_dir, T, rank=0, world_size=1, buffer_size=BUFFER) as loader:
        x, y = loader.next_rows(5)
        assert x.shape == y.shape == (5, T) and x.dtype == y.dtype == torch.int64
        tokenizer = Tokenizer.load(tokenizer_dir)
        assert (x[:, 0] == tokenizer.bos_id).all()
        assert torch.equal(x[:, 1:], y[:, :-1])
        more, positions = [], [loader.position()]
        for _ in range(25):
            more.append(collect(loader, 1, n=20)[0])
            positions.append(loader.position())
        more = np.concatenate(more)
    # One rank reads the units in file order: (epoch, shard) only moves forward, into epoch 2.
    assert [p[:2] for p in positions] == sorted(p[:2] for p in positions)
    assert positions[0] == (1, index.train[0].shard, 0) and positions[-1][0] >= 2
    got = np.concatenate([torch.cat([x, y[:, -1:]], dim=1).numpy(), more])
    # 505 rows take ~700 documents (~1.4 per row: most documents are longer than a row), more than
    # the 520 of an epoch.
    epochs = [(u, None) for _ in range(2) for u in index.train]
    assert (got == direct_rows(tokenizer, epochs, len(got))).all()


def through_json(ranks: list[TrainLoader]) -> Cursor:
    """The ranks' merged cursor through JSON, as a checkpoint stores it."""
    merged = merge_cursor([loader.state() for loader in ranks], ranks[0].num_units, ranks[0].shuffle_seed)
    return Cursor.from_dict(json.loads(json.dumps(merged.to_dict())))


def test_same_world_size_resume_gives_identical_batches(corpus, ray_session):
    index, tokenizer_dir = corpus
    # With a shuffled unit order (seed 7), as the trainer may run, and a buffer of documents from more
    # units than the loader's warm start would read for a fresh start (WARM_START_READS).
    buffer = 120
    ranks = [recording_loader(index, tokenizer_dir, T, r, 2, shuffle_seed=7, buffer_size=buffer)
             for r in range(2)]
    positions = []
    for loader in ranks:
        collect(loader, 6)
        positions.append(loader.position())
    merged = through_json(ranks)
    expected = [collect(loader, 12)[0] for loader in ranks]
    assert [loader.position() for loader in ranks] != positions     # the frontier moved on
    for loader in ranks:
        loader.close()
    for r in range(2):
        with recording_loader(index, tokenizer_dir, T, r, 2, cursor=merged, shuffle_seed=7,
                         buffer_size=buffer) as resumed:
            got, taken = collect(resumed, 12)
            # The documents the cursor owes are read in this process, none left to Ray Data's first
            # tasks (seconds to start on a restarted group's node).
            owed = resumed._sequence.handover
            while len(taken) < sum(len(read.rows) for read in owed):  # until all of them came
                taken += collect(resumed, 1)[1]
            assert len(owed) > WARM_START_READS and resumed._reader.warm_reads >= len(owed), len(owed)
        assert torch.equal(torch.from_numpy(got), torch.from_numpy(expected[r]))


def test_small_row_groups_fill_the_packers_buffer_in_this_process(corpus, ray_session, monkeypatch):
    """Units of 50 documents: the packer's default buffer (1000) needs 20 reads for its first row. The
    warm start reads them here (while its reads take under WARM_START_S), not 2 and then Ray Data's
    pipeline, whose first tasks wait seconds for processes: the first rows are the ones packed in
    this process. (The budget is raised: how fast a loaded machine reads must not decide the test.)"""
    monkeypatch.setattr(loader_module, "WARM_START_S", 60.0)
    index, tokenizer_dir = corpus
    with recording_loader(index, tokenizer_dir, T, 0, 1) as loader:
        got, _ = collect(loader, 1)
        assert loader._reader.warm_reads > WARM_START_READS and loader._reader.warm_reads * 50 >= 1000
    epochs = [(u, None) for _ in range(3) for u in index.train]
    assert (got == direct_rows(Tokenizer.load(tokenizer_dir), epochs, len(got), buffer_size=1000)).all()


def test_resume_on_one_rank_consumes_every_document_once(corpus, ray_session):
    index, tokenizer_dir = corpus
    epoch_one = {(1, u.index, row) for u in index.train for row in range(u.num_rows)}
    consumed = []
    ranks = [recording_loader(index, tokenizer_dir, T, r, 2, buffer_size=BUFFER) for r in range(2)]
    for loader in ranks:
        consumed += collect(loader, 8)[1]
    merged = through_json(ranks)
    for loader in ranks:
        loader.close()
    assert merged.in_flight, "the test needs documents in flight at the resize"
    handed_over = set(expand(merged.in_flight))
    with recording_loader(index, tokenizer_dir, T, 0, 1, cursor=merged, buffer_size=BUFFER) as single:
        # Run until the frontier is well into epoch 2: every epoch-1 unit has been read by then.
        while single.position()[0] < 2 or len(consumed) < len(epoch_one):
            consumed += collect(single, 10)[1]
        final = merge_cursor([single.state()], single.num_units, single.shuffle_seed)
    assert len(consumed) == len(set(consumed)), "a document was trained on twice"
    in_flight = set(expand(final.in_flight))
    assert not in_flight & set(consumed)
    # Every epoch-1 document is trained on exactly once, or still waiting in the packer's buffer.
    assert {d for d in consumed if d[0] == 1} | {d for d in in_flight if d[0] == 1} == epoch_one
    assert handed_over & set(consumed), "the handed-over documents were read by the new rank"
    assert len({d for d in consumed if d[0] == 1}) > 0.9 * len(epoch_one)


def test_schedule_visits_every_unit_once_per_epoch(corpus):
    index, _ = corpus
    schedule = UnitSchedule(index, shuffle_seed=7)
    U = len(index.train)
    epochs = [[schedule(p) for p in range(e * U, (e + 1) * U)] for e in range(2)]
    for e, visits in enumerate(epochs):
        assert {epoch for epoch, _, _ in visits} == {e + 1}
        assert sorted(unit for _, unit, _ in visits) == list(range(U))
        assert all(rows == index.train[unit].num_rows for _, unit, rows in visits)
    assert [u for _, u, _ in epochs[0]] != [u for _, u, _ in epochs[1]]   # reshuffled per epoch


def test_cursor_from_another_corpus_is_refused(corpus):
    index, tokenizer_dir = corpus
    cursor = merge_cursor([RankCursor(rank=0, world_size=1, next_position=0, pending=[])], num_units=99,
                          shuffle_seed=None)
    with pytest.raises(RaychatError, match="99 train row groups"):
        recording_loader(index, tokenizer_dir, T, 0, 1, cursor=cursor)


def test_validation_rows_are_the_val_split_packed_in_order_at_most_one_pass(corpus):
    index, tokenizer_dir = corpus
    tokenizer = Tokenizer.load(tokenizer_dir)
    # The packer's buffer reads the split again (pass 2 and on) to stay full, as nanochat's val loader
    # does ...
    expected = direct_rows(tokenizer, [(unit, None) for _ in range(4) for unit in index.val], 120)
    assert (pack_validation_rows(index, tokenizer_dir, T, 7, BUFFER) == expected[:7]).all()
    # ... but asked for more rows than the split's documents fill, it stops at the row that has
    # packed as many documents as the split holds (80 here).
    got = pack_validation_rows(index, tokenizer_dir, T, 120, BUFFER)
    assert got.dtype == np.int64 and len(got) < 120 and (got == expected[:len(got)]).all()
    packer = BestFitPacker(T + 1, BUFFER)
    docs = iter([(None, np.array(ids, dtype=np.int32)) for _ in range(4) for unit in index.val
                 for ids in tokenizer.encode_batch(read_unit_texts(unit), prepend_bos=True)])
    used = [len(packer.fill(np.empty((1, T + 1), dtype=np.int64), lambda: next(docs))) for _ in range(120)]
    assert sum(used[:len(got) - 1]) < index.num_val_docs == 80 <= sum(used[:len(got)])
    assert len(pack_validation_rows(index, tokenizer_dir, T, 120, BUFFER, min_rows=110)) == 110


@pytest.mark.parametrize("victim", [0, 6], ids=["first-read-in-process", "later-read-in-ray-data"])
def test_row_group_damaged_after_indexing_is_named(corpus, ray_session, tmp_path, victim):
    """Data pages damaged after the index was built (footer intact, so only reading finds it): the
    error is one RaychatError naming the shard, from the rank's own first reads and from Ray Data's
    tasks alike."""
    index, tokenizer_dir = corpus
    data = tmp_path / "data"
    shutil.copytree(index.data_dir, data)
    damaged_index = CorpusIndex.load(data)
    path = damaged_index.train[victim].path
    raw = bytearray(Path(path).read_bytes())
    raw[len(raw) // 4: len(raw) // 4 + 512] = bytes(512)   # inside the zstd-compressed text pages
    Path(path).write_bytes(bytes(raw))
    with (TrainLoader(damaged_index, tokenizer_dir, T, rank=0, world_size=1, buffer_size=BUFFER) as loader,
          pytest.raises(RaychatError) as failure):
        for _ in range(200):   # ~1.4 documents per row: 200 x 5 rows pass every unit
            loader.next_rows(5)
    message = str(failure.value)
    assert Path(path).name in message and "\n" not in message
