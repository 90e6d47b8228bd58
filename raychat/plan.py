"""`python -m raychat.plan`: what a training run would do, without training.

Depth drives everything through the scaling rules (raychat/scaling.py), so a flag changed here can
move the batch size, the learning rates, the weight decay and the number of steps at once. This
command shows the resolved numbers (the same table the trainer prints at start-up) in a second,
with no data, no GPU and no Ray, so a run can be sized before it is launched.
"""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from raychat.common import RaychatError, default_data_dir, default_tokenizer_dir, run_cli
from raychat.config import TrainConfig, add_config_flags, config_from_args
from raychat.corpus.index import list_shards
from raychat.data.budget import budget_lines, corpus_budget
from raychat.elastic.cadence import plan_line, replica_line
from raychat.memory import (
    GIB,
    GPU_MEMORY_GIB,
    embedding_tables,
    fit_device_batch_size,
    format_memory,
    gpu_memory_gib,
    plan_memory,
)
from raychat.model.precision import DTYPES, run_auto_dtype
from raychat.scaling import format_plan, resolve_plan
from raychat.tokenizer.core import META_FILE, Tokenizer

EPILOG = """\
examples:
  python -m raychat.plan --depth 24                 # nanochat's GPT-2-class model, all rules on auto
  python -m raychat.plan --preset cpu               # the laptop-CPU configuration
  python -m raychat.plan --depth 12 --total-batch-size 65536 --num-iterations 10000 --json
  python -m raychat.plan --depth 20 --num-workers 8 # the batch layout over 8 workers
  python -m raychat.plan --depth 24 --num-workers 8 --gpu H100   # does a rank fit an 80 GB H100?
  python -m raychat.plan --depth 24 --num-workers 8 --gpu H100 --device-batch-size -1  # what fits

The vocabulary size comes from the tokenizer in --tokenizer-dir when one is there, else from
--vocab-size (the size `raychat.train` would train a tokenizer with). With a corpus in --data-dir and
a tokenizer, the plan also compares the tokens the run needs with the tokens the corpus holds.
"""


def plan_vocab_size(cfg: TrainConfig) -> tuple[int, str]:
    """(vocab size, where it came from): the tokenizer in --tokenizer-dir if one is there (what
    training would use), else --vocab-size (what training would train a tokenizer with)."""
    tokenizer_dir = Path(cfg.tokenizer_dir).expanduser() if cfg.tokenizer_dir else default_tokenizer_dir()
    if (tokenizer_dir / META_FILE).is_file():  # meta.json is written last: a tokenizer is (meant to be) there
        return Tokenizer.load(tokenizer_dir).vocab_size, f"the tokenizer at {tokenizer_dir}"
    return cfg.vocab_size, "--vocab-size, no tokenizer yet"


def device_memory(gpu: str, gpu_memory: float) -> tuple[float | None, str]:
    """(GiB, name) of the device to check the estimate against: --gpu-memory, else --gpu's table entry."""
    if gpu_memory > 0:
        return gpu_memory, gpu or "the device"
    if not gpu:
        return None, ""
    gib = gpu_memory_gib(gpu)
    if gib is None:
        raise RaychatError(f"--gpu {gpu!r} is not a device raychat knows; give its size with "
                           "--gpu-memory GIB")
    return gib, gpu


def memory_mode(cfg: TrainConfig, on_gpu: bool) -> tuple[int, bool, str]:
    """(compute dtype bytes, compiled, label) of the step the memory estimate describes: a GPU's when the
    plan is checked against one (or runs on one), else this CPU's."""
    if on_gpu:
        compute_bytes, compiled = (4 if cfg.dtype == "fp32" else 2), cfg.compile != "off"
    else:
        dtype = run_auto_dtype(torch.device("cpu"))[0] if cfg.dtype == "auto" else DTYPES[cfg.dtype]
        compute_bytes, compiled = dtype.itemsize, cfg.compile == "on"
    where = "GPU" if on_gpu else "CPU"
    return compute_bytes, compiled, f"{where}, {'bf16' if compute_bytes == 2 else 'fp32'}, " + (
        "compiled" if compiled else "eager")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raychat.plan",
        description="Resolve a raychat training run without training: model shape and parameter counts, "
                    "FLOPs per token, horizon, batch size and its layout over workers, learning-rate "
                    "scale and weight decay. Takes the same flags as `python -m raychat.train`.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--gpu", default="", help="check the memory estimate against this device, e.g. H100, "
                        f"A100 40GB, RTX 4090 (known: {', '.join(sorted(GPU_MEMORY_GIB))})")
    parser.add_argument("--gpu-memory", type=float, default=0.0, metavar="GIB",
                        help="check the memory estimate against a device of this many GiB")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    vocab_size, vocab_source = plan_vocab_size(cfg)
    # An elastic run (MIN:MAX) is planned at its largest size; the global batch does not depend on
    # it, and every size down to 1 fits whenever the largest one does.
    world_size = cfg.worker_range()[1]
    plan = resolve_plan(cfg, vocab_size, world_size)
    data_dir = Path(cfg.data_dir).expanduser() if cfg.data_dir else default_data_dir()
    tokenizer_dir = Path(cfg.tokenizer_dir).expanduser() if cfg.tokenizer_dir else default_tokenizer_dir()
    budget = None
    if data_dir.is_dir() and list_shards(data_dir) and (tokenizer_dir / META_FILE).is_file():
        budget = corpus_budget(plan.total_tokens, data_dir, Tokenizer.load(tokenizer_dir))
    device_gib, device = device_memory(args.gpu, args.gpu_memory)
    on_gpu = device_gib is not None or torch.cuda.is_available()
    compute_bytes, compiled, mode = memory_mode(cfg, on_gpu)
    if device_gib is not None and plan.device_batch_rule == "auto":  # what each worker on it would pick
        plan = plan.with_device_batch_size(fit_device_batch_size(plan, int(device_gib * GIB), compute_bytes,
                                                                 compiled, cfg))
    memory = plan_memory(plan, compute_bytes, compiled, cfg)
    tables = embedding_tables(plan.params, world_size, cfg)
    if args.json:
        print(json.dumps({**plan.to_json(), "vocab_source": vocab_source,
                          "memory": {**memory.to_json(), "mode": mode, "embedding_tables": asdict(tables)},
                          "corpus": budget.to_json() if budget else None}))
    else:
        print(f"raychat plan for {cfg.tag} (vocab size from {vocab_source})")
        print(format_plan(plan))
        print(plan_line(cfg.save_every, cfg.max_lost_minutes))
        print(replica_line(cfg.replicate_every, memory.save_host))
        print("\n".join(format_memory(memory, tables, mode, device_gib, device)))
        for line in budget_lines(budget) if budget else [f"corpus: none sized yet (needs a corpus in "
                                                        f"{data_dir} and a tokenizer in {tokenizer_dir})"]:
            print(line)
    return 0


if __name__ == "__main__":
    run_cli(main)
