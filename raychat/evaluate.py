"""`python -m raychat.evaluate core`: score a run's checkpoint on CORE (nanochat's base_eval --eval core).

The model shape comes from the checkpoint's metadata. With --num-workers W > 1 the examples are
split across W local Ray tasks (rank r scores examples r, r+W, ... of every task) and their
per-example results merged, so the score does not depend on W (raychat.evaluation.core).
"""

import argparse
import os
import time

import torch

from raychat.checkpoint.format import read_meta
from raychat.checkpoint.reader import load_checkpoint
from raychat.checkpoint.resume import find_checkpoint
from raychat.common import RaychatError, default_tokenizer_dir, run_cli
from raychat.evaluation.bundle import cached_bundle, default_bundle_dir
from raychat.evaluation.core import Results, combine, format_task_line, score_shard
from raychat.locations import redact
from raychat.model.gpt import GPT, build_model
from raychat.ray_glue.runtime_env import worker_runtime_env
from raychat.storage import run_directory
from raychat.tokenizer.core import Tokenizer, check_vocab


def load_model(checkpoint: str, device: torch.device) -> GPT:
    """The checkpoint's model, built from its metadata, in eval mode."""
    model_state, _, meta = load_checkpoint(checkpoint, load_optimizer=False)
    model = build_model(meta.model_config, device)
    model.load_state_dict(model_state, strict=True)
    return model.eval()


def score_part(checkpoint: str, tokenizer_dir: str, bundle_dir: str, max_per_task: int, rank: int,
               world_size: int, threads: int = 0) -> Results:
    """One worker's share of the bundle, scored on the checkpoint's model (runs in a Ray task too)."""
    if threads:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(checkpoint, device)
    return score_shard(model, Tokenizer.load(tokenizer_dir), cached_bundle(bundle_dir), max_per_task, rank,
                       world_size, device)


def score_on_workers(args: tuple, num_workers: int) -> list[Results]:
    """score_part for ranks 0..W-1 as local Ray tasks, each on its share of the cores."""
    import ray

    from raychat.ray_glue.cluster_address import LOCAL
    from raychat.ray_glue.quiet import quiet_ray
    from raychat.ray_glue.ray_internals import record_command_line_redacted

    if not ray.is_initialized():
        quiet_ray(main_is_raychat=True)  # Ray's start-up and token-auth notices are not the command's output
        record_command_line_redacted(redact)  # a joined cluster shows the command line: no credentials
        local = {"address": LOCAL, "num_cpus": num_workers, "include_dashboard": False}
        kwargs = {} if os.environ.get("RAY_ADDRESS") else local
        ray.init(runtime_env=worker_runtime_env(os.environ), log_to_driver=False, **kwargs)
    threads = max(1, (os.cpu_count() or 1) // num_workers)
    task = ray.remote(num_cpus=1)(score_part)
    return ray.get([task.remote(*args, rank, num_workers, threads) for rank in range(num_workers)])


def core(args: argparse.Namespace) -> int:
    if args.num_workers < 1:
        raise RaychatError(f"--num-workers must be at least 1, got {args.num_workers}")
    if args.num_workers > 1:  # (one worker scores in this process, without importing Ray)
        from raychat.ray_glue.cluster_address import check_cluster_answers

        check_cluster_answers(os.environ.get("RAY_ADDRESS", ""))
    bundle_dir = str(args.eval_bundle or default_bundle_dir())
    bundle = cached_bundle(bundle_dir)  # a missing or malformed bundle fails here, before any model loads
    run = run_directory(args.storage_path, args.run_name)
    checkpoint = find_checkpoint(run, args.step)
    tokenizer_dir = str(args.tokenizer_dir or default_tokenizer_dir())
    meta = read_meta(checkpoint)
    check_vocab(Tokenizer.load(tokenizer_dir), meta.vocab_size, meta.tokenizer_fingerprint,
                str(checkpoint))
    print(f"# {checkpoint} (step {meta.step}): CORE on {len(bundle.tasks)} tasks of {bundle.directory}, "
          f"max {args.max_per_task} per task, {args.num_workers} worker(s)", flush=True)
    t0 = time.time()
    part = (str(checkpoint), tokenizer_dir, bundle_dir, args.max_per_task)
    one = args.num_workers == 1
    shards = [score_part(*part, 0, 1)] if one else score_on_workers(part, args.num_workers)
    result = combine(bundle, args.max_per_task, shards)
    for task in bundle.tasks:
        print(format_task_line(task.label, task, result))
    print(f"CORE metric: {result.core_metric:.4f} ({result.num_examples:,} examples in "
          f"{time.time() - t0:.1f}s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raychat.evaluate",
        description="Evaluate a trained raychat checkpoint. `core` scores it on nanochat's CORE metric "
                    "(the DCLM in-context-learning tasks of the eval bundle), per task and overall.",
        epilog="Example: python -m raychat.evaluate core --run-name d12 --max-per-task 500 --num-workers 4",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser(
        "core", help="score a checkpoint on CORE (nanochat's definition)",
        description="Score a run's checkpoint on CORE: per-task accuracy, centered accuracy "
                    "(acc - baseline) / (1 - baseline), and their mean. Same rules and numbers as "
                    "nanochat's `python -m scripts.base_eval --eval core`.")
    p.add_argument("--run-name", required=True, help="the run to evaluate (its --run-name)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--storage-path", default="", help="where runs live: a directory or a URI such as "
                   "s3://bucket/runs (default $RAYCHAT_HOME/runs)")
    p.add_argument("--tokenizer-dir", default="", help="tokenizer (default $RAYCHAT_HOME/tokenizer)")
    p.add_argument("--eval-bundle", default="", help="eval bundle directory (default "
                   "$RAYCHAT_HOME/eval_bundle; fetch it with "
                   "`python -m raychat.corpus download-eval-bundle`)")
    p.add_argument("--max-per-task", type=int, default=-1,
                   help="examples per task, a fixed seeded subsample (default -1: all, as nanochat's "
                        "base_eval)")
    p.add_argument("--num-workers", type=int, default=1,
                   help="local workers (Ray tasks) sharing the examples; the score does not depend on it")
    args = parser.parse_args(argv)
    return core(args)


if __name__ == "__main__":
    run_cli(main)
