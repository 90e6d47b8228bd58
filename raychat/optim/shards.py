"""Which part of each parameter a rank of MuonAdamW updates, and the optimizer state it keeps for
that part: arithmetic of (size, world size) and local tensors only; the collectives that move the
parts are in `raychat.optim.muon_adamw`.

No world size has to divide a tensor dim:
- an AdamW tensor is cut into `world` equal shards (64-element aligned, so the fused kernel treats
  every element as it would unsharded); the few elements left over, and whole tensors under
  SHARD_MIN_NUMEL, are replicated: reduced by one coalesced all-reduce and updated on every rank.
  Nothing large is padded or copied: collectives read the gradient and write the parameter in place.
- a Muon group of K matrices gives each rank ceil(K / world) of them; the stack is zero-padded.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from raychat.common import RaychatError
from raychat.optim.base import check_saved_groups

# AdamW tensors smaller than this are replicated, not sharded: one coalesced all-reduce of all of
# them costs less than a reduce-scatter plus an all-gather each (nanochat's threshold).
SHARD_MIN_NUMEL = 1024
# Shard sizes are multiples of one 64-byte cache line of elements: the fused AdamW kernel vectorises
# per cache line, so an element gets the same arithmetic whichever shard it lands in.
SHARD_ALIGN = 64


def world_and_rank() -> tuple[int, int]:
    """(world size, rank) of the default process group; (1, 0) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def adamw_shard_numel(numel: int, world: int) -> int:
    """Elements of an AdamW tensor in each rank's shard; elements from shard * world on are replicated."""
    if world == 1 or numel < SHARD_MIN_NUMEL:
        return 0
    return numel // world // SHARD_ALIGN * SHARD_ALIGN


def muon_chunk(num_matrices: int, world: int) -> int:
    """Matrices of a Muon group each rank owns (rank r: [r * chunk, (r + 1) * chunk), padded)."""
    return math.ceil(num_matrices / world)


def adamw_runs(numel: int, world: int, rank: int) -> list[tuple[int, int]]:
    """(start, length) of the runs of a flattened AdamW tensor that `rank` updates: its shard, then
    the replicated rest."""
    shard = adamw_shard_numel(numel, world)
    runs = [(rank * shard, shard), (shard * world, numel - shard * world)]
    return [(start, length) for start, length in runs if length]


def owned_matrices(num_matrices: int, world: int, rank: int) -> range:
    """Indices of the matrices of a Muon group that `rank` owns (none past the group's end)."""
    chunk = muon_chunk(num_matrices, world)
    return range(rank * chunk, min(num_matrices, (rank + 1) * chunk))


def state_shapes(kind: str, shape: torch.Size) -> dict[str, tuple[int, ...]]:
    """Shapes of one parameter's tensors in the canonical state dict."""
    if kind == "adamw":
        return {"exp_avg": tuple(shape), "exp_avg_sq": tuple(shape)}
    # NorMuon's second moment is factored: per row for tall or square matrices, per column for wide
    rows, cols = shape
    factored = (rows, 1) if rows >= cols else (1, cols)
    return {"momentum_buffer": (rows, cols), "second_momentum_buffer": factored}


def check_saved_state(param_groups: list[dict], state_dict: dict) -> None:
    """A canonical state dict (MuonAdamW.state_dict(), from any world size) fits these groups:
    RaychatError naming what to do if it was saved for another model."""
    check_saved_groups(param_groups, state_dict["param_groups"])
    saved_state = state_dict["state"]
    for group in param_groups:
        for name, p in zip(group["names"], group["params"], strict=True):
            for key, shape in state_shapes(group["kind"], p.shape).items():
                found = tuple(saved_state[name][key].shape) if name in saved_state else shape
                if found != shape:
                    raise RaychatError(f"optimizer state {name}.{key} is {found} in the checkpoint, "
                                       f"expected {shape}: resume with the saved run's model flags or "
                                       "start a new --run-name")


@dataclass
class AdamSlot:
    """A contiguous run of a flattened AdamW parameter that this rank updates, with its state."""
    start: int
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: Tensor  # 0-D float32 on the parameter's device, as the fused kernel wants it

    def of(self, tensor: Tensor) -> Tensor:
        """This run of `tensor` (a parameter, its gradient, or a full state tensor), flat."""
        return tensor.view(-1)[self.start:self.start + self.exp_avg.numel()]


def adam_slots(p: Tensor, world: int, rank: int, full: dict[str, Tensor] | None = None,
               step: int = 0) -> list[AdamSlot]:
    """This rank's runs of `p` (its shard, then the replicated rest), state cut from `full`
    (whole-tensor exp_avg and exp_avg_sq) or zeros."""
    slots = []
    for start, length in adamw_runs(p.numel(), world, rank):
        step_t = torch.tensor(float(step), dtype=torch.float32, device=p.device)
        slot = AdamSlot(start, torch.zeros(length, device=p.device, dtype=p.dtype),
                        torch.zeros(length, device=p.device, dtype=p.dtype), step_t)
        if full is not None:
            slot.exp_avg.copy_(full["exp_avg"].reshape(-1)[start:start + length])
            slot.exp_avg_sq.copy_(full["exp_avg_sq"].reshape(-1)[start:start + length])
        slots.append(slot)
    return slots


def muon_buffers(params: list[Tensor], world: int, rank: int,
                 full: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Momentum buffers of the matrices of a Muon group (same-shape `params`) this rank owns (zero
    rows past the group's end), cut from `full` (stacked over the whole group) or zeros."""
    chunk = muon_chunk(len(params), world)
    kw = {"device": params[0].device, "dtype": params[0].dtype}
    shapes = state_shapes("muon", params[0].shape)
    buffers = {key: torch.zeros(chunk, *shape, **kw) for key, shape in shapes.items()}
    if full is not None:
        for key, buffer in buffers.items():
            owned = full[key][rank * chunk:(rank + 1) * chunk]
            buffer[:len(owned)].copy_(owned)
    return buffers
