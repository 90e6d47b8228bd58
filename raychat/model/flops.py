"""Peak FLOP/s of the accelerator and MFU (model FLOPs utilisation); the FLOPs per token come from
the model (GPT.estimate_flops).

MFU divides achieved FLOP/s by the dense bf16 tensor-core peak. The table below holds datasheet
figures (dense, i.e. without 2:4 sparsity). GeForce cards run bf16 with fp32 accumulation at half
the rate NVIDIA advertises for fp16 accumulation, and training needs fp32 accumulation, so they get
the fp32-accumulate figure. A CUDA/ROCm device not in the table is measured once with a large bf16
matmul (labelled "measured", never a silent 0% or a guess); a CPU has no MFU.
"""

import functools
import re
import time

import torch

from raychat.model.precision import auto_dtype

# (words that must all occur in the device name, dense bf16 FLOP/s). Names are split into words at
# anything not a letter or digit ("NVIDIA A100-SXM4-80GB" -> nvidia a100 sxm4 80gb), so "a40" does
# not match an RTX A4000. First match wins: variants come before the plain name (h100 nvl before h100,
# 4070 ti super before 4070 ti before 4070).
PEAK_BF16_TABLE: list[tuple[tuple[str, ...], float]] = [
    # --- NVIDIA Blackwell / Grace ---
    (("gb200",), 2.5e15),          # GB200 NVL72 datasheet: 360 PFLOPS FP16/BF16 sparse / 72 GPUs / 2
    (("gh200",), 989e12),          # GH200 datasheet: 1,979 TFLOPS BF16 sparse (same Hopper GPU as H100 SXM)
    (("b200",), 2.25e15),          # HGX B200 datasheet: 4.5 PFLOPS FP16/BF16 sparse per GPU
    # --- NVIDIA Hopper ---
    (("h200", "nvl"), 835e12),     # H200 NVL datasheet: 1,671 TFLOPS BF16 sparse
    (("h200",), 989e12),           # H200 SXM datasheet: 1,979 TFLOPS BF16 sparse
    (("h100", "nvl"), 835e12),     # H100 NVL datasheet: 1,671 TFLOPS BF16 sparse
    (("h100", "pcie"), 756e12),    # H100 PCIe datasheet: 1,513 TFLOPS BF16 sparse
    (("h100",), 989e12),           # H100 SXM datasheet: 1,979 TFLOPS BF16 sparse ("NVIDIA H100 80GB HBM3")
    (("h800", "pcie"), 756e12),    # H800 PCIe: H100 PCIe compute (export variant with slower interconnect)
    (("h800",), 989e12),           # H800 SXM: H100 SXM compute (export variant with slower NVLink)
    (("h20",), 148e12),            # H20 datasheet: 148 TFLOPS BF16 dense
    # --- NVIDIA Ampere / Ada data centre and workstation ---
    (("a100",), 312e12),           # A100 datasheet: 312 TFLOPS BF16 dense (SXM and PCIe)
    (("a800",), 312e12),           # A800: A100 compute (export variant)
    (("a40",), 149.7e12),          # A40 datasheet: 149.7 TFLOPS BF16 dense
    (("a30",), 165e12),            # A30 datasheet: 165 TFLOPS BF16 dense
    (("a6000",), 154.8e12),        # RTX A6000 datasheet: 309.7 TFLOPS tensor sparse / 2
    (("6000", "ada"), 364.2e12),     # RTX 6000 Ada datasheet: 1,457 TFLOPS FP8 sparse / 4
    (("l40s",), 362e12),           # L40S datasheet: 733 TFLOPS BF16 sparse (362.05 dense)
    (("l40",), 181e12),            # L40 datasheet: 362 TFLOPS BF16 sparse (181.05 dense)
    (("l4",), 121e12),             # L4 datasheet: 242 TFLOPS BF16 sparse
    # --- NVIDIA GeForce: bf16 with fp32 accumulate, dense ---
    (("5090",), 209.5e12),         # RTX Blackwell whitepaper: RTX 5090 FP16/BF16 w/ FP32 acc 209.5 TFLOPS
    (("4090",), 165.2e12),         # Ada whitepaper: RTX 4090 BF16 w/ FP32 acc 165.2 TFLOPS
    (("4080", "super"), 104.4e12),  # derived: 80 SMs x 2.55 GHz x 512 FLOP/clk/SM (Ada fp32-acc rate)
    (("4080",), 97.5e12),          # Ada whitepaper: RTX 4080 BF16 w/ FP32 acc 97.5 TFLOPS
    (("4070", "ti", "super"), 88.2e12),  # derived: 66 SMs x 2.61 GHz x 512
    (("4070", "ti"), 80.2e12),     # derived: 60 SMs x 2.61 GHz x 512
    (("4070", "super"), 71.0e12),  # derived: 56 SMs x 2.475 GHz x 512
    (("4070",), 58.3e12),          # derived: 46 SMs x 2.475 GHz x 512 (4090 check: 128 x 2.52 x 512 = 165.2)
    (("3090", "ti"), 80.0e12),     # derived: 84 SMs x 1.86 GHz x 512 (Ampere GeForce fp32-acc rate)
    (("3090",), 71e12),            # GA102 whitepaper: RTX 3090 BF16 w/ FP32 acc 71 TFLOPS
    (("3080", "ti"), 68.2e12),     # derived: 80 SMs x 1.665 GHz x 512
    (("3080",), 59.5e12),          # GA102 whitepaper: RTX 3080 BF16 w/ FP32 acc 59.5 TFLOPS
    # --- AMD Instinct (ROCm devices report as torch "cuda") ---
    (("mi355x",), 2.5e15),         # MI355X spec sheet: 2.5 PFLOPS FP16/BF16 dense
    (("mi325x",), 1307.4e12),      # MI325X spec sheet: 1,307.4 TFLOPS BF16 dense
    (("mi300x",), 1307.4e12),      # MI300X spec sheet: 1,307.4 TFLOPS BF16 dense
    (("mi300a",), 980.6e12),       # MI300A spec sheet: 980.6 TFLOPS BF16 dense
    (("mi250x",), 383e12),         # MI250X spec sheet: 383 TFLOPS BF16 ("AMD Instinct MI250X/MI250")
    (("mi250",), 362.1e12),        # MI250 spec sheet: 362.1 TFLOPS BF16
    (("mi210",), 181e12),          # MI210 spec sheet: 181 TFLOPS BF16
]


