"""A test and benchmark FIXTURE: seeded synthetic corpora of made-up text. Never training data.

Tests and benchmarks need corpora of any size, reproducible to the byte, in seconds and offline;
`python -m raychat.corpus synthetic` and the test suite make them here. The text mimics the
statistics that matter to the loader and the tokenizer (a heavy-tailed length distribution with a
few book-length documents, several scripts, numbers, punctuation, emoji) and nothing else: a model
trained on it learns nothing useful. Document i of seed s is the same whatever the layout.
"""

import functools
import os
import random
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa

from raychat.corpus.check import CorpusSummary, validate_corpus
from raychat.corpus.index import DEFAULT_DOCS_PER_SHARD, ROW_GROUP_SIZE
from raychat.corpus.writer import CorpusWriter, split_val_count

# Documents are sequences of tokens drawn from a fixed made-up vocabulary (words of several scripts,
# numbers, punctuation, emoji), each token stored with its trailing separator. A batch of documents
# is assembled without per-character Python: token ids -> padded byte rows -> masked compress ->
# one UTF-8 buffer plus offsets, handed to Arrow as a string array without copies.

# (script, weight as the main script of a document, alphabet of syllable onsets, vowels, separator)
_SCRIPTS = [
    ("latin", 0.80, "b c d f g h j k l m n p r s t v w z st tr pl br ch sh th gr cl",
     "a e i o u ea ou ai é ü ö", " "),
    ("cyrillic", 0.05, "б в г д ж з к л м н п р с т ф х ц ч ш", "а е и о у ы я ю", " "),
    ("greek", 0.03, "β γ δ ζ θ κ λ μ ν ξ π ρ σ τ φ χ ψ", "α ε η ι ο υ ω ά έ ί ό", " "),
    ("arabic", 0.03, "ب ت ث ج ح خ د ذ ر ز س ش ص ض ط ظ ع غ ف ق ك ل م ن ه", "ا و ي", " "),
    ("devanagari", 0.03, "क ख ग घ च छ ज झ ट ठ ड ढ त थ द ध न प फ ब भ म य र ल व श स ह", "ा ि ी ु ू े ै ो ौ", " "),
    ("cjk", 0.06, "", "", ""),
]
_PUNCTUATION = {  # repeated entries weight the draw
    " ": [". "] * 6 + [", "] * 8 + [".\n\n"] * 2 + ["\n", "? ", "! ", ": ", "; "],
    "": ["。"] * 6 + ["，"] * 8 + ["。\n\n"] * 2 + ["\n", "？", "！", "：", "、"],
}
_WORDS_PER_SCRIPT = {"latin": 30000}
_DEFAULT_WORDS = 8000
_KIND_THRESHOLDS = np.cumsum(np.array([0.12, 0.03, 0.002], dtype=np.float32))  # punctuation, number, emoji
_MEDIAN_TOKENS, _SIGMA_TOKENS = 300, 1.1          # ordinary documents: ~2 KB median, heavy right tail
_P_VERY_LONG, _MEDIAN_VERY_LONG = 0.003, 30000    # a few book-length documents (~200 KB)
_MAX_TOKENS = 200_000
_MAX_TOKEN_BYTES = 16  # assembly moves every token as a 16-byte row, so longer words are not drawn


def _make_word(rng: random.Random, onsets: list[str], vowels: list[str]) -> str:
    syllables = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
    return "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(syllables))


