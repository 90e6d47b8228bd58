"""The tokenizer: nanochat's id layout, lossless round trips, specials only on purpose, HF and tiktoken
giving the same ids, the token-bytes table, and one-line errors for bad input.

Trained for real with HF tokenizers on a small corpus of real text (standard-library sources, the
users' notes in shared/seeds, multilingual lines) written with the corpus module's writer."""

import json
import pickle
import random
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raychat.common import RaychatError
from raychat.corpus.index import iter_split_texts
from raychat.corpus.writer import CorpusWriter
from raychat.tokenizer.core import HF_FILE, SPECIAL_TOKENS, Tokenizer, check_vocab
from raychat.tokenizer.stats import tokenizer_stats
from raychat.tokenizer.train import MIN_VOCAB_SIZE, train_tokenizer

VOCAB = 1024
SEEDS_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "seeds"


def _multilingual_lines(rng: random.Random, n: int) -> list[str]:
    """Lines mixing scripts, emoji, digits and odd whitespace, the cases a byte-level BPE must survive."""
    pieces = ["naïve café", "Straße", "Ελληνικά", "русский текст", "日本語のテキスト", "中文分词测试",
              "한국어", "עברית", "العربية", "हिन्दी", "🙂🚀👩‍💻", "1234567890", "3.14159",
              "  \t  ", "\r\n", "\u00a0\u2003",
              "don't", "WE'LL", "x²+y²", "∑∫√", "<|bos|>", "<|user_start|>"]
    return [" ".join(rng.choice(pieces) for _ in range(rng.randint(5, 40))) for _ in range(n)]


def _real_documents() -> list[str]:
    docs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        docs.append(path.read_text(encoding="utf-8", errors="replace")[:6000])
        if sum(map(len, docs)) > 300_000:
            break
    if SEEDS_DIR.is_dir():
        docs += [p.read_text(encoding="utf-8") for p in sorted(SEEDS_DIR.glob("*.txt"))]
    return docs + _multilingual_lines(random.Random(0), 300)


def _write_corpus(out: Path, train: list[str], val: list[str]) -> Path:
    with CorpusWriter(out, docs_per_shard=256) as writer:
        writer.add_train(train)
        writer.add_val(val)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    docs = _real_documents()
    random.Random(1).shuffle(docs)
    return _write_corpus(tmp_path_factory.mktemp("tok_corpus"), docs[:-40], docs[-40:])


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer(corpus, out, vocab_size=VOCAB, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.load(tok_dir)


def load_hf_tokenizer(tok_dir):
    """The HF `tokenizers.Tokenizer` file train_tokenizer saves beside tiktoken's (for chat rendering)."""
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(Path(tok_dir) / HF_FILE))


@pytest.fixture(scope="module")
def hf_plain(tok_dir):
    """The saved HF tokenizer, reading special-token strings as plain text (as tiktoken's encode_ordinary)."""
    hf = load_hf_tokenizer(tok_dir)
    hf.encode_special_tokens = True
    return hf


def all_texts(corpus: Path) -> list[str]:
    return list(iter_split_texts(corpus, "train")) + list(iter_split_texts(corpus, "val"))


# ---------------------------------------------------------------------------------------------------
# Id layout (nanochat's rustbpe+tiktoken tokenizer: bytes, merges in order, then the specials)


@pytest.mark.unit
def test_vocab_size_is_exact_and_specials_come_last(tok):
    assert tok.vocab_size == VOCAB
    assert tok.encoding.n_vocab == VOCAB
    num_ranks = VOCAB - len(SPECIAL_TOKENS)  # 1015
    assert tok.bos_id == 1015
    assert tok.special_tokens == {name: 1015 + i for i, name in enumerate(SPECIAL_TOKENS)}
    assert SPECIAL_TOKENS[0] == "<|bos|>" and len(SPECIAL_TOKENS) == 9
    assert [tok.encoding.decode_single_token_bytes(b) for b in range(256)] == [bytes([b]) for b in range(256)]
    assert len(tok.encoding._mergeable_ranks) == num_ranks


