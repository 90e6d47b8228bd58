"""The GPU acceptance run: everything only a GPU runs, in one command that fits a 10-minute window.

    python -m bench.gpu              # on a GPU node: JSON to $OUT (else bench/out/), markdown on stdout
    python -m bench.gpu --dry-run    # every part on CPU at tiny shapes (tests/test_bench_gpu.py runs it)

Parts, in this order, each printed as it finishes and written to the JSON at once (a run cut short
still leaves what it measured); a part that would not fit the time left of --budget-s is skipped and
says so:
- process group: Ray Train's TorchTrainer (raychat's trainer, Ray's TorchConfig, raychat's timeout
  flag) on every GPU, one worker each: the group forms (NCCL, the world size), an all-reduce sums
  right, and with 2+ GPUs the all-reduce bus bandwidth as nccl-tests reports it: algbw = bytes / time,
  busbw = algbw * 2(n-1)/n (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md),
  in-place, float32 sum, the slowest rank's mean time.
- train: `python -m raychat.train` as a user runs it, on every GPU, nanochat's shape at --depth
  (head dim 128, T 2048, SSSL, device batch 32, the auto total batch), compiled, bf16, for
  --train-steps steps with a save half way and at the end: median tok/s and MFU of the steps after
  the first few, peak GPU memory, next to nanochat's own published figures for that depth
  (NANOCHAT_PUBLISHED, labelled: another code base, node and date).
- resume (2+ GPUs; skipped on one): the same command on half the GPUs with a longer horizon: it
  resumes from the first run's last checkpoint at the other world size and trains on.
- correctness: the loss of one batch at d12, bf16 compiled against fp32 eager from the same
  weights (bf16 rounding moves a loss near ln(vocab) by well under 1%; a broken kernel moves it more).
- save and resume in one process: d20 at device batch 16, two training steps, a sharded checkpoint
  saved and loaded back into a fresh model and optimizer; peak GPU memory while training and the
  extra during the save (torch.cuda.max_memory_allocated) next to the plan's estimate
  (raychat.memory), and the step after the resume bitwise equal to the step of the model that never
  stopped.
- loader: tokens/sec of raychat's TrainLoader (rank 0 of 1, Ray Data on this machine's cores)
  against bench/loader.py's nanochat-style reference loader, B 32 x T 2048, same corpus.
- steps: d12 (and d20 with --all-variants) step speed, compiled, bf16: SSSL through FlexAttention
  against L through SDPA, each with and without --fp8 (torchao tensorwise); compile time and peak
  memory per variant, each in its own process (bench.step.launch).
The corpus is $RAYCHAT_HOME/data when it holds shards, else a synthetic one written here (no network),
with a tokenizer trained on it. The dry run uses 2 CPU workers (gloo) for the process group, the
train run and its resume (2 -> 1 workers), a tiny model uncompiled, eager steps (FlexAttention has no
CPU backward in torch 2.13, so SSSL runs as masked SDPA there), torchao's emulated fp8, and compiles
only the correctness check's forward: it proves the command runs, not how fast.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.loader import ReferenceLoader, reference_documents, timed
from bench.step import REPO_ROOT, BenchConfig, launch, run_variant
from raychat.checkpoint.format import checkpoint_dir_name
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.reader import load_checkpoint
from raychat.checkpoint.sharded import save_checkpoint
from raychat.common import RaychatError, default_data_dir, default_tokenizer_dir, run_cli
from raychat.corpus.index import CorpusIndex, list_shards
from raychat.memory import estimate_memory
from raychat.model.gpt import build_model, gpt_config
from raychat.model.precision import Precision
from raychat.optim.muon_adamw import build_optimizer
from raychat.tokenizer.core import META_FILE, Tokenizer
from raychat.tokenizer.train import train_tokenizer
from testkit.gpu_report import NANOCHAT_LOG, NANOCHAT_PUBLISHED, ROW_HEADER, markdown_row
from testkit.gpu_report import pct as _pct

GPU_CONFIGS = [
    BenchConfig("d12", 12, 32, -1, max_seq_len=2048, head_dim=128, window_pattern="SSSL"),
    BenchConfig("d20", 20, 32, -1, max_seq_len=2048, head_dim=128, window_pattern="SSSL"),
]
DRY_CONFIGS = [BenchConfig("tiny", 2, 2, 2 * 2 * 256, max_seq_len=256, head_dim=64, window_pattern="SSSL",
                           vocab_size=1024)]
LOADER_SHAPE = (32, 2048)
DRY_LOADER_SHAPE = (4, 256)
CORRECTNESS_TOLERANCE = 0.01  # relative loss difference, bf16 compiled vs fp32 eager
SAVE_CONFIG = BenchConfig("d20", 20, 16, -1, max_seq_len=2048, head_dim=128, window_pattern="SSSL")

# The all-reduce sizes (bytes, float32) and timed iterations of the process-group part; nccl-tests'
# busbw approaches the links' bandwidth only at large sizes, so the largest is the headline.
ALLREDUCE_BYTES = [2**20, 2**24, 2**27, 2**30]
DRY_ALLREDUCE_BYTES = [2**16, 2**20]
ALLREDUCE_WARMUP, ALLREDUCE_ITERS = 5, 20
# The train run: nanochat's d12 shape (T 2048, head dim 128, SSSL, device batch 32, auto total batch);
# its tok/s and MFU are the medians of the steps after the first TRAIN_WARMUP_STEPS (compile, warm-up).
# The final evaluation (there is always one) reads one device batch: it is not what is measured.
TRAIN_WARMUP_STEPS = 5
TRAIN_FLAGS = ["--compile", "on", "--dtype", "bf16", "--max-seq-len", "2048", "--head-dim", "128",
               "--window-pattern", "SSSL",
               "--device-batch-size", "32", "--eval-every", "-1", "--eval-tokens", "65536",
               "--sample-every", "-1", "--core-metric-every", "-1", "--replicate-every", "-1",
               "--keep-checkpoints", "2"]
DRY_TRAIN_FLAGS = ["--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64", "--window-pattern", "L",
                   "--device-batch-size", "4", "--total-batch-size", "1024", "--eval-every", "-1",
                   "--eval-tokens", "2048", "--warmup-steps", "2", "--sample-every", "-1",
                   "--core-metric-every", "-1", "--replicate-every", "-1", "--keep-checkpoints", "2",
                   "--vocab-size", "1024"]
SYNTHETIC_DOCS, DRY_SYNTHETIC_DOCS = 40_000, 2_000
# Seconds each part is expected to take on one H100, compiles cold: a part whose estimate exceeds the
# time left of --budget-s is skipped (and says so) so that the command ends, with its JSON, in time.
ESTIMATE_S = {"process_group": 45, "train": 200, "resume": 150, "correctness": 60, "save_resume": 60,
              "loader": 45, "variant": 75}


def step_variants(configs: list[BenchConfig], device: str, steps: int, warmup: int, tmp: str,
                  dry_run: bool, fits: Callable[[], bool] = lambda: True) -> list[dict]:
    """Every (config, attention, fp8) variant: SSSL via FlexAttention and L via SDPA, fp8 off and on;
    those left when `fits()` says no more time is left are not run (and said so)."""
    args = SimpleNamespace(steps=steps, warmup=warmup, threads=0)
    results = []
    for config in configs:
        for pattern, attention in (("SSSL", "flex"), ("L", "sdpa")):
            for fp8 in (None, "tensorwise"):
                if not fits():
                    print(f"  {config.name} {pattern} fp8 {fp8 or 'off'}: skipped (time budget)", flush=True)
                    continue
                variant = replace(config, window_pattern=pattern)
                env = {"RAYCHAT_ATTENTION": "sdpa" if dry_run else attention}
                cache = os.path.join(tmp, f"inductor_{config.name}_{pattern}_{fp8}")
                if dry_run:  # in this process: four interpreter start-ups would be most of the minute
                    r = run_variant(variant, "eager", device, steps, warmup, time.time(), "auto", fp8,
                                    log=lambda _: None)
                else:
                    r = launch(variant, "compile", device, args, cache, "auto", fp8, env)
                r.update(attention=env["RAYCHAT_ATTENTION"], fp8=fp8 or "off",
                         peak_memory_gb=r.get("max_cuda_mem_gb", r["max_rss_gb"]))
                print(f"  {config.name} {pattern:<4} {r['attention']:<4} fp8 {r['fp8']:<10} "
                      f"{r['tok_per_sec']:>12,.0f} tok/s  MFU {_pct(r.get('mfu'))}  compile "
                      f"{r['compile_s']:.0f}s  peak {r['peak_memory_gb']:.1f} GB", flush=True)
                results.append(r)
    return results


def corpus(workdir: Path, dry_run: bool) -> tuple[str, str, str]:
    """(data dir, tokenizer dir, what it is): $RAYCHAT_HOME's corpus and tokenizer when it has both
    (not in a dry run), else a synthetic corpus written here (no network needed) and a tokenizer
    trained on it."""
    from raychat.corpus.fixture import write_synthetic_corpus

    data_dir, tokenizer_dir = default_data_dir(), default_tokenizer_dir()
    if not dry_run and data_dir.is_dir() and list_shards(data_dir) and (tokenizer_dir / META_FILE).is_file():
        return str(data_dir), str(tokenizer_dir), f"corpus {data_dir}"
    docs = DRY_SYNTHETIC_DOCS if dry_run else SYNTHETIC_DOCS
    data_dir, tokenizer_dir = workdir / "data", workdir / "tokenizer"
    write_synthetic_corpus(data_dir, docs, seed=0)
    train_tokenizer(data_dir, tokenizer_dir, vocab_size=1024 if dry_run else 32768, log=lambda _: None)
    return str(data_dir), str(tokenizer_dir), f"synthetic corpus ({docs:,} documents)"


def loader_rates(data_dir: str, tokenizer_dir: str, what: str, shape: tuple[int, int],
                 seconds: float) -> dict:
    """raychat's TrainLoader against the reference loader on the same corpus, rank 0 of 1, on the
    bench's Ray instance."""
    from raychat.data.loader import TrainLoader

    index = CorpusIndex.load(data_dir)
    tokenizer = Tokenizer.load(tokenizer_dir)
    B, T = shape
    reference = ReferenceLoader(reference_documents(index, tokenizer), B, T)
    _, n, ref_seconds, _, _ = timed(reference.next_batch, 1, seconds=seconds)
    with TrainLoader(index, tokenizer_dir, T, rank=0, world_size=1) as ours:
        _, _, ours_seconds, _, _ = timed(lambda: ours.next_rows(B), 2, batches=n)
    ref_rate, rate = n * B * T / ref_seconds, n * B * T / ours_seconds
    print(f"  loader B {B} x T {T} ({what}): raychat {rate / 1e6:.2f} M tok/s, reference "
          f"{ref_rate / 1e6:.2f} M tok/s ({rate / ref_rate:.2f}x), {os.cpu_count()} cores", flush=True)
    return {"B": B, "T": T, "corpus": what, "raychat_tok_per_sec": rate, "reference_tok_per_sec": ref_rate,
            "ratio": rate / ref_rate, "cores": os.cpu_count()}


