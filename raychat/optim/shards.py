"""Which part of each parameter a rank of MuonAdamW updates: arithmetic of (size, world size) only,
apart from the collectives in `raychat.optim.muon_adamw` that move the parts.

No world size has to divide a tensor dim:
- an AdamW tensor is cut into `world` equal shards (64-element aligned, so the fused kernel treats
  every element as it would unsharded); the few elements left over, and whole tensors under
  SHARD_MIN_NUMEL, are replicated: reduced by one coalesced all-reduce and updated on every rank.
  Nothing large is padded or copied: collectives read the gradient and write the parameter in place.
- a Muon group of K matrices gives each rank ceil(K / world) of them; the stack is zero-padded.
"""

import math

import torch.distributed as dist

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