@pytest.mark.unit
def test_merges_in_learning_order_on_a_corpus_worked_out_by_hand(tmp_path):
    # Pieces after the split pattern: "ab" once, " ab" 199 times. Pair counts: (a,b) 200, ( ,a) 199,
    # so merge 1 is "ab" (id 256); then " ab" = [" ", "ab"] gives ( ,ab) 199: merge 2 is " ab" (257).
    # Nothing is left to merge, so the largest possible vocabulary is 258 + 9 specials = 267.
    corpus = _write_corpus(tmp_path / "c", [" ".join(["ab"] * 200)], ["ab"])
    tokenizer = train_tokenizer(corpus, tmp_path / "t", vocab_size=267, log=lambda _: None)
    assert tokenizer.encoding.decode_single_token_bytes(256) == b"ab"
    assert tokenizer.encoding.decode_single_token_bytes(257) == b" ab"
    assert tokenizer.bos_id == 258
    assert tokenizer.encode("ab ab ab", prepend_bos=True) == [258, 256, 257, 257]
    assert tokenizer.encode("ba") == [ord("b"), ord("a")]
    with pytest.raises(RaychatError, match="only supports a vocabulary of 267"):
        train_tokenizer(corpus, tmp_path / "t2", vocab_size=268, log=lambda _: None)


@pytest.mark.unit
def test_training_is_deterministic(corpus, tok, tmp_path):
    again = train_tokenizer(corpus, tmp_path / "again", vocab_size=VOCAB, log=lambda _: None)
    assert again.fingerprint == tok.fingerprint
    ranks_file = "tokenizer.tiktoken"
    assert (tmp_path / "again" / ranks_file).read_bytes() == (tok.directory / ranks_file).read_bytes()


# ---------------------------------------------------------------------------------------------------
# Encoding properties

surrogate_free = st.characters(blacklist_categories=("Cs",))
texts = st.one_of(
    st.text(alphabet=surrogate_free, max_size=200),
    st.text(alphabet=st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), max_size=50),  # emoji
    st.text(alphabet=st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), max_size=50),    # CJK
    st.text(alphabet=st.sampled_from(" \t\n\r\u00a0\u2003\u3000\x0b\x0c\x85"), max_size=60),  # whitespace
    st.lists(st.sampled_from(["<|bos|>", "<|user_end|>", "<|", "|>", "bos", " ", "a", "\n", "é"]),
             max_size=20).map("".join),
)
hypothesis_settings = settings(max_examples=300, deadline=None,
                               suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.unit
@hypothesis_settings
@given(text=texts)
def test_decode_encode_round_trips(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, prepend_bos=True)) == "<|bos|>" + text


@pytest.mark.unit
@hypothesis_settings
@given(text=texts)
def test_special_tokens_never_come_from_plain_text(tok, text):
    first_special = tok.vocab_size - len(SPECIAL_TOKENS)
    for ids in (tok.encode(text), *tok.encode_batch([text, text + "<|bos|>"], prepend_bos=False, threads=2)):
        assert all(0 <= i < first_special for i in ids)


@pytest.mark.unit
def test_literal_special_strings_are_ordinary_text(tok):
    text = "".join(SPECIAL_TOKENS)
    ids = tok.encode(text, prepend_bos=True)
    assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
    assert max(ids[1:]) < tok.vocab_size - len(SPECIAL_TOKENS)
    assert tok.decode(ids[1:]) == text


@pytest.mark.unit
def test_encode_batch_equals_encode_on_any_thread_count(tok, corpus):
    docs = all_texts(corpus)
    expected = [tok.encode(d) for d in docs]
    for threads in (0, 1, 2, 3):
        assert tok.encode_batch(docs, prepend_bos=False, threads=threads) == expected
    with_bos = tok.encode_batch(docs, threads=2)
    assert with_bos == [[tok.bos_id, *ids] for ids in expected]
    assert tok.encode_batch([], threads=2) == []


@pytest.mark.unit
def test_hf_and_tiktoken_give_identical_ids(tok, tok_dir, hf_plain, corpus):
    docs = all_texts(corpus) + _multilingual_lines(random.Random(7), 200)
    mismatched = [d[:60] for d in docs if hf_plain.encode(d, add_special_tokens=False).ids != tok.encode(d)]
    assert not mismatched
    # The HF tokenizer knows the special tokens under the same ids (for chat rendering).
    hf = load_hf_tokenizer(tok_dir)
    assert hf.get_vocab_size() == VOCAB
    assert hf.encode("<|bos|>hi", add_special_tokens=False).ids == [tok.bos_id, *tok.encode("hi")]
    assert hf.decode(tok.encode(docs[0])) == docs[0]


@pytest.mark.unit
@hypothesis_settings
@given(text=st.text(alphabet=surrogate_free, max_size=100))
def test_hf_and_tiktoken_agree_on_arbitrary_text(hf_plain, tok, text):
    assert hf_plain.encode(text, add_special_tokens=False).ids == tok.encode(text)


@pytest.mark.unit
def test_token_bytes_table(tok, corpus):
    table = tok.token_bytes()
    assert table.dtype == torch.int32 and table.shape == (VOCAB,)
    first_special = VOCAB - len(SPECIAL_TOKENS)
    assert table[first_special:].tolist() == [0] * len(SPECIAL_TOKENS)
    assert table[:first_special].tolist() == [len(tok.encoding.decode_single_token_bytes(i))
                                              for i in range(first_special)]
    for doc in all_texts(corpus)[:50]:
        ids = tok.encode(doc, prepend_bos=True)
        assert int(table[ids].sum()) == len(doc.encode("utf-8"))