def _allreduce_worker(config: dict) -> None:
    """On each Ray Train worker: the process group Ray's TorchConfig formed, an all-reduce that must sum
    to 1 + 2 + ... + n, then the bus bandwidth of in-place float32 all-reduces (nccl-tests' busbw)."""
    import ray.train
    import torch.distributed as dist
    from ray.train.torch import get_device

    context = ray.train.get_context()
    rank, n = context.get_world_rank(), context.get_world_size()
    device = get_device()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    total = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(total)
    rows = []
    for size in config["sizes"] if n > 1 else []:  # one rank moves nothing: no bandwidth to measure
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(config["warmup"]):
            dist.all_reduce(x)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(config["iters"]):
            dist.all_reduce(x)
        sync()
        seconds = torch.tensor([(time.perf_counter() - t0) / config["iters"]], device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's time: the collective's
        algbw = size / seconds.item() / 1e9
        rows.append({"bytes": size, "time_us": seconds.item() * 1e6, "algbw_gbps": algbw,
                     "busbw_gbps": algbw * 2 * (n - 1) / n})
        del x
    if rank == 0:  # a file, not ray.train.report: Ray Train's Result keeps metrics of checkpoints only
        Path(config["out"]).write_text(json.dumps({
            "backend": dist.get_backend(), "world_size": dist.get_world_size(), "device": str(device),
            "sum_ok": total.item() == n * (n + 1) / 2, "allreduce": rows}))


def process_group_check(workers: int, use_gpu: bool, sizes: list[int], iters: int, storage: str) -> dict:
    """Ray Train's TorchTrainer on `workers` workers of this node, set up as raychat's runs set it up
    (its trainer class, Ray's TorchConfig from raychat's config): the group it forms and its
    all-reduce bandwidth."""
    from ray.train import RunConfig, ScalingConfig

    from raychat.config import TrainConfig
    from raychat.run.driver import RaychatTrainer, process_group, train_logging

    cfg = TrainConfig()
    resources = {"CPU": 1.0, **({"GPU": 1.0} if use_gpu else {})}
    os.makedirs(storage, exist_ok=True)
    t0 = time.time()
    trainer = RaychatTrainer(
        _allreduce_worker, train_loop_config={"sizes": sizes, "iters": iters, "warmup": ALLREDUCE_WARMUP,
                                              "out": os.path.join(storage, "process_group.json")},
        torch_config=process_group(cfg),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=RunConfig(name="bench_gpu_process_group", storage_path=storage,
                             logging_config=train_logging()))
    trainer.fit()
    found = json.loads(Path(storage, "process_group.json").read_text())
    expected = "nccl" if use_gpu else "gloo"
    ok = found["backend"] == expected and found["world_size"] == workers and found["sum_ok"]
    result = {**found, "ok": ok, "expected_backend": expected, "timeout_s": cfg.process_group_timeout_s,
              "seconds": time.time() - t0}
    print(f"  process group: {found['backend']}, {found['world_size']} rank(s) through Ray's TorchConfig "
          f"(timeout {cfg.process_group_timeout_s} s), all-reduce sum {'ok' if found['sum_ok'] else 'WRONG'}"
          f" ({'ok' if ok else 'FAILED: expected ' + expected + f', {workers} ranks'})", flush=True)
    for row in found["allreduce"]:
        print(f"    all-reduce {row['bytes'] / 2**20:>7,.0f} MiB: {row['time_us']:>10,.0f} us  algbw "
              f"{row['algbw_gbps']:7.1f} GB/s  busbw {row['busbw_gbps']:7.1f} GB/s", flush=True)
    if not found["allreduce"]:
        print("    all-reduce bandwidth: skipped (one rank: nothing crosses a link)", flush=True)
    return result


def raychat_train(flags: list[str], env: dict[str, str], timeout_s: float) -> None:
    """`python -m raychat.train FLAGS` as a user runs it, its output passed through, joined to the
    bench's Ray instance (RAY_ADDRESS in `env`)."""
    print(f"  $ python -m raychat.train {' '.join(flags)}", flush=True)
    try:
        done = subprocess.run([sys.executable, "-m", "raychat.train", *flags], env=env, cwd=REPO_ROOT,
                              timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired as e:
        raise RaychatError(f"raychat.train did not end within the {timeout_s:.0f} s the budget left") from e
    if done.returncode != 0:
        raise RaychatError(f"raychat.train failed (exit code {done.returncode}); its error is printed above")


def run_numbers(run_dir: str, depth: int, warmup_steps: int) -> dict:
    """What the run's metrics log says of its last attempt: tok/s and MFU (medians past the warm-up
    steps), peak memory of rank 0 (its last report), precision, the steps and where it started."""
    from raychat.storage import Storage
    from raychat.telemetry.metrics_log import read_timeline

    timeline = read_timeline(Storage(run_dir))
    start = timeline.starts[-1]
    steps = [s for s in timeline.steps if s["step"] >= start["step"]]
    timed_steps = steps[warmup_steps:] or steps[-1:]
    mfus = [s["mfu"] for s in timed_steps if s.get("mfu") is not None]
    peak_mib = timeline.last_report.get("peak_memory_mib")
    on_gpu = "cuda" in str(start.get("device"))
    compile_flag = (start.get("config") or {}).get("compile")
    return {"depth": depth, "world_size": start["world_size"], "precision": start.get("precision"),
            "compiled": compile_flag == "on" or (compile_flag == "auto" and on_gpu),
            "device": start.get("device"), "peak_flops": start.get("peak_flops"),
            "resumed_from": start.get("resumed_from"), "first_step": start["step"],
            "last_step": steps[-1]["step"] if steps else None, "timed_steps": len(timed_steps),
            "tok_per_sec": statistics.median(s["tokens_per_sec"] for s in timed_steps),
            "mfu": statistics.median(mfus) if mfus else None,
            "first_step_s": steps[0]["dt"] if steps else None,
            "first_loss": steps[0]["raw_loss"] if steps else None,
            "last_loss": steps[-1]["raw_loss"] if steps else None,
            "peak_memory_gib": None if peak_mib is None else peak_mib / 1024,
            "peak_memory_of": "GPU (torch.cuda.max_memory_allocated, rank 0)" if on_gpu
            else "process RSS (rank 0)"}


def published(depth: int) -> dict | None:
    return NANOCHAT_PUBLISHED.get(depth)


def train_run(flags: list[str], env: dict, run_dir: str, depth: int, workers: int, steps: int,
              warmup_steps: int, timeout_s: float) -> dict:
    """The train part: raychat.train on `workers` workers for `steps` steps, saving half way and at
    the end; its numbers next to nanochat's published ones for the depth."""
    t0 = time.time()
    raychat_train([*flags, "--num-workers", str(workers), "--num-iterations", str(steps),
                   "--save-every", str(max(1, steps // 2))], env, timeout_s)
    result = {**run_numbers(run_dir, depth, warmup_steps), "wall_s": time.time() - t0,
              "nanochat_published": published(depth)}
    result["ok"] = result["last_step"] == steps - 1 and result["first_step"] == 0
    memory = "n/a" if result["peak_memory_gib"] is None else f"{result['peak_memory_gib']:.1f} GiB"
    print(f"  train d{depth} on {workers} worker(s), {result['precision']}"
          f"{', compiled' if result['compiled'] else ''}: {result['tok_per_sec']:,.0f} tok/s, MFU "
          f"{_pct(result['mfu'])}, peak memory {memory} ({result['peak_memory_of']}); steps "
          f"{result['first_step']}..{result['last_step']} in {result['wall_s']:.0f} s", flush=True)
    reference = published(depth)
    source = reference["source"] if reference else f"nanochat publishes no figure for d{depth}"
    print(f"    reference, not measured here: {source} ({NANOCHAT_LOG})", flush=True)
    return result


def resume_run(flags: list[str], env: dict, run_dir: str, depth: int, workers: int, first: dict,
               more_steps: int, warmup_steps: int, timeout_s: float) -> dict:
    """The resume part: the same run name rerun on `workers` workers (another world size) with a
    longer horizon; it must start from the first run's last checkpoint and train to the new end."""
    t0 = time.time()
    steps = first["last_step"] + 1 + more_steps
    raychat_train([*flags, "--num-workers", str(workers), "--num-iterations", str(steps),
                   "--save-every", "-1"], env, timeout_s)
    result = {**run_numbers(run_dir, depth, min(warmup_steps, more_steps - 1)), "wall_s": time.time() - t0,
              "from_world_size": first["world_size"]}
    expected = checkpoint_dir_name(first["last_step"] + 1)
    result["ok"] = (result["resumed_from"] == expected and result["world_size"] == workers
                    and result["first_step"] == first["last_step"] + 1 and result["last_step"] == steps - 1)
    print(f"  resume: {first['world_size']} -> {result['world_size']} worker(s) from "
          f"{result['resumed_from']} (expected {expected}), steps "
          f"{result['first_step']}..{result['last_step']}, loss {first['last_loss']:.4f} before -> "
          f"{result['first_loss']:.4f} after (fresh start: {first['first_loss']:.4f}), "
          f"{result['tok_per_sec']:,.0f} tok/s "
          f"({'ok' if result['ok'] else 'FAILED'})", flush=True)
    return result


def correctness(config: BenchConfig, device: torch.device) -> dict:
    """One batch's loss: bf16 compiled against fp32 eager, same weights."""
    model_config = gpt_config(config.depth, 64, config.head_dim, config.max_seq_len, config.vocab_size,
                              config.window_pattern)
    batch = torch.randint(0, config.vocab_size, (2, config.max_seq_len + 1),
                          generator=torch.Generator().manual_seed(0)).to(device)
    x, y = batch[:, :-1], batch[:, 1:]
    losses = {}
    variants = (("fp32_eager", torch.float32, False), ("bf16_compiled", torch.bfloat16, True))
    for name, dtype, compiled in variants:
        torch.manual_seed(0)
        model = build_model(model_config, device, Precision(dtype, None, False))
        with torch.no_grad():  # weights that make every layer and the logits count (at init the
            # output projections are zero and the logits ~0, so any kernel would give ln(vocab))
            for block in model.transformer.h:
                block.attn.c_proj.weight.normal_(std=0.02)
                block.mlp.c_proj.weight.normal_(std=0.02)
            model.lm_head.weight.normal_(std=model_config.n_embd**-0.5)
        run = torch.compile(model, dynamic=False) if compiled else model
        with torch.no_grad():
            losses[name] = run(x, y).item()
        del model, run
    gap = abs(losses["bf16_compiled"] - losses["fp32_eager"]) / losses["fp32_eager"]
    ok = gap <= CORRECTNESS_TOLERANCE
    print(f"  correctness ({config.name}): fp32 eager {losses['fp32_eager']:.5f}, bf16 compiled "
          f"{losses['bf16_compiled']:.5f}, relative gap {gap:.2e} ({'ok' if ok else 'FAILED'}, tolerance "
          f"{CORRECTNESS_TOLERANCE})", flush=True)
    return {**losses, "relative_gap": gap, "tolerance": CORRECTNESS_TOLERANCE, "ok": ok}


def _peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def save_resume(config: BenchConfig, device: torch.device, tmp: str) -> dict:
    """Train two steps, save a sharded checkpoint, resume it into fresh objects, compare a step."""
    model_config = gpt_config(config.depth, 64, config.head_dim, config.max_seq_len, config.vocab_size,
                              config.window_pattern)
    precision = Precision(torch.bfloat16 if device.type == "cuda" else torch.float32, None, False)
    lrs = dict(embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02, scalar_lr=0.5, weight_decay=0.2)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (config.device_batch_size, config.max_seq_len + 1),
                             generator=generator).to(device) for _ in range(3)]

    def step(model, optimizer, batch) -> float:
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        return loss.item()

    def fresh():
        torch.manual_seed(0)
        model = build_model(model_config, device, precision)
        return model, build_optimizer(model, **lrs)

    model, optimizer = fresh()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for batch in batches[:2]:
        step(model, optimizer, batch)
    train_peak = _peak_bytes(device)
    directory = os.path.join(tmp, "checkpoint_000002")
    t0 = time.perf_counter()
    save_checkpoint(directory, model.state_dict(), optimizer.state_dict(),
                    CheckpointMeta(step=2, model_config=model_config).to_json())
    save_s = time.perf_counter() - t0
    save_peak = _peak_bytes(device)
    t0 = time.perf_counter()
    model_state, optim_state, _ = load_checkpoint(directory)
    resumed, resumed_optimizer = fresh()
    resumed.load_state_dict(model_state)
    resumed_optimizer.load_state_dict(optim_state)
    load_s = time.perf_counter() - t0
    bitwise = step(model, optimizer, batches[2]) == step(resumed, resumed_optimizer, batches[2])
    bitwise = bitwise and all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(),
                                                                strict=True))
    # the step above: eager, one micro-batch of device_batch_size rows, one rank
    estimate = estimate_memory(model_config, model.num_scaling_params(), config.device_batch_size, 1, 1,
                               precision.dtype.itemsize, compiled=False)
    size = sum(f.stat().st_size for f in Path(directory).iterdir())
    result = {"config": config.name, "checkpoint_bytes": size,
              "save_s": save_s, "load_s": load_s, "train_peak_bytes": train_peak,
              "save_extra_bytes": None if save_peak is None else save_peak - train_peak,
              "predicted_device_bytes": estimate.peak, "bitwise_after_resume": bitwise}
    gib = 2**30
    peaks = ("" if train_peak is None else f", peak {train_peak / gib:.1f} GiB training (plan "
             f"{estimate.peak / gib:.1f} GiB), +{(save_peak - train_peak) / gib:.2f} GiB in the save")
    print(f"  save/resume ({config.name}): {size / 1e9:.2f} GB saved in {save_s:.1f} s, loaded in "
          f"{load_s:.1f} s{peaks}; next step bitwise equal: {bitwise}", flush=True)
    return result


def markdown(report: dict) -> str:
    """The dated section for bench/RESULTS.md: the acceptance row, then the parts' details."""
    parts = report["parts"]
    lines = [f"### {report['date']}: `python -m bench.gpu{' --dry-run' if report['dry_run'] else ''}` on "
             f"{report['device_name']} (torch {report['torch']}, Ray {report['ray']}), "
             f"{report['seconds']:.0f} s", "", ROW_HEADER, markdown_row(report)]
    steps = parts.get("steps", {}).get("variants", [])
    if steps:
        lines += ["", "| config | window | attention | fp8 | tok/s | MFU | compile | peak memory |",
                  "|---|---|---|---|---|---|---|---|"]
    for r in steps:
        lines.append(f"| {r['config']['name']} | {r['config']['window_pattern']} | {r['attention']} "
                     f"| {r['fp8']} | {r['tok_per_sec']:,.0f} | {_pct(r.get('mfu'))} "
                     f"| {r['compile_s']:.0f} s | {r['peak_memory_gb']:.1f} GB |")
    notes = []
    loader, check, saved = parts.get("loader", {}), parts.get("correctness", {}), parts.get("save_resume", {})
    if "ratio" in loader:
        notes.append(f"Loader B {loader['B']} x T {loader['T']}: raychat "
                     f"{loader['raychat_tok_per_sec'] / 1e6:.2f} M tok/s vs reference "
                     f"{loader['reference_tok_per_sec'] / 1e6:.2f} M tok/s "
                     f"({loader['ratio']:.2f}x, {loader['cores']} cores).")
    if "ok" in check:
        notes.append(f"Correctness: fp32 eager {check['fp32_eager']:.5f} vs bf16 compiled "
                     f"{check['bf16_compiled']:.5f} (relative gap {check['relative_gap']:.1e}, "
                     f"{'ok' if check['ok'] else 'FAILED'}).")
    if saved.get("train_peak_bytes") is not None:
        notes.append(f"Save/resume {saved['config']}: {saved['checkpoint_bytes'] / 1e9:.2f} GB in "
                     f"{saved['save_s']:.1f} s, loaded in {saved['load_s']:.1f} s; peak "
                     f"{saved['train_peak_bytes'] / 2**30:.1f} GiB training against the plan's "
                     f"{saved['predicted_device_bytes'] / 2**30:.1f} GiB, "
                     f"+{saved['save_extra_bytes'] / 2**30:.2f} GiB during the save; next step bitwise: "
                     f"{saved['bitwise_after_resume']}.")
    skipped = [f"{name}: {part['skipped']}" for name, part in parts.items() if "skipped" in part]
    failed = [f"{name}: {part['error']}" for name, part in parts.items() if "error" in part]
    if skipped:
        notes.append("Skipped: " + "; ".join(skipped) + ".")
    if failed:
        notes.append("Failed: " + "; ".join(failed) + ".")
    return "\n".join(lines + ([""] + [" ".join(notes)] if notes else []))


class Parts:
    """The parts run so far, each written to the JSON as it ends; a part that would not fit the time
    left of the budget is recorded as skipped instead of run."""

    def __init__(self, report: dict, out: Path, budget_s: float, dry_run: bool):
        self.report, self.out, self.budget_s, self.dry_run = report, out, budget_s, dry_run
        self.start = time.time()

    def left_s(self) -> float:
        return self.budget_s - (time.time() - self.start)

    def fits(self, estimate_s: float) -> bool:
        return self.dry_run or estimate_s <= self.left_s()

    def run(self, name: str, body: Callable[[], dict], estimate_s: float = 0.0,
            skip: str | None = None) -> dict:
        if skip is None and not self.fits(estimate_s):
            skip = (f"{self.left_s():.0f} s of the {self.budget_s:.0f} s budget left, ~{estimate_s:.0f} s "
                    "needed")
        t0 = time.time()
        if skip is not None:
            result = {"skipped": skip}
            print(f"  {name}: skipped ({skip})", flush=True)
        else:
            try:
                result = body()
            except Exception as e:  # the other parts still run and the JSON says what failed
                result = {"error": f"{type(e).__name__}: {e}"}
                print(f"  {name}: FAILED: {result['error']}", flush=True)
        result["part_s"] = time.time() - t0
        self.report["parts"][name] = result
        self.write()
        return result

    def write(self) -> None:
        self.report["seconds"] = time.time() - self.start
        self.report["markdown_row"] = markdown_row(self.report)
        self.report["markdown"] = markdown(self.report)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=1))


