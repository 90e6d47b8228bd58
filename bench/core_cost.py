"""What the CORE metric costs a run: seconds per example against the training step, and the share of
a d24 run it takes at the default cadence (--core-metric-every 2000, --core-metric-max-per-task 500).

The real eval bundle (22 DCLM tasks) is not on this machine, so the bench writes one of the same
shape from the sample corpus's English text: the three task types with the few-shot counts most
CORE tasks use (multiple choice with 4 choices and 10 shots like hellaswag, arc, piqa; schema with
2 options and no shots like winograd; language modelling with 10 shots like jeopardy, squad). Then,
in this process, on a model of --depth (nanochat's width and heads):

  CORE   raychat's scorer (raychat.evaluation.core.score_shard, what the loop runs), every forward
         counted: seconds and tokens per example, so forward FLOP/s achieved
  train  forward + backward + MuonAdamW over --train-rows x --seq-len random tokens: tok/s and FLOP/s

The d24 share is arithmetic from those: CORE's forward FLOPs per evaluation (examples x tokens per
example x 2N) over the training FLOPs between two evaluations (2000 steps x batch x 6N), times the
measured efficiency gap (training FLOP/s over CORE's). The gap is this machine's (a label, not a
GPU figure): on a GPU, compiled bf16 training runs further ahead of batch-of-one uncompiled scoring.

    python -m bench.core_cost                      # d4 on this CPU, 30 examples per task (~2 min)
    python -m bench.core_cost --depth 6 --per-task 60
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.loader import corpus_and_tokenizer
from raychat.common import run_cli
from raychat.config import TrainConfig
from raychat.corpus.index import read_unit_texts
from raychat.evaluation.bundle import load_bundle
from raychat.evaluation.core import combine, score_shard
from raychat.model.gpt import build_model
from raychat.model.precision import resolve_precision
from raychat.optim.base import ShardedOptimizer
from raychat.optim.muon_adamw import build_optimizer
from raychat.scaling import resolve_plan
from raychat.tokenizer.core import Tokenizer

CORE_EVERY, MAX_PER_TASK, CORE_TASKS = 2000, 500, 22  # nanochat's defaults, and the bundle's task count


def _words(texts: list[str], start: int, count: int) -> str:
    words = " ".join(texts).split()
    return " ".join(words[start % max(1, len(words) - count):][:count])


def write_shaped_bundle(root: Path, texts: list[str], per_task: int) -> Path:
    """A bundle in nanochat's layout with CORE's three task types at typical lengths (words)."""
    def mc(i: int) -> dict:
        return {"query": _words(texts, 97 * i, 40), "gold": i % 4,
                "choices": [_words(texts, 97 * i + 50 + 20 * c, 15) for c in range(4)]}

    def schema(i: int) -> dict:
        return {"context_options": [_words(texts, 53 * i + 7 * o, 25) for o in range(2)],
                "continuation": _words(texts, 53 * i + 30, 10), "gold": i % 2}

    def lm(i: int) -> dict:
        return {"context": _words(texts, 61 * i, 30), "continuation": _words(texts, 61 * i + 30, 4)}

    tasks = [("mc_10shot", "multiple_choice", 10, 25, mc), ("schema_0shot", "schema", 0, 50, schema),
             ("lm_10shot", "language_modeling", 10, 0, lm)]
    (root / "eval_data").mkdir(parents=True)
    yaml, csv = ["icl_tasks:"], ["Eval Task,Random baseline"]
    for label, kind, shots, baseline, make in tasks:
        data = [make(i) for i in range(per_task + shots + 1)]  # enough for the few-shot draws
        (root / "eval_data" / f"{label}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in data))
        yaml += [f"- label: {label}", f"  dataset_uri: {label}.jsonl", f"  num_fewshot: [{shots}]",
                 f"  icl_task_type: {kind}", "  continuation_delimiter: ' '"]
        csv.append(f"{label},{baseline}")
    (root / "core.yaml").write_text("\n".join(yaml) + "\n")
    (root / "eval_meta_data.csv").write_text("\n".join(csv) + "\n")
    return root


def time_core(model: torch.nn.Module, tokenizer: Tokenizer, bundle_dir: Path, per_task: int) -> dict:
    """Score every task once on one rank; tokens counted at the model's input."""
    tokens = 0

    def count(_module, args, _kwargs):
        nonlocal tokens
        tokens += args[0].numel()

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    bundle = load_bundle(bundle_dir)
    t0 = time.perf_counter()
    shard = score_shard(model, tokenizer, bundle, per_task, 0, 1, torch.device("cpu"))
    result = combine(bundle, per_task, [shard])
    seconds = time.perf_counter() - t0
    handle.remove()
    return {"examples": result.num_examples, "seconds": seconds, "tokens": tokens}


