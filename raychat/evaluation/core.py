"""CORE scoring, rule for rule as nanochat's nanochat/core_eval.py and scripts/base_eval.py.

For each task: the examples are shuffled with random.Random(1337) and, with max_per_task > 0, the
first max_per_task kept. Example idx (of that list) gets num_fewshot others drawn by
random.Random(1234 + idx).sample(every other index, num_fewshot). Prompts (d = the task's delimiter;
each few-shot example is followed by a blank line):
    multiple_choice    one per choice:   {shot.query}{d}{shot.choices[shot.gold]}\\n\\n ... {query}{d}{choice}
    schema             one per option:   {shot.context_options[shot.gold]}{d}{shot.continuation}\\n\\n ...
                                         {option}{d}{continuation}
    language_modeling  {shot.context.strip()}{d}{shot.continuation}\\n\\n ... {context.strip()}{d}, the
                       whole prompt .strip()ped, then the same with {continuation} appended
Each prompt is tokenized with BOS first. Scored span: multiple_choice, after the choices' common
token prefix; schema, the options' common token suffix; language_modeling, the tokens the
continuation adds. multiple_choice and schema are right when the gold prompt has the lowest mean
cross-entropy over its span (the first one on ties); language_modeling when the greedy prediction
matches every continuation token. Accuracy is the mean over examples (float32, as nanochat's);
centered = (accuracy - baseline/100) / (1 - baseline/100); CORE = the mean of the centered values.

Splitting across ranks: rank r scores examples r, r+W, ... of every task and returns its results
per example; the merged results, not per-rank means, make the score, so any W gives the same CORE.
"""

import random
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from raychat.common import RaychatError
from raychat.evaluation.bundle import Bundle, Task


class TokenEncoder(Protocol):
    """What scoring needs of a tokenizer (raychat.tokenizer.core.Tokenizer is one): batches of
    prompts encoded with BOS first, and the BOS id that pads the batch."""

    bos_id: int

    def encode_batch(self, texts: list[str], prepend_bos: bool = True, threads: int = 0) -> list[list[int]]:
        ...


SHUFFLE_SEED, FEWSHOT_SEED = 1337, 1234

Results = dict[str, dict[int, bool]]  # task label -> example index -> correct


def task_examples(task: Task, max_per_task: int) -> list[dict]:
    """The examples scored for a task: shuffled with a fixed seed, then the first max_per_task
    (all if max_per_task <= 0). A fixed seed, so every rank and every run scores the same ones."""
    data = list(task.data)
    random.Random(SHUFFLE_SEED).shuffle(data)
    data = data[:max_per_task] if max_per_task > 0 else data
    if task.num_fewshot >= len(data):
        raise RaychatError(f"CORE task {task.label} is {task.num_fewshot}-shot but only {len(data)} examples "
                           "are scored: raise --core-metric-max-per-task (or --max-per-task)")
    return data


def fewshot_examples(data: list[dict], idx: int, num_fewshot: int) -> list[dict]:
    if num_fewshot == 0:
        return []
    others = [i for i in range(len(data)) if i != idx]
    return [data[i] for i in random.Random(FEWSHOT_SEED + idx).sample(others, num_fewshot)]


