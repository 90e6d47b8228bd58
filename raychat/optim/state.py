"""MuonAdamW's state as the ranges each rank owns: saved and restored with no collective.

`state_dict()` gathers every shard into full tensors on every rank; a checkpoint does not need
that. `owned_pieces` lists the ranges of the canonical state this rank holds (its AdamW shards,
rank 0 also the replicated remainders; the Muon momenta of the matrices it owns), as
(parameter name, state key, full shape, flat start, tensor) views of its own memory; `wanted_ranges`
lists the ranges a rank needs at the current world size, and `load_owned` builds the state from
them. The canonical names and shapes are those of `state_dict()`, so both ways agree.
"""

from collections.abc import Callable

import torch

from raychat.common import RaychatError
from raychat.optim.muon_adamw import MuonAdamW
from raychat.optim.shards import (
    adam_slots,
    adamw_shard_numel,
    muon_buffers,
    muon_chunk,
    state_shapes,
    world_and_rank,
)

# (parameter name, state key, full shape of that state tensor, flat start, elements or tensor)
Range = tuple[str, str, tuple[int, ...], int, int]
OwnedPiece = tuple[str, str, tuple[int, ...], int, torch.Tensor]


def _adamw_runs(numel: int, world: int, rank: int) -> list[tuple[int, int]]:
    """(start, length) of the runs rank updates: its shard, then the replicated rest (the layout
    of raychat.optim.shards.adam_slots)."""
    shard = adamw_shard_numel(numel, world)
    runs = [(rank * shard, shard), (shard * world, numel - shard * world)]
    return [(start, length) for start, length in runs if length]


def _owned_matrices(group: dict, world: int, rank: int) -> range:
    chunk = muon_chunk(len(group["params"]), world)
    return range(rank * chunk, min(len(group["params"]), (rank + 1) * chunk))


def owned_pieces(optimizer: MuonAdamW) -> tuple[list[OwnedPiece], dict]:
    """This rank's state ranges (views, no copy) and the plain data every rank holds alike."""
    world, rank = optimizer._check_layout()
    pieces: list[OwnedPiece] = []
    groups = [{key: value for key, value in g.items() if key != "params"} for g in optimizer.param_groups]
    plain: dict = {"param_groups": groups, "steps": {}, "stateful": []}
    for group in optimizer.param_groups:
        if group["kind"] == "adamw":
            for name, p in zip(group["names"], group["params"], strict=True):
                slots = optimizer.state[p].get("slots")
                if not slots:
                    continue
                plain["stateful"].append(name)
                plain["steps"][name] = int(slots[0].step.item())
                sharded = adamw_shard_numel(p.numel(), world) * world
                for slot in slots:
                    if slot.start < sharded or rank == 0:  # a replicated run is written once, by rank 0
                        pieces += [(name, "exp_avg", tuple(p.shape), slot.start, slot.exp_avg),
                                   (name, "exp_avg_sq", tuple(p.shape), slot.start, slot.exp_avg_sq)]
            continue
        state = optimizer.state[group["params"][0]]
        if not state:
            continue
        plain["stateful"] += group["names"]
        owned = _owned_matrices(group, world, rank)
        shapes = state_shapes("muon", group["params"][0].shape)
        for row, i in enumerate(owned):
            for key, shape in shapes.items():
                pieces.append((group["names"][i], key, shape, 0, state[key][row]))
    return pieces, plain


def wanted_ranges(optimizer: MuonAdamW, stateful: list[str]) -> list[Range]:
    """The ranges of the saved state this rank needs at the current world size."""
    world, rank = world_and_rank()
    has_state = set(stateful)
    ranges: list[Range] = []
    for group in optimizer.param_groups:
        if group["kind"] == "adamw":
            for name, p in zip(group["names"], group["params"], strict=True):
                if name in has_state:
                    for start, length in _adamw_runs(p.numel(), world, rank):
                        ranges += [(name, key, tuple(p.shape), start, length)
                                   for key in ("exp_avg", "exp_avg_sq")]
        elif group["names"][0] in has_state:
            shapes = state_shapes("muon", group["params"][0].shape)
            for i in _owned_matrices(group, world, rank):
                ranges += [(group["names"][i], key, shape, 0, shape[0] * shape[1])
                           for key, shape in shapes.items()]
    return ranges


def _check_groups(optimizer: MuonAdamW, saved_groups: list[dict]) -> None:
    if [(g["kind"], list(g["names"])) for g in saved_groups] != \
            [(g["kind"], list(g["names"])) for g in optimizer.param_groups]:
        raise RaychatError("the optimizer state in this checkpoint has other parameter groups than this "
                           "model: resume with the saved run's model flags (--depth, --aspect-ratio, "
                           "--head-dim, ...) or start a new --run-name")


@torch.no_grad()
def load_owned(optimizer: MuonAdamW, plain: dict, read: Callable[[str, str, int], torch.Tensor]) -> None:
    """Build this rank's state: `read(name, key, start)` returns the range `wanted_ranges` listed
    for (name, key, start); `plain` is what `owned_pieces` returned beside the pieces."""
    _check_groups(optimizer, plain["param_groups"])
    world, rank = world_and_rank()
    optimizer._layout = (world, rank)
    optimizer.state.clear()
    has_state = set(plain["stateful"])
    # Only the state is restored: the groups keep the hyperparameters this run was built with
    # (learning rates and their scale, betas, eps, weight decay), so a rerun with lower rates after a
    # NaN, or another batch size, trains with what it asked for from this step on.
    for group in optimizer.param_groups:
        if group["kind"] == "adamw":
            for name, p in zip(group["names"], group["params"], strict=True):
                if name in has_state:
                    slots = adam_slots(p, world, rank, step=plain["steps"][name])
                    for slot in slots:
                        slot.exp_avg.copy_(read(name, "exp_avg", slot.start))
                        slot.exp_avg_sq.copy_(read(name, "exp_avg_sq", slot.start))
                    optimizer.state[p]["slots"] = slots
        elif group["names"][0] in has_state:
            buffers = muon_buffers(group["params"], world, rank)
            for row, i in enumerate(_owned_matrices(group, world, rank)):
                for key, buffer in buffers.items():
                    buffer[row].copy_(read(group["names"][i], key, 0).view(buffer.shape[1:]))
            optimizer.state[group["params"][0]].update(buffers)
