"""How good a tokenizer is on a text: compression (bytes per token), vocabulary usage and encode
throughput, the numbers `python -m raychat.tokenizer eval` prints. (Evaluating a model is
raychat.evaluation's; these are measurements of the tokenizer alone.)
"""

import time
from dataclasses import dataclass

import numpy as np

from raychat.tokenizer.core import Tokenizer, available_cores


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


def tokenizer_stats(tokenizer: Tokenizer, texts: list[str], threads: int = 0) -> TokenizerStats:
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
