"""Every CPU attention path against a plain softmax(QK^T / sqrt(D)) V written out here in float64,
with the sliding window applied as an explicit loop-built mask; GQA included. The FlexAttention
block mask (the CUDA path) is checked too, through FlexAttention's eager CPU implementation."""

import math

import pytest
import torch
from helpers import modules_loaded_by

from raychat.common import RaychatError
from raychat.model.attention import (
    _cached_mask,
    attention_backend,
    causal_attention,
    layer_masks,
    sliding_window_bool_mask,
)


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


@pytest.mark.unit
@pytest.mark.parametrize("n_head,n_kv_head", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [0, 1, 5, 18, 19, 64])
def test_cpu_paths_match_reference(n_head, n_kv_head, window):
    T = 19
    q, k, v = random_qkv(T, n_head, n_kv_head)
    expected = reference_attention(q, k, v, window)
    got = causal_attention(q, k, v, window)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.unit
def test_float32_path_matches_reference():
    q, k, v = random_qkv(33, 4, 2, dtype=torch.float32, seed=3)
    expected = reference_attention(q.double(), k.double(), v.double(), 7)
    torch.testing.assert_close(causal_attention(q, k, v, 7).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_bool_mask_by_hand():
    # T=4, window 1: each query sees itself and the one token before it
    expected = torch.tensor([[1, 0, 0, 0],
                             [1, 1, 0, 0],
                             [0, 1, 1, 0],
                             [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(sliding_window_bool_mask(4, 1, torch.device("cpu")), expected)
    # window 0: attention to itself only
    assert torch.equal(sliding_window_bool_mask(3, 0, torch.device("cpu")), torch.eye(3, dtype=torch.bool))


@pytest.mark.unit
def test_window_changes_output_only_beyond_the_window():
    T, window = 24, 6
    q, k, v = random_qkv(T, 2, 2, seed=5)
    full = causal_attention(q, k, v, T)
    windowed = causal_attention(q, k, v, window)
    # queries 0..window see their whole prefix either way; later ones lose their oldest keys
    torch.testing.assert_close(windowed[:, :, : window + 1], full[:, :, : window + 1], rtol=0, atol=1e-12)
    assert (windowed[:, :, window + 1:] - full[:, :, window + 1:]).abs().amax() > 1e-3


@pytest.mark.unit
def test_masks_are_cached_and_skipped_when_window_covers_sequence():
    cpu = torch.device("cpu")
    first = layer_masks(16, [4, 15, 100, 4], cpu)
    second = layer_masks(16, [4, 15, 100, 4], cpu)
    assert first[1] is None and first[2] is None  # window >= T - 1: every query sees its whole prefix
    assert first[0] is first[3] is second[0]  # built once per (T, window, device)
    assert first[0].shape == (16, 16) and first[0].dtype == torch.bool


@pytest.mark.unit
def test_backend_choice(monkeypatch):
    assert attention_backend(torch.device("cpu")) == "sdpa"
    monkeypatch.setenv("RAYCHAT_ATTENTION", "flex")
    assert attention_backend(torch.device("cpu")) == "flex"  # the CUDA path, compiled for CPU
    assert attention_backend(torch.device("cpu"), allow_flex=False) == "sdpa"
    monkeypatch.delenv("RAYCHAT_ATTENTION")
    assert attention_backend(torch.device("cuda", 0)) == "flex"  # decided by name: no GPU needed
    assert attention_backend(torch.device("cuda", 0), allow_flex=False) == "sdpa"
    monkeypatch.setenv("RAYCHAT_ATTENTION", "sdpa")
    assert attention_backend(torch.device("cuda", 0)) == "sdpa"
    monkeypatch.setenv("RAYCHAT_ATTENTION", "fast")
    with pytest.raises(RaychatError, match="RAYCHAT_ATTENTION"):
        attention_backend(torch.device("cpu"))


@pytest.mark.unit
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


@pytest.mark.integration  # torch.compile: inductor runs a C++ compiler
@pytest.mark.parametrize("n_head,n_kv_head", [(4, 4), (4, 2)])
def test_compiled_flex_on_cpu_matches_masked_sdpa(monkeypatch, n_head, n_kv_head):
    """The CUDA path as the model runs it (layer_masks -> BlockMask -> compiled FlexAttention), on CPU,
    for the windows of a 4-layer SSSL model at T 256 (S = 128, the last layer L: plain causal SDPA),
    against the masked-SDPA path. fp32; measured differences ~1e-7, asserted 1e-5."""
    from raychat.model.gpt import GPTConfig, window_sizes

    T = 256
    windows = window_sizes(GPTConfig(sequence_len=T, n_layer=4, window_pattern="SSSL"))
    assert windows == [128, 128, 128, 256]
    q, k, v = random_qkv(T, n_head, n_kv_head, dtype=torch.float32, seed=11)
    sdpa_masks = layer_masks(T, windows, torch.device("cpu"))
    monkeypatch.setenv("RAYCHAT_ATTENTION", "flex")
    flex_masks = layer_masks(T, windows, torch.device("cpu"))
    assert [type(m).__name__ for m in flex_masks] == ["BlockMask"] * 3 + ["NoneType"]
    for window, flex_mask, sdpa_mask in zip(windows, flex_masks, sdpa_masks, strict=True):
        got = causal_attention(q, k, v, window, flex_mask)
        want = causal_attention(q, k, v, window, sdpa_mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the window matters here: a full causal attention differs (so the comparison can fail)
    assert (causal_attention(q, k, v, T) - causal_attention(q, k, v, 128, sdpa_masks[0])).abs().amax() > 1e-2


@pytest.mark.unit
def test_flex_block_mask_gradients_are_the_masked_sdpa_gradients():
    """PyTorch 2.13 has no FlexAttention backward on CPU (it raises), so the GPU path's gradients are
    checked through what defines them: the block mask's mask_mod, evaluated densely over all (q, kv),
    must be the SDPA bool mask, and its block table must list every block holding an allowed pair.
    Then SDPA with that mask has the SDPA path's gradients, exactly."""
    from torch.nn.attention.flex_attention import create_mask

    T, window = 384, 128
    block_mask = _cached_mask(T, window, torch.device("cpu"), "flex")
    dense = create_mask(block_mask.mask_mod, None, None, T, T, device="cpu")[0, 0]
    bool_mask = sliding_window_bool_mask(T, window, torch.device("cpu"))
    assert torch.equal(dense, bool_mask)
    blocks = block_mask.to_dense()[0, 0].bool()  # [T/128, T/128]: blocks the kernel visits
    visited = blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert not (bool_mask & ~visited).any()
    assert blocks.sum() == 5  # by hand: diagonal blocks 3 + the one below each of 2 = 5, not all 6 lower
    q, k, v = (t.requires_grad_() for t in random_qkv(T, 2, 2, dtype=torch.float32, seed=13))
    grads = []
    for mask in (dense, bool_mask):
        out = causal_attention(q, k, v, window, mask)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.integration  # a subprocess
def test_the_model_never_loads_torchdynamo():
    """TorchDynamo costs every process that loads it 1.6 s (each CLI and driver: they plan the model):
    the worker loop imported, a model built as everyone builds it (shapes on meta, then init) and an
    eager forward and backward with sliding windows must not import it. (A worker's torch.optim
    optimizer loads it anyway.)"""
    code = ("import torch, raychat.worker.loop\n"
            "from raychat.model.gpt import GPTConfig, build_model\n"
            "m = build_model(GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2,"
            " n_embd=32, window_pattern='SL'), 'cpu')\n"
            "m(torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))).backward()")
    assert not modules_loaded_by(code, "torch._dynamo"), "TorchDynamo was loaded"
