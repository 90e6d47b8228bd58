"""The plan's memory estimate (raychat.memory) against what a CPU training step really allocates.

A run sized by `python -m raychat.plan` should fit where the plan says it fits. On a GPU the check is
torch.cuda.max_memory_allocated (bench.gpu); on this CPU each configuration runs a few real optimizer
steps (bench.step's variant: the worker's model, MuonAdamW and micro-batch loop, eager, in a fresh
process) while a thread samples glibc's count of the bytes handed out (mallinfo2: heap in use plus
mmapped blocks), and compares three figures, all measured from the process's state just before the
model is built (the interpreter and torch's own libraries excluded):

  predicted   raychat.memory.plan_memory(...).peak for the same plan, dtype and eager mode
  allocated   the highest sampled count of allocated bytes: the CPU's max_memory_allocated
  rss         peak resident memory (ru_maxrss): allocated plus the freed heap pages glibc keeps

The target (issue 19) is the prediction within 15% of the measured peak. It holds against the
allocated bytes; RSS sits above them by what the allocator retains, which depends on the order of
frees and is not a property of the model (bench/RESULTS.md, "Memory", has both).

    python -m bench.memory                      # configurations A, B, A with 2 micro-batches (~2 min)
    python -m bench.memory --configs d4x4/4096 --dtypes bf16,fp32
    python -m bench.memory --quick              # a tiny model, seconds

The numbers go to $OUT/memory.json when $OUT is set, else bench/out/memory.json.
"""

import argparse
import ctypes
import json
import os
import resource
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.step import CPU_CONFIGS, QUICK_CPU, REPO_ROOT, BenchConfig, parse_configs, run_child, run_variant
from raychat.common import RaychatError, run_cli
from raychat.memory import plan_memory

TARGET = 0.15
DEFAULT_CONFIGS = "A,B,d4x4/4096"  # d4x4/4096 is A in two micro-batches: gradients live through a forward


class _MallInfo2(ctypes.Structure):
    FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
              "keepcost")
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]


def allocated_bytes_counter():
    """A function returning the bytes glibc has handed out (heap in use + mmapped), or a RaychatError."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError) as error:
        raise RaychatError(f"bench.memory needs glibc 2.33+ (mallinfo2) to count allocated bytes: {error}") \
            from None
    mallinfo2.restype = _MallInfo2

    def allocated() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd
    return allocated


class PeakSampler:
    """Samples a counter from a thread every `interval_s` and keeps its highest value."""

    def __init__(self, counter, interval_s: float = 2e-4):
        self.counter, self.interval_s, self.peak = counter, interval_s, counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.counter())
            time.sleep(self.interval_s)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.counter())


def child_main(spec: dict) -> int:
    torch.set_num_threads(spec["threads"])
    config = BenchConfig(**spec["config"])
    counter = allocated_bytes_counter()
    allocated_before = counter()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with PeakSampler(counter) as sampler:
        result = run_variant(config, "eager", "cpu", spec["steps"], 1, time.time(), spec["dtype"],
                             log=lambda message: print(message, file=sys.stderr, flush=True),
                             matmul_ceiling=False)
    _, plan = config.plan()
    estimate = plan_memory(plan, compute_bytes=2 if result["dtype"] == "bf16" else 4, compiled=False)
    out = {"config": config.name, "describe": config.describe(), "dtype": result["dtype"],
           "micro_batches": result["micro_batches"], "threads": spec["threads"],
           "predicted_bytes": estimate.peak, "estimate": estimate.to_json(),
           "allocated_peak_bytes": sampler.peak - allocated_before,
           "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before}
    out["predicted_vs_allocated"] = out["predicted_bytes"] / out["allocated_peak_bytes"]
    out["predicted_vs_rss"] = out["predicted_bytes"] / out["rss_peak_bytes"]
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def measure(config: BenchConfig, dtype: str, steps: int, threads: int) -> dict:
    """One configuration in a fresh interpreter (so its peaks are its own)."""
    spec = {"config": asdict(config), "dtype": dtype, "steps": steps, "threads": threads}
    return run_child("bench.memory", spec, f"the {config.name} {dtype} run")


def describe(row: dict) -> str:
    mb = {key: row[key] / 1e6 for key in ("predicted_bytes", "allocated_peak_bytes", "rss_peak_bytes")}
    return (f"{row['config']} [{row['dtype']}] {row['describe']}, {row['micro_batches']} micro-batch(es): "
            f"predicted {mb['predicted_bytes']:,.0f} MB, allocated {mb['allocated_peak_bytes']:,.0f} MB "
            f"({row['predicted_vs_allocated']:.2f}x; within {TARGET:.0%}: "
            f"{'yes' if row['within_target'] else 'NO'}), peak RSS {mb['rss_peak_bytes']:,.0f} MB "
            f"({row['predicted_vs_rss']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="CPU configurations: A, B or specs "
                        f"dDEPTHxBATCH[/TOTAL] at head-dim 64, T 512 (default {DEFAULT_CONFIGS})")
    parser.add_argument("--dtypes", default="auto", help="auto, bf16, fp32, comma-separated (default auto)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps after one warm-up (default 2; "
                        "the optimizer's state exists from the first step on)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: glibc's count "
                        "covers the main arena, where a single-threaded step allocates everything)")
    parser.add_argument("--quick", action="store_true", help="a tiny model (d2, T 128, vocab 4096)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))
    configs = [QUICK_CPU] if args.quick else parse_configs(args.configs, CPU_CONFIGS, CPU_CONFIGS["A"])
    rows = []
    for config in configs:
        for dtype in filter(None, (d.strip() for d in args.dtypes.split(","))):
            row = measure(config, dtype, args.steps, args.threads)
            row["within_target"] = abs(row["predicted_vs_allocated"] - 1) <= TARGET
            rows.append(row)
            print(describe(row), flush=True)
    out_dir = Path(os.environ.get("OUT") or Path(REPO_ROOT) / "bench" / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (out_dir / "memory.json").write_text(json.dumps({"date": date, "torch": torch.__version__, "rows": rows},
                                                    indent=1))
    print(f"wrote {out_dir / 'memory.json'}")
    return 0


if __name__ == "__main__":
    run_cli(main)
