"""Tiny CORE eval bundles written by tests (nanochat's layout) and a model whose scores are worked out
by hand: a byte-level tokenizer and a bigram "chain" model."""

import json
from pathlib import Path

import tiktoken
import torch

from raychat.tokenizer.core import SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer


def write_bundle(root: Path, tasks: list[dict]) -> Path:
    """tasks: {label, type, shots, delimiter, baseline, data}; returns the bundle directory."""
    (root / "eval_data").mkdir(parents=True, exist_ok=True)
    lines = ["icl_tasks:"]
    csv = ["Eval Task,Random baseline"]
    for task in tasks:
        uri = f"{task['label']}.jsonl"
        (root / "eval_data" / uri).write_text("".join(json.dumps(item) + "\n" for item in task["data"]))
        lines += [f"- label: {task['label']}", f"  dataset_uri: {uri}", f"  num_fewshot: [{task['shots']}]",
                  f"  icl_task_type: {task['type']}",
                  f"  continuation_delimiter: {json.dumps(task.get('delimiter', ' '))}"]
        csv.append(f"{task['label']},{task['baseline']}")
    (root / "core.yaml").write_text("\n".join(lines) + "\n")
    (root / "eval_meta_data.csv").write_text("\n".join(csv) + "\n")
    return root


def byte_tokenizer() -> Tokenizer:
    """One token per byte (ids 0..255, no merges), then nanochat's special tokens."""
    ranks = {bytes([b]): b for b in range(256)}
    specials = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
    encoding = tiktoken.Encoding("bytes", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks,
                                 special_tokens=specials)
    meta = {"vocab_size": 256 + len(SPECIAL_TOKENS), "special_tokens": specials, "fingerprint": "bytes"}
    return Tokenizer(Path("/nonexistent"), encoding, meta)


CHAIN = "abcde fghij"
HIT = 10.0


class ChainModel(torch.nn.Module):
    """Predicts the next byte of CHAIN after each of its bytes (logit HIT there, 0 elsewhere), and
    '#' after any other token. So every position's loss is one of two values, low when the target
    follows CHAIN ("a hit"): an option's mean loss falls with its fraction of hits."""

    def __init__(self, vocab_size: int):
        super().__init__()
        table = torch.zeros(vocab_size, vocab_size)
        table[:, ord("#")] = HIT
        for here, after in zip(CHAIN, CHAIN[1:], strict=False):
            table[ord(here)] = 0.0
            table[ord(here), ord(after)] = HIT
        self.register_buffer("table", table)

    def forward(self, idx: torch.Tensor, fixed_length: bool = True) -> torch.Tensor:
        return self.table[idx]


# A bundle for real tokenizers and trained models: a few tasks of each type, plain English.
WORD_TASKS = [
    {"label": "capitals", "type": "multiple_choice", "shots": 1, "baseline": 25, "delimiter": " Answer: ",
     "data": [{"query": f"The capital of {country} is?", "choices": ["Paris", "Rome", "Berlin", "Madrid"],
               "gold": gold} for gold, country in enumerate(["France", "Italy", "Germany", "Spain"])]},
    {"label": "pronouns", "type": "schema", "shots": 0, "baseline": 50,
     "data": [{"context_options": [f"The {a} gave the {b} a book because it", f"The {b} gave the {a} a book "
                                   "because it"], "continuation": "was kind.", "gold": i % 2}
              for i, (a, b) in enumerate([("module", "class"), ("function", "object"), ("string", "list")])]},
    {"label": "continuations", "type": "language_modeling", "shots": 2, "baseline": 0,
     "data": [{"context": text.rsplit(" ", 1)[0], "continuation": text.rsplit(" ", 1)[1]} for text in [
         "Return the value of the", "This module provides the", "The default value is",
         "Raise an error if the", "See the documentation of the"]]},
]


def write_word_bundle(root: Path) -> Path:
    return write_bundle(root, WORD_TASKS)
