"""nanochat's tokenizer in raychat's format: `python -m raychat.tokenizer import-nanochat`.

nanochat saves its tokenizer as `tokenizer/tokenizer.pkl`, a pickled tiktoken Encoding. Unpickling
runs whatever code the file names, so it happens only when the user says the file is trusted
(--trust-pickle); raychat loads no pickle otherwise. From the Encoding only plain data is kept: the
ranks (token bytes -> id), the special tokens and the split pattern, which must be nanochat's (the
ones raychat trains with). HF's merges are recovered from the ranks (each token is the merge of the
two parts byte-pair encoding with the lower ranks leaves), so the HF tokenizer beside it gives the
same ids, as for a tokenizer raychat trained.
"""

import pickle
from pathlib import Path

import tiktoken

from raychat.common import RaychatError
from raychat.tokenizer.core import SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer
from raychat.tokenizer.train import byte_to_char, write_tokenizer


def _parts(token: bytes, ranks: dict[bytes, int], below: int) -> list[bytes]:
    """Byte-pair encode `token` with the merges of rank < `below` (lowest rank first, as BPE does)."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        pairs = [(ranks.get(a + b, below), i) for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))]
        rank, i = min(pairs)
        if rank >= below:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that made each multi-byte token, in rank order."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _parts(token, ranks, rank)
        if len(parts) != 2:
            raise RaychatError(f"token {token!r} (id {rank}) is not one merge of lower-ranked tokens: not a "
                               "byte-pair encoding raychat can rebuild")
        merges.append((parts[0], parts[1]))
    return merges


def import_nanochat_tokenizer(pickle_path: str | Path, out_dir: str | Path, trust_pickle: bool) -> Tokenizer:
    """Read nanochat's tokenizer.pkl (only with `trust_pickle`) and write raychat's files to out_dir."""
    pickle_path = Path(pickle_path).expanduser().resolve()
    if pickle_path.is_dir():
        pickle_path = pickle_path / "tokenizer.pkl"
    if not pickle_path.is_file():
        raise RaychatError(f"--from {pickle_path} does not exist: give nanochat's tokenizer directory "
                           "(NANOCHAT_BASE_DIR/tokenizer) or its tokenizer.pkl")
    if not trust_pickle:
        raise RaychatError(f"{pickle_path} is a pickle: loading it runs code the file names. If it comes "
                           "from a nanochat run you trust, add --trust-pickle")
    try:
        with open(pickle_path, "rb") as f:
            encoding = pickle.load(f)  # noqa: S301 - the user said the file is trusted
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in any way its opcodes lead to
        reason = (str(e).splitlines() or [""])[0][:200]
        raise RaychatError(f"{pickle_path} does not load ({type(e).__name__}: {reason}): give the "
                           "tokenizer.pkl nanochat wrote") from None
    if not isinstance(encoding, tiktoken.Encoding):
        raise RaychatError(f"{pickle_path} holds a {type(encoding).__name__}, not nanochat's tiktoken "
                           "Encoding")
    ranks, specials, pattern = encoding._mergeable_ranks, encoding._special_tokens, encoding._pat_str
    expected_specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    if pattern != SPLIT_PATTERN or specials != expected_specials:
        raise RaychatError(f"{pickle_path}: its split pattern or special tokens (names, ids) are not "
                           "nanochat's, which raychat encodes with")
    single_bytes_first = all(ranks.get(bytes([b])) == b for b in range(256))
    if sorted(ranks.values()) != list(range(len(ranks))) or not single_bytes_first:
        raise RaychatError(f"{pickle_path}: its ranks are not 0..N-1 with the 256 single bytes first")
    chars = byte_to_char()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    ranks = dict(sorted(ranks.items(), key=lambda item: item[1]))
    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in recover_merges(ranks)]
    out_dir = Path(out_dir).expanduser().resolve()
    return write_tokenizer(out_dir, ranks, vocab, merges, {"imported_from": str(pickle_path)})
