"""The function every Ray Train worker runs: build the model, restore, step, evaluate, checkpoint.

This is nanochat's base_train loop made world-size-independent. Each optimizer step consumes the
same global rows whatever the number of workers: rank r takes its share of rows (R//W or R//W+1),
the loss is summed and divided by the global token count, and the optimizer SUM-reduces gradients,
so 1 worker and 8 workers compute the same update. Everything a resume needs (model, optimizer,
loader cursor, loop state) goes into each checkpoint, so Ray can restart the group at any size.
"""

import gc
import json
import math
import os
import resource
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed as dist
from ray.train import Checkpoint
from ray.train.v2.api.report_config import CheckpointUploadMode

import raychat
from raychat.checkpoint import (
    AsyncCheckpointWriter,
    is_complete,
    latest_valid_checkpoint,
    load_checkpoint,
    read_meta,
)
from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.console import log_line
from raychat.corpus import CorpusIndex
from raychat.evaluate import SAMPLE_PROMPTS, evaluate_bpb
from raychat.flops import mfu as compute_mfu
from raychat.flops import peak_flops
from raychat.loader import TrainLoader, merge_cursor, val_loader
from raychat.metrics import RayMetrics, WandbLogger, format_step_line, format_val_line
from raychat.model import build_model
from raychat.optim import build_optimizer
from raychat.scaling import (
    lr_multiplier,
    micro_batch_sizes,
    muon_momentum,
    muon_weight_decay,
    rank_rows,
    resolve_plan,
)
from raychat.stop_note import write_stop_note
from raychat.tokenizer import Tokenizer, check_vocab


@dataclass
class LoopState:
    """Loop variables besides the step that a resume must restore (nanochat's loop_state)."""

    min_val_bpb: float = float("inf")
    smooth_train_loss: float = 0.0
    total_training_time: float = 0.0
    val_bpb: float | None = None


def _all_gather_objects(obj: Any, world_size: int) -> list[Any]:
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _find_resume_checkpoint(cfg: TrainConfig, run_dir: Path | None) -> Path | None:
    """The checkpoint to start from: --resume-from-step if given, else the latest Ray knows about;
    a damaged latest one is skipped for the newest complete one in the run directory."""
    if cfg.resume_from_step >= 0:
        found = latest_valid_checkpoint(run_dir, step=cfg.resume_from_step) if run_dir else None
        if found is None:
            raise RaychatError(f"no complete checkpoint at step {cfg.resume_from_step} in {run_dir}: pick a "
                               "step listed there (a local --storage-path) or drop --resume-from-step")
        return found
    reported = ray.train.get_checkpoint()
    if reported is not None:
        path = Path(reported.path)
        if path.exists() and is_complete(path):
            return path
        if path.exists():
            print(f"warning: checkpoint {path} is damaged or incomplete; using an earlier one", flush=True)
    return latest_valid_checkpoint(run_dir) if run_dir is not None and run_dir.exists() else None


