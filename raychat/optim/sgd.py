"""Plain SGD, momentum optional: --optimizer sgd, with --sgd-lr and --sgd-momentum.

A baseline beside nanochat's Muon + AdamW, and the smallest optimizer behind raychat.optim.base. Its
state, one momentum buffer per parameter (none without momentum), is kept whole on every rank:
step() all-reduces each gradient in place and every rank applies the same update, so the copies stay
identical with no gather. A checkpoint holds one copy, written by rank 0, and on resume every rank
reads it whole: W reads of a state the size of the model, the price of keeping SGD this simple
(MuonAdamW shards its state instead, and each byte is read about once).
"""

import torch
import torch.distributed as dist

from raychat.config import TrainConfig
from raychat.model.gpt import GPT
from raychat.optim.base import (
    OptimizerSpec,
    OwnedPiece,
    Range,
    ReadRange,
    ShardedOptimizer,
    StateBytes,
    check_saved_groups,
)
from raychat.optim.shards import world_and_rank
from raychat.scaling import Plan

MOMENTUM_KEY = "momentum_buffer"


class SGD(ShardedOptimizer):
    """p <- p - lr * b with b <- momentum * b + g (b = g without momentum), g the gradient summed over
    ranks; a parameter without a gradient counts as a zero gradient, so every rank takes part in every
    all-reduce. Groups need "params", "names" and "lr"; "momentum" defaults to 0."""

    name = "sgd"

    def __init__(self, param_groups: list[dict]):
        for group in param_groups:
            group["params"] = list(group["params"])
            if len(group.get("names", ())) != len(group["params"]):
                raise ValueError("every optimizer group needs 'names': one name per parameter")
            group.setdefault("momentum", 0.0)
            group.setdefault("initial_lr", group["lr"])
        super().__init__(param_groups)

    @torch.no_grad()
    def step(self) -> None:
        world, _ = world_and_rank()
        grads = [[p.grad if p.grad is not None else torch.zeros_like(p) for p in group["params"]]
                 for group in self.param_groups]
        if world > 1:  # all launched before any is waited on, so they overlap
            works = [dist.all_reduce(g, op=dist.ReduceOp.SUM, async_op=True) for gs in grads for g in gs]
            for work in works:
                work.wait()
        for group, group_grads in zip(self.param_groups, grads, strict=True):
            update = group_grads
            if group["momentum"]:
                for p in group["params"]:
                    if MOMENTUM_KEY not in self.state[p]:
                        self.state[p][MOMENTUM_KEY] = torch.zeros_like(p)
                update = [self.state[p][MOMENTUM_KEY] for p in group["params"]]
                torch._foreach_mul_(update, group["momentum"])
                torch._foreach_add_(update, group_grads)
            torch._foreach_add_(group["params"], update, alpha=-group["lr"])

    def _named(self, with_momentum: bool = False) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of every parameter, or of those whose group has momentum."""
        return [pair for group in self.param_groups if group["momentum"] or not with_momentum
                for pair in zip(group["names"], group["params"], strict=True)]

    def owned_pieces(self) -> tuple[list[OwnedPiece], dict]:
        _, rank = world_and_rank()
        stateful = [(name, p) for name, p in self._named() if MOMENTUM_KEY in self.state[p]]
        groups = [{key: value for key, value in g.items() if key != "params"} for g in self.param_groups]
        plain = {"param_groups": groups, "steps": {}, "stateful": [name for name, _ in stateful]}
        if rank != 0:  # every rank holds the same copy: rank 0 writes it
            return [], plain
        return [(name, MOMENTUM_KEY, tuple(p.shape), 0, self.state[p][MOMENTUM_KEY])
                for name, p in stateful], plain

    def wanted_ranges(self, stateful: list[str]) -> list[Range]:
        """The saved momenta, whole; none for a group this run gives no momentum (a checkpoint saved with
        --sgd-momentum resumed without it: the buffers would never be used)."""
        has_state = set(stateful)
        return [(name, MOMENTUM_KEY, tuple(p.shape), 0, p.numel())
                for name, p in self._named(with_momentum=True) if name in has_state]

    @torch.no_grad()
    def load_owned(self, plain: dict, read: ReadRange) -> None:
        check_saved_groups(self.param_groups, plain["param_groups"])
        self.state.clear()
        has_state = set(plain["stateful"])
        for name, p in self._named(with_momentum=True):
            if name in has_state:
                saved = read(name, MOMENTUM_KEY, 0).view(p.shape)
                self.state[p][MOMENTUM_KEY] = torch.zeros_like(p).copy_(saved)


class SGDSpec(OptimizerSpec):
    """--optimizer sgd: one group over every parameter, lr --sgd-lr times the batch-size scale (and the
    run's lr schedule, as every optimizer's), momentum --sgd-momentum."""

    def build(self, model: GPT, cfg: TrainConfig, plan: Plan) -> SGD:
        names, params = zip(*model.named_parameters(), strict=True)
        return SGD([{"params": list(params), "names": list(names), "lr": cfg.sgd_lr * plan.lr_scale,
                     "momentum": cfg.sgd_momentum}])

    def state_bytes(self, cfg: TrainConfig, params: dict[str, int], world_size: int) -> StateBytes:
        """One fp32 momentum buffer per parameter on every rank, none with --sgd-momentum 0 (SGD then
        keeps no state at all); gradients are reduced in place, so no step buffers; rank 0 saves the
        one copy."""
        momentum = 4 * params["total"] if cfg.sgd_momentum else 0
        return StateBytes(state=momentum, step_buffers=0, saved=momentum)


SPEC = SGDSpec()
