"""Training a tokenizer: HF's BpeTrainer learns the merges from the corpus's training split, then
the vocabulary is exported to tiktoken's form (token bytes -> rank, rank = id) and the HF tokenizer is
rebuilt with those same ids, so `raychat.tokenizer.core.Tokenizer` (tiktoken) and the HF tokenizer give
identical ids. Everything that needs HF `tokenizers` lives here; encoding does not.
"""

import base64
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raychat.common import RaychatError
from raychat.corpus.index import CorpusIndex, iter_split_texts
from raychat.locations import normalize_location
from raychat.tokenizer.core import (
    FORMAT_VERSION,
    HF_FILE,
    META_FILE,
    RANKS_FILE,
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    TOKEN_BYTES_FILE,
    Tokenizer,
    compute_fingerprint,
)

MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
_PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"
_FALSE_VALUES = ("", "off", "false", "f", "no", "n", "0")  # what HF tokenizers reads as "off"
# Progress: a line this often while the corpus is read (a small corpus is read before the first one),
# and HF's own bars (word counting, merges) on a terminal for a corpus this large.
PROGRESS_EVERY_S = 30.0
HF_PROGRESS_MIN_DOCS = 100_000


def byte_to_char() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (GPT-2's): bytes that are printable
    Latin-1 characters stand for themselves, the other 68 are shifted to U+0100 and up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + i)) for i, b in enumerate(shifted))
    return chars


def _hf_tokenizer(vocab: dict[str, int] | None = None, merges: list[tuple[str, str]] | None = None):
    """nanochat's HF pipeline: no normalizer, split by SPLIT_PATTERN, then bytes -> characters."""
    from tokenizers import Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    model = BPE(vocab, merges) if vocab is not None else BPE()
    hf = HFTokenizer(model)
    hf.normalizer = None
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    return hf


@dataclass
class _ReadStats:
    docs: int = 0
    chars: int = 0
    seconds_reading: float = 0.0


class _Progress:
    """A line every `every_s` seconds while the trainer reads the corpus (its share of documents or
    of --max-chars, whichever is further along), and one when the reading is done, if any was said."""

    def __init__(self, log: Callable[[str], None], every_s: float, total_docs: int, max_chars: int):
        self.log, self.every_s, self.total_docs, self.max_chars = log, every_s, total_docs, max_chars
        self.start = self.last = time.monotonic()
        self.lines = 0

    def __call__(self, stats: _ReadStats) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last, self.lines = now, self.lines + 1
        share = max(stats.docs / max(self.total_docs, 1), stats.chars / self.max_chars)
        self.log(f"Tokenizer: read {stats.docs:,} documents ({stats.chars:,} chars, {min(share, 1):.0%}) "
                 f"in {now - self.start:.0f}s")

    def done(self, stats: _ReadStats) -> None:
        if self.lines:
            self.log(f"Tokenizer: read {stats.docs:,} documents ({stats.chars:,} chars) in "
                     f"{time.monotonic() - self.start:.0f}s; learning the merges")


def _batches(texts: Iterable[str], stats: _ReadStats, serial_after: bool,
             size: int = 1024, progress: _Progress | None = None) -> Iterator[list[str]]:
    """Feeds the HF trainer lists of documents (fewer Python<->Rust crossings than one by one).

    When the corpus is exhausted and `serial_after`, switch HF's parallelism off: the trainer reads
    TOKENIZERS_PARALLELISM at each parallel section; counting words (done) gains from every core,
    but the merge loop runs one tiny rayon job per merge, 32k of them, whose thread wake-ups cost
    more than the work."""
    batch: list[str] = []
    start = time.perf_counter()
    for text in texts:
        batch.append(text)
        stats.docs += 1
        stats.chars += len(text)
        if len(batch) == size:
            stats.seconds_reading += time.perf_counter() - start
            if progress is not None:
                progress(stats)
            yield batch
            batch = []
            start = time.perf_counter()
    stats.seconds_reading += time.perf_counter() - start
    if batch:
        if progress is not None:
            progress(stats)
        yield batch
    if progress is not None:
        progress.done(stats)
    if serial_after:
        os.environ[_PARALLELISM_ENV] = "false"