def lookup_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak for a device name such as "NVIDIA H100 80GB HBM3"; None if not in the table.
    Laptop GPUs share names with desktop cards but run far lower clocks, so they are never looked up."""
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    if words & {"laptop", "mobile"}:
        return None
    for names, flops in PEAK_BF16_TABLE:
        if words.issuperset(names):
            return flops
    return None


@functools.cache
def _measured_peak(device: torch.device) -> float:
    """Best FLOP/s of a large square matmul in the device's compute dtype, over ~0.3 s."""
    dtype = auto_dtype(device)
    free_bytes, _ = torch.cuda.mem_get_info(device)
    n = 8192 if free_bytes > 2 * 3 * 8192 * 8192 * 4 else 4096
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):  # warm up clocks and cuBLAS heuristics
        a @ b
    torch.cuda.synchronize(device)
    best, spent = 0.0, 0.0
    while spent < 0.3:
        start = time.perf_counter()
        for _ in range(5):
            a @ b
        torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        best, spent = max(best, 5 * 2 * n**3 / elapsed), spent + elapsed
    del a, b
    torch.cuda.empty_cache()
    return best


def peak_flops(device: torch.device | str) -> tuple[float | None, str]:
    """(peak dense bf16 FLOP/s, how it was obtained): "table", "measured" (device not in the table:
    a one-off bf16 matmul benchmark of a few hundred ms), or "cpu" with None (no MFU off-GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, "cpu"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    peak = lookup_peak_flops(torch.cuda.get_device_name(device))
    if peak is not None:
        return peak, "table"
    return _measured_peak(device), "measured"


def mfu(flops_per_token: int, tokens_per_sec: float, peak: float | None, world_size: int) -> float | None:
    """MFU in percent (as nanochat's log line prints it): achieved FLOP/s over the peak of all
    workers. tokens_per_sec is the global throughput (all workers together); None without a peak."""
    if peak is None or peak <= 0:
        return None
    return 100.0 * flops_per_token * tokens_per_sec / (peak * world_size)
