"""The worker's checkpoints: what each rank saves (what it owns) and reads back (what it needs).

Save: every rank hands its saver the pieces it owns (`state_pieces`), named
world-size-independently: `model/<param>` for its 1/W of the model
(raychat.checkpoint.sharded.model_ranges) and `optim/<param>/<key>` for the optimizer state it holds
(which is the optimizer's to say: raychat.optim.base.ShardedOptimizer), with the optimizer's name, so
that a resume under another optimizer is refused. No tensor is gathered; the loop's one collective
for a save is the loader cursors' (a few kilobytes), which also gives every rank the save's token.

Resume at any W: `read_share` (local reads only, so damage found by any rank can be agreed on
before any collective) reads the rank's 1/W of the model and the optimizer ranges it will own;
`apply_share` all-gathers the model (one collective) and builds the optimizer's shards. Each byte
of the checkpoint is read by about one rank.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raychat.checkpoint.reader import CheckpointReader
from raychat.checkpoint.sharded import Piece, model_ranges, split_range
from raychat.optim.base import ShardedOptimizer
from raychat.optim.registry import check_same_optimizer


def model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def state_pieces(model: torch.nn.Module, optimizer: ShardedOptimizer, world: int, rank: int
                 ) -> tuple[list[Piece], dict]:
    """The pieces this rank owns (views of its own memory) and the optimizer's plain data."""
    state = model.state_dict()
    pieces = [Piece(f"model/{name}", tuple(state[name].shape), start,
                    state[name].detach().reshape(-1)[start:stop])
              for name, start, stop in model_ranges(model_shapes(model), world, rank)]
    owned, plain = optimizer.owned_pieces()
    pieces += [Piece(f"optim/{name}/{key}", shape, start, tensor)
               for name, key, shape, start, tensor in owned]
    return pieces, {**plain, "optimizer": optimizer.name}


@dataclass
class Share:
    """What one rank read of a checkpoint: its part of the model (flat), its optimizer ranges."""

    model: torch.Tensor
    optim: dict[tuple[str, str, int], torch.Tensor]
    plain: dict


def read_share(reader: CheckpointReader, model: torch.nn.Module, optimizer: ShardedOptimizer, world: int,
               rank: int) -> Share:
    """This rank's reads (no collective: a damaged file raises here, on this rank only). A checkpoint
    of another optimizer is refused before any read: its state has other keys and layouts."""
    if reader.extra.get("param_groups"):
        check_same_optimizer(reader.extra.get("optimizer"), optimizer.name, str(reader.directory))
    shapes = model_shapes(model)
    model_wanted = [(f"model/{name}", start, stop - start, shapes[name])
                    for name, start, stop in model_ranges(shapes, world, rank)]
    optim_wanted = optimizer.wanted_ranges(reader.extra.get("stateful", []))
    read = reader.read_many(model_wanted + [(f"optim/{name}/{key}", start, numel, shape)
                                            for name, key, shape, start, numel in optim_wanted])
    parts, optim_parts = read[:len(model_wanted)], read[len(model_wanted):]
    flat = torch.cat(parts) if parts else torch.empty(0)
    optim = {(name, key, start): part
             for (name, key, _, start, _), part in zip(optim_wanted, optim_parts, strict=True)}
    return Share(flat, optim, reader.extra)


def _gather_model(flat: torch.Tensor, total: int, world: int, device: torch.device) -> torch.Tensor:
    """Every rank's part of the model, concatenated on every rank (parts padded to one length)."""
    if world == 1:
        return flat.to(device)
    length = -(-total // world)
    send = torch.zeros(length, dtype=flat.dtype, device=device)
    send[:flat.numel()].copy_(flat)
    out = torch.empty(length * world, dtype=flat.dtype, device=device)
    dist.all_gather_single(out, send)
    return torch.cat([out[r * length:r * length + (hi - lo)]
                      for r, (lo, hi) in enumerate(split_range(total, world, r) for r in range(world))])


@torch.no_grad()
def apply_share(share: Share, model: torch.nn.Module, optimizer: ShardedOptimizer, world: int,
                device: torch.device) -> None:
    """Load the model (one all-gather) and this rank's optimizer state (collective: all ranks)."""
    shapes = model_shapes(model)
    full = _gather_model(share.model, sum(math.prod(s) for s in shapes.values()), world, device)
    state, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        state[name] = full[offset:offset + n].view(shape)
        offset += n
    model.load_state_dict(state, strict=True)
    if share.plain.get("param_groups"):
        optimizer.load_owned(share.plain, lambda name, key, start: share.optim[(name, key, start)])