def time_training(model: torch.nn.Module, optimizer: ShardedOptimizer, rows: int, seq_len: int,
                  vocab_size: int, steps: int = 6, warmup: int = 2) -> float:
    """Median seconds of one optimizer step over rows x seq_len random tokens."""
    generator = torch.Generator().manual_seed(0)
    times = []
    for step in range(warmup + steps):
        idx = torch.randint(0, vocab_size, (rows, seq_len + 1), generator=generator)
        t0 = time.perf_counter()
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        loss.item()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.core_cost", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=4, help="model depth (nanochat's width: 64 x depth)")
    parser.add_argument("--per-task", type=int, default=30, help="examples scored per task (default 30)")
    parser.add_argument("--seq-len", type=int, default=2048, help="training rows' length (default 2048)")
    parser.add_argument("--train-rows", type=int, default=4, help="rows per training step (default 4)")
    parser.add_argument("--data-dir", default="", help="corpus for the texts (default: the sample corpus)")
    parser.add_argument("--tokenizer-dir", default="", help="tokenizer (default: one trained here)")
    parser.add_argument("--vocab-size", type=int, default=32768, help="vocab of a tokenizer trained here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="raychat-core-cost-") as tmp:
        index, tokenizer_dir, what = corpus_and_tokenizer(args, Path(tmp))
        tokenizer = Tokenizer.load(tokenizer_dir)
        texts = [t for unit in index.val for t in read_unit_texts(unit, location=index.data_dir)]
        bundle_dir = write_shaped_bundle(Path(tmp) / "bundle", texts, args.per_task)
        cfg = TrainConfig(depth=args.depth, max_seq_len=args.seq_len, num_iterations=1, dtype="auto")
        plan = resolve_plan(cfg, tokenizer.vocab_size)
        precision = resolve_precision(cfg.dtype, False, cfg.fp8_recipe, torch.device("cpu"))
        torch.manual_seed(0)
        model = build_model(plan.model, "cpu", precision)
        optimizer = build_optimizer(model, embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02,
                                    scalar_lr=0.5, weight_decay=0.0)
        core = time_core(model, tokenizer, bundle_dir, args.per_task)
        step_s = time_training(model, optimizer, args.train_rows, args.seq_len, tokenizer.vocab_size)

    flops_fwd_per_token = plan.flops_per_token / 3  # forward only: a third of forward + backward
    core_flops_per_s = core["tokens"] * flops_fwd_per_token / core["seconds"]
    train_tokens = args.train_rows * args.seq_len
    train_flops_per_s = train_tokens * plan.flops_per_token / step_s
    gap = train_flops_per_s / core_flops_per_s
    tokens_per_example = core["tokens"] / core["examples"]
    print(f"{what}; d{args.depth} ({plan.scaling_params:,} scaling params), {precision.name} on CPU, "
          f"{torch.get_num_threads()} threads")
    per_example_ms = core["seconds"] / core["examples"] * 1000
    print(f"CORE: {core['examples']} examples in {core['seconds']:.1f}s = {per_example_ms:.0f} ms per "
          f"example, {tokens_per_example:,.0f} tokens forwarded per example, "
          f"{core_flops_per_s / 1e9:.2f} GFLOP/s")
    print(f"train: {train_tokens:,} tokens per step in {step_s:.2f}s = {train_tokens / step_s:,.0f} tok/s, "
          f"{train_flops_per_s / 1e9:.2f} GFLOP/s; training runs {gap:.2f}x CORE's FLOP/s here")

    d24 = resolve_plan(TrainConfig(depth=24), tokenizer.vocab_size)
    examples = CORE_TASKS * MAX_PER_TASK  # an upper bound: a few tasks hold fewer than 500
    flop_share = (examples * tokens_per_example * 2) / (CORE_EVERY * d24.total_batch_size * 6)
    evaluations = d24.num_iterations // CORE_EVERY + 1
    print(f"d24 (batch {d24.total_batch_size:,} tokens, {d24.num_iterations:,} steps): one CORE evaluation "
          f"of <= {examples:,} examples forwards {flop_share * 100:.2f}% of the FLOPs trained between two "
          f"(every {CORE_EVERY} steps); at this machine's efficiency gap {flop_share * gap * 100:.1f}% of "
          f"the training time, {evaluations} evaluations in the run")
    return 0


if __name__ == "__main__":
    run_cli(main)
