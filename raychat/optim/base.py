"""The interface every optimizer of a run implements: what the worker, the step, the checkpoint and
the memory estimate ask of it, so that none of them knows which optimizer it is.

- `ShardedOptimizer` is the optimizer itself. Data parallelism is its business, not DDP's: the
  caller scales the loss by 1 / (global tokens) and `step()` SUM-reduces the gradients however the
  optimizer likes (MuonAdamW reduce-scatters them to the rank that owns each slice of the state; SGD
  all-reduces them and keeps its state whole on every rank). So it also decides which part of its
  state each rank holds, and names that state for the checkpoint world-size-independently, as
  ranges of full tensors keyed by parameter name: `owned_pieces` (what this rank writes),
  `wanted_ranges` (what it needs at the current world size) and `load_owned` (its state from them).
- `OptimizerSpec` is how a run builds one from its flags and plan, which hyperparameters besides the
  learning rate follow the step, and what its state and its step cost in memory per rank.

Every param group carries "names" (its parameters' names, the keys of the saved state), "lr" and
"initial_lr": the step sets lr = initial_lr x the schedule's multiplier for every optimizer alike.

It keeps torch.optim.Optimizer's shape (`param_groups`, `state`, `step()`) but is not one: that base
class loads TorchDynamo the first time it is built (`torch._disable_dynamo` wraps its methods):
seconds of CPU in each worker, paid again by every restart of a CPU run, where it was most of a
restart's restore on a small, busy host. A run sets the lr itself and needs nothing else of torch's
class; a compiled (GPU) run loads TorchDynamo for the model anyway.
"""

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.model.gpt import GPT
from raychat.scaling import Plan

# (parameter name, state key, full shape of that state tensor, flat start, elements or tensor)
Range = tuple[str, str, tuple[int, ...], int, int]
OwnedPiece = tuple[str, str, tuple[int, ...], int, torch.Tensor]
# read(name, key, start) -> the saved range that `wanted_ranges` listed for (name, key, start)
ReadRange = Callable[[str, str, int], torch.Tensor]


class ShardedOptimizer(ABC):
    """An optimizer that reduces gradients across ranks itself and saves and restores each rank's
    share of its state with no collective (see the module docstring)."""

    name: ClassVar[str]  # its --optimizer name: a checkpoint records it, a resume under another is refused

    def __init__(self, param_groups: list[dict]):
        """`param_groups`: dicts with "params" (a list) and the group's hyperparameters, kept as given."""
        params = [p for group in param_groups for p in group["params"]]
        if not params:
            raise ValueError("the optimizer was given no parameters")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in the optimizer's groups")
        self.param_groups = param_groups
        self.state: defaultdict[torch.Tensor, dict] = defaultdict(dict)  # per parameter, as torch's

    @abstractmethod
    def step(self) -> None:
        """One update of every parameter from its gradient, reduced across ranks here."""

    @abstractmethod
    def owned_pieces(self) -> tuple[list[OwnedPiece], dict]:
        """This rank's state ranges (views of its memory, no copy) and the plain data every rank holds
        alike: "param_groups" (the groups without their tensors), "stateful" (names of the parameters
        that have state), "steps" (per-parameter step counts, where the optimizer keeps them)."""

    @abstractmethod
    def wanted_ranges(self, stateful: list[str]) -> list[Range]:
        """The ranges of a saved state (of the parameters in `stateful`) this rank needs at the
        current world size."""

    @abstractmethod
    def load_owned(self, plain: dict, read: ReadRange) -> None:
        """Build this rank's state from what `owned_pieces` saved: `plain` as it returned it, `read`
        the ranges `wanted_ranges` listed. The groups keep this run's hyperparameters."""


@dataclass(frozen=True)
class StateBytes:
    """What an optimizer adds to one rank's memory, beside the weights and gradients (raychat.memory)."""

    state: int  # kept from step to step (moments, momenta): this rank's share
    step_buffers: int  # alive only during step() (reduction and gather buffers)
    saved: int  # of its state, what the busiest rank copies to host memory at a save


class OptimizerSpec(ABC):
    """What a run knows of an optimizer: how to build it from the flags and the plan, what it
    schedules per step besides the lr, and its memory. One instance, `SPEC`, per optimizer module."""

    @abstractmethod
    def build(self, model: GPT, cfg: TrainConfig, plan: Plan) -> ShardedOptimizer:
        """The optimizer over every parameter of `model`, its lrs already times plan.lr_scale."""

    def schedule(self, optimizer: ShardedOptimizer, cfg: TrainConfig, plan: Plan,  # noqa: B027 (a default)
                 step: int) -> None:
        """Set what follows the step besides the lr (which every optimizer's groups follow alike);
        nothing by default."""

    @abstractmethod
    def state_bytes(self, cfg: TrainConfig, params: dict[str, int], world_size: int) -> StateBytes:
        """Its memory on the busiest of `world_size` ranks, for a model with `params` counts by group
        (GPT.num_scaling_params), as built from the flags `cfg` (a hyperparameter may decide what
        state it keeps: --sgd-momentum 0 keeps none)."""


def check_saved_groups(param_groups: list[dict], saved_groups: list[dict]) -> None:
    """Saved param groups (from any world size) are these groups, by kind and parameter names:
    RaychatError naming what to do if the state was saved for another model."""
    if [(g.get("kind"), list(g["names"])) for g in saved_groups] != \
            [(g.get("kind"), list(g["names"])) for g in param_groups]:
        raise RaychatError("the optimizer state in this checkpoint has other parameter groups than this "
                           "model: resume with the saved run's model flags (--depth, --aspect-ratio, "
                           "--head-dim, ...) or start a new --run-name")
