"""The tokenizer: nanochat's byte-level BPE, trained with HF `tokenizers`, encoded with `tiktoken`.

Two libraries because each is best at one half: HF's BpeTrainer learns the merges from a streamed
corpus in Rust; tiktoken encodes faster and releases the GIL, so a batch of documents encodes on
every core. After training, the vocabulary is exported to tiktoken's form (token bytes -> rank,
rank = id) and the HF tokenizer is rebuilt with those same ids, so the two give identical ids.

Ids follow nanochat's rustbpe+tiktoken tokenizer: 0..255 are the single bytes, then the merged tokens
in the order they were learned, then the special tokens, `<|bos|>` first. The vocabulary size
counts the special tokens.

A tokenizer directory holds only readable, safely loadable files (nothing is unpickled):
    tokenizer.tiktoken  one line per mergeable token: base64 of its bytes, space, rank (= id)
    tokenizer.json      the equivalent HF tokenizer, same ids
    token_bytes.npy     int32 [vocab_size]: UTF-8 bytes per id, 0 for special tokens (for bits per byte)
    meta.json           vocab size, special tokens, split pattern, fingerprint, what it was trained on
meta.json is written last, so a directory with a meta.json whose fingerprint matches is complete.
"""

import argparse
import base64
import hashlib
import io
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tiktoken

from raychat.common import RaychatError, default_data_dir, default_tokenizer_dir, run_cli
from raychat.corpus_index import CorpusIndex, iter_split_texts

if TYPE_CHECKING:
    import torch

SPECIAL_TOKENS = [
    "<|bos|>",  # begins every document; the only special token pretraining uses
    # the chat tokens, used by fine-tuning to render conversations
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
]

# GPT-4's split pattern, except numbers split into groups of at most 2 digits (GPT-4: 3), as nanochat
# does, so a small vocabulary spends fewer tokens on numbers.
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                 r"""|\s*[\r\n]|\s+(?!\S)|\s+""")

MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
FORMAT_VERSION = 1
RANKS_FILE, HF_FILE = "tokenizer.tiktoken", "tokenizer.json"
TOKEN_BYTES_FILE, META_FILE = "token_bytes.npy", "meta.json"
_PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"
_FALSE_VALUES = ("", "off", "false", "f", "no", "n", "0")  # what HF tokenizers reads as "off"


def _train_hint(tokenizer_dir: Path) -> str:
    return f"train one with `python -m raychat.tokenizer train --tokenizer-dir {tokenizer_dir}`"


def _fingerprint(ranks_text: bytes, special_tokens: dict[str, int], pattern: str) -> str:
    """Short hash of everything that decides which ids a text gets."""
    digest = hashlib.sha256(ranks_text)
    digest.update(json.dumps(special_tokens, sort_keys=True).encode())
    digest.update(pattern.encode())
    return digest.hexdigest()[:16]


def available_cores() -> int:
    """Cores this process may run on (respects CPU affinity, unlike os.cpu_count())."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Tokenizer:
    """A trained tokenizer, loaded from its directory. Cheap to load (cached per process) and pickled
    as just its directory, so Ray tasks and actors can be handed one or the path."""

    def __init__(self, directory: Path, encoding: tiktoken.Encoding, meta: dict):
        self.directory = directory
        self.encoding = encoding
        self.meta = meta
        self.vocab_size: int = meta["vocab_size"]
        self.special_tokens: dict[str, int] = meta["special_tokens"]
        self.bos_id: int = self.special_tokens["<|bos|>"]
        self.fingerprint: str = meta["fingerprint"]
        self._token_bytes: torch.Tensor | None = None

    @classmethod
    def load(cls, tokenizer_dir: str | Path) -> "Tokenizer":
        directory = Path(tokenizer_dir).expanduser().resolve()
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            what = "does not exist" if not directory.exists() else f"has no {META_FILE}"
            raise RaychatError(f"no tokenizer at {directory} (it {what}): {_train_hint(directory)}, "
                               "or pass the --tokenizer-dir of an existing one")
        stat = meta_path.stat()
        return _load_cached(str(directory), stat.st_mtime_ns, stat.st_size)

    def __reduce__(self):
        return (Tokenizer.load, (str(self.directory),))

    def __repr__(self) -> str:
        return (f"Tokenizer({str(self.directory)!r}, vocab_size={self.vocab_size}, "
                f"fingerprint={self.fingerprint!r})")

    def encode(self, text: str, prepend_bos: bool = False) -> list[int]:
        """Ids of a plain text; special-token strings in it are encoded as ordinary text."""
        ids = self.encoding.encode_ordinary(text)
        return [self.bos_id, *ids] if prepend_bos else ids

    def encode_batch(self, texts: list[str], prepend_bos: bool = True, threads: int = 0) -> list[list[int]]:
        """Ids of many texts, encoded on `threads` threads (0 = every available core); tiktoken releases
        the GIL while it encodes, so threads scale."""
        threads = threads or available_cores()
        if threads == 1 or len(texts) <= 1:
            batch = [self.encoding.encode_ordinary(text) for text in texts]
        else:
            batch = self.encoding.encode_ordinary_batch(texts, num_threads=min(threads, len(texts)))
        if prepend_bos:
            batch = [[self.bos_id, *ids] for ids in batch]
        return batch

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids (bytes that do not form valid UTF-8 on their own become U+FFFD)."""
        return self.encoding.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))

    def token_bytes(self) -> "torch.Tensor":
        """int32 [vocab_size]: UTF-8 length in bytes of each token, 0 for special tokens. Bits per byte
        divides the summed loss by the summed bytes of the target tokens."""
        if self._token_bytes is None:
            import torch

            try:
                table = np.load(self.directory / TOKEN_BYTES_FILE, allow_pickle=False)
            except (OSError, ValueError) as e:
                raise self._damaged(f"{TOKEN_BYTES_FILE} does not load ({type(e).__name__}: {e})") from e
            if table.dtype != np.int32 or table.shape != (self.vocab_size,):
                raise self._damaged(f"{TOKEN_BYTES_FILE} is not an int32 array of shape [{self.vocab_size}]")
            self._token_bytes = torch.from_numpy(table)
        return self._token_bytes

    def _damaged(self, why: str) -> RaychatError:
        return _damaged(self.directory, why)