def render_prompts(task_type: str, item: dict, delimiter: str, shots: list[dict]) -> list[str]:
    """The prompts of one example (see the module docstring for the format)."""
    if task_type == "multiple_choice":
        prefix = "".join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{prefix}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        prefix = "".join(f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}\n\n"
                         for s in shots)
        return [f"{prefix}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]
    prefix = "".join(f"{s['context'].strip()}{delimiter}{s['continuation']}\n\n" for s in shots)
    without = f"{prefix}{item['context'].strip()}{delimiter}"
    return [without.strip(), without + item["continuation"]]


def common_length(sequences: list[list[int]], from_end: bool = False) -> int:
    """Length of the token prefix (or suffix) all sequences share."""
    shortest = min(len(s) for s in sequences)
    for i in range(shortest):
        pos = -1 - i if from_end else i
        if any(s[pos] != sequences[0][pos] for s in sequences):
            return i
    return shortest


Spans = list[tuple[int, int]]


def scored_spans(task_type: str, tokens: list[list[int]], label: str) -> tuple[list[list[int]], Spans]:
    """The sequences to run and the [start, end) token span scored in each."""
    if task_type == "multiple_choice":
        start = common_length(tokens)
        return tokens, [(start, len(t)) for t in tokens]
    if task_type == "schema":
        suffix = common_length(tokens, from_end=True)
        return tokens, [(len(t) - suffix, len(t)) for t in tokens]
    without, with_continuation = tokens
    if len(without) >= len(with_continuation) or with_continuation[:len(without)] != without:
        raise RaychatError(f"CORE task {label}: an example's prompt without its continuation does not "
                           "tokenize to a prefix of the prompt with it; check the bundle's eval_data")
    return [with_continuation], [(len(without), len(with_continuation))]


@torch.no_grad()
def score_example(model: torch.nn.Module, tokenizer: TokenEncoder, task: Task, data: list[dict], idx: int,
                  device: torch.device) -> bool:
    """Whether the model gets example idx of `data` (the task's scored examples) right."""
    item = data[idx]
    shots = fewshot_examples(data, idx, task.num_fewshot)
    prompts = render_prompts(task.task_type, item, task.delimiter, shots)
    tokens = tokenizer.encode_batch(prompts, prepend_bos=True, threads=1)
    sequences, spans = scored_spans(task.task_type, tokens, task.label)
    limit = getattr(model, "rotary_seq_len", None)  # nanochat would fail past it; keep the last tokens
    if limit is not None and max(len(s) for s in sequences) > limit:
        crops = [max(0, len(s) - limit) for s in sequences]
        sequences = [s[c:] for s, c in zip(sequences, crops, strict=True)]
        spans = [(a - c, b - c) for (a, b), c in zip(spans, crops, strict=True)]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), tokenizer.bos_id, dtype=torch.long)  # BOS pads, on the right
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
    ids = ids.to(device)
    logits = model(ids, fixed_length=False)  # shapes vary per example: never a compiled graph
    if task.task_type == "language_modeling":
        start, end = spans[0]
        return bool(torch.equal(logits[0, start - 1:end - 1].argmax(dim=-1), ids[0, start:end]))
    targets = torch.roll(ids, shifts=-1, dims=1)
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    losses = losses.view(ids.shape)
    mean_losses = [losses[row, start - 1:end - 1].mean().item() for row, (start, end) in enumerate(spans)]
    return mean_losses.index(min(mean_losses)) == item["gold"]


def score_shard(model: torch.nn.Module, tokenizer: TokenEncoder, bundle: Bundle, max_per_task: int, rank: int,
                world_size: int, device: torch.device) -> Results:
    """This rank's share (examples rank, rank + W, ...) of every task, per example."""
    was_training = model.training
    model.eval()
    results: Results = {}
    for task in bundle.tasks:
        data = task_examples(task, max_per_task)
        results[task.label] = {idx: score_example(model, tokenizer, task, data, idx, device)
                               for idx in range(rank, len(data), world_size)}
    model.train(was_training)
    return results


@dataclass
class CoreResult:
    accuracy: dict[str, float]
    centered: dict[str, float]
    core_metric: float
    num_examples: int


def combine(bundle: Bundle, max_per_task: int, shards: list[Results]) -> CoreResult:
    """Per-task accuracy, centered accuracy and CORE from every rank's per-example results."""
    accuracy, centered, count = {}, {}, 0
    for task in bundle.tasks:
        merged: dict[int, bool] = {}
        for shard in shards:
            merged.update(shard[task.label])
        expected = len(task_examples(task, max_per_task))
        if sorted(merged) != list(range(expected)):
            raise ValueError(f"task {task.label}: results for {len(merged)} of {expected} examples")
        correct = torch.tensor([float(merged[i]) for i in range(expected)], dtype=torch.float32)
        accuracy[task.label] = correct.mean().item()
        base = 0.01 * task.baseline
        centered[task.label] = (accuracy[task.label] - base) / (1.0 - base)
        count += expected
    return CoreResult(accuracy, centered, sum(centered.values()) / len(centered), count)


def format_task_line(label: str, task: Task, result: CoreResult) -> str:
    return (f"{label:<32} {task.num_fewshot:>2}-shot {task.task_type:<17} accuracy: "
            f"{result.accuracy[label]:.4f} | centered: {result.centered[label]:.4f}")


def format_core_line(step: int, core_metric: float) -> str:
    """nanochat's log line for CORE in the training loop."""
    return f"Step {step:05d} | CORE metric: {core_metric:.4f}"
