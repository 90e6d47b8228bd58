"""One optimizer step of nanochat's base_train loop, in plain PyTorch (no Ray).

The step is world-size-independent: rank r trains on its share of the global rows in micro-batches,
each micro-batch's summed loss is scaled by 1 / (global tokens) before backward, and the optimizer
SUM-reduces gradients, so 1 worker and 8 workers compute the same update. The step's one collective
(and its one host sync) sums the loss across ranks, together with whatever small values the caller
wants summed at the same time (the worker loop's elastic flags), so those cost no second sync.

The Ray worker loop (raychat.worker.loop) and the no-Ray baseline of bench/overhead.py run this same
function.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from raychat.config import TrainConfig
from raychat.optim.base import ShardedOptimizer
from raychat.optim.registry import optimizer_spec
from raychat.scaling import Plan, lr_multiplier, micro_batch_sizes


class RowSource(Protocol):
    """Where a step's rows come from (raychat.data.loader.TrainLoader, or saved rows in a benchmark)."""

    def next_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class StepComponents(Protocol):
    """What a step computes with: the worker's components (raychat.worker.setup.Worker) have them."""

    cfg: TrainConfig
    plan: Plan
    device: torch.device
    model: torch.nn.Module  # compiled or not
    optimizer: ShardedOptimizer  # built by the spec of cfg.optimizer
    loader: RowSource
    micro_slices: list[slice]  # this rank's rows of the step, cut into forward passes


@dataclass
class StepResult:
    loss: float  # mean loss per token over the global batch (all ranks)
    lrm: float  # learning-rate multiplier the step used
    dt: float  # seconds, data wait included
    data_wait: float  # seconds waiting for the loader's rows
    summed: list[float]  # the caller's `also_sum` values, summed over ranks


def micro_slices(rows: int, device_batch_size: int) -> list[slice]:
    """This rank's `rows` rows of a step as slices of at most device_batch_size rows."""
    slices, offset = [], 0
    for size in micro_batch_sizes(rows, device_batch_size):
        slices.append(slice(offset, offset + size))
        offset += size
    return slices


def set_schedules(optimizer: ShardedOptimizer, cfg: TrainConfig, plan: Plan, step: int) -> float:
    """Learning rates for `step` (every group's initial lr times the schedule's multiplier), then what
    the optimizer itself schedules (muon_adamw: Muon's momentum and weight decay); returns the lr
    multiplier."""
    lrm = lr_multiplier(step, plan.num_iterations, cfg.warmup_steps, cfg.warmdown_ratio, cfg.final_lr_frac)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lrm
    optimizer_spec(cfg.optimizer).schedule(optimizer, cfg, plan, step)
    return lrm


def train_step(c: StepComponents, step: int,
               also_sum: Sequence[float] | Callable[[], Sequence[float]] = ()) -> StepResult:
    """One optimizer step over this rank's rows. `also_sum` rides on the loss's all-reduce; a callable
    is asked just before it, after the optimizer step (what it says has seen the step's time go by:
    whether a send begun before the step has finished)."""
    t0 = time.perf_counter()
    x_all, y_all = c.loader.next_rows(c.micro_slices[-1].stop)
    data_wait = time.perf_counter() - t0
    x_all = x_all.to(c.device, non_blocking=True)
    y_all = y_all.to(c.device, non_blocking=True)
    inv_global_tokens = 1.0 / (c.plan.rows_per_step * c.cfg.max_seq_len)
    loss_sum = torch.zeros((), dtype=torch.float32, device=c.device)
    for sl in c.micro_slices:
        loss = c.model(x_all[sl], y_all[sl], loss_reduction="sum")
        (loss * inv_global_tokens).backward()
        loss_sum += loss.detach()
    lrm = set_schedules(c.optimizer, c.cfg, c.plan, step)
    c.optimizer.step()
    c.model.zero_grad(set_to_none=True)
    stats = loss_sum.reshape(1)
    extra = also_sum() if callable(also_sum) else also_sum
    if extra:
        stats = torch.cat([stats, torch.tensor(list(extra), dtype=torch.float32).to(c.device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    loss_total, *summed = stats.tolist()  # the step's one host sync
    return StepResult(loss_total * inv_global_tokens, lrm, time.perf_counter() - t0, data_wait, summed)