def _damaged(directory: Path, why: str) -> RaychatError:
    return RaychatError(f"tokenizer at {directory} is damaged ({why}): retrain it with "
                        f"`python -m raychat.tokenizer train --tokenizer-dir {directory}` (checkpoints made "
                        "with the old one need the old files back)")


def _parse_ranks(ranks_text: bytes, directory: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    try:
        for line in ranks_text.splitlines():
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
    except ValueError as e:  # binascii.Error is a ValueError too
        raise _damaged(directory, f"{RANKS_FILE} line {len(ranks) + 1} is not `base64 rank`") from e
    bytes_first = all(ranks.get(bytes([b])) == b for b in range(256))
    if not bytes_first or sorted(ranks.values()) != list(range(len(ranks))):
        raise _damaged(directory, f"{RANKS_FILE} does not hold ranks 0..N-1 with the 256 single bytes first")
    return ranks


def _load_cached(directory_str: str, mtime_ns: int, size: int) -> Tokenizer:
    """Loads once per process and version of meta.json (Ray workers reuse their process)."""
    key = (directory_str, mtime_ns, size)
    if key not in _LOADED:
        _LOADED[key] = _load_uncached(Path(directory_str))
    return _LOADED[key]


_LOADED: dict[tuple[str, int, int], Tokenizer] = {}


def _load_uncached(directory: Path) -> Tokenizer:
    try:
        meta = json.loads((directory / META_FILE).read_text())
        vocab_size, specials = int(meta["vocab_size"]), dict(meta["special_tokens"])
        pattern, fingerprint = str(meta["pattern"]), str(meta["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = f"{META_FILE} is unreadable or lacks a field ({type(e).__name__}: {e})"
        raise _damaged(directory, why) from e
    if meta.get("format") != FORMAT_VERSION:
        raise _damaged(directory, f"{META_FILE} has format {meta.get('format')!r}, this raychat reads "
                                  f"format {FORMAT_VERSION}")
    try:
        ranks_text = (directory / RANKS_FILE).read_bytes()
    except OSError as e:
        raise _damaged(directory, f"{RANKS_FILE} is unreadable: {e.strerror}") from e
    if _fingerprint(ranks_text, specials, pattern) != fingerprint:
        raise _damaged(directory, f"{RANKS_FILE} does not match the fingerprint in {META_FILE}")
    ranks = _parse_ranks(ranks_text, directory)
    if "<|bos|>" not in specials or sorted(specials.values()) != list(range(len(ranks), vocab_size)):
        raise _damaged(directory, f"{META_FILE}: special tokens must take ids {len(ranks)}..{vocab_size - 1}")
    encoding = tiktoken.Encoding(f"raychat-{fingerprint}", pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens=specials, explicit_n_vocab=vocab_size)
    return Tokenizer(directory, encoding, meta)


def check_vocab(tokenizer: Tokenizer, vocab_size: int, fingerprint: str | None, source: str) -> None:
    """The tokenizer must be the one the checkpoint at `source` was trained with (same ids)."""
    if tokenizer.vocab_size != vocab_size:
        raise RaychatError(
            f"tokenizer at {tokenizer.directory} has vocab {tokenizer.vocab_size:,} but checkpoint {source} "
            f"was trained with {vocab_size:,}: pass --tokenizer-dir with the tokenizer that run used")
    if fingerprint is not None and fingerprint != tokenizer.fingerprint:
        raise RaychatError(
            f"tokenizer at {tokenizer.directory} (fingerprint {tokenizer.fingerprint}) is not the one "
            f"checkpoint {source} was trained with (fingerprint {fingerprint}), although both have vocab "
            f"{vocab_size:,}: pass --tokenizer-dir with the tokenizer that run used")


# ----------------------------------------------------------------------------------------------------
# Training


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


def _batches(texts: Iterable[str], stats: _ReadStats, serial_after: bool,
             size: int = 1024) -> Iterator[list[str]]:
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
            yield batch
            batch = []
            start = time.perf_counter()
    stats.seconds_reading += time.perf_counter() - start
    if batch:
        yield batch
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
                    log: Callable[[str], None] = print) -> Tokenizer:
    """Train on the training split of the corpus in data_dir (documents cut to doc_cap characters, up
    to max_chars characters in all) and save to out_dir (replacing a tokenizer there)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise RaychatError(f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least "
                           f"{MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    if max_chars < 1 or doc_cap < 1:
        raise RaychatError(f"--max-chars ({max_chars}) and --doc-cap ({doc_cap}) must be at least 1")
    data_dir = Path(data_dir).expanduser().resolve()
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
    trainer = BpeTrainer(vocab_size=vocab_size, min_frequency=0, show_progress=False,
                         initial_alphabet=sorted(byte_to_char().values()), special_tokens=SPECIAL_TOKENS)
    try:
        if switch:
            os.environ[_PARALLELISM_ENV] = "true"  # exists from now on, so the flip replaces it in place
        texts = iter_split_texts(data_dir, "train", max_chars, doc_cap)
        hf.train_from_iterator(_batches(texts, stats, switch), trainer)
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
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    exported = _hf_tokenizer(vocab, merges)
    exported.add_special_tokens(SPECIAL_TOKENS)
    ranks_text = b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in ranks.items())
    token_bytes = np.array([len(token) for token in ranks] + [0] * len(specials), dtype=np.int32)
    meta = {
        "format": FORMAT_VERSION,
        "vocab_size": vocab_size,
        "special_tokens": specials,
        "pattern": SPLIT_PATTERN,
        "fingerprint": _fingerprint(ranks_text, specials, SPLIT_PATTERN),
        "trained_on": {"data_dir": str(data_dir), "docs": stats.docs, "chars": stats.chars,
                       "max_chars": max_chars, "doc_cap": doc_cap, "seconds": round(seconds, 3)},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_dir / RANKS_FILE, ranks_text)
    _write_atomic(out_dir / HF_FILE, exported.to_str().encode())
    with io.BytesIO() as buffer:
        np.save(buffer, token_bytes, allow_pickle=False)
        _write_atomic(out_dir / TOKEN_BYTES_FILE, buffer.getvalue())
    _write_atomic(out_dir / META_FILE, json.dumps(meta, indent=1).encode())
    tokenizer = Tokenizer.load(out_dir)
    log(f"Saved tokenizer to {out_dir} (vocab {vocab_size:,}, fingerprint {tokenizer.fingerprint})")
    return tokenizer


def load_hf_tokenizer(tokenizer_dir: str | Path):
    """The HF `tokenizers.Tokenizer` of a saved tokenizer (same ids as `Tokenizer`). Special-token
    strings inside a text are matched as special tokens unless `encode_special_tokens` is set."""
    from tokenizers import Tokenizer as HFTokenizer

    directory = Tokenizer.load(tokenizer_dir).directory  # validates the directory first
    return HFTokenizer.from_file(str(directory / HF_FILE))


# ----------------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class TokenizerStats:
    docs: int
    bytes: int
    tokens: int
    ids_used: int        # distinct non-special ids seen
    ids_total: int       # non-special ids in the vocabulary
    encode_seconds: float
    threads: int

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(self.tokens, 1)

    @property
    def vocab_usage(self) -> float:
        return self.ids_used / self.ids_total

    @property
    def mb_per_second(self) -> float:
        return self.bytes / 1e6 / max(self.encode_seconds, 1e-9)

    def format(self) -> str:
        return "\n".join([
            f"  documents:        {self.docs:,} ({self.bytes / 1e6:,.2f} MB of UTF-8 text)",
            f"  tokens:           {self.tokens:,}",
            f"  bytes per token:  {self.bytes_per_token:.3f}",
            f"  vocabulary usage: {self.vocab_usage:.1%} "
            f"({self.ids_used:,} of {self.ids_total:,} non-special ids)",
            f"  encode speed:     {self.mb_per_second:,.1f} MB/s on {self.threads} thread(s) "
            f"({self.mb_per_second / self.threads:,.1f} MB/s per thread)",
        ])


def evaluate_tokenizer(tokenizer: Tokenizer, texts: list[str], threads: int = 0) -> TokenizerStats:
    """Compression (bytes per token), vocabulary usage and encode throughput on `texts`."""
    threads = threads or available_cores()
    t0 = time.perf_counter()
    batch = tokenizer.encode_batch(texts, prepend_bos=False, threads=threads)
    seconds = time.perf_counter() - t0
    num_ordinary = tokenizer.vocab_size - len(tokenizer.special_tokens)
    seen = np.zeros(tokenizer.vocab_size, dtype=bool)
    for ids in batch:
        seen[ids] = True
    return TokenizerStats(
        docs=len(texts), bytes=sum(len(text.encode("utf-8", "surrogatepass")) for text in texts),
        tokens=sum(len(ids) for ids in batch), ids_used=int(seen[:num_ordinary].sum()),
        ids_total=num_ordinary, encode_seconds=seconds, threads=threads)


# ----------------------------------------------------------------------------------------------------
# Command line

DESCRIPTION = """\
Train and evaluate raychat's tokenizer: nanochat's byte-level BPE (GPT-4 split pattern with digit
pairs, special tokens <|bos|> and the chat tokens), trained with HF tokenizers, encoded with tiktoken.

  python -m raychat.tokenizer train        # train on $RAYCHAT_HOME/data, save to $RAYCHAT_HOME/tokenizer
  python -m raychat.tokenizer eval         # bytes per token, vocabulary usage, speed on the val split
"""
EPILOG = """\
No corpus yet? `python -m raychat.corpus sample --out DIR` writes one from text already on this
machine. `python -m raychat.train` trains a tokenizer by itself when --tokenizer-dir has none.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m raychat.tokenizer", description=DESCRIPTION,
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,eval}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", default="", help="corpus directory of shard_*.parquet "
                        "(default $RAYCHAT_HOME/data)")
    common.add_argument("--tokenizer-dir", default="",
                        help="tokenizer directory (default $RAYCHAT_HOME/tokenizer)")
    train = commands.add_parser("train", parents=[common], help="train a tokenizer on the training split",
                                description="Train a tokenizer on the training split of a corpus and save it "
                                "to --tokenizer-dir (a tokenizer already there is replaced).")
    train.add_argument("--vocab-size", type=int, default=32768, help="vocabulary size, special tokens "
                       f"included (at least {MIN_VOCAB_SIZE}; default 32768)")
    train.add_argument("--max-chars", type=int, default=2_000_000_000,
                       help="train on at most this many characters (default 2,000,000,000)")
    train.add_argument("--doc-cap", type=int, default=10_000,
                       help="cut each document to this many characters (default 10,000)")
    evaluate = commands.add_parser("eval", parents=[common],
                                   help="evaluate a tokenizer on the validation split",
                                   description="Bytes per token, vocabulary usage and encode throughput of a "
                                   "tokenizer on the validation split of a corpus.")
    evaluate.add_argument("--max-chars", type=int, default=50_000_000,
                          help="evaluate on at most this many characters (default 50,000,000)")
    evaluate.add_argument("--threads", type=int, default=0, help="encode threads (default 0 = every core)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()
    tokenizer_dir = Path(args.tokenizer_dir).expanduser() if args.tokenizer_dir else default_tokenizer_dir()
    if args.command == "train":
        train_tokenizer(data_dir, tokenizer_dir, args.vocab_size, args.max_chars, args.doc_cap)
        return 0
    if args.threads < 0:
        raise RaychatError(f"--threads must be 0 (every core) or more, got {args.threads}")
    tokenizer = Tokenizer.load(tokenizer_dir)
    texts = list(iter_split_texts(data_dir, "val", max_chars=args.max_chars))
    stats = evaluate_tokenizer(tokenizer, texts, args.threads)
    print(f"tokenizer {tokenizer.directory} (vocab {tokenizer.vocab_size:,}, fingerprint "
          f"{tokenizer.fingerprint}) on the validation split of {Path(data_dir).resolve()}:")
    print(stats.format())
    return 0


if __name__ == "__main__":
    run_cli(main)