@pytest.mark.unit
def test_evaluate_counts(tok, corpus):
    val = list(iter_split_texts(corpus, "val"))
    stats = tokenizer_stats(tok, val, threads=2)
    ids = [tok.encode(d) for d in val]
    assert stats.docs == len(val)
    assert stats.tokens == sum(map(len, ids))
    assert stats.bytes == sum(len(d.encode()) for d in val)
    assert stats.ids_used == len({i for row in ids for i in row})
    assert stats.ids_total == VOCAB - len(SPECIAL_TOKENS)
    assert stats.bytes_per_token == pytest.approx(stats.bytes / stats.tokens)


# ---------------------------------------------------------------------------------------------------
# Loading: cheap, by path, safe in other processes


@pytest.mark.unit
def test_load_is_cached_and_pickles_as_its_path(tok, tok_dir):
    assert Tokenizer.load(tok_dir) is tok
    data = pickle.dumps(tok)
    assert len(data) < 1000  # the directory, not the vocabulary
    assert pickle.loads(data).fingerprint == tok.fingerprint


@pytest.mark.ray
def test_loads_and_encodes_inside_a_ray_task(ray_session, tok, tok_dir, corpus):
    import ray

    @ray.remote
    def encode_in_task(directory: str, texts: list[str]) -> tuple[str, list[list[int]]]:
        from raychat.tokenizer.core import Tokenizer
        loaded = Tokenizer.load(directory)
        return loaded.fingerprint, loaded.encode_batch(texts, threads=1)

    docs = list(iter_split_texts(corpus, "val"))
    fingerprint, ids = ray.get(encode_in_task.remote(str(tok_dir), docs))
    assert fingerprint == tok.fingerprint
    assert ids == tok.encode_batch(docs)


@pytest.mark.unit
def test_check_vocab(tok):
    check_vocab(tok, VOCAB, tok.fingerprint, "ckpt/step_00010")
    check_vocab(tok, VOCAB, None, "ckpt/step_00010")
    mismatch = "has vocab 1,024 but checkpoint ckpt/step_00010 was trained with 2,048"
    with pytest.raises(RaychatError, match=mismatch):
        check_vocab(tok, 2048, tok.fingerprint, "ckpt/step_00010")
    with pytest.raises(RaychatError, match="fingerprint 0123456789abcdef"):
        check_vocab(tok, VOCAB, "0123456789abcdef", "ckpt/step_00010")


# ---------------------------------------------------------------------------------------------------
# Command line: the happy path and one clear line for every mistake


def run_cli(commands, *args: str) -> subprocess.CompletedProcess:
    """`python -m raychat.tokenizer ARGS` as a user runs it (in this module's reused interpreter)."""
    return commands.run("raychat.tokenizer", *args, timeout=120)


@pytest.mark.integration  # commands in a reused interpreter
def test_cli_train_then_eval(commands, corpus, tmp_path):
    out = tmp_path / "cli_tok"
    done = run_cli(commands, "train", "--data-dir", str(corpus), "--tokenizer-dir", str(out), "--vocab-size",
                   "512")
    assert done.returncode == 0, done.stderr
    tokenizer = Tokenizer.load(out)
    assert tokenizer.vocab_size == 512 and tokenizer.bos_id == 503
    done = run_cli(commands, "eval", "--data-dir", str(corpus), "--tokenizer-dir", str(out), "--threads", "1")
    assert done.returncode == 0, done.stderr
    stats = tokenizer_stats(tokenizer, list(iter_split_texts(corpus, "val")), threads=1)
    assert f"bytes per token:  {stats.bytes_per_token:.3f}" in done.stdout
    assert f"({stats.ids_used:,} of 503 non-special ids)" in done.stdout


def _damage(tok_dir: Path, tmp_path: Path, how: str) -> Path:
    broken = tmp_path / f"broken_{how}"
    shutil.copytree(tok_dir, broken)
    if how == "truncated_ranks":
        ranks = broken / "tokenizer.tiktoken"
        ranks.write_bytes(ranks.read_bytes()[:1000])
    elif how == "bad_meta_json":
        (broken / "meta.json").write_text("{not json")
    elif how == "meta_missing_field":
        meta = json.loads((broken / "meta.json").read_text())
        del meta["special_tokens"]
        (broken / "meta.json").write_text(json.dumps(meta))
    elif how == "ranks_missing":
        (broken / "tokenizer.tiktoken").unlink()
    return broken


