"""What one Ray Train worker builds before its first step: the `Worker` the loop runs on.

`setup` reads the run's config, agrees with the other ranks on the checkpoint to resume from (see
raychat.checkpoint.resume), starts the data loader on its cursor first (so Ray Data's start-up and the first
documents' tokenizing overlap building and restoring the model), builds the model, the optimizer
and the checkpoint saver, and tells the run's coordinator that an attempt started (raychat.run.elastic),
which logs why, if this is a restart. The train loop itself is in raychat.run.loop.
"""

import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray.train
import torch
import torch.distributed as dist

from raychat.checkpoint.resume import Restore, candidates
from raychat.checkpoint.saver import CheckpointSaver
from raychat.config import TrainConfig
from raychat.corpus.index import CorpusIndex, read_corpus_meta
from raychat.data.loader import TrainLoader
from raychat.model.compile_check import probe_compile, uses_compile
from raychat.model.flops import peak_flops
from raychat.model.gpt import build_model
from raychat.model.precision import configure_matmuls, resolve_precision
from raychat.optim.muon_adamw import build_optimizer
from raychat.run.console import log_line
from raychat.run.elastic import coordinator_name, describe_attempt
from raychat.run.metrics import (
    RayMetrics,
    WandbLogger,
)
from raychat.scaling import (
    Plan,
    micro_batch_sizes,
    rank_rows,
    resolve_plan,
)
from raychat.storage import Storage
from raychat.tokenizer.core import Tokenizer, check_vocab


@dataclass
class LoopState:
    """Loop variables besides the step that a resume must restore (nanochat's loop_state)."""

    min_val_bpb: float = float("inf")
    smooth_train_loss: float = 0.0
    total_training_time: float = 0.0
    val_bpb: float | None = None
    restarts: int = 0  # worker-group restarts after failures
    resizes: int = 0  # planned resizes (the group grew or shrank with nothing lost)
    redone_steps: int = 0  # steps trained again after restarts (work lost since the last checkpoint)


@dataclass
class Worker:
    """What the loop needs, built once by `setup`."""

    cfg: TrainConfig
    plan: Plan
    rank: int
    world_size: int
    device: torch.device
    tokenizer: Tokenizer
    index: CorpusIndex
    tokenizer_dir: str
    loader: TrainLoader
    orig_model: torch.nn.Module
    model: torch.nn.Module  # orig_model, compiled or not
    optimizer: torch.optim.Optimizer
    saver: CheckpointSaver
    storage_path: str
    session: str
    corpus_meta: dict  # what made the corpus (source; Hub repo and revision), kept with each checkpoint
    step: int = 0
    loop: LoopState = field(default_factory=LoopState)
    micro_slices: list[slice] = field(default_factory=list)
    peak_flops: float = 0.0
    ray_metrics: RayMetrics | None = None
    wandb: WandbLogger | None = None
    trace_dir: str | None = None
    attempt: str = ""
    coordinator: Any = None  # rank 0: the run's elastic Coordinator actor
    save_request: Any = None  # rank 0: a pending Coordinator.poll_request() reply
    val_rows: torch.Tensor | None = None  # this rank's share of the fixed validation rows
    preempt_saved: bool = False
    resize_requested: bool = False
    preempt_requested: bool = False

    @property
    def master(self) -> bool:
        return self.rank == 0

    def log(self, message: str) -> None:
        if self.master:
            log_line(message)


def all_gather_objects(obj: Any, world_size: int) -> list[Any]:
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _set_cpu_threads(local_world_size: int) -> None:
    # Workers on one machine share its cores (those this process may run on, which a container or
    # taskset can limit); Ray would otherwise leave each worker with one thread.
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // local_world_size))


