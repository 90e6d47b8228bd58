"""The peak table looked up by the names devices really report, and MFU arithmetic (FLOPs per token
are the model's: tests/test_model.py)."""

import pytest
import torch

from raychat.model.flops import PEAK_BF16_TABLE, lookup_peak_flops, mfu, peak_flops

pytestmark = pytest.mark.unit


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
    # a typo of one order of magnitude (989e9, 2.5e16) in any entry lands outside this range
    assert all(1e13 < flops < 1e16 for _, flops in PEAK_BF16_TABLE)


def test_cpu_has_no_peak():
    assert peak_flops(torch.device("cpu")) == (None, "cpu")
    assert peak_flops("cpu") == (None, "cpu")


def test_mfu_arithmetic():
    # seed 001's RTX 4070 run: d12 (window L, nanochat's 887,098,032 FLOPs/token), ~55,700 tok/s on one
    # GPU: 887,098,032 x 55,700 / 58.3e12 = 0.84754
    percent = mfu(887_098_032, 55_700, 58.3e12, 1)
    assert percent == pytest.approx(84.754, abs=0.001)
    # 8 H100s together at 4,000,000 tok/s on a model of 1e9 FLOPs/token: 4e15 / (8 * 989e12) = 50.56%
    assert mfu(1_000_000_000, 4_000_000, 989e12, 8) == pytest.approx(50.5561, abs=1e-4)
    assert mfu(887_098_032, 55_700, None, 1) is None
