"""Is the corpus big enough for the plan? Tokens the run trains on against tokens the corpus holds.

Counted before training from what is cheap: the corpus's text bytes come from the parquet footers
(the uncompressed size of the `text` column, less the 4-byte length before each document), and the
tokenizer's bytes per token is measured on up to 2 MB of the validation split. A run that would go
past one epoch repeats documents; the plan says so, with the command that downloads enough ClimbMix.
"""

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from raychat.corpus.download import MAX_SHARD
from raychat.corpus.index import CorpusIndex, read_corpus_meta, read_footers, read_unit_texts
from raychat.scaling import Plan
from raychat.tokenizer.core import Tokenizer

SAMPLE_CHARS = 2_000_000
# nanochat's dev/repackage_data_reference.py cuts ClimbMix into shards of at least 250M characters.
CLIMBMIX_CHARS_PER_SHARD = 250_000_000


@dataclass(frozen=True)
class CorpusBudget:
    tokens_needed: int
    tokens_available: int   # estimated: train text bytes / bytes per token
    bytes_per_token: float
    epochs: float
    source: str             # corpus.json's source: "hub", "sample", "ingest", ... ("" when unknown)
    climbmix_shards: int    # train shards of ClimbMix that would hold tokens_needed (estimate)

    @property
    def download_command(self) -> str:
        return f"python -m raychat.corpus download --shards {self.climbmix_shards}"

    def to_json(self) -> dict:
        return {**asdict(self), "download_command": self.download_command}


def train_text_bytes(index: CorpusIndex) -> int:
    """UTF-8 bytes of the train documents, from the footers (no document is read)."""
    total = 0
    for footer in read_footers(index.data_dir, sorted({unit.path for unit in index.train})):
        metadata = footer.metadata
        for row_group in range(metadata.num_row_groups):
            group = metadata.row_group(row_group)
            total += group.column(0).total_uncompressed_size - 4 * group.num_rows
    return total


def _val_sample(index: CorpusIndex) -> list[str]:
    """The first SAMPLE_CHARS (or a little more) characters of the val split."""
    sample: list[str] = []
    chars = 0
    for unit in index.val:
        for text in read_unit_texts(unit, location=index.data_dir):
            sample.append(text)
            chars += len(text)
            if chars >= SAMPLE_CHARS:
                return sample
    return sample


def corpus_budget(tokens_needed: int, data_dir: str | Path | CorpusIndex,
                  tokenizer: Tokenizer) -> CorpusBudget:
    """How tokens_needed compares with what the corpus in data_dir (or an index of it) holds, in the
    tokenizer's tokens."""
    index = data_dir if isinstance(data_dir, CorpusIndex) else CorpusIndex.load(data_dir)
    sample = _val_sample(index)
    sample_bytes = sum(len(text.encode()) for text in sample)
    sample_tokens = sum(len(ids) for ids in tokenizer.encode_batch(sample, prepend_bos=False))
    bytes_per_token = sample_bytes / max(sample_tokens, 1)
    available = int(train_text_bytes(index) / bytes_per_token)
    # chars <= bytes, so this undercounts a shard's tokens: the command asks for enough, not too few.
    per_shard = CLIMBMIX_CHARS_PER_SHARD / bytes_per_token
    shards = min(MAX_SHARD, max(1, math.ceil(tokens_needed / per_shard)))
    return CorpusBudget(tokens_needed=tokens_needed, tokens_available=available,
                        bytes_per_token=round(bytes_per_token, 3),
                        epochs=round(tokens_needed / max(available, 1), 3),
                        source=str(read_corpus_meta(index.data_dir).get("source", "")),
                        climbmix_shards=shards)


def budget_lines(budget: CorpusBudget) -> list[str]:
    """What the plan prints: one line when the corpus suffices, a warning and the fix when it does not."""
    head = (f"corpus: {budget.tokens_needed:,} tokens needed, ~{budget.tokens_available:,} available "
            f"({budget.bytes_per_token:.2f} bytes/token), {budget.epochs:.2f} epochs")
    if budget.source == "sample":
        return [head, "corpus: this is the offline SAMPLE corpus (text found on this machine), fit to check "
                      f"that training runs, not to train a model; for real data: {budget.download_command}"]
    if budget.epochs <= 1:
        return [head]
    return [head, f"corpus: WARNING: the run goes past one epoch and repeats documents {budget.epochs:.1f} "
                  f"times; ~{budget.climbmix_shards} ClimbMix shards hold enough: {budget.download_command}"]


def corpus_budget_lines(plan: Plan, data_dir: str | Path | CorpusIndex, tokenizer: Tokenizer) -> list[str]:
    """For the driver: the budget lines of a resolved plan (raychat.scaling.Plan) on this corpus."""
    return budget_lines(corpus_budget(plan.total_tokens, data_dir, tokenizer))
