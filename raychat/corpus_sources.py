"""Where corpora come from when they are not downloaded: the user's files (ingest), text already on
this machine (sample: the offline default), and seeded generated text (synthetic: tests, benchmarks).

All three write through `raychat.corpus.CorpusWriter`, so they share the layout, the temp-name
protocol and the row-group size. Each is deterministic: the same inputs give byte-identical shards.
"""

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import random
import re
import sysconfig
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raychat.common import RaychatError
from raychat.corpus import (
    DEFAULT_DOCS_PER_SHARD,
    ROW_GROUP_SIZE,
    TEXT_TYPES,
    CorpusSummary,
    CorpusWriter,
    split_val_count,
    validate_corpus,
)

# ----------------------------------------------------------------------------- ingest

INGEST_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")


def _input_files(paths: Sequence[str | Path]) -> list[Path]:
    files = []
    for given in paths:
        path = Path(given).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in INGEST_SUFFIXES)
            if not found:
                raise RaychatError(f"{path} holds no {'/'.join(INGEST_SUFFIXES)} files: point ingest at the "
                                   "files to turn into a corpus")
            files += found
        elif path.is_file():
            if path.suffix.lower() not in INGEST_SUFFIXES:
                raise RaychatError(f"{path}: ingest reads {', '.join(INGEST_SUFFIXES)} files, not "
                                   f"'{path.suffix or 'no extension'}': convert it or leave it out")
            files.append(path)
        else:
            raise RaychatError(f"input {path} does not exist: check the path given to ingest")
    return files


