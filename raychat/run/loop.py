"""The function every Ray Train worker runs: nanochat's base_train loop, world-size-independent.

Each optimizer step consumes the same global rows whatever the number of workers: rank r takes its
share of rows (R//W or R//W+1), the loss is summed and divided by the global token count, and the
optimizer SUM-reduces gradients, so 1 worker and 8 workers compute the same update. Everything a
resume needs (model, optimizer, loader cursor, loop state) goes into each checkpoint, so Ray can
restart the group at any size. `setup` (raychat.run.worker_setup) builds what the loop needs; the
loop below reads top to bottom, each block a named function above it.
"""

import gc
import json
import math
import os
import resource
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed as dist
from ray.train.v2._internal.execution.context import get_train_context

import raychat
from raychat.checkpoint.stop_note import write_stop_note
from raychat.data.loader import merge_cursor, val_loader
from raychat.model.flops import mfu as compute_mfu
from raychat.model.generate import generate
from raychat.run.evaluate import SAMPLE_PROMPTS, evaluate_bpb
from raychat.run.metrics import (
    counts_toward_total_time,
    eta_seconds,
    format_step_line,
    format_val_line,
    smooth_loss,
)
from raychat.run.worker_setup import Worker, all_gather_objects, setup
from raychat.scaling import (
    lr_multiplier,
    muon_momentum,
    muon_weight_decay,
)

PLANNED_RESIZE_WAIT_S = 120.0  # after a planned-resize save, how long to wait for Ray to restart the group


