"""Whether the model runs under torch.compile (--compile), and a refusal before training when it cannot.

torch.compile fails late and at length: at the first forward, inside a worker, as a page of
traceback (no working C++ compiler for inductor's CPU kernels, no Triton for its CUDA ones, a
Python version dynamo does not support). Compiling one tiny function on the workers' device type
meets each of those in seconds, so the driver does it before any worker starts and a worker does it
before it builds its loader (on a cluster the driver's machine is not the workers'). The probe costs
seconds, more with a cold inductor cache on a small CPU, and runs only when compile is on.
"""

import os

import torch

from raychat.common import RaychatError
from raychat.model.precision import training_device


def uses_compile(mode: str, device: torch.device) -> bool:
    """--compile auto is on for CUDA and off on CPU (bench/RESULTS.md, "Step": eager is faster there)."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def probe_compile(device: torch.device) -> None:
    """Compile and run a tiny function on `device`; a one-line RaychatError naming --compile if that fails."""
    try:
        torch.compile(lambda x: torch.nn.functional.gelu(x) * 2, dynamic=False)(torch.ones(8, device=device))
    except Exception as error:  # dynamo and inductor raise many types; each means "cannot compile here"
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = lines[0] if lines else type(error).__name__
        raise RaychatError(f"--compile: torch.compile does not work on this machine's {device.type} "
                           f"({reason}); run with --compile off") from None


def check_compile(mode: str, gpus_per_worker: float) -> bool:
    """The driver's check for a local run; False when it did not probe (joining a cluster: RAY_ADDRESS,
    where the workers' machines may differ from this one), so the workers probe instead."""
    device = training_device(gpus_per_worker)
    if os.environ.get("RAY_ADDRESS"):
        return False
    if uses_compile(mode, device):
        print(f"Checking that torch.compile works on {device.type} (--compile {mode})...", flush=True)
        probe_compile(device)
    return True


def seconds_compiling() -> float:
    """Seconds this process has spent in torch.compile so far, by TorchDynamo's own account (a private
    API, read here only: 0.0 where a torch release lacks it). The difference across a step is what
    the step spent compiling, which the time ledger counts as `compile`, not as training."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("entire_frame_compile", 0.0))
    except Exception:  # noqa: BLE001 -- a private API: its absence costs the split, never a step
        return 0.0
