"""Bits per byte on the run's validation rows (raychat.data.validation), the trainer's validation
metric.

Bits per byte, not loss, is what we compare across runs: it does not depend on the tokenizer's vocab
size. It is the sum of nats over target tokens divided by ln(2) times the sum of their UTF-8 bytes;
special tokens (0 bytes) count in neither sum, as in nanochat's evaluate_bpb.
"""

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


@torch.no_grad()
def evaluate_bpb(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 token_bytes: torch.Tensor, device: torch.device) -> float:
    """Bits per byte over `batches`, summed over all ranks when torch.distributed is initialized."""
    token_bytes = token_bytes.to(device)
    total_nats = torch.zeros((), dtype=torch.float64, device=device)
    total_bytes = torch.zeros((), dtype=torch.int64, device=device)
    for x, y in batches:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        nats = model(x, y, loss_reduction="none").reshape(-1)
        targets = y.reshape(-1)
        nbytes = torch.where(targets >= 0, token_bytes[targets.clamp(min=0)], 0)
        counted = nbytes > 0
        total_nats += nats[counted].sum(dtype=torch.float64)
        total_bytes += nbytes.sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total_nats, op=dist.ReduceOp.SUM)
        dist.all_reduce(total_bytes, op=dist.ReduceOp.SUM)
    num_bytes = total_bytes.item()
    if num_bytes == 0:
        return float("inf")
    return total_nats.item() / (math.log(2) * num_bytes)
