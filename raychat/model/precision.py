"""Which number formats a run computes in (--dtype, --fp8), decided once per device, refused early.

Master weights are always fp32 (the optimizer updates them); `--dtype` sets the activation dtype
and `--fp8` additionally runs the transformer's large matmuls in float8 (raychat/model/fp8.py).

auto picks bf16 on CUDA SM80+ (Ampere and later: native bf16 tensor cores) and on CPUs with native
bf16 instructions (avx512_bf16 or amx_bf16 among /proc/cpuinfo's flags), fp32 elsewhere. Both CPU
rules were measured (bench/RESULTS.md, "Precision on CPU"). On a CPU with those instructions bf16
trains about twice as fast as fp32 and ends the quick start at the same val bpb. On a CPU without
them PyTorch emulates bf16 matmuls, far slower than fp32, so there `--dtype bf16` is refused. A
model built without a
precision (library use: raychat.sample, tests) computes in `auto_dtype(device)`: bf16 on CUDA SM80+.

FP8 needs CUDA SM89+ (Ada, Hopper, Blackwell: float8 tensor cores). RAYCHAT_FP8_EMULATE=1 runs
torchao's emulation instead (plain matmuls on the float8-rounded values): slow, for testing the
conversion on a CPU. Anything else is refused in one line before a worker starts.
"""

import os
from dataclasses import dataclass
from functools import cache

import torch

from raychat.common import RaychatError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)
FP8_RECIPES = ("tensorwise", "rowwise")
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bf16 instructions


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype  # activation dtype
    fp8_recipe: str | None  # None: no float8; else torchao's recipe name
    fp8_emulate: bool  # torchao emulation (no float8 hardware)

    @property
    def name(self) -> str:
        base = str(self.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
        if self.fp8_recipe is None:
            return base
        return f"{base} + fp8 {self.fp8_recipe}" + (" (emulated)" if self.fp8_emulate else "")


@cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (Linux /proc/cpuinfo; none elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return frozenset()
    return frozenset(flags)


def cpu_has_native_bf16() -> bool:
    """Whether this machine's CPU has bf16 instructions."""
    return bool(cpu_flags() & set(CPU_BF16_FLAGS))


def cpu_auto_dtype(flags: frozenset[str] | set[str]) -> tuple[torch.dtype, str]:
    """--dtype auto on a CPU with these feature flags: the dtype, and why (for the plan)."""
    native = sorted(set(flags) & set(CPU_BF16_FLAGS))
    if native:
        return torch.bfloat16, f"bf16, the CPU has native bf16 ({', '.join(native)}): about 2x fp32's tok/s"
    return torch.float32, "fp32, the CPU has no native bf16 (no avx512_bf16/amx_bf16): bf16 would be emulated"


def run_auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """--dtype auto for a run's workers on `device`: the dtype, and why."""
    if device.type == "cpu":
        return cpu_auto_dtype(cpu_flags())
    dtype = auto_dtype(device)
    return dtype, "bf16 on CUDA SM80+" if dtype == torch.bfloat16 else "fp32, no bf16 tensor cores below SM80"


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """A model's compute dtype when none is given: bf16 on CUDA SM80+, fp32 elsewhere."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return torch.bfloat16
    return torch.float32


def resolve_precision(dtype: str, fp8: bool, fp8_recipe: str, device: torch.device | str) -> Precision:
    """The precision a worker on `device` runs, or a one-line RaychatError naming the flag and the fix."""
    device = torch.device(device)
    if dtype not in DTYPE_CHOICES:
        raise RaychatError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if fp8_recipe not in FP8_RECIPES:
        raise RaychatError(f"--fp8-recipe must be one of {', '.join(FP8_RECIPES)}, got {fp8_recipe!r}")
    chosen = run_auto_dtype(device)[0] if dtype == "auto" else DTYPES[dtype]
    if chosen == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        raise RaychatError("--dtype bf16: this CPU has no native bf16 (no avx512_bf16/amx_bf16 flag), so "
                           "bf16 would be emulated and many times slower: use --dtype fp32 (or auto)")
    if not fp8:
        return Precision(chosen, None, False)
    emulate = os.environ.get("RAYCHAT_FP8_EMULATE", "0") == "1"
    capable = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if not capable and not emulate:
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            where = f"{torch.cuda.get_device_name(device)} (SM{major}{minor})"
        else:
            where = "the CPU"
        raise RaychatError(f"--fp8 needs a CUDA GPU of SM89 or newer (Ada, H100, B200); {where} has no "
                           "float8 matmuls: drop --fp8 (or set RAYCHAT_FP8_EMULATE=1 to test the conversion "
                           "slowly)")
    return Precision(chosen, fp8_recipe, emulate and not capable)


def training_device(gpus_per_worker: float) -> torch.device:
    """The device a local run's workers get: CUDA when this machine has a GPU and workers take one."""
    return torch.device("cuda" if torch.cuda.is_available() and gpus_per_worker != 0 else "cpu")


def check_precision(dtype: str, fp8: bool, fp8_recipe: str, gpus_per_worker: float) -> None:
    """The driver's check, before any worker starts. Skipped when joining a cluster (RAY_ADDRESS):
    the driver's machine is not the workers' there, and each worker runs resolve_precision itself."""
    if not os.environ.get("RAY_ADDRESS"):
        resolve_precision(dtype, fp8, fp8_recipe, training_device(gpus_per_worker))


def describe_precision(dtype: str, fp8: bool, fp8_recipe: str, gpus_per_worker: float) -> str:
    """The plan's precision line for this machine's workers (never raises: the plan also sizes runs
    meant for other machines)."""
    device = training_device(gpus_per_worker)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    try:
        chosen = resolve_precision(dtype, fp8, fp8_recipe, device).name
    except RaychatError as error:
        return f"refused on this machine ({where}): {error}"
    rule = f" (auto: {run_auto_dtype(device)[1]})" if dtype == "auto" else ""
    return f"{chosen} on {where}{rule}"


def configure_matmuls(device: torch.device) -> None:
    """TF32 for the fp32 matmuls left on CUDA (as nanochat sets it); nothing to do elsewhere."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
