"""Causal self-attention with nanochat's sliding windows, on whatever device we run.

nanochat gets sliding windows from Flash Attention 3 (Hopper only, downloaded at run time) and
falls back to SDPA elsewhere. raychat downloads nothing, so it picks among PyTorch's own kernels:

- window covers the whole sequence (every `L` layer, and `S` layers when T <= window):
  SDPA with `is_causal=True`, which runs the flash / memory-efficient kernels on GPU.
- window shorter than the sequence, on CUDA: FlexAttention (compiled) with a sliding-window block
  mask, so the masked-out blocks are skipped rather than computed and thrown away.
- window shorter than the sequence, elsewhere (CPU): SDPA with an explicit boolean mask.

Window semantics are FA3's `window_size=(window, 0)`: query i sees keys j with i - window <= j <= i.
Masks are built once per (T, window, device) and cached; `layer_masks` is the one place that builds
them and is kept out of torch.compile graphs, so a compiled model takes a single graph break at the
top of forward instead of one per layer. Nothing here imports TorchDynamo until something compiles:
that import costs every process seconds, and every CLI, driver and CPU worker that imports or plans
the model would pay it.

Set RAYCHAT_ATTENTION=sdpa to use the boolean-mask path on CUDA too (a fallback if FlexAttention
misbehaves on some GPU), or RAYCHAT_ATTENTION=flex to run the CUDA path on CPU (PyTorch compiles
FlexAttention for CPU too: slower than the masked SDPA there, but it is how the tests and
`bench.gpu --dry-run` exercise the GPU code without a GPU).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from raychat.common import RaychatError

if TYPE_CHECKING:  # only for type checkers: importing flex_attention loads TorchDynamo (seconds)
    from torch.nn.attention.flex_attention import BlockMask

# bool [T, T] (SDPA), BlockMask (flex), None (plain causal)
AttentionMask = Union[Tensor, "BlockMask", None]


@functools.cache
def compiled_flex_attention():
    """FlexAttention compiled once per process (eager FlexAttention materialises the full scores).
    Created on first use, from `layer_masks`, so importing raychat stays free of torch.compile."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def attention_backend(device: torch.device, allow_flex: bool = True) -> str:
    """Which kernel serves windows shorter than the sequence on `device`: "flex" or "sdpa"."""
    choice = os.environ.get("RAYCHAT_ATTENTION", "auto").strip().lower()
    if choice not in ("auto", "flex", "sdpa"):
        raise RaychatError(f"RAYCHAT_ATTENTION must be auto, flex or sdpa, got {choice!r}")
    if choice == "sdpa" or not allow_flex:
        return "sdpa"
    return "flex" if choice == "flex" or device.type == "cuda" else "sdpa"


def sliding_window_bool_mask(seq_len: int, window: int, device: torch.device) -> Tensor:
    """[T, T] bool, True where query i may attend key j: 0 <= i - j <= window."""
    pos = torch.arange(seq_len, device=device)
    distance = pos[:, None] - pos[None, :]
    return (distance >= 0) & (distance <= window)


@functools.lru_cache(maxsize=64)
def _cached_mask(seq_len: int, window: int, device: torch.device, backend: str) -> AttentionMask:
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        compiled_flex_attention()  # build the compiled kernel here, outside any compiled caller

        def sliding_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        return create_block_mask(sliding_causal, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device)
    return sliding_window_bool_mask(seq_len, window, device)


def layer_masks(seq_len: int, windows: list[int], device: torch.device,
                allow_flex: bool = True) -> list[AttentionMask]:
    """One mask per layer for a forward pass of `seq_len` tokens (None where the window covers it all).
    Kept out of compiled graphs: under torch.compile the lookup runs through raychat.model.eager
    (imported only then: TorchDynamo is loaded by that time), so the masks enter the graph as inputs.
    allow_flex=False when T changes from call to call (generation): compiled FlexAttention
    specialises on T and would recompile for every new length."""
    if torch.compiler.is_compiling():
        from raychat.model.eager import call_eagerly

        return call_eagerly(build_layer_masks, seq_len, windows, device, allow_flex)
    return build_layer_masks(seq_len, windows, device, allow_flex)


def build_layer_masks(seq_len: int, windows: list[int], device: torch.device,
                      allow_flex: bool) -> list[AttentionMask]:
    """`layer_masks`, without regard to torch.compile."""
    device = torch.device(device)
    backend = attention_backend(device, allow_flex)
    return [None if w >= seq_len - 1 else _cached_mask(seq_len, w, device, backend) for w in windows]


def causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int, mask: AttentionMask = None) -> Tensor:
    """Causal attention over [B, H, T, D] tensors where each query sees itself and the `window`
    tokens before it. k and v may have fewer heads than q (GQA) as long as they divide them.
    `mask` is what `layer_masks` returned for this layer; it is looked up when not given."""
    seq_len = q.size(2)
    gqa = q.size(1) != k.size(1)
    if window >= seq_len - 1:  # every query already sees its whole prefix
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask is None:
        mask = layer_masks(seq_len, [window], q.device)[0]
    if isinstance(mask, Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=gqa)  # a BlockMask