@pytest.mark.integration  # commands in a reused interpreter
@pytest.mark.parametrize("case", ["vocab_too_small", "missing_corpus", "missing_tokenizer", "truncated_ranks",
                                  "bad_meta_json", "meta_missing_field", "ranks_missing", "corpus_too_small"])
def test_cli_bad_input_gives_one_line(commands, case, corpus, tok_dir, tmp_path):
    if case == "vocab_too_small":
        args, expected = ["train", "--data-dir", str(corpus), "--vocab-size", str(MIN_VOCAB_SIZE - 1),
                          "--tokenizer-dir", str(tmp_path / "t")], "--vocab-size 264 is too small"
    elif case == "missing_corpus":
        args, expected = ["train", "--data-dir", str(tmp_path / "nowhere"), "--tokenizer-dir",
                          str(tmp_path / "t")], f"corpus directory {tmp_path / 'nowhere'} does not exist"
    elif case == "missing_tokenizer":
        args, expected = ["eval", "--data-dir", str(corpus), "--tokenizer-dir", str(tmp_path / "none")], \
            f"no tokenizer at {tmp_path / 'none'}"
    elif case == "corpus_too_small":
        tiny = _write_corpus(tmp_path / "tiny", ["hello world"], ["bye"])
        args, expected = ["train", "--data-dir", str(tiny), "--tokenizer-dir", str(tmp_path / "t")], \
            "lower --vocab-size or train on more text"
    else:
        args, expected = ["eval", "--data-dir", str(corpus), "--tokenizer-dir",
                          str(_damage(tok_dir, tmp_path, case))], "is damaged"
    done = run_cli(commands, *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raychat: error: "), done.stderr
    assert expected in lines[0]
    assert "Traceback" not in done.stderr


@pytest.mark.unit
def test_damaged_token_bytes_is_reported(tok_dir, tmp_path):
    broken = tmp_path / "broken_tb"
    shutil.copytree(tok_dir, broken)
    np.save(broken / "token_bytes.npy", np.zeros(3, dtype=np.int32))
    with pytest.raises(RaychatError, match=r"token_bytes.npy is not an int32 array of shape \[1024\]"):
        Tokenizer.load(broken).token_bytes()
    (broken / "token_bytes.npy").write_bytes(b"garbage")
    with pytest.raises(RaychatError, match="token_bytes.npy does not load"):
        Tokenizer.load(broken).token_bytes()


@pytest.mark.integration  # commands in a reused interpreter
@pytest.mark.parametrize("args,flags", [(["--help"], ["train", "eval", "raychat.corpus sample"]),
                                        (["train", "--help"], ["--vocab-size", "--max-chars", "--doc-cap"]),
                                        (["eval", "--help"], ["--threads", "--data-dir", "--tokenizer-dir"])])
def test_help_explains_each_command(commands, args, flags):
    done = run_cli(commands, *args)
    assert done.returncode == 0
    assert all(flag in done.stdout for flag in flags)


@pytest.mark.unit
def test_nanochats_pickled_tokenizer_imports_with_its_ids_only_if_trusted(tok, tok_dir, corpus, tmp_path):
    """nanochat's tokenizer.pkl (a pickled tiktoken Encoding, as nanochat and raychat.export write it)
    -> raychat's files: the same ranks, specials and fingerprint, and HF merges recovered from the
    ranks alone that are the ones training learned."""
    from raychat.tokenizer.cli import main

    source = tmp_path / "nanochat" / "tokenizer"
    source.mkdir(parents=True)
    with open(source / "tokenizer.pkl", "wb") as f:
        pickle.dump(tok.encoding, f)
    out = tmp_path / "imported"
    with pytest.raises(RaychatError, match="is a pickle: loading it runs code .* add --trust-pickle"):
        main(["import-nanochat", "--from", str(source), "--tokenizer-dir", str(out)])
    assert not out.exists()
    trusted = ["import-nanochat", "--from", str(source), "--tokenizer-dir", str(out), "--trust-pickle"]
    assert main(trusted) == 0
    imported = Tokenizer.load(out)
    assert imported.fingerprint == tok.fingerprint and imported.vocab_size == tok.vocab_size
    assert (out / HF_FILE).read_text() == (tok_dir / HF_FILE).read_text()  # the merges, in training's order
    docs = all_texts(corpus)[:50]
    assert [imported.encode(d) for d in docs] == [tok.encode(d) for d in docs]

    with open(source / "tokenizer.pkl", "wb") as f:
        pickle.dump({"not": "an encoding"}, f)
    with pytest.raises(RaychatError, match="holds a dict, not nanochat's tiktoken Encoding"):
        main(trusted)