class _Decoder:
    """UTF-8 decoding that never fails: invalid bytes become U+FFFD, counted per file for the report."""

    def __init__(self) -> None:
        self.bad_files: dict[Path, int] = {}

    def __call__(self, path: Path, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("utf-8", errors="replace")
            # Real U+FFFD characters in the input were valid; count only the ones decoding introduced.
            replaced = text.count("\ufffd") - data.count("\ufffd".encode())
            self.bad_files[path] = self.bad_files.get(path, 0) + replaced
            return text


def _file_documents(path: Path, decode: _Decoder) -> Iterator[str | None]:
    """The documents in one input file (None for a null parquet value)."""
    suffix = path.suffix.lower()
    if suffix in (".txt", ".md"):
        yield decode(path, path.read_bytes())
    elif suffix == ".jsonl":
        with open(path, "rb") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(decode(path, line))
                except json.JSONDecodeError as e:
                    raise RaychatError(f"{path}:{line_number}: not valid JSON ({e.msg}): fix or remove that "
                                       "line (each line must be an object with a string field `text`)") from e
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise RaychatError(f"{path}:{line_number}: no string field `text`: each line must be a "
                                       "JSON object like {\"text\": \"...\"}")
                yield record["text"]
    else:
        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise RaychatError(f"{path} is not a readable parquet file ({' '.join(str(e).split())}): "
                               "fix or remove it") from e
        schema = parquet.schema_arrow
        if "text" not in schema.names or schema.field("text").type not in TEXT_TYPES:
            raise RaychatError(f"{path} has no string column `text` (columns: {', '.join(schema.names)}): "
                               "rename the document column to `text`")
        for batch in parquet.iter_batches(batch_size=ROW_GROUP_SIZE, columns=["text"]):
            # As bytes, so invalid UTF-8 written by another tool is handled like in text files.
            for data in batch.column(0).cast(pa.large_binary()).to_pylist():
                yield None if data is None else decode(path, data)


def ingest(paths: Sequence[str | Path], out_dir: str | Path, docs_per_shard: int = DEFAULT_DOCS_PER_SHARD,
           val_docs: int | None = None, overwrite: bool = False,
           log: Callable[[str], None] = print) -> CorpusSummary:
    """Turn local .txt/.md (one document per file), .jsonl and .parquet (one per record, field `text`)
    files into a corpus. Empty (or whitespace-only) and exact-duplicate documents are dropped; the
    last documents in input order become the validation shard."""
    files = _input_files(paths)
    decode = _Decoder()
    seen: set[bytes] = set()
    num_docs = num_empty = num_duplicates = 0
    # The val split is the tail of the stream, whose size depends on the final count: hold back enough.
    tail: deque[str] = deque()
    tail_size = val_docs if val_docs is not None else 2 * ROW_GROUP_SIZE
    batch: list[str] = []
    with CorpusWriter(out_dir, docs_per_shard, overwrite) as writer:
        for path in files:
            for text in _file_documents(path, decode):
                if text is None or not text.strip():
                    num_empty += 1
                    continue
                digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
                if digest in seen:
                    num_duplicates += 1
                    continue
                seen.add(digest)
                num_docs += 1
                tail.append(text)
                if len(tail) > tail_size:
                    batch.append(tail.popleft())
                    if len(batch) == ROW_GROUP_SIZE:
                        writer.add_train(batch)
                        batch = []
        if num_docs == 0:
            raise RaychatError(f"no documents found in {len(files)} input files (all empty or duplicates): "
                               "nothing to ingest")
        num_val = split_val_count(num_docs, val_docs)
        tail_docs = list(tail)
        writer.add_train(batch + tail_docs[:len(tail_docs) - num_val])
        writer.add_val(tail_docs[len(tail_docs) - num_val:])
    for path, count in decode.bad_files.items():
        log(f"warning: {path}: {count} invalid UTF-8 byte sequences replaced with U+FFFD")
    log(f"ingest: {len(files)} files -> {num_docs:,} documents ({num_empty:,} empty and {num_duplicates:,} "
        f"duplicate documents dropped; invalid UTF-8 in {len(decode.bad_files)} files)")
    return validate_corpus(out_dir)


# ----------------------------------------------------------------------------- sample

SAMPLE_MAX_MB = 20.0
SAMPLE_DOCS_PER_SHARD = ROW_GROUP_SIZE
SAMPLE_SHUFFLE_SEED = 0
MIN_DOCSTRING_CHARS = 40
MIN_SAMPLE_DOC_CHARS = 200
# Docstrings: a triple-quoted string opening the file (after comments) or the line after one ending
# in ':' (a def/class header). Anchoring on the ':' keeps closing quotes of other strings from
# being mistaken for openings, without the cost of parsing every file.
DOCSTRING = re.compile(rb'''(?:\A(?:[ \t]*(?:#[^\n]*)?\n)*|:[ \t]*(?:#[^\n]*)?\n(?:[ \t]*\n)*)'''
                       rb'''[ \t]*[rRuU]?("""|\'\'\')(.*?)\1''', re.S)


def _package_descriptions() -> list[str]:
    """Long descriptions (READMEs) of the installed distributions, one per distribution name."""
    by_name: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if name and len(text) >= MIN_SAMPLE_DOC_CHARS:
            by_name[name] = max(by_name.get(name, ""), text)  # two installs of one name: deterministic pick
    return [by_name[name] for name in sorted(by_name)]


def _help_topics() -> list[str]:
    """Python's interactive help topics: sections of the language reference."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [topics[key] for key in sorted(topics) if len(topics[key]) >= MIN_SAMPLE_DOC_CHARS]


def _python_source_files() -> list[Path]:
    """Every .py file of the standard library and the installed packages, in a fixed order."""
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], paths["platlib"]]
    files: list[Path] = []
    seen_roots: set[str] = set()
    for root in roots:
        real = os.path.realpath(root)
        if real in seen_roots or not os.path.isdir(real):
            continue
        seen_roots.add(real)
        for dirpath, dirnames, filenames in os.walk(real):
            # site-packages sits inside the stdlib directory; it is walked as its own root.
            dirnames[:] = sorted(d for d in dirnames
                                 if d not in ("site-packages", "dist-packages", "__pycache__"))
            files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def _file_docstrings(path: Path) -> str:
    try:
        source = path.read_bytes()
    except OSError:
        return ""
    parts = []
    for match in DOCSTRING.finditer(source):
        raw = match.group(2)
        try:
            text = inspect.cleandoc(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        if len(text) >= MIN_DOCSTRING_CHARS:
            parts.append(text)
    return "\n\n".join(parts)


def sample_documents(max_mb: float = SAMPLE_MAX_MB) -> list[str]:
    """Human-written text already on this machine, shuffled, about max_mb MB of UTF-8 (whole documents):
    package descriptions and help topics first (the most prose-like), then docstrings, one document per
    source file, from a fixed shuffle of the source files until the budget is met. Same installed
    packages -> same list."""
    budget = int(max_mb * 1e6)
    documents: list[str] = []
    seen: set[str] = set()
    size = 0

    def add(text: str) -> None:
        nonlocal size
        if len(text) < MIN_SAMPLE_DOC_CHARS or text in seen:
            return
        try:
            encoded_size = len(text.encode())
        except UnicodeEncodeError:  # lone surrogates from undecodable package metadata
            return
        seen.add(text)
        documents.append(text)
        size += encoded_size

    prose = _package_descriptions() + _help_topics()
    random.Random(SAMPLE_SHUFFLE_SEED).shuffle(prose)
    for text in prose:
        if size >= budget:
            break
        add(text)
    sources = _python_source_files()
    random.Random(SAMPLE_SHUFFLE_SEED).shuffle(sources)
    for path in sources:
        if size >= budget:
            break
        add(_file_docstrings(path))
    random.Random(SAMPLE_SHUFFLE_SEED).shuffle(documents)  # so val and every shard mix all sources
    return documents


def write_sample_corpus(out_dir: str | Path, max_mb: float = SAMPLE_MAX_MB,
                        docs_per_shard: int = SAMPLE_DOCS_PER_SHARD, val_docs: int | None = None,
                        overwrite: bool = False, log: Callable[[str], None] = print) -> CorpusSummary:
    """The offline default corpus (see sample_documents), written to out_dir."""
    documents = sample_documents(max_mb)
    if not documents:
        raise RaychatError("found no package descriptions or docstrings on this machine for the sample "
                           "corpus: use `python -m raychat.corpus ingest` or `synthetic` instead")
    num_val = split_val_count(len(documents), val_docs)
    with CorpusWriter(out_dir, docs_per_shard, overwrite) as writer:
        writer.add_train(documents[:-num_val])
        writer.add_val(documents[-num_val:])
    size_mb = sum(len(d.encode()) for d in documents) / 1e6
    log(f"sample: {len(documents):,} documents, {size_mb:.1f} MB of text")
    return validate_corpus(out_dir)


# ----------------------------------------------------------------------------- synthetic
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
    with CorpusWriter(out_dir, docs_per_shard, overwrite, workers=workers) as writer:
        for batch in iter_synthetic_batches(num_docs, seed, workers=workers):
            train_part = max(0, min(len(batch), num_train - done))
            writer.add_train(batch.slice(0, train_part))
            writer.add_val(batch.slice(train_part))
            done += len(batch)
    return validate_corpus(out_dir)
