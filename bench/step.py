"""Training-step speed of raychat's model and optimizer: forward + backward + optimizer tokens/sec.

One step is exactly what a raychat worker runs per optimizer step with one worker: the step's rows
cut into micro-batches of --device-batch-size, loss summed and scaled by the global token count,
backward, MuonAdamW.step(), zero_grad, one host sync for the loss. Batches are random token ids
(the speed of a dense step does not depend on which ids they are), so no corpus is needed.

Each (configuration, eager|compile) variant runs in a fresh Python process, so compile time, the
inductor cache (a fresh one per invocation: cold; with --warm a second compiled run reuses it) and
peak RSS belong to that variant alone. Per variant it prints: steady-state tokens/sec (median step,
first --warmup steps excluded), the median forward+backward and optimizer-step times, the time from
launching the process to the end of the first step, and the first step's own duration (for a
compiled model: mostly compilation).

Ratios, each between two figures measured in this invocation on this machine: compiled vs eager
steady state, bf16 vs fp32, each against the step's matmul-only ceiling. nanochat's own figures for
configurations A and B (NANOCHAT_TOK_PER_SEC below) were measured on another host: they are printed
as labelled references, never divided by (figures from two machines make no ratio; nanochat's code
timed in the same window as this script is the comparison, bench/RESULTS.md).

    python -m bench.step                         # configurations A and B, eager and compiled (~15 min)
    python -m bench.step --quick                 # smoke test: a tiny model, 2 steps per variant
    python -m bench.step --configs A --modes eager --steps 20
    python -m bench.step --configs d8x16/16384   # depth 8, device batch 16, total batch 16384 tokens
    python -m bench.step --warm                  # also a compiled run with a warm inductor cache
    python -m bench.step --dtypes fp32,bf16      # each variant in both dtypes (bf16 vs fp32 ratios)

The GPU measurements (d12/d20, MFU, FlexAttention, FP8) are `python -m bench.gpu`, which runs its
variants through `launch` here.
"""

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import torch

from raychat.common import RaychatError, run_cli
from raychat.config import TrainConfig
from raychat.model.flops import mfu, peak_flops
from raychat.model.gpt import build_model
from raychat.model.precision import DTYPES, Precision, auto_dtype
from raychat.optim.muon_adamw import build_optimizer
from raychat.scaling import Plan, micro_batch_sizes, resolve_plan

# nanochat's own base_train at configurations A and B, measured 2026-11-30 on another host (2 cores
# without bf16 instructions, torch 2.13.0 CPU, compiled): median tok/s and seconds to the first step
# with a cold / warm compile cache. Printed as references with that label, never divided by.
NANOCHAT_MEASURED = "nanochat base_train, 2026-11-30, another host (2 cores without bf16, torch 2.13.0 CPU)"
NANOCHAT_TOK_PER_SEC = {"A": 1370, "B": 780}
NANOCHAT_FIRST_STEP_S = {"A": (65, 11), "B": (92, 30)}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # children run `-m bench.step`


@dataclass(frozen=True)
class BenchConfig:
    name: str
    depth: int
    device_batch_size: int
    total_batch_size: int   # tokens per optimizer step; -1 = the scaling rule's auto batch
    max_seq_len: int = 512
    head_dim: int = 64
    window_pattern: str = "L"
    vocab_size: int = 32768

    def plan(self) -> tuple[TrainConfig, Plan]:
        """The run this configuration is (one worker, a nominal horizon) and its resolved plan."""
        cfg = TrainConfig(depth=self.depth, head_dim=self.head_dim, max_seq_len=self.max_seq_len,
                          window_pattern=self.window_pattern, device_batch_size=self.device_batch_size,
                          total_batch_size=self.total_batch_size, vocab_size=self.vocab_size,
                          num_iterations=1000)
        return cfg, resolve_plan(cfg, self.vocab_size)

    def describe(self) -> str:
        total = "auto" if self.total_batch_size == -1 else f"{self.total_batch_size}"
        return (f"d{self.depth}, head-dim {self.head_dim}, window {self.window_pattern}, "
                f"T {self.max_seq_len}, device batch {self.device_batch_size}, total batch {total}, "
                f"vocab {self.vocab_size}")