def _checkpoint_meta(step: int, cfg: TrainConfig, plan: Any, tokenizer: Tokenizer, world_size: int,
                     rank_states: list[dict], loop: LoopState) -> dict:
    """Everything besides tensors that a resume (at any world size) or `raychat.sample` needs."""
    return {
        "step": step,
        "raychat_version": raychat.__version__,
        "model_config": asdict(plan.model),
        "plan": plan.to_json(),
        "user_config": cfg.to_dict(),
        "world_size": world_size,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "cursor": merge_cursor(rank_states),
        "loop_state": asdict(loop),
        "val_bpb": loop.val_bpb,
    }


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _trace_consumed(trace_dir: str, attempt: str, step: int, rank: int, world_size: int,
                    ids: list[tuple[int, int, int]]) -> None:
    """Test hook ($RAYCHAT_TRACE_DIR): append the documents this rank trained on at `step`."""
    path = Path(trace_dir) / f"{attempt}_rank{rank}_{os.getpid()}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps({"attempt": attempt, "step": step, "rank": rank, "world_size": world_size,
                            "pid": os.getpid(), "ids": [list(i) for i in ids]}) + "\n")


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point. `config` holds the TrainConfig as a dict plus resolved paths."""
    cfg = TrainConfig.from_dict(config["train_config"])
    data_dir, tokenizer_dir = config["data_dir"], config["tokenizer_dir"]
    run_dir = Path(config["run_dir"]) if config.get("run_dir") else None
    trace_dir = os.environ.get("RAYCHAT_TRACE_DIR")

    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    master = rank == 0
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        # Workers on one machine share its cores (those this process may run on, which a container
        # or taskset can limit); Ray would otherwise leave each worker with one thread.
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cores // ctx.get_local_world_size()))

    def log(message: str) -> None:
        if master:
            log_line(message)

    tokenizer = Tokenizer.load(tokenizer_dir)
    token_bytes = tokenizer.token_bytes()
    plan = resolve_plan(cfg, tokenizer.vocab_size, world_size)
    T = cfg.max_seq_len

    # Resume position first: with the cursor known the loader can start now, so Ray Data's start-up
    # and the tokenizing of the packer's first ~1000 documents overlap building (and compiling,
    # and restoring) the model instead of blocking step 0.
    step, loop, cursor = 0, LoopState(), None
    resume_path = _find_resume_checkpoint(cfg, run_dir)   # verified: complete, hashes match
    if resume_path is not None:
        meta = read_meta(resume_path)
        check_vocab(tokenizer, meta["vocab_size"], meta.get("tokenizer_fingerprint"), str(resume_path))
        step, cursor, loop = meta["step"], meta["cursor"], LoopState(**meta["loop_state"])
    index = CorpusIndex.load(data_dir)
    loader = TrainLoader(index, tokenizer_dir, T, rank, world_size, cursor=cursor,
                         record_consumed=bool(trace_dir))

    # Same seed on every rank: identical initial weights without a broadcast.
    torch.manual_seed(cfg.seed)
    orig_model = build_model(plan.model, device)
    use_compile = cfg.compile == "on" or (cfg.compile == "auto" and device.type == "cuda")
    model = torch.compile(orig_model, dynamic=False) if use_compile else orig_model
    optimizer = build_optimizer(
        orig_model,
        embedding_lr=cfg.embedding_lr * plan.lr_scale,
        unembedding_lr=cfg.unembedding_lr * plan.lr_scale,
        matrix_lr=cfg.matrix_lr * plan.lr_scale,
        scalar_lr=cfg.scalar_lr * plan.lr_scale,
        weight_decay=plan.weight_decay,
    )
    if resume_path is not None:
        model_state, optim_state, meta = load_checkpoint(resume_path, device=device, verified=True)
        orig_model.load_state_dict(model_state, strict=True)
        optimizer.load_state_dict(optim_state)
        del model_state, optim_state
        log(f"Resumed from {resume_path} at step {step} "
            f"(saved by {meta['world_size']} workers, now {world_size})")

    num_iterations = plan.num_iterations
    my_rows = rank_rows(plan.rows_per_step, world_size, rank)
    micro_sizes = micro_batch_sizes(my_rows, cfg.device_batch_size)
    # Slices of each step's rows, hoisted out of the step loop.
    micro_slices = []
    offset = 0
    for size in micro_sizes:
        micro_slices.append(slice(offset, offset + size))
        offset += size
    inv_global_tokens = 1.0 / (plan.rows_per_step * T)

    peak, peak_source = peak_flops(device)
    if master and peak_source == "measured":
        gpu_name = torch.cuda.get_device_name(device)
        log(f"Peak bf16 FLOPS: {peak:.3e} (measured: {gpu_name} is not in the table)")
    ray_metrics = RayMetrics(run_name=cfg.name) if master else None
    wandb_logger = WandbLogger(cfg.run, config=cfg.to_dict()) if master else None
    writer = AsyncCheckpointWriter() if master else None
    # A checkpoint is written in the background and handed to Ray at the next step, so the write
    # overlaps one step of training; every rank reports at the same steps (report is a barrier).
    pending_step: int | None = None
    pending_dir: Path | None = None
    eval_rows = cfg.device_batch_size
    eval_batches_count = max(1, cfg.eval_tokens // (eval_rows * T * world_size))
    # One id per start of the worker group (rank 0's), so a trace can tell redone steps apart.
    attempt = _all_gather_objects(f"{time.time():.3f}", world_size)[0] if trace_dir else ""
    first_step_of_attempt = step
    log(f"Training {num_iterations} steps on {world_size} worker(s), {my_rows} rows/step on rank 0 "
        f"in micro-batches {micro_sizes}, device {device}")

    while True:
        last_step = step == num_iterations
        metrics: dict[str, Any] = {}

        # Evaluate val bpb (all ranks).
        if last_step or (cfg.eval_every > 0 and step % cfg.eval_every == 0):
            model.eval()
            batches = val_loader(index, tokenizer_dir, T, eval_rows, rank, world_size)
            limited = (b for _, b in zip(range(eval_batches_count), batches, strict=False))
            loop.val_bpb = evaluate_bpb(model, limited, token_bytes, device)
            batches.close()  # stops the val reader thread until the next evaluation
            loop.min_val_bpb = min(loop.min_val_bpb, loop.val_bpb)
            log(format_val_line(step, loop.val_bpb))
            metrics["val_bpb"] = loop.val_bpb
            if ray_metrics:
                ray_metrics.update(val_bpb=loop.val_bpb)
            if wandb_logger:
                wandb_logger.log({"val/bpb": loop.val_bpb,
                                  "total_training_time": loop.total_training_time}, step)
            model.train()

        # Sample (rank 0, uncompiled model: prompt shapes vary).
        if master and (last_step or (cfg.sample_every > 0 and step > 0 and step % cfg.sample_every == 0)):
            orig_model.eval()
            for prompt in SAMPLE_PROMPTS:
                tokens = [tokenizer.bos_id] + tokenizer.encode(prompt)
                completion = orig_model.generate(tokens, max_tokens=16, temperature=0.0)
                log(prompt + tokenizer.decode(completion))
            orig_model.train()

        # A checkpoint written in the background at the previous step: hand it to Ray now.
        report_dir: Path | None = None
        report_step: int | None = None
        if pending_step is not None:
            if master:
                writer.wait()
                report_dir = pending_dir
            report_step, pending_step, pending_dir = pending_step, None, None

        # Save: every --save-every steps and at the end, not at the step we resumed from.
        save_now = last_step or (cfg.save_every > 0 and step > 0 and step % cfg.save_every == 0
                                 and step != first_step_of_attempt)
        if save_now:
            optim_state = optimizer.state_dict()  # collective: gathers the ZeRO shards
            rank_states = _all_gather_objects(loader.state(), world_size)
            ckpt_dir = None
            if master:
                ckpt_dir = Path(tempfile.mkdtemp(prefix=f"raychat_ckpt_{step:06d}_"))
                writer.submit(ckpt_dir, orig_model.state_dict(), optim_state,
                              _checkpoint_meta(step, cfg, plan, tokenizer, world_size, rank_states, loop))
            del optim_state
            if last_step:
                if master:
                    writer.wait()
                # The final checkpoint supersedes one still pending from the previous step.
                report_dir, report_step = ckpt_dir, step
            else:
                pending_step, pending_dir = step, ckpt_dir
        if report_step is not None:
            metrics["checkpoint_step"] = report_step

        if metrics or last_step:
            metrics.update(step=step, world_size=world_size, total_tokens=step * plan.total_batch_size,
                           flops_so_far=step * plan.total_batch_size * plan.flops_per_token,
                           min_val_bpb=loop.min_val_bpb, total_training_time=loop.total_training_time,
                           train_done=last_step)
            if last_step:
                metrics["peak_memory_mib"] = _peak_memory_mib(device)
            checkpoint = Checkpoint.from_directory(str(report_dir)) if report_dir else None
            ray.train.report(
                metrics, checkpoint=checkpoint,
                checkpoint_dir_name=f"checkpoint_{report_step:06d}" if report_step is not None else None,
                checkpoint_upload_mode=CheckpointUploadMode.ASYNC if checkpoint and not last_step
                else CheckpointUploadMode.SYNC,
                delete_local_checkpoint_after_upload=True,
            )

        if last_step:
            break

        # ---- one optimizer step ----
        t0 = time.perf_counter()
        x_all, y_all = loader.next_rows(my_rows)
        data_wait = time.perf_counter() - t0
        x_all = x_all.to(device, non_blocking=True)
        y_all = y_all.to(device, non_blocking=True)
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for sl in micro_slices:
            loss = model(x_all[sl], y_all[sl], loss_reduction="sum")
            (loss * inv_global_tokens).backward()
            loss_sum += loss.detach()
        lrm = lr_multiplier(step, num_iterations, cfg.warmup_steps, cfg.warmdown_ratio, cfg.final_lr_frac)
        momentum = muon_momentum(step, num_iterations, cfg.warmdown_ratio)
        weight_decay = muon_weight_decay(step, num_iterations, plan.weight_decay)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if group["kind"] == "muon":
                group["momentum"] = momentum
                group["weight_decay"] = weight_decay
        optimizer.step()
        model.zero_grad(set_to_none=True)
        if world_size > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        train_loss = loss_sum.item() * inv_global_tokens  # the one host sync of the step
        dt = time.perf_counter() - t0

        if trace_dir:
            _trace_consumed(trace_dir, attempt, step, rank, world_size, loader.consumed_doc_ids())
        if not math.isfinite(train_loss):
            # Every rank sees the same global loss, so all stop together; the last good checkpoint stays.
            log(f"Loss is {train_loss} at step {step}: stopping")
            if master:
                write_stop_note(config["storage_path"], cfg.name, {"reason": "nan", "step": step})
            break

        # Logging (host-side only).
        beta = 0.9
        loop.smooth_train_loss = beta * loop.smooth_train_loss + (1 - beta) * train_loss
        debiased = loop.smooth_train_loss / (1 - beta ** (step + 1))
        tok_per_sec = int(plan.total_batch_size / dt)
        step_mfu = compute_mfu(plan.flops_per_token, plan.total_batch_size / dt, peak, world_size)
        if step > 10:
            loop.total_training_time += dt
        eta = None
        if step > 10:
            eta = (num_iterations - step) * loop.total_training_time / (step - 10)
        epoch, pq, rg = loader.position()
        log(format_step_line(step, num_iterations, debiased, lrm, dt, tok_per_sec, step_mfu, epoch, pq, rg,
                             loop.total_training_time, eta))
        if ray_metrics:
            ray_metrics.update(loss=debiased, tokens_per_sec=tok_per_sec, mfu=step_mfu or 0.0, step=step,
                               world_size=world_size, data_wait_seconds=data_wait)
        if wandb_logger and step % 100 == 0:
            wandb_logger.log({"train/loss": debiased, "train/lrm": lrm, "train/dt": dt,
                              "train/tok_per_sec": tok_per_sec, "train/mfu": step_mfu or 0.0}, step)

        # nanochat's GC handling: the collector scans often and finds little; freeze after setup.
        if step == first_step_of_attempt:
            gc.collect()
            gc.freeze()
            gc.disable()
        elif step % 5000 == 0:
            gc.collect()
        step += 1

    loader.close()
    if wandb_logger:
        wandb_logger.finish()
