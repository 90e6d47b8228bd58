"""The tokenizer: nanochat's byte-level BPE, trained with HF `tokenizers`, encoded with `tiktoken`.

Two libraries because each is best at one half: HF's BpeTrainer learns the merges from a streamed
corpus in Rust (`raychat.tokenizer.train`); tiktoken encodes faster and releases the GIL, so a batch
of documents encodes on every core (this module: loading, encoding, the checks a run makes).

Ids follow nanochat's rustbpe+tiktoken tokenizer: 0..255 are the single bytes, then the merged tokens
in the order they were learned, then the special tokens, `<|bos|>` first. The vocabulary size
counts the special tokens.

A tokenizer directory holds only readable, safely loadable files (nothing is unpickled):
    tokenizer.tiktoken  one line per mergeable token: base64 of its bytes, space, rank (= id)
    tokenizer.json      the equivalent HF tokenizer, same ids
    token_bytes.npy     int32 [vocab_size]: UTF-8 bytes per id, 0 for special tokens (for bits per byte)
    meta.json           vocab size, special tokens, split pattern, fingerprint, what it was trained on
meta.json is written last, so a directory with a meta.json whose fingerprint matches is complete.

`python -m raychat.tokenizer train|eval` is the command line (`raychat.tokenizer.cli`).
"""

import base64
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tiktoken

from raychat.common import RaychatError
from raychat.locations import is_uri, redact
from raychat.tokenizer.remote import local_copy

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

FORMAT_VERSION = 1
RANKS_FILE, HF_FILE = "tokenizer.tiktoken", "tokenizer.json"
TOKEN_BYTES_FILE, META_FILE = "token_bytes.npy", "meta.json"


def _train_hint(tokenizer_dir: Path) -> str:
    return f"train one with `python -m raychat.tokenizer train --tokenizer-dir {tokenizer_dir}`"


def compute_fingerprint(ranks_text: bytes, special_tokens: dict[str, int], pattern: str) -> str:
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
    as just its location, so Ray tasks and actors can be handed one or the path. `location` is what
    the user gave (a path or a bucket URI); `directory` the local files (a bucket's are cached)."""

    def __init__(self, directory: Path, encoding: tiktoken.Encoding, meta: dict, location: str = ""):
        self.directory = directory
        self.location = location or str(directory)
        self.encoding = encoding
        self.meta = meta
        self.vocab_size: int = meta["vocab_size"]
        self.special_tokens: dict[str, int] = meta["special_tokens"]
        self.bos_id: int = self.special_tokens["<|bos|>"]
        self.fingerprint: str = meta["fingerprint"]
        self._token_bytes: torch.Tensor | None = None

    @classmethod
    def load(cls, tokenizer_dir: str | Path) -> "Tokenizer":
        location = tokenizer_dir if isinstance(tokenizer_dir, str) else str(tokenizer_dir)  # a SafeLocation
        if is_uri(location):
            directory = local_copy(location, (RANKS_FILE, HF_FILE, TOKEN_BYTES_FILE), META_FILE)
        else:
            directory = Path(location).expanduser().resolve()
            location = str(directory)
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            what = "does not exist" if not directory.exists() else f"has no {META_FILE}"
            raise RaychatError(f"no tokenizer at {directory} (it {what}): {_train_hint(directory)}, "
                               "or pass the --tokenizer-dir of an existing one")
        stat = meta_path.stat()
        return _load_cached(location, str(directory), stat.st_mtime_ns, stat.st_size)

    def __reduce__(self):
        return (Tokenizer.load, (self.location,))

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


def _load_cached(location: str, directory_str: str, mtime_ns: int, size: int) -> Tokenizer:
    """Loads once per process and version of meta.json (Ray workers reuse their process)."""
    key = (location, directory_str, mtime_ns, size)
    if key not in _LOADED:
        _LOADED[key] = _load_uncached(Path(directory_str), location)
    return _LOADED[key]


_LOADED: dict[tuple[str, str, int, int], Tokenizer] = {}


def _load_uncached(directory: Path, location: str) -> Tokenizer:
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
    if compute_fingerprint(ranks_text, specials, pattern) != fingerprint:
        raise _damaged(directory, f"{RANKS_FILE} does not match the fingerprint in {META_FILE}")
    ranks = _parse_ranks(ranks_text, directory)
    if "<|bos|>" not in specials or sorted(specials.values()) != list(range(len(ranks), vocab_size)):
        raise _damaged(directory, f"{META_FILE}: special tokens must take ids {len(ranks)}..{vocab_size - 1}")
    encoding = tiktoken.Encoding(f"raychat-{fingerprint}", pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens=specials, explicit_n_vocab=vocab_size)
    return Tokenizer(directory, encoding, meta, location)


def check_vocab(tokenizer: Tokenizer, vocab_size: int, fingerprint: str | None, source: str) -> None:
    """The tokenizer must be the one the checkpoint at `source` was trained with (same ids)."""
    if tokenizer.vocab_size != vocab_size:
        raise RaychatError(
            f"tokenizer at {redact(tokenizer.location)} has vocab {tokenizer.vocab_size:,} but checkpoint "
            f"{source} was trained with {vocab_size:,}: pass --tokenizer-dir with the tokenizer that run "
            "used")
    if fingerprint is not None and fingerprint != tokenizer.fingerprint:
        raise RaychatError(
            f"tokenizer at {redact(tokenizer.location)} (fingerprint {tokenizer.fingerprint}) is not the one "
            f"checkpoint {source} was trained with (fingerprint {fingerprint}), although both have vocab "
            f"{vocab_size:,}: pass --tokenizer-dir with the tokenizer that run used")

