"""Every CPU attention path against a plain softmax(QK^T / sqrt(D)) V written out here in float64,
with the sliding window applied as an explicit loop-built mask; GQA included. The FlexAttention
block mask (the CUDA path) is checked too, through FlexAttention's eager CPU implementation."""

import math

import pytest
import torch

from raychat.attention import (
    _cached_mask,
    attention_backend,
    causal_attention,
    layer_masks,
    sliding_window_bool_mask,
)
from raychat.common import RaychatError


def reference_attention(q, k, v, window):
    """[B, H, T, D] float64; query i attends keys j with i - window <= j <= i; kv head of query
    head h is h // (Hq / Hkv)."""
    B, Hq, T, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            kh, vh = k[b, h // group], v[b, h // group]
            scores = q[b, h] @ kh.T / math.sqrt(D)
            for i in range(T):
                for j in range(T):
                    if not (0 <= i - j <= window):
                        scores[i, j] = -math.inf
            out[b, h] = torch.softmax(scores, dim=-1) @ vh
    return out


def random_qkv(T, n_head, n_kv_head, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n_head, T, 8, generator=g, dtype=dtype)
    k = torch.randn(2, n_kv_head, T, 8, generator=g, dtype=dtype)
    v = torch.randn(2, n_kv_head, T, 8, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("n_head,n_kv_head", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [0, 1, 5, 18, 19, 64])
def test_cpu_paths_match_reference(n_head, n_kv_head, window):
    T = 19
    q, k, v = random_qkv(T, n_head, n_kv_head)
    expected = reference_attention(q, k, v, window)
    got = causal_attention(q, k, v, window)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_float32_path_matches_reference():
    q, k, v = random_qkv(33, 4, 2, dtype=torch.float32, seed=3)
    expected = reference_attention(q.double(), k.double(), v.double(), 7)
    torch.testing.assert_close(causal_attention(q, k, v, 7).double(), expected, rtol=1e-5, atol=1e-5)


def test_bool_mask_by_hand():
    # T=4, window 1: each query sees itself and the one token before it
    expected = torch.tensor([[1, 0, 0, 0],
                             [1, 1, 0, 0],
                             [0, 1, 1, 0],
                             [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(sliding_window_bool_mask(4, 1, torch.device("cpu")), expected)
    # window 0: attention to itself only
    assert torch.equal(sliding_window_bool_mask(3, 0, torch.device("cpu")), torch.eye(3, dtype=torch.bool))


def test_window_changes_output_only_beyond_the_window():
    T, window = 24, 6
    q, k, v = random_qkv(T, 2, 2, seed=5)
    full = causal_attention(q, k, v, T)
    windowed = causal_attention(q, k, v, window)
    # queries 0..window see their whole prefix either way; later ones lose their oldest keys
    torch.testing.assert_close(windowed[:, :, : window + 1], full[:, :, : window + 1], rtol=0, atol=1e-12)
    assert (windowed[:, :, window + 1:] - full[:, :, window + 1:]).abs().amax() > 1e-3


def test_masks_are_cached_and_skipped_when_window_covers_sequence():
    cpu = torch.device("cpu")
    first = layer_masks(16, [4, 15, 100, 4], cpu)
    second = layer_masks(16, [4, 15, 100, 4], cpu)
    assert first[1] is None and first[2] is None  # window >= T - 1: every query sees its whole prefix
    assert first[0] is first[3] is second[0]  # built once per (T, window, device)
    assert first[0].shape == (16, 16) and first[0].dtype == torch.bool


def test_backend_choice(monkeypatch):
    assert attention_backend(torch.device("cpu")) == "sdpa"
    monkeypatch.setenv("RAYCHAT_ATTENTION", "flex")
    assert attention_backend(torch.device("cpu")) == "sdpa"  # no FlexAttention kernels off CUDA
    monkeypatch.delenv("RAYCHAT_ATTENTION")
    assert attention_backend(torch.device("cuda", 0)) == "flex"  # decided by name: no GPU needed
    assert attention_backend(torch.device("cuda", 0), allow_flex=False) == "sdpa"
    monkeypatch.setenv("RAYCHAT_ATTENTION", "sdpa")
    assert attention_backend(torch.device("cuda", 0)) == "sdpa"
    monkeypatch.setenv("RAYCHAT_ATTENTION", "fast")
    with pytest.raises(RaychatError, match="RAYCHAT_ATTENTION"):
        attention_backend(torch.device("cpu"))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("n_head,n_kv_head", [(4, 4), (4, 2)])
def test_flex_block_mask_matches_reference(n_head, n_kv_head):
    """The CUDA path's block mask, run through FlexAttention's eager implementation on CPU: same
    mask_mod and GQA handling as on the GPU, only the kernel differs."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    T, window = 40, 9
    q, k, v = random_qkv(T, n_head, n_kv_head, seed=7)
    block_mask = _cached_mask(T, window, torch.device("cpu"), "flex")
    assert isinstance(block_mask, BlockMask)
    got = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=n_head != n_kv_head)
    torch.testing.assert_close(got, reference_attention(q, k, v, window), rtol=1e-10, atol=1e-10)