# The reference CPU configurations (A, B); nanochat's GPU shapes for MFU; the --quick stand-ins
# (two micro-batches per step, so gradient accumulation is exercised too).
CPU_CONFIGS = {
    "A": BenchConfig("A", depth=4, device_batch_size=8, total_batch_size=4096),
    "B": BenchConfig("B", depth=6, device_batch_size=32, total_batch_size=16384),
}
QUICK_CPU = BenchConfig("quick", depth=2, device_batch_size=2, total_batch_size=512, max_seq_len=128,
                        vocab_size=4096)

CUSTOM_SPEC = re.compile(r"d(\d+)x(\d+)(?:/(\d+))?$")


def parse_configs(text: str, named: dict[str, BenchConfig], base: BenchConfig) -> list[BenchConfig]:
    """Comma-separated names from `named`, or specs dDEPTHxBATCH[/TOTAL] built on `base`'s shape."""
    configs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        if item in named:
            configs.append(named[item])
            continue
        match = CUSTOM_SPEC.match(item)
        if not match:
            raise RaychatError(f"unknown configuration {item!r}: use {', '.join(named)} or a spec like "
                               "d8x16 (depth 8, device batch 16) or d8x16/16384 (total batch 16384 tokens)")
        depth, batch = int(match[1]), int(match[2])
        total = int(match[3]) if match[3] else batch * base.max_seq_len
        configs.append(replace(base, name=item, depth=depth, device_batch_size=batch, total_batch_size=total))
    return configs


# ----------------------------------------------------------------------------------------------------
# One variant, in its own process


