"""FLOPs per token worked out by hand for d12, the peak table looked up by the names devices really
report, and MFU arithmetic."""

import pytest
import torch

from raychat.flops import PEAK_BF16_FLOPS, flops_per_token, lookup_peak_flops, mfu, peak_flops
from raychat.model import GPTConfig, gpt_config


def d12(window_pattern: str) -> GPTConfig:
    return gpt_config(12, 64, 128, 2048, 32768, window_pattern)


def test_d12_flops_per_token_by_hand():
    V, C, L, H, D, T = 32768, 768, 12, 6, 128, 2048
    # matmul weights: the blocks (q, k, v, proj = 4C^2; MLP = 8C^2) + the 6 ve gates (12 x 6) + lm_head.
    # Excluded as nanochat does: wte, value embeddings and the 50 scalars (lookups / elementwise).
    matmul_params = L * 12 * C * C + 6 * 12 * H + C * V
    assert matmul_params == 110_100_912
    attention_full = L * 12 * H * D * T
    assert flops_per_token(d12("L")) == 6 * matmul_params + attention_full == 887_097_888
    # SSSL: layers 3, 7, 11 see T = 2048, the other nine a window of 2048 / 4 = 512
    attention_sssl = 12 * H * D * (9 * 512 + 3 * 2048)
    assert flops_per_token(d12("SSSL")) == 6 * matmul_params + attention_sssl == 759_695_904


def test_window_longer_than_sequence_counts_the_sequence():
    # T = 256: the short window rounds up to 128 (< T) and counts as 128; T = 100: S = 128 > T counts T
    small = GPTConfig(sequence_len=256, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32,
                      window_pattern="S")
    tiny = GPTConfig(sequence_len=100, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32,
                     window_pattern="S")
    matmul = 2 * 12 * 32 * 32 + 12 * 2 + 32 * 64  # blocks, one ve gate (layer 1), lm_head
    assert flops_per_token(small) == 6 * matmul + 12 * 2 * 16 * (128 + 256)
    assert flops_per_token(tiny) == 6 * matmul + 12 * 2 * 16 * (100 + 100)


@pytest.mark.parametrize("device_name,expected", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA H800", 989e12),
    ("NVIDIA H20", 148e12),
    ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA B200", 2.25e15),
    ("NVIDIA GB200", 2.5e15),
    ("NVIDIA L4", 121e12),
    ("NVIDIA L40S", 362e12),
    ("NVIDIA L40", 181e12),
    ("NVIDIA RTX 6000 Ada Generation", 364.2e12),
    ("NVIDIA GeForce RTX 4070", 58.3e12),
    ("NVIDIA GeForce RTX 4070 Ti SUPER", 88.2e12),
    ("NVIDIA GeForce RTX 4080", 97.5e12),
    ("NVIDIA GeForce RTX 4090", 165.2e12),
    ("NVIDIA GeForce RTX 3090", 71e12),
    ("NVIDIA GeForce RTX 5090", 209.5e12),
    ("AMD Instinct MI300X", 1307.4e12),
    ("AMD Instinct MI325X", 1307.4e12),
    ("AMD Instinct MI250X/MI250", 383e12),
])
def test_peak_table_by_real_device_names(device_name, expected):
    assert lookup_peak_flops(device_name) == expected


@pytest.mark.parametrize("device_name", [
    "NVIDIA GeForce RTX 4070 Laptop GPU",   # desktop name, far lower clocks: measure instead
    "NVIDIA RTX A4000",                     # must not be caught by "A40"
    "Tesla T4",
    "NVIDIA A10G",
])
def test_unknown_devices_are_not_guessed(device_name):
    assert lookup_peak_flops(device_name) is None


def test_table_entries_are_dense_bf16_figures():
    assert PEAK_BF16_FLOPS["h100"] == 989e12 and PEAK_BF16_FLOPS["4070"] == 58.3e12
    assert all(1e13 < flops < 1e16 for flops in PEAK_BF16_FLOPS.values())


def test_cpu_has_no_peak():
    assert peak_flops(torch.device("cpu")) == (None, "cpu")
    assert peak_flops("cpu") == (None, "cpu")


def test_mfu_arithmetic():
    # seed 001's RTX 4070 run: d12 (window L), ~55,700 tok/s on one GPU
    percent = mfu(887_097_888, 55_700, 58.3e12, 1)
    assert percent == pytest.approx(100 * 887_097_888 * 55_700 / 58.3e12)
    assert percent == pytest.approx(84.75, abs=0.01)
    # 8 H100s together at 4,000,000 tok/s on a model of 1e9 FLOPs/token: 4e15 / (8 * 989e12) = 50.56%
    assert mfu(1_000_000_000, 4_000_000, 989e12, 8) == pytest.approx(50.5561, abs=1e-4)
    assert mfu(887_097_888, 55_700, None, 1) is None