@functools.cache
def _vocabulary() -> dict:
    """The token table, the same for every seed (so corpora of different seeds share one 'language')."""
    rng = random.Random(20261130)
    tokens: list[str] = []
    scripts = []
    for name, weight, onsets, vowels, separator in _SCRIPTS:
        count = _WORDS_PER_SCRIPT.get(name, _DEFAULT_WORDS)
        words: dict[str, None] = {}
        while len(words) < count:
            if name == "cjk":
                word = "".join(chr(0x4E00 + rng.randrange(3000)) for _ in range(rng.choice((1, 2, 2, 3))))
            else:
                word = _make_word(rng, onsets.split() + [""], vowels.split())
                if name == "latin" and rng.random() < 0.1:
                    word = word.capitalize()
            if len(word) < 2 or len((word + separator).encode()) > _MAX_TOKEN_BYTES:
                continue
            words[word] = None
        # Zipf: frequent words are short, so rank words by length (ties keep generation order).
        ranked = sorted(words, key=len)
        word_start = len(tokens)
        tokens += [w + separator for w in ranked]
        punct_start = len(tokens)
        tokens += _PUNCTUATION[separator]
        scripts.append((weight, word_start, count, punct_start, len(_PUNCTUATION[separator])))
    number_start = len(tokens)
    for _ in range(5000):
        kind = rng.randrange(5)
        value = rng.randrange(10 ** rng.randrange(1, 7))
        tokens.append([f"{value}", f"{rng.randrange(1800, 2031)}", f"{value / 100:.2f}", f"{value % 100}%",
                       f"{value:,}"][kind] + " ")
    emoji_start = len(tokens)
    tokens += [chr(0x1F300 + i) + " " for i in range(0, 0x150, 2)]
    encoded = [t.encode() for t in tokens]
    lengths = np.array([len(b) for b in encoded], dtype=np.int64)
    # Rows padded to 16 bytes and viewed as uint64: np.take then moves whole machine words.
    width = _MAX_TOKEN_BYTES
    assert lengths.max() <= width
    padded = np.zeros((len(encoded), width), dtype=np.uint8)
    for i, b in enumerate(encoded):
        padded[i, :len(b)] = np.frombuffer(b, dtype=np.uint8)
    mask = np.arange(width)[None, :] < lengths[:, None]
    weights, word_start, word_count, punct_start, punct_count = (np.array(column)
                                                                 for column in zip(*scripts, strict=True))
    is_punct = np.zeros(len(tokens), dtype=bool)
    for start, count in zip(punct_start, punct_count, strict=True):
        is_punct[start:start + count] = True
    return dict(
        padded=padded.view(np.uint64), mask=mask.view(np.uint64), lengths=lengths,
        ends_with_space=np.array([b.endswith(b" ") for b in encoded]), is_punct=is_punct,
        script_p=weights / weights.sum(), word_start=word_start, log_word_count=np.log(word_count + 1),
        punct_start=punct_start, punct_count=punct_count,
        number_start=number_start, number_count=emoji_start - number_start,
        emoji_start=emoji_start, emoji_count=len(tokens) - emoji_start,
    )