def validation_rows(w: Worker) -> torch.Tensor:
    """This rank's share of the run's fixed validation rows: the first --eval-tokens of the val split
    packed as by one worker, row i evaluated by rank i % W. The same rows and so the same bpb for
    the same weights at any world size; packed once per attempt, then reused at every evaluation."""
    num_rows = max(w.world_size, w.cfg.eval_tokens // w.cfg.max_seq_len)
    batches = val_loader(w.index, w.tokenizer_dir, w.cfg.max_seq_len, w.cfg.device_batch_size, 0, 1)
    rows: list[torch.Tensor] = []
    for x, y in batches:
        rows.extend(torch.cat([x, y[:, -1:]], dim=1))
        if len(rows) >= num_rows:
            break
    batches.close()
    return torch.stack(rows[w.rank:num_rows:w.world_size])


def evaluate(w: Worker) -> float:
    """Validation bpb over --eval-tokens (all ranks), logged like nanochat."""
    if w.val_rows is None:
        w.val_rows = validation_rows(w)
    rows = w.cfg.device_batch_size
    batches = ((chunk[:, :-1], chunk[:, 1:]) for chunk in w.val_rows.split(rows))
    w.model.eval()
    bpb = evaluate_bpb(w.model, batches, w.tokenizer.token_bytes(), w.device)
    w.model.train()
    w.loop.val_bpb = bpb
    w.loop.min_val_bpb = min(w.loop.min_val_bpb, bpb)
    w.log(format_val_line(w.step, bpb))
    if w.ray_metrics:
        w.ray_metrics.update(val_bpb=bpb)
    if w.wandb:
        w.wandb.log({"val/bpb": bpb, "total_training_time": w.loop.total_training_time}, w.step)
    return bpb


def sample(w: Worker) -> None:
    """Greedy continuations of nanochat's prompts (rank 0, uncompiled model: prompt shapes vary)."""
    w.orig_model.eval()
    for prompt in SAMPLE_PROMPTS:
        tokens = [w.tokenizer.bos_id] + w.tokenizer.encode(prompt)
        w.log(prompt + w.tokenizer.decode(generate(w.orig_model, tokens, max_tokens=16, temperature=0.0)))
    w.orig_model.train()


def save(w: Worker, wait: bool) -> None:
    """Checkpoint the state before step `w.step` (all ranks: gathering the state is collective)."""
    optim_state = w.optimizer.state_dict()  # gathers the ZeRO shards
    rank_states = all_gather_objects(w.loader.state(), w.world_size)
    if w.master:
        meta = {
            "step": w.step, "raychat_version": raychat.__version__, "session": w.session,
            "model_config": asdict(w.plan.model), "plan": w.plan.to_json(), "user_config": w.cfg.to_dict(),
            "world_size": w.world_size, "vocab_size": w.tokenizer.vocab_size,
            "tokenizer_fingerprint": w.tokenizer.fingerprint, "cursor": merge_cursor(rank_states),
            "loop_state": asdict(w.loop), "val_bpb": w.loop.val_bpb, "corpus": w.corpus_meta,
        }
        w.saver.save(w.step, w.orig_model.state_dict(), optim_state, meta, wait=wait)


def train_step(w: Worker) -> tuple[float, float, float, float]:
    """One optimizer step over this rank's rows: (global mean loss, lr multiplier, seconds, seconds
    waiting for data)."""
    t0 = time.perf_counter()
    x_all, y_all = w.loader.next_rows(w.micro_slices[-1].stop)
    data_wait = time.perf_counter() - t0
    x_all = x_all.to(w.device, non_blocking=True)
    y_all = y_all.to(w.device, non_blocking=True)
    inv_global_tokens = 1.0 / (w.plan.rows_per_step * w.cfg.max_seq_len)
    loss_sum = torch.zeros((), dtype=torch.float32, device=w.device)
    for sl in w.micro_slices:
        loss = w.model(x_all[sl], y_all[sl], loss_reduction="sum")
        (loss * inv_global_tokens).backward()
        loss_sum += loss.detach()
    step, n = w.step, w.plan.num_iterations
    lrm = lr_multiplier(step, n, w.cfg.warmup_steps, w.cfg.warmdown_ratio, w.cfg.final_lr_frac)
    momentum = muon_momentum(step, n, w.cfg.warmdown_ratio)
    weight_decay = muon_weight_decay(step, n, w.plan.weight_decay)
    for group in w.optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lrm
        if group["kind"] == "muon":
            group["momentum"] = momentum
            group["weight_decay"] = weight_decay
    w.optimizer.step()
    w.model.zero_grad(set_to_none=True)
    # The step's one collective and host sync carries, besides the loss, whether any rank was asked
    # to save now: rank 0 for a planned resize, any rank whose node got a preemption notice.
    flags = torch.tensor([_resize_requested(w), _preemption_noticed(w)], dtype=torch.float32)
    stats = torch.cat([loss_sum.reshape(1), flags.to(w.device)])
    if w.world_size > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    loss_total, resize, preempt = stats.tolist()
    w.resize_requested, w.preempt_requested = resize > 0, preempt > 0
    return loss_total * inv_global_tokens, lrm, time.perf_counter() - t0, data_wait


def _resize_requested(w: Worker) -> float:
    """Rank 0: has the controller asked for a save before a planned resize? (never blocks)"""
    if w.coordinator is None:
        return 0.0
    if w.save_request is None:
        w.save_request = w.coordinator.poll_request.remote()
    ready, _ = ray.wait([w.save_request], timeout=0)
    if not ready:
        return 0.0
    requested, w.save_request = ray.get(ready[0]), None
    return float(requested)


def _preemption_noticed(w: Worker) -> float:
    """Has Ray marked this worker's node as draining (a spot reclaim)? Read from the worker's own
    context: the public ray.train.get_preemption_info() is a barrier across workers, too costly per
    step (ray/train/v2/_internal/execution/train_fn_utils.py, get_preemption_info)."""
    if w.preempt_saved:
        return 0.0
    context = getattr(get_train_context(), "preemption_context", None)
    return float(getattr(context, "preemption_info", None) is not None)


def save_on_request(w: Worker) -> None:
    """A planned resize or a preemption notice: checkpoint this step now (synchronously), so the
    restarted group loses nothing. Before a resize, wait to be stopped instead of training on."""
    save(w, wait=True)
    if w.preempt_requested:
        w.preempt_saved = True
        if w.coordinator is not None:
            ray.get(w.coordinator.preemption_saved.remote(w.step))  # for the next attempt's log line
        w.log(f"Preemption notice: saved step {w.step}")
    if w.resize_requested:
        if w.coordinator is not None:
            ray.get(w.coordinator.saved.remote(w.step))
        w.log(f"Planned resize: saved step {w.step}, waiting for the new worker group")
        deadline = time.monotonic() + PLANNED_RESIZE_WAIT_S
        while time.monotonic() < deadline:  # Ray stops this group; if it does not, train on
            time.sleep(0.5)


def log_step(w: Worker, train_loss: float, lrm: float, dt: float, data_wait: float) -> None:
    """nanochat's step line, the Ray gauges and (every 100 steps) wandb."""
    step, n, tokens = w.step, w.plan.num_iterations, w.plan.total_batch_size
    w.loop.smooth_train_loss, debiased = smooth_loss(w.loop.smooth_train_loss, train_loss, step)
    if counts_toward_total_time(step):
        w.loop.total_training_time += dt
    step_mfu = compute_mfu(w.plan.flops_per_token, tokens / dt, w.peak_flops, w.world_size)
    epoch, pq, rg = w.loader.position()
    w.log(format_step_line(step, n, debiased, lrm, dt, tokens / dt, step_mfu, epoch, pq, rg,
                           w.loop.total_training_time, eta_seconds(step, n, w.loop.total_training_time)))
    if w.ray_metrics:
        w.ray_metrics.update(loss=debiased, tokens_per_sec=tokens / dt, mfu=step_mfu or 0.0, step=step,
                             world_size=w.world_size, data_wait_seconds=data_wait)
    if w.wandb and step % 100 == 0:
        w.wandb.log({"train/loss": debiased, "train/lrm": lrm, "train/dt": dt,
                     "train/tok_per_sec": tokens / dt, "train/mfu": step_mfu or 0.0}, step)


def report(w: Worker, metrics: dict, last_step: bool) -> None:
    """Metrics to Ray Train (and Tune). Every rank reports at the same steps: report is a barrier."""
    metrics.update(step=w.step, world_size=w.world_size, total_tokens=w.step * w.plan.total_batch_size,
                   flops_so_far=w.step * w.plan.total_batch_size * w.plan.flops_per_token,
                   min_val_bpb=w.loop.min_val_bpb, total_training_time=w.loop.total_training_time,
                   checkpoint_step=w.saver.latest_step, train_done=last_step, restarts=w.loop.restarts,
                   resizes=w.loop.resizes, redone_steps=w.loop.redone_steps)
    if last_step:
        usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        on_cuda = w.device.type == "cuda"
        metrics["peak_memory_mib"] = torch.cuda.max_memory_allocated(w.device) / 2**20 if on_cuda else usage
        if w.coordinator is not None:
            ray.get(w.coordinator.finish.remote(metrics))  # the driver's summary
    ray.train.report(metrics)


def _trace_consumed(w: Worker) -> None:
    """Test hook ($RAYCHAT_TRACE_DIR): append the documents this rank trained on at this step."""
    path = Path(w.trace_dir) / f"{w.attempt}_rank{w.rank}_{os.getpid()}.jsonl"
    with path.open("a") as f:
        ids = [list(i) for i in w.loader.consumed_doc_ids()]
        f.write(json.dumps({"attempt": w.attempt, "step": w.step, "rank": w.rank, "world_size": w.world_size,
                            "pid": os.getpid(), "ids": ids}) + "\n")


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point. `config` holds the TrainConfig as a dict plus resolved paths."""
    w = setup(config)
    cfg, num_iterations = w.cfg, w.plan.num_iterations
    first_step = w.step
    while True:
        last_step = w.step == num_iterations
        metrics: dict[str, Any] = {}
        if last_step or _due(w.step, cfg.eval_every):
            metrics["val_bpb"] = evaluate(w)
        if w.master and (last_step or (w.step > 0 and _due(w.step, cfg.sample_every))):
            sample(w)
        w.saver.poll()
        # Save every --save-every steps and at the end, not at the step we resumed from.
        if last_step or (w.step != first_step and _due(w.step, cfg.save_every)):
            save(w, wait=last_step)
        if metrics or last_step:
            report(w, metrics, last_step)
        if last_step:
            break

        train_loss, lrm, dt, data_wait = train_step(w)
        if w.trace_dir:
            _trace_consumed(w)
        if not math.isfinite(train_loss):
            # Every rank sees the same global loss, so all stop together. The save in flight holds the
            # weights from before this step: finish it, so the last good checkpoint is whole.
            w.saver.finish()
            w.log(f"Loss is {train_loss} at step {w.step}: stopping")
            if w.master:
                write_stop_note(w.storage_path, cfg.name, {"reason": "nan", "step": w.step})
            break
        log_step(w, train_loss, lrm, dt, data_wait)
        if w.coordinator is not None:
            w.coordinator.progress.remote(w.step)  # fire and forget: what a restart will have redone

        # nanochat's GC handling: the collector scans often and finds little; freeze after setup.
        if w.step == first_step:
            gc.collect()
            gc.freeze()
            gc.disable()
        elif w.step % 5000 == 0:
            gc.collect()
        w.step += 1
        if (w.resize_requested or w.preempt_requested) and w.step < num_iterations:
            save_on_request(w)

    w.saver.close()
    w.loader.close()
    if w.wandb:
        w.wandb.finish()