def _export(hf) -> tuple[dict[bytes, int], dict[str, int], list[tuple[str, str]]]:
    """Ranks for tiktoken (bytes -> id: single bytes first in byte order, then merged tokens in
    learning order), the same vocabulary as HF strings, and HF's merges in order."""
    model = json.loads(hf.to_str())["model"]
    char_to_byte = {c: b for b, c in byte_to_char().items()}
    learned = sorted((i, s) for s, i in model["vocab"].items() if s not in SPECIAL_TOKENS and len(s) > 1)
    ranks = {bytes([b]): b for b in range(256)}
    vocab = {c: b for b, c in byte_to_char().items()}
    for token in (s for _, s in learned):
        vocab[token] = len(ranks)
        ranks[bytes(char_to_byte[c] for c in token)] = len(ranks)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return ranks, vocab, merges


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def train_tokenizer(data_dir: str | Path, out_dir: str | Path, vocab_size: int = 32768,
                    max_chars: int = 2_000_000_000, doc_cap: int = 10_000,
                    log: Callable[[str], None] = print,
                    progress_every_s: float = PROGRESS_EVERY_S) -> Tokenizer:
    """Train on the training split of the corpus in data_dir (documents cut to doc_cap characters, up
    to max_chars characters in all) and save to out_dir (replacing a tokenizer there). While the corpus
    is read, a progress line every `progress_every_s` seconds."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise RaychatError(f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least "
                           f"{MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    if max_chars < 1 or doc_cap < 1:
        raise RaychatError(f"--max-chars ({max_chars}) and --doc-cap ({doc_cap}) must be at least 1")
    data_dir = normalize_location(data_dir)  # a local path or a bucket URI
    out_dir = Path(out_dir).expanduser().resolve()
    index = CorpusIndex.load(data_dir)  # a bad corpus fails here, before any training
    from tokenizers.trainers import BpeTrainer

    log(f"Training tokenizer (vocab {vocab_size:,}) on the {index.num_train_docs:,} training documents of "
        f"{data_dir} (each cut to {doc_cap:,} chars, at most {max_chars:,} chars in all)")

    # Count words on every core, merge on one (see _batches); a user's explicit setting wins.
    user_parallelism = os.environ.get(_PARALLELISM_ENV)
    switch = user_parallelism is None or user_parallelism.lower() not in _FALSE_VALUES
    stats = _ReadStats()
    t0 = time.perf_counter()
    hf = _hf_tokenizer()
    progress = _Progress(log, progress_every_s, index.num_train_docs, max_chars)
    # HF's bars draw only on a terminal; a small corpus is done before they would say anything useful.
    hf_bars = sys.stderr.isatty() and index.num_train_docs >= HF_PROGRESS_MIN_DOCS
    trainer = BpeTrainer(vocab_size=vocab_size, min_frequency=0, show_progress=hf_bars,
                         initial_alphabet=sorted(byte_to_char().values()), special_tokens=SPECIAL_TOKENS)
    try:
        if switch:
            os.environ[_PARALLELISM_ENV] = "true"  # exists from now on, so the flip replaces it in place
        texts = iter_split_texts(data_dir, "train", max_chars, doc_cap)
        hf.train_from_iterator(_batches(texts, stats, switch, progress=progress), trainer)
    finally:
        if user_parallelism is None:
            os.environ.pop(_PARALLELISM_ENV, None)
        else:
            os.environ[_PARALLELISM_ENV] = user_parallelism
    seconds = time.perf_counter() - t0
    if hf.get_vocab_size() < vocab_size:
        raise RaychatError(f"the training text of {data_dir} ({stats.chars:,} chars) only supports a "
                           f"vocabulary of {hf.get_vocab_size():,}, less than --vocab-size {vocab_size:,}: "
                           "lower --vocab-size or train on more text (more documents, higher --max-chars)")
    log(f"Trained on {stats.docs:,} documents, {stats.chars:,} chars in {seconds:.1f}s "
        f"({stats.seconds_reading:.1f}s of it reading the corpus)")

    ranks, vocab, merges = _export(hf)
    provenance = {"trained_on": {"data_dir": str(data_dir), "docs": stats.docs, "chars": stats.chars,
                                 "max_chars": max_chars, "doc_cap": doc_cap, "seconds": round(seconds, 3)}}
    tokenizer = write_tokenizer(out_dir, ranks, vocab, merges, provenance)
    log(f"Saved tokenizer to {out_dir} (vocab {vocab_size:,}, fingerprint {tokenizer.fingerprint})")
    return tokenizer


def write_tokenizer(out_dir: Path, ranks: dict[bytes, int], vocab: dict[str, int],
                    merges: list[tuple[str, str]], provenance: dict) -> Tokenizer:
    """raychat's tokenizer files from ranks (token bytes -> id) and the same vocabulary and merges
    as HF strings, with nanochat's special tokens after the ranks; returns the tokenizer loaded back."""
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    exported = _hf_tokenizer(vocab, merges)
    exported.add_special_tokens(SPECIAL_TOKENS)
    ranks_text = b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in ranks.items())
    token_bytes = np.array([len(token) for token in ranks] + [0] * len(specials), dtype=np.int32)
    meta = {
        "format": FORMAT_VERSION,
        "vocab_size": len(ranks) + len(specials),
        "special_tokens": specials,
        "pattern": SPLIT_PATTERN,
        "fingerprint": compute_fingerprint(ranks_text, specials, SPLIT_PATTERN),
        **provenance,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_dir / RANKS_FILE, ranks_text)
    _write_atomic(out_dir / HF_FILE, exported.to_str().encode())
    with io.BytesIO() as buffer:
        np.save(buffer, token_bytes, allow_pickle=False)
        _write_atomic(out_dir / TOKEN_BYTES_FILE, buffer.getvalue())
    _write_atomic(out_dir / META_FILE, json.dumps(meta, indent=1).encode())
    return Tokenizer.load(out_dir)