def _synthetic_batch(rng: np.random.Generator, num_docs: int) -> pa.StringArray:
    v = _vocabulary()
    script = rng.choice(len(v["script_p"]), size=num_docs, p=v["script_p"])
    very_long = rng.random(num_docs) < _P_VERY_LONG
    median = np.where(very_long, _MEDIAN_VERY_LONG, _MEDIAN_TOKENS)
    sigma = np.where(very_long, 0.7, _SIGMA_TOKENS)
    num_tokens = np.clip(rng.lognormal(np.log(median), sigma), 1, _MAX_TOKENS).astype(np.int64)
    first = np.cumsum(num_tokens) - num_tokens
    last = first + num_tokens - 1
    token_script = np.repeat(script, num_tokens)
    total = int(num_tokens.sum())

    # Words: log-uniform rank (a Zipf-like law) within the document's script; then some positions
    # become punctuation, numbers or emoji (never a document's first token).
    uniform = rng.random(total, dtype=np.float32)
    rank = np.exp(uniform * v["log_word_count"][token_script]).astype(np.int64) - 1
    ids = v["word_start"][token_script] + rank
    kind = np.searchsorted(_KIND_THRESHOLDS, rng.random(total, dtype=np.float32), side="right")
    kind[1:][(kind[1:] == 0) & (kind[:-1] == 0)] = len(_KIND_THRESHOLDS)  # no punctuation runs like ",."
    kind[first] = len(_KIND_THRESHOLDS)
    specials = [(v["punct_start"], v["punct_count"]), (v["number_start"], v["number_count"]),
                (v["emoji_start"], v["emoji_count"])]
    for k, (start, count) in enumerate(specials):
        where = np.flatnonzero(kind == k)
        if np.ndim(start):  # punctuation depends on the script
            start, count = start[token_script[where]], count[token_script[where]]
        ids[where] = start + (rng.random(len(where)) * count).astype(np.int64)

    # Assemble: each token's bytes sit left-aligned in a padded row; the mask keeps the real bytes and
    # drops the space before punctuation and after a document's last token.
    lengths = v["lengths"][ids]
    mask = np.take(v["mask"], ids, axis=0).view(np.bool_)
    followed_by_punct = np.zeros(total, dtype=bool)
    followed_by_punct[:-1] = v["is_punct"][ids[1:]]
    followed_by_punct[last] = True
    trim = np.flatnonzero(followed_by_punct & v["ends_with_space"][ids])
    mask[trim, lengths[trim] - 1] = False
    lengths[trim] -= 1
    data = np.take(v["padded"], ids, axis=0).view(np.uint8)[mask]
    offsets = np.zeros(num_docs + 1, dtype=np.int64)
    np.cumsum(np.add.reduceat(lengths, first), out=offsets[1:])
    string_type = pa.large_string() if offsets[-1] >= 2**31 else pa.string()
    offsets = offsets.astype(np.int64 if string_type == pa.large_string() else np.int32)
    return pa.Array.from_buffers(string_type, num_docs, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _batch(seed: int, batch_index: int) -> pa.Array:
    return _synthetic_batch(np.random.default_rng([seed, batch_index]), ROW_GROUP_SIZE)


def iter_synthetic_batches(num_docs: int, seed: int, start: int = 0, workers: int = 1) -> Iterator[pa.Array]:
    """Documents start..num_docs-1 of the synthetic corpus `seed`, in Arrow string arrays of up to
    ROW_GROUP_SIZE. Document i is the same whatever start/num_docs/layout/workers: each batch of
    ROW_GROUP_SIZE documents has its own seed. `workers` threads generate ahead (numpy releases the GIL)."""
    indices = range(start // ROW_GROUP_SIZE, -(-num_docs // ROW_GROUP_SIZE))
    to_submit = iter(indices)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="synthetic") as pool:
        ahead: deque[Future] = deque()
        for batch_index in indices:
            while len(ahead) < 2 * workers and (i := next(to_submit, None)) is not None:
                ahead.append(pool.submit(_batch, seed, i))
            batch = ahead.popleft().result()
            batch_start = batch_index * ROW_GROUP_SIZE
            lo, hi = max(start - batch_start, 0), min(num_docs - batch_start, ROW_GROUP_SIZE)
            yield batch.slice(lo, hi - lo)


def synthetic_texts(num_docs: int, seed: int = 0) -> list[str]:
    """The first num_docs synthetic documents as Python strings (for tests)."""
    return [text for batch in iter_synthetic_batches(num_docs, seed) for text in batch.to_pylist()]


def write_synthetic_corpus(out_dir: str | Path, num_docs: int, seed: int = 0,
                           docs_per_shard: int = DEFAULT_DOCS_PER_SHARD, val_docs: int | None = None,
                           overwrite: bool = False, workers: int | None = None) -> CorpusSummary:
    """num_docs synthetic documents: the first go to train shards, the last `val_docs` to the val shard.
    `workers` threads generate and as many compress (default: the CPU count, at most 8)."""
    num_val = split_val_count(num_docs, val_docs)
    num_train = num_docs - num_val
    workers = workers or min(8, os.cpu_count() or 1)
    done = 0
    with CorpusWriter(out_dir, docs_per_shard, overwrite, workers=workers, source="synthetic") as writer:
        for batch in iter_synthetic_batches(num_docs, seed, workers=workers):
            train_part = max(0, min(len(batch), num_train - done))
            writer.add_train(batch.slice(0, train_part))
            writer.add_val(batch.slice(train_part))
            done += len(batch)
    return validate_corpus(out_dir)
