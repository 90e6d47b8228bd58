"""Corpus layout, index, writers and the `python -m raychat.corpus` CLI, on real parquet files."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import REPO, run_corpus_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from raychat.common import RaychatError
from raychat.corpus.check import validate_corpus
from raychat.corpus.cli import main
from raychat.corpus.default import prepare_default_corpus
from raychat.corpus.fixture import synthetic_texts, write_synthetic_corpus
from raychat.corpus.index import (
    ROW_GROUP_SIZE,
    CorpusIndex,
    Unit,
    iter_split_texts,
    list_shards,
    read_corpus_meta,
    read_unit_texts,
)
from raychat.corpus.ingest import ingest
from raychat.corpus.sample import write_sample_corpus
from raychat.corpus.writer import CorpusWriter
from raychat.data.budget import budget_lines, corpus_budget, train_text_bytes
from raychat.tokenizer.core import Tokenizer


def all_texts(index: CorpusIndex, split: str) -> list[str]:
    return [text for unit in index.split(split) for text in read_unit_texts(unit)]


def file_digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for _, p in list_shards(directory)}


@pytest.fixture(scope="module")
def expected() -> list[str]:
    """The documents of synthetic_dir, generated in memory."""
    return synthetic_texts(3500, seed=0)


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory) -> Path:
    """3500 documents: 2500 train in shards of 2048 docs, 1000 val."""
    out = tmp_path_factory.mktemp("synthetic")
    write_synthetic_corpus(out, num_docs=3500, seed=0, docs_per_shard=2048, val_docs=1000, workers=3)
    return out


# ----------------------------------------------------------------------------- layout and index

@pytest.mark.unit
def test_layout_and_units_worked_out_by_hand(synthetic_dir):
    # 2500 train docs in shards of 2048 -> shard 0: 1024 + 1024, shard 1: 452; val: shard 2 with 1000.
    assert [p.name for _, p in list_shards(synthetic_dir)] == [
        "shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"]
    index = CorpusIndex.load(synthetic_dir)
    assert [(u.index, u.shard, u.row_group, u.num_rows) for u in index.train] == [
        (0, 0, 0, 1024), (1, 0, 1, 1024), (2, 1, 0, 452)]
    assert [(u.index, u.shard, u.row_group, u.num_rows) for u in index.val] == [(0, 2, 0, 1000)]
    assert index.num_train_docs == 2500 and index.num_val_docs == 1000
    assert all(Path(u.path).is_absolute() for u in index.train + index.val)
    assert index.data_dir == str(synthetic_dir.resolve())
    for _, path in list_shards(synthetic_dir):
        assert pq.ParquetFile(path).schema_arrow.field("text").type == pa.string()


@pytest.mark.unit
def test_read_unit_texts_round_trips_and_picks_rows(synthetic_dir, expected):
    index = CorpusIndex.load(synthetic_dir)
    assert all_texts(index, "train") == expected[:2500]
    assert all_texts(index, "val") == expected[2500:]
    unit = index.train[2]  # docs 2048..2499
    assert read_unit_texts(unit, [5, 2, 5, 451]) == [expected[i] for i in (2053, 2050, 2053, 2499)]
    assert read_unit_texts(unit, []) == []


@pytest.mark.integration  # a subprocess
def test_index_is_stable_across_loads_and_processes(synthetic_dir):
    first, second = CorpusIndex.load(synthetic_dir), CorpusIndex.load(str(synthetic_dir) + "/")
    assert first.train == second.train and first.val == second.val
    # Another interpreter (other hash seed) must see the same units and the same shuffled order.
    code = ("import json,sys; from raychat.corpus.index import CorpusIndex; "
            "i = CorpusIndex.load(sys.argv[1]); "
            "print(json.dumps([[u.index, u.shard, u.row_group, u.num_rows] for u in i.train] + "
            "[i.epoch_order(e, 7) for e in range(3)]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code, str(synthetic_dir)], capture_output=True, text=True,
                         env=env, check=True, timeout=60).stdout
    assert json.loads(out) == ([[u.index, u.shard, u.row_group, u.num_rows] for u in first.train]
                               + [first.epoch_order(e, 7) for e in range(3)])


def fake_index(num_units: int) -> CorpusIndex:
    units = [Unit(i, i // 3, f"/nowhere/shard_{i // 3:05d}.parquet", i % 3, 1024) for i in range(num_units)]
    return CorpusIndex(Path("/nowhere"), units, [])


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(num_units=st.integers(0, 300), epoch=st.integers(0, 10_000), seed=st.integers(-2**63, 2**63))
def test_epoch_order_is_a_deterministic_permutation(num_units, epoch, seed):
    index = fake_index(num_units)
    assert index.epoch_order(epoch) == list(range(num_units))  # no seed: file order
    order = index.epoch_order(epoch, seed)
    assert sorted(order) == list(range(num_units))
    assert order == fake_index(num_units).epoch_order(epoch, seed)


@pytest.mark.unit
@settings(max_examples=30, deadline=None)
@given(num_units=st.integers(20, 300), seed=st.integers(0, 2**32))
def test_epoch_order_changes_with_epoch_and_seed(num_units, seed):
    # 20! orders: a collision between two seeded shuffles would be a bug, not chance.
    index = fake_index(num_units)
    assert index.epoch_order(1, seed) != index.epoch_order(2, seed)
    assert index.epoch_order(1, seed) != index.epoch_order(1, seed + 1)
    assert index.epoch_order(1, seed) != list(range(num_units))


@pytest.mark.unit
def test_iter_split_texts_caps_and_stops(synthetic_dir, expected):
    assert list(iter_split_texts(synthetic_dir, "val")) == expected[2500:]
    capped = list(iter_split_texts(synthetic_dir, "train", doc_cap=100))
    assert capped == [t[:100] for t in expected[:2500]]
    # Stops after the document that brings the total to max_chars.
    lengths = [len(t) for t in expected[:2500]]
    max_chars = sum(lengths[:10]) + 1  # reached inside document 10 (0-based)
    assert list(iter_split_texts(synthetic_dir, max_chars=max_chars)) == expected[:11]
    assert list(iter_split_texts(synthetic_dir, max_chars=sum(lengths[:10]))) == expected[:10]
    with pytest.raises(RaychatError, match="unknown split"):
        next(iter_split_texts(synthetic_dir, "test"))


@pytest.mark.unit
def test_validate_corpus_counts(synthetic_dir, expected):
    summary = validate_corpus(synthetic_dir, deep=True)
    assert (summary.num_shards, summary.train_row_groups, summary.val_row_groups) == (3, 3, 1)
    assert (summary.train_docs, summary.val_docs) == (2500, 1000)
    assert "3 shards (2 train + 1 val), 4 row groups, 2,500 train + 1,000 val documents" in str(summary)
    assert summary.train_text_bytes == sum(len(t.encode()) for t in expected[:2500])
    assert summary.val_text_bytes == sum(len(t.encode()) for t in expected[2500:])
    on_disk = sum(path.stat().st_size for _, path in list_shards(synthetic_dir))
    assert summary.train_bytes + summary.val_bytes == on_disk


# ----------------------------------------------------------------------------- synthetic

@pytest.mark.unit
def test_synthetic_is_deterministic_whatever_the_layout(tmp_path, synthetic_dir, expected):
    write_synthetic_corpus(tmp_path / "again", num_docs=3500, seed=0, docs_per_shard=2048, val_docs=1000,
                           workers=1)
    assert file_digests(tmp_path / "again") == file_digests(synthetic_dir)
    write_synthetic_corpus(tmp_path / "other_layout", num_docs=2500, seed=0, docs_per_shard=700, val_docs=300)
    index = CorpusIndex.load(tmp_path / "other_layout")
    assert all_texts(index, "train") + all_texts(index, "val") == expected[:2500]
    assert [u.num_rows for u in index.train[:3]] == [700, 700, 700]  # shards of 700 docs: 1 row group each
    assert synthetic_texts(50, seed=1) != synthetic_texts(50, seed=0)


@pytest.mark.unit
def test_synthetic_documents_look_like_text():
    texts = synthetic_texts(4096, seed=3)
    lengths = sorted(len(t) for t in texts)
    assert lengths[0] >= 1 and all(t == t.strip(" ") for t in texts)
    assert lengths[len(lengths) // 2] > 500          # typical documents are paragraphs, not words
    assert lengths[0] < 100 and lengths[-1] > 50_000  # and some are very short, some book-length
    joined = "".join(texts)
    assert any("\u4e00" <= c <= "\u9fff" for c in joined[:2_000_000])   # CJK
    assert any("\u0400" <= c <= "\u04ff" for c in joined[:2_000_000])   # Cyrillic
    assert any(ord(c) >= 0x1F300 for c in joined)                       # emoji (4-byte UTF-8)
    assert sum(c.isdigit() for c in joined) > 1000 and ". " in joined and ", " in joined
    assert " ," not in joined and " ." not in joined  # punctuation follows words directly


# ----------------------------------------------------------------------------- writer

@pytest.mark.unit
def test_writer_refuses_existing_shards_and_cleans_up(tmp_path):
    out = tmp_path / "corpus"
    with CorpusWriter(out, docs_per_shard=3) as writer:
        writer.add_train(["a", "b", "c", "d"])
        writer.add_val(["v"])
    assert [(u.shard, u.num_rows) for u in CorpusIndex.load(out).train] == [(0, 3), (1, 1)]
    before = file_digests(out)
    with pytest.raises(RaychatError, match="already holds 3 shard files.*--overwrite"):
        CorpusWriter(out)
    # A write that fails halfway leaves the old corpus untouched and no temp files.
    with pytest.raises(ZeroDivisionError), CorpusWriter(out, docs_per_shard=1, overwrite=True) as writer:
        writer.add_train(["x"] * 50)
        raise ZeroDivisionError
    assert file_digests(out) == before
    assert sorted(p.name for p in out.iterdir()) == sorted([*before, "corpus.json"])
    assert read_corpus_meta(out) == {"source": "custom"}
    with CorpusWriter(out, overwrite=True) as writer:
        writer.add_train(["new"])
        writer.add_val(["val"])
    assert all_texts(CorpusIndex.load(out), "train") == ["new"] and len(list_shards(out)) == 2
    with pytest.raises(RaychatError, match="0 val documents"), CorpusWriter(tmp_path / "noval") as writer:
        writer.add_train(["t"])
    assert list_shards(tmp_path / "noval") == [] and not list((tmp_path / "noval").iterdir())
    assert read_corpus_meta(tmp_path / "noval") == {}


# ----------------------------------------------------------------------------- ingest

@pytest.mark.unit
def test_ingest_drops_empty_and_duplicates_and_reports_bad_utf8(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("first document")
    (src / "b.md").write_text("# second\n\nwith markdown")
    (src / "sub" / "c.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"text": "first document"}, {"text": ""}, {"text": "   \n"}, {"text": "third", "id": 3}]) + "\n\n")
    # 3 invalid sequences, and one real (valid) U+FFFD that must not be counted.
    (src / "sub" / "d.txt").write_bytes(b"caf\xe9 ok \xff\xfe end \xef\xbf\xbd")
    pq.write_table(pa.table({"id": [1, 2, 3], "text": ["fourth", None, "fifth"]}), src / "e.parquet")
    (src / "ignored.csv").write_text("not read")
    lines: list[str] = []
    summary = ingest([src], tmp_path / "out", val_docs=2, log=lines.append)
    index = CorpusIndex.load(tmp_path / "out")
    # Directory walked in name order: a.txt, b.md, e.parquet, sub/c.jsonl, sub/d.txt.
    assert all_texts(index, "train") == ["first document", "# second\n\nwith markdown", "fourth", "fifth"]
    assert all_texts(index, "val") == ["third", "caf\ufffd ok \ufffd\ufffd end \ufffd"]
    assert (summary.train_docs, summary.val_docs) == (4, 2)
    assert f"warning: {src / 'sub' / 'd.txt'}: 3 invalid UTF-8 byte sequences replaced with U+FFFD" in lines
    assert "6 documents (3 empty and 1 duplicate documents dropped" in lines[-1]


@pytest.mark.unit
def test_ingest_default_val_split_and_bad_inputs(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3000)))
    ingest([docs], tmp_path / "out", docs_per_shard=1024, log=lambda _: None)
    index = CorpusIndex.load(tmp_path / "out")
    assert index.num_val_docs == 300 and index.num_train_docs == 2700  # 10% of the documents
    assert all_texts(index, "val")[0] == "doc 2700"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(RaychatError, match=r"bad.jsonl:2: not valid JSON"):
        ingest([bad], tmp_path / "o2", log=lambda _: None)
    bad.write_text('{"body": "no text"}\n')
    with pytest.raises(RaychatError, match=r"bad.jsonl:1: no string field `text`"):
        ingest([bad], tmp_path / "o3", log=lambda _: None)
    with pytest.raises(RaychatError, match="not 'csv'|not '.csv'"):
        (tmp_path / "x.csv").write_text("a")
        ingest([tmp_path / "x.csv"], tmp_path / "o4", log=lambda _: None)
    with pytest.raises(RaychatError, match="does not exist"):
        ingest([tmp_path / "missing.txt"], tmp_path / "o5", log=lambda _: None)


# ----------------------------------------------------------------------------- sample

@pytest.mark.unit
def test_sample_corpus_is_real_text_and_deterministic(tmp_path):
    write_sample_corpus(tmp_path / "a", max_mb=1.0, log=lambda _: None)
    write_sample_corpus(tmp_path / "b", max_mb=1.0, log=lambda _: None)
    assert file_digests(tmp_path / "a") == file_digests(tmp_path / "b")
    assert read_corpus_meta(tmp_path / "a") == {"source": "sample"}
    index = CorpusIndex.load(tmp_path / "a")
    texts = all_texts(index, "train") + all_texts(index, "val")
    size = sum(len(t.encode()) for t in texts)
    assert 1_000_000 <= size < 1_500_000  # budget met by whole documents
    words = " ".join(texts).split()
    assert words.count("the") > len(words) / 100  # English prose, not code or noise
    assert len(set(texts)) == len(texts) and min(map(len, texts)) >= 200


@pytest.mark.unit
def test_prepare_default_corpus_offline_writes_the_sample(tmp_path):
    assert os.environ.get("RAYCHAT_OFFLINE") == "1"  # set by conftest: no network in tests
    lines: list[str] = []
    assert prepare_default_corpus(tmp_path / "data", log=lines.append) == "sample"
    assert any("RAYCHAT_OFFLINE" in line for line in lines)
    summary = validate_corpus(tmp_path / "data", deep=True)
    assert 5e6 <= summary.train_text_bytes + summary.val_text_bytes <= 21e6
    assert summary.num_shards >= 3  # several train shards + val
    with pytest.raises(RaychatError, match="already holds shards"):
        prepare_default_corpus(tmp_path / "data", log=lines.append)


# ----------------------------------------------------------------------------- CLI

@pytest.mark.integration  # commands in a reused interpreter
def test_cli_synthetic_then_check(commands, tmp_path):
    made = run_corpus_cli(commands, "synthetic", "--out", tmp_path / "c", "--docs", 1500, "--seed", 5,
                          "--docs-per-shard", 512, "--val-docs", 300)
    assert made.returncode == 0, made.stderr
    checked = run_corpus_cli(commands, "check", tmp_path / "c", "--deep")
    assert checked.returncode == 0, checked.stderr
    # 1200 train docs in shards of 512: 512 + 512 + 176, one row group each; val 300.
    assert "shards:     4 (3 train + 1 val)" in checked.stdout
    assert "documents:  1,500 (train 1,200, val 300)" in checked.stdout
    assert "row groups: 4 (train 3, val 1)" in checked.stdout
    assert "source:     synthetic" in checked.stdout  # corpus.json says what made it


def write_shard(path: Path, table: pa.Table) -> None:
    pq.write_table(table, path, row_group_size=ROW_GROUP_SIZE)


def good(n: int = 3) -> pa.Table:
    return pa.table({"text": [f"doc {i}" for i in range(n)]})


def bad_corpora(root: Path) -> list[tuple[Path, str, str]]:
    """(corpus dir, path the error must name, words it must contain) for each kind of bad corpus."""
    cases = []
    missing = root / "missing"
    cases.append((missing, str(missing), "does not exist"))
    empty = root / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no shards here")
    cases.append((empty, str(empty), "no shard_*.parquet"))
    no_text = root / "no_text"
    no_text.mkdir()
    write_shard(no_text / "shard_00000.parquet", pa.table({"body": ["x"]}))
    write_shard(no_text / "shard_00001.parquet", good())
    cases.append((no_text, str(no_text / "shard_00000.parquet"), "no `text` column"))
    not_parquet = root / "not_parquet"
    not_parquet.mkdir()
    write_shard(not_parquet / "shard_00000.parquet", good())
    (not_parquet / "shard_00001.parquet").write_text("this is not parquet")
    write_shard(not_parquet / "shard_00002.parquet", good())
    cases.append((not_parquet, str(not_parquet / "shard_00001.parquet"), "not a readable parquet"))
    zero = root / "zero_docs"
    zero.mkdir()
    for i in range(2):
        write_shard(zero / f"shard_{i:05d}.parquet", pa.table({"text": pa.array([], pa.string())}))
    cases.append((zero, str(zero / "shard_00000.parquet"), "zero documents"))
    one = root / "one_shard"
    one.mkdir()
    write_shard(one / "shard_00000.parquet", good())
    cases.append((one, "shard_00000.parquet", "only one shard"))
    ints = root / "int_text"
    ints.mkdir()
    write_shard(ints / "shard_00000.parquet", pa.table({"text": [1, 2]}))
    write_shard(ints / "shard_00001.parquet", good())
    cases.append((ints, str(ints / "shard_00000.parquet"), "expected strings"))
    big = root / "big_row_groups"
    big.mkdir()
    pq.write_table(good(ROW_GROUP_SIZE + 1), big / "shard_00000.parquet", row_group_size=2 * ROW_GROUP_SIZE)
    write_shard(big / "shard_00001.parquet", good())
    cases.append((big, str(big / "shard_00000.parquet"), "row group 0 has 1025 rows"))
    return cases


@pytest.mark.integration  # commands in a reused interpreter
def test_cli_bad_corpora_fail_with_one_line_naming_the_file(commands, tmp_path):
    for corpus_dir, named, words in bad_corpora(tmp_path):
        # The trainer's start-up check and `check` say the same thing.
        with pytest.raises(RaychatError, match=re.escape(words)) as error:
            validate_corpus(corpus_dir)
        assert named in str(error.value)
        if words in ("expected strings", "row group 0 has 1025 rows"):
            continue  # not among the CLI cases; one subprocess less each
        result = run_corpus_cli(commands, "check", corpus_dir)
        assert result.returncode == 2, (corpus_dir, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("raychat: error: "), result.stderr
        assert named in lines[0] and words in lines[0], lines[0]
        assert result.stdout == ""


@pytest.mark.integration  # commands in a reused interpreter
def test_cli_bad_inputs_to_writers(commands, tmp_path):
    empty_docs = tmp_path / "empty.jsonl"
    empty_docs.write_text('{"text": ""}\n{"text": "  "}\n')
    result = run_corpus_cli(commands, "ingest", empty_docs, "--out", tmp_path / "out")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "no documents found" in result.stderr
    result = run_corpus_cli(commands, "synthetic", "--out", tmp_path / "s", "--docs", 10, "--val-docs", 10)
    assert result.returncode == 2 and "--val-docs must be between 1 and 9" in result.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.unit
def test_cli_help_explains_every_command(capsys):
    for command in ("download", "ingest", "sample", "synthetic", "check"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert "usage: python -m raychat.corpus " + command in capsys.readouterr().out


# ----------------------------------------------------------------------------- budget

@pytest.mark.unit
def test_corpus_budget_against_tokens_counted_by_hand(tiny_corpus, tmp_path):
    data_dir, tokenizer_dir = tiny_corpus
    tokenizer = Tokenizer.load(tokenizer_dir)
    index = CorpusIndex.load(data_dir)
    train = all_texts(index, "train")
    # Independent figures: every train document's UTF-8 bytes, and its tokens, counted directly.
    text_bytes = sum(len(t.encode()) for t in train)
    assert text_bytes <= train_text_bytes(index) < 1.01 * text_bytes  # plus page headers
    tokens = sum(len(tokenizer.encode(t)) for t in train)
    budget = corpus_budget(3 * tokens, data_dir, tokenizer)
    assert abs(budget.tokens_available - tokens) < 0.1 * tokens  # bytes/token measured on val only
    assert budget.epochs == pytest.approx(3 * tokens / budget.tokens_available, rel=1e-3)
    lines = budget_lines(budget)
    assert "past one epoch" in lines[1] and lines[1].endswith(
        f"python -m raychat.corpus download --shards {budget.climbmix_shards}")
    # 250M characters per ClimbMix shard: one shard holds this tiny run.
    assert budget.climbmix_shards == 1
    assert budget_lines(corpus_budget(tokens // 2, data_dir, tokenizer))[1:] == []
    write_sample_corpus(tmp_path / "sample", max_mb=0.5, log=lambda _: None)
    sample_lines = budget_lines(corpus_budget(10, tmp_path / "sample", tokenizer))
    assert "SAMPLE corpus" in sample_lines[1]