def setup(config: dict) -> Worker:
    """Tokenizer, plan, resume position, loader, model and optimizer for this rank."""
    cfg = TrainConfig.from_dict(config["train_config"])
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        _set_cpu_threads(ctx.get_local_world_size())
    master = rank == 0

    def log(message: str) -> None:
        if master:
            log_line(message)

    use_compile = uses_compile(cfg.compile, device)
    if use_compile and not config.get("compile_checked"):
        probe_compile(device)  # one line instead of a traceback at the first forward
    tokenizer = Tokenizer.load(config["tokenizer_dir"])
    plan = resolve_plan(cfg, tokenizer.vocab_size, world_size)
    run = Storage(config["storage_path"]).child(cfg.name)
    gather = lambda obj: all_gather_objects(obj, world_size)  # noqa: E731

    # Resume position first: with the cursor known the loader starts now, so Ray Data's start-up and
    # the tokenizing of the packer's first documents overlap building and restoring the model.
    names = gather(candidates(run, config["session"], config.get("resume_from")) if master else None)[0]
    restore = Restore(run, names, gather, log)
    index = CorpusIndex.load(config["data_dir"])
    trace_dir = os.environ.get("RAYCHAT_TRACE_DIR")

    def start_loader(meta: dict | None) -> TrainLoader:
        cursor = meta["cursor"] if meta else None
        return TrainLoader(index, config["tokenizer_dir"], cfg.max_seq_len, rank, world_size, cursor=cursor,
                           shuffle_seed=cfg.shuffle_seed if cfg.shuffle_seed >= 0 else None,
                           data_tasks=max(1, int(cfg.cpus_per_worker)), record_consumed=bool(trace_dir))

    if restore.meta is not None:
        check_vocab(tokenizer, restore.meta["vocab_size"], restore.meta.get("tokenizer_fingerprint"),
                    str(restore.checkpoint))
    loader = start_loader(restore.meta)
    first_meta = restore.meta

    torch.manual_seed(cfg.seed)  # same seed on every rank: identical initial weights without a broadcast
    precision = resolve_precision(cfg.dtype, cfg.fp8, cfg.fp8_recipe, device)
    configure_matmuls(device)
    orig_model = build_model(plan.model, device, precision)
    model = torch.compile(orig_model, dynamic=False) if use_compile else orig_model
    optimizer = build_optimizer(
        orig_model,
        embedding_lr=cfg.embedding_lr * plan.lr_scale,
        unembedding_lr=cfg.unembedding_lr * plan.lr_scale,
        matrix_lr=cfg.matrix_lr * plan.lr_scale,
        scalar_lr=cfg.scalar_lr * plan.lr_scale,
        weight_decay=plan.weight_decay,
    )
    step, loop = 0, LoopState()
    state = restore.load(device)
    resumed_from = restore.checkpoint.name if state is not None else None
    if state is not None:
        if restore.meta is not first_meta:  # fell back to an older checkpoint: its cursor, not the other's
            loader.close()
            loader = start_loader(restore.meta)
        orig_model.load_state_dict(state[0], strict=True)
        optimizer.load_state_dict(state[1])
        del state
        step, loop = restore.meta["step"], LoopState(**restore.meta["loop_state"])
        log(f"Resumed from {restore.checkpoint} at step {step} "
            f"(saved by {restore.meta['world_size']} workers, now {world_size})")
    coordinator = ray.get_actor(coordinator_name(config["session"])) if master else None
    if coordinator is not None:
        previous = ray.get(coordinator.start_attempt.remote(step, world_size))
        start = describe_attempt(previous, step, world_size, resumed_from)
        if start.line:
            log(start.line)
        loop.restarts += start.kind == "failure"
        loop.resizes += start.kind == "planned"
        loop.redone_steps += start.redone_steps

    micro_slices, offset = [], 0
    for size in micro_batch_sizes(rank_rows(plan.rows_per_step, world_size, rank), cfg.device_batch_size):
        micro_slices.append(slice(offset, offset + size))
        offset += size
    peak, peak_source = peak_flops(device)
    if peak_source == "measured":
        gpu_name = torch.cuda.get_device_name(device)
        log(f"Peak bf16 FLOPS: {peak:.3e} (measured: {gpu_name} is not in the table)")
    worker = Worker(
        cfg=cfg, plan=plan, rank=rank, world_size=world_size, device=device, tokenizer=tokenizer,
        index=index, tokenizer_dir=config["tokenizer_dir"], loader=loader, orig_model=orig_model,
        model=model, optimizer=optimizer, storage_path=config["storage_path"], session=config["session"],
        corpus_meta=read_corpus_meta(config["data_dir"]),
        saver=CheckpointSaver(run, cfg.keep_checkpoints, enabled=master, log=log),
        step=step, loop=loop, micro_slices=micro_slices, peak_flops=peak, trace_dir=trace_dir,
        ray_metrics=RayMetrics(run_name=cfg.name) if master else None, coordinator=coordinator,
        wandb=WandbLogger(cfg.run, config=cfg.to_dict()) if master else None,
    )
    # One id per start of the worker group (rank 0's), so a trace can tell redone steps apart.
    worker.attempt = gather(f"{time.time():.3f}")[0] if trace_dir else ""
    log(f"Training {plan.num_iterations} steps on {world_size} worker(s), {offset} rows/step on rank 0 "
        f"in micro-batches {[s.stop - s.start for s in micro_slices]}, device {device}, {precision.name}")
    return worker