def matmul_floor_s(model: torch.nn.Module, rows_per_micro_batch: list[int], dtype: torch.dtype,
                   device: torch.device) -> float:
    """Seconds one optimizer step spends in its Linear layers' matmuls alone, timed here at the step's
    own shapes: per micro-batch of N rows and per Linear (out x in), the forward N x in @ in x out and
    the backward's grad-input and grad-weight products, each at the BLAS's full speed on contiguous
    inputs. Attention, elementwise work and the optimizer are left out, so no implementation of this
    model can take less time per step on this machine: tokens / this is a ceiling on tok/s."""
    shapes: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            shapes[tuple(module.weight.shape)] = shapes.get(tuple(module.weight.shape), 0) + 1
    total = 0.0
    for n in set(rows_per_micro_batch):
        for (out_features, in_features), count in shapes.items():
            x = torch.randn(n, in_features, dtype=dtype, device=device)
            w = torch.randn(out_features, in_features, dtype=dtype, device=device)
            g = torch.randn(n, out_features, dtype=dtype, device=device)
            products = ((x, w.t()), (g, w), (g.t(), x))  # forward, grad input, grad weight
            for a, b in products:
                torch.mm(a, b)  # warm-up: first-touch pages, BLAS thread start
            start = time.perf_counter()
            for a, b in products:
                torch.mm(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            total += (time.perf_counter() - start) * count * rows_per_micro_batch.count(n)
    return total


def run_variant(config: BenchConfig, mode: str, device_name: str, steps: int, warmup: int,
                launched_at: float, dtype: str = "auto", fp8_recipe: str | None = None, log=print,
                matmul_ceiling: bool = True) -> dict:
    """Build the model and optimizer as a raychat worker does, run warmup + steps optimizer steps on
    random batches, return the timings (seconds) and the first losses. dtype: auto, bf16 or fp32
    (not checked against the CPU: the bench measures what the trainer refuses); fp8_recipe: torchao's
    float8 training, emulated off CUDA; matmul_ceiling: also time the step's matmuls alone on the CPU
    (`matmul_floor_s`: its [rows, vocab] operands would dominate a memory measurement)."""
    device = torch.device(device_name)
    precision = Precision(auto_dtype(device) if dtype == "auto" else DTYPES[dtype], fp8_recipe,
                          fp8_emulate=device.type != "cuda")
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    cfg, plan = config.plan()
    T = config.max_seq_len
    torch.manual_seed(0)
    build_start = time.perf_counter()
    model = build_model(plan.model, device, precision)
    scale = plan.lr_scale
    optimizer = build_optimizer(model, embedding_lr=cfg.embedding_lr * scale,
                                unembedding_lr=cfg.unembedding_lr * scale, matrix_lr=cfg.matrix_lr * scale,
                                scalar_lr=cfg.scalar_lr * scale, weight_decay=plan.weight_decay)
    step_model = torch.compile(model, dynamic=False) if mode == "compile" else model
    sync()
    build_s = time.perf_counter() - build_start

    rows = plan.rows_per_step
    slices, offset = [], 0
    for size in micro_batch_sizes(rows, config.device_batch_size):
        slices.append(slice(offset, offset + size))
        offset += size
    inv_global_tokens = 1.0 / (rows * T)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):  # alternate two batches so no step can reuse anything of the previous one
        tokens = torch.randint(0, config.vocab_size, (rows, T + 1), generator=generator)
        batches.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))

    def one_step(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        """(forward+backward seconds, optimizer seconds, loss) of one optimizer step."""
        start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for sl in slices:
            loss = step_model(x[sl], y[sl], loss_reduction="sum")
            (loss * inv_global_tokens).backward()
            loss_sum += loss.detach()
        sync()
        middle = time.perf_counter()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        loss_value = loss_sum.item() * inv_global_tokens
        return middle - start, time.perf_counter() - middle, loss_value

    fwd_bwd, optim, losses = [], [], []
    first_step_s = first_step_done_at = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            usage_before = resource.getrusage(resource.RUSAGE_SELF)
        f, o, loss = one_step(*batches[i % 2])
        if i == 0:
            first_step_s, first_step_done_at = f + o, time.time()
            log(f"  {config.name} {mode}: first step {first_step_s:.1f}s, loss {loss:.4f}")
        if i >= warmup:
            fwd_bwd.append(f)
            optim.append(o)
        losses.append(loss)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    step_s = [f + o for f, o in zip(fwd_bwd, optim, strict=True)]
    result = {
        "config": asdict(config), "mode": mode, "device": str(device), "threads": torch.get_num_threads(),
        "dtype": precision.name, "steps": steps,
        "total_batch_size": plan.total_batch_size, "micro_batches": len(slices),
        "params": plan.params["total"], "flops_per_token": plan.flops_per_token,
        "build_s": build_s, "first_step_s": first_step_s, "to_first_step_s": first_step_done_at - launched_at,
        "step_s_median": statistics.median(step_s), "step_s_min": min(step_s),
        "fwd_bwd_s_median": statistics.median(fwd_bwd), "optim_s_median": statistics.median(optim),
        "tok_per_sec": plan.total_batch_size / statistics.median(step_s),
        "losses": losses[:3], "max_rss_gb": usage.ru_maxrss / 2**20,
        # CPU seconds and minor page faults per timed step: steadier than wall time on a shared machine,
        # and system time is where allocation churn (fresh pages for big temporaries) shows
        "user_s_per_step": (usage.ru_utime - usage_before.ru_utime) / steps,
        "sys_s_per_step": (usage.ru_stime - usage_before.ru_stime) / steps,
        "minor_faults_per_step": (usage.ru_minflt - usage_before.ru_minflt) / steps,
        # the first step's excess over a steady one: compilation, for a compiled model
        "compile_s": max(0.0, first_step_s - statistics.median(step_s)) if mode == "compile" else 0.0,
    }
    if matmul_ceiling and mode == "eager" and not cuda:  # the same for every mode; on GPUs MFU is the figure
        micro_rows = [sl.stop - sl.start for sl in slices]
        floor_s = matmul_floor_s(model, [n * T for n in micro_rows], precision.dtype, device)
        result.update(matmul_floor_s=floor_s, matmul_ceiling_tok_per_sec=plan.total_batch_size / floor_s)
    if cuda:
        peak, source = peak_flops(device)
        result.update(peak_flops=peak, peak_source=source, gpu=torch.cuda.get_device_name(device),
                      mfu=mfu(plan.flops_per_token, result["tok_per_sec"], peak, 1),
                      max_cuda_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30)
    return result


def child_main(spec: dict) -> int:
    if spec["threads"] > 0:
        torch.set_num_threads(spec["threads"])
    result = run_variant(BenchConfig(**spec["config"]), spec["mode"], spec["device"], spec["steps"],
                         spec["warmup"], spec["launched_at"], spec["dtype"], spec["fp8_recipe"],
                         log=lambda message: print(message, file=sys.stderr, flush=True))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def launch(config: BenchConfig, mode: str, device: str, args, cache_dir: str, dtype: str = "auto",
           fp8_recipe: str | None = None, env: dict[str, str] | None = None) -> dict:
    """Run one variant in a fresh interpreter with TORCHINDUCTOR_CACHE_DIR=cache_dir (and `env`)."""
    spec = {"config": asdict(config), "mode": mode, "device": device, "steps": args.steps,
            "warmup": args.warmup, "threads": args.threads, "launched_at": time.time(), "dtype": dtype,
            "fp8_recipe": fp8_recipe}
    env = {**os.environ, **(env or {}), "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    return run_child("bench.step", spec, f"the {config.name} {mode} run", env)


def run_child(module: str, spec: dict, what: str, env: dict[str, str] | None = None) -> dict:
    """`python -m module --child SPEC` in a fresh interpreter; the JSON of its last RESULT line."""
    done = subprocess.run([sys.executable, "-m", module, "--child", json.dumps(spec)], env=env,
                          stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RaychatError(f"{what} failed (exit code {done.returncode}); its error is printed above")
    return json.loads(lines[-1].removeprefix("RESULT "))



# ----------------------------------------------------------------------------------------------------
# Reporting


def describe_result(r: dict, cache: str) -> str:
    step_ms, fb_ms = 1000 * r["step_s_median"], 1000 * r["fwd_bwd_s_median"]
    opt_ms = 1000 * r["optim_s_median"]
    line = (f"{r['config']['name']:>5} {r['mode'] + (' (' + cache + ')' if cache else ''):<15} "
            f"{r['tok_per_sec']:>9,.0f} tok/s | step {step_ms:,.0f} ms = fwd+bwd {fb_ms:,.0f} + optimizer "
            f"{opt_ms:,.0f} (median of {r['steps']}, min step {1000 * r['step_s_min']:,.0f}) | first step "
            f"{r['first_step_s']:.1f}s, {r['to_first_step_s']:.1f}s after launch | "
            f"peak RSS {r['max_rss_gb']:.1f} GB | per step: CPU {r['user_s_per_step']:.2f}s user + "
            f"{r['sys_s_per_step']:.2f}s system, {r['minor_faults_per_step']:,.0f} page faults")
    if r.get("mfu") is not None:
        line += (f" | MFU {r['mfu']:.1f}% of {r['peak_flops'] / 1e12:,.0f} TFLOP/s ({r['peak_source']}, "
                 f"{r['gpu']}) | {r['max_cuda_mem_gb']:.1f} GiB on the GPU")
    return line


def compare(results: dict[tuple[str, str, str], dict], name: str, dtype: str) -> list[str]:
    """Ratios for one configuration in one dtype, both sides measured here: compiled vs eager, each vs
    the matmul-only ceiling (higher is better)."""
    lines = []
    eager, compiled = results.get((name, "eager", dtype)), results.get((name, "compile", dtype))
    if eager and compiled:
        e, c = eager["tok_per_sec"], compiled["tok_per_sec"]
        loss_gap = abs(eager["losses"][0] - compiled["losses"][0])
        lines.append(f"{name:>5} {dtype} compile vs eager, steady state: {c / e:.2f}x ({c:,.0f} vs {e:,.0f} "
                     f"tok/s); first-step loss differs by {loss_gap:.2e}")
    if eager and eager.get("matmul_ceiling_tok_per_sec"):
        ceiling = eager["matmul_ceiling_tok_per_sec"]
        reached = ", ".join(f"{mode} {r['tok_per_sec'] / ceiling:.0%}"
                            for mode, r in (("eager", eager), ("compiled", compiled)) if r)
        lines.append(f"{name:>5} {dtype} matmul-only ceiling: {ceiling:,.0f} tok/s (this step's Linear "
                     f"matmuls alone take {eager['matmul_floor_s']:.2f} s); reached: {reached}")
    return lines


def nanochat_reference(name: str) -> str | None:
    """nanochat's figure for a reference configuration, labelled with where it was measured: a
    reference to read beside this machine's figures, not a denominator."""
    if name not in NANOCHAT_TOK_PER_SEC:
        return None
    cold, warm = NANOCHAT_FIRST_STEP_S[name]
    return (f"{name:>5} reference, not a ratio: {NANOCHAT_MEASURED}: {NANOCHAT_TOK_PER_SEC[name]:,} tok/s, "
            f"first step after {cold} s cold / {warm} s warm")


def compare_dtypes(results: dict[tuple[str, str, str], dict], name: str, mode: str) -> list[str]:
    """bf16 vs fp32 for one configuration and mode: speed and the first losses."""
    bf16, fp32 = results.get((name, mode, "bf16")), results.get((name, mode, "fp32"))
    if not (bf16 and fp32):
        return []
    loss_gap = max(abs(a - b) for a, b in zip(bf16["losses"], fp32["losses"], strict=False))
    return [f"{name:>5} {mode} bf16 vs fp32: {bf16['tok_per_sec'] / fp32['tok_per_sec']:.2f}x tok/s "
            f"({bf16['tok_per_sec']:,.0f} vs {fp32['tok_per_sec']:,.0f}); first losses differ by up to "
            f"{loss_gap:.3f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="A,B", help="CPU configurations: A, B (reference) or specs "
                        "dDEPTHxBATCH[/TOTAL] at head-dim 64, T 512, window L (default: A,B)")
    parser.add_argument("--modes", default="eager,compile", help="eager, compile or both (default: both)")
    parser.add_argument("--dtypes", default="auto", help="activation dtypes, each a variant: auto, bf16, "
                        "fp32 (default: auto, what the trainer picks here)")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per variant (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, the compiling one "
                        "included (default 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's, every core; "
                        "what a lone raychat worker sets)")
    parser.add_argument("--warm", action="store_true", help="also rerun each compiled variant with the "
                        "inductor cache its cold run filled (time to first step with a warm cache)")
    parser.add_argument("--quick", action="store_true", help="smoke test: a tiny model (d2, T 128, vocab "
                        "4096, 2 micro-batches), 2 timed steps after 1 warm-up")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(json.loads(args.child))

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"eager", "compile"}:
        raise RaychatError(f"--modes must list eager and/or compile, got {args.modes!r}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or set(dtypes) - {"auto", *DTYPES}:
        raise RaychatError(f"--dtypes must list auto, bf16 and/or fp32, got {args.dtypes!r}")
    if args.steps < 1 or args.warmup < 1:
        raise RaychatError("--steps and --warmup must be at least 1 (the first step is never timed)")
    if args.quick:
        args.steps, args.warmup = 2, 1
    configs = [QUICK_CPU] if args.quick else parse_configs(args.configs, CPU_CONFIGS, CPU_CONFIGS["A"])

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads "
          f"{args.threads or torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}; "
          f"{args.steps} timed steps after {args.warmup} warm-up per variant", flush=True)
    results: dict[tuple[str, str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="raychat_bench_step_") as tmp:
        for config in configs:
            print(f"{config.name}: {config.describe()}", flush=True)
            for dtype in dtypes:
                cache_dir = os.path.join(tmp, f"inductor_{config.name}_{dtype}")
                for mode in modes:
                    r = launch(config, mode, "cpu", args, cache_dir, dtype)
                    results[(config.name, mode, dtype)] = r
                    print(f"[{r['dtype']}] " + describe_result(r, "cold cache" if mode == "compile" else ""),
                          flush=True)
                    if mode == "compile" and args.warm:
                        warm = launch(config, mode, "cpu", args, cache_dir, dtype)
                        results[(config.name, "compile-warm", dtype)] = warm
                        print(f"[{warm['dtype']}] " + describe_result(warm, "warm cache"), flush=True)

    print("\nRatios (higher is faster):")
    for config in configs:
        for dtype in dtypes:
            for line in compare(results, config.name, dtype):
                print(line)
        for mode in modes:
            for line in compare_dtypes(results, config.name, mode):
                print(line)
        if (reference := nanochat_reference(config.name)) is not None:
            print(reference)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