def start_ray(gpus: int) -> str:
    """A local Ray instance for every part (raychat.train joins it through RAY_ADDRESS): never a
    cluster found on the machine. Returns its address."""
    import ray

    context = ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2 * max(gpus, 2) + 4),
                       num_gpus=gpus, include_dashboard=True, dashboard_host="127.0.0.1",
                       configure_logging=False, log_to_driver=True)
    return context.address_info["gcs_address"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="every part on CPU at tiny shapes, 2 CPU "
                        "workers for the process group, the train run and its resume (~2 minutes)")
    parser.add_argument("--gpus", type=int, default=-1, help="GPUs to use (default: every visible one)")
    parser.add_argument("--depth", type=int, default=12, help="the train run's depth (default 12; nanochat "
                        f"publishes figures for {', '.join(f'd{d}' for d in NANOCHAT_PUBLISHED)})")
    parser.add_argument("--train-steps", type=int, default=20, help="the train run's steps (default 20); "
                        "the resume trains half as many more")
    parser.add_argument("--budget-s", type=float, default=540.0, help="seconds the whole command may take "
                        "(default 540, for a 10-minute window): parts that would not fit are skipped")
    parser.add_argument("--all-variants", action="store_true", help="step variants at d20 too, not d12 only")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per step variant (default 4)")
    parser.add_argument("--out", default="", help="JSON path (default: $OUT/bench_gpu.json if $OUT is set, "
                        "else bench/out/bench_gpu_<date>.json)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise RaychatError("bench.gpu needs a CUDA GPU: run it on one, or pass --dry-run to check it on CPU")
    import ray

    device = torch.device("cpu" if args.dry_run else "cuda")
    gpus = 0 if args.dry_run else (torch.cuda.device_count() if args.gpus < 0 else args.gpus)
    workers = 2 if args.dry_run else gpus
    date = datetime.date.today().isoformat()
    device_name = "CPU" if args.dry_run else torch.cuda.get_device_name(device)
    if args.out:
        out = Path(args.out)
    elif os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "bench_gpu.json"
    else:
        out = Path(REPO_ROOT) / "bench" / "out" / f"bench_gpu_{date}.json"
    report = {"date": date, "dry_run": args.dry_run, "torch": torch.__version__, "ray": ray.__version__,
              "device_name": device_name, "gpus": gpus, "workers": workers, "budget_s": args.budget_s,
              "parts": {}}
    parts = Parts(report, out, args.budget_s, args.dry_run)
    print(f"bench.gpu {date}: {'dry run on CPU, 2 workers' if args.dry_run else f'{gpus} x {device_name}'}, "
          f"JSON {out}", flush=True)
    configs = DRY_CONFIGS if args.dry_run else GPU_CONFIGS[: len(GPU_CONFIGS) if args.all_variants else 1]
    depth = DRY_CONFIGS[0].depth if args.dry_run else args.depth
    with tempfile.TemporaryDirectory(prefix="raychat_bench_gpu_") as tmp:
        data_dir, tokenizer_dir, what = corpus(Path(tmp), args.dry_run)
        report["corpus"] = what
        address = start_ray(gpus)
        try:
            parts.run("process_group", lambda: process_group_check(
                max(workers, 1), not args.dry_run, DRY_ALLREDUCE_BYTES if args.dry_run else ALLREDUCE_BYTES,
                2 if args.dry_run else ALLREDUCE_ITERS, os.path.join(tmp, "ray_train")),
                ESTIMATE_S["process_group"])
            runs = os.path.join(tmp, "runs")
            flags = [*(DRY_TRAIN_FLAGS if args.dry_run else TRAIN_FLAGS), "--depth", str(depth),
                     "--data-dir", data_dir, "--tokenizer-dir", tokenizer_dir, "--storage-path", runs,
                     "--run-name", "acceptance"]
            env = {**os.environ, "RAY_ADDRESS": address,
                   "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}  # the resume's compile: warm
            warmup = 1 if args.dry_run else TRAIN_WARMUP_STEPS
            train_steps = 4 if args.dry_run else args.train_steps
            train = parts.run("train", lambda: train_run(flags, env, os.path.join(runs, "acceptance"), depth,
                                                         max(workers, 1), train_steps, warmup, parts.left_s()
                                                         if not args.dry_run else 600),
                              ESTIMATE_S["train"])
            parts.run("resume", lambda: resume_run(flags, env, os.path.join(runs, "acceptance"), depth,
                                                   workers // 2, train, max(2, train_steps // 2), warmup,
                                                   parts.left_s() if not args.dry_run else 600),
                      ESTIMATE_S["resume"], skip=None if workers >= 2 and train.get("ok") else
                      ("one GPU: a resume at another world size needs 2+" if workers < 2 else
                       "the train run did not finish"))
            parts.run("correctness", lambda: correctness(configs[0], device), ESTIMATE_S["correctness"])
            parts.run("save_resume", lambda: save_resume(configs[0] if args.dry_run else SAVE_CONFIG, device,
                                                         tmp), ESTIMATE_S["save_resume"])
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the step variants' processes share this GPU
            parts.run("loader", lambda: loader_rates(data_dir, tokenizer_dir, what, DRY_LOADER_SHAPE
                                                     if args.dry_run else LOADER_SHAPE,
                                                     2.0 if args.dry_run else 10.0), ESTIMATE_S["loader"])
        finally:
            ray.shutdown()
        parts.run("steps", lambda: {"variants": step_variants(
            configs, device.type, 1 if args.dry_run else args.steps, 1 if args.dry_run else 2, tmp,
            args.dry_run, fits=lambda: parts.fits(ESTIMATE_S["variant"]))})
    parts.write()
    print(f"\nJSON: {out}\n\nFor bench/RESULTS.md:\n\n{report['markdown']}", flush=True)
    # A part skipped (one GPU, the budget) fails nothing; one that failed or errored fails the command.
    checks = {"process_group": "ok", "train": "ok", "resume": "ok", "correctness": "ok",
              "save_resume": "bitwise_after_resume"}
    done = {name: report["parts"][name] for name in checks if "skipped" not in report["parts"][name]}
    return 0 if all(part.get(checks[name]) is True for name, part in done.items()) else 1


if __name__ == "__main__":
    run_cli(main)
