"""The one GPU check: everything only a GPU runs, measured in one command of at most ~8 minutes.

    python -m bench.gpu              # on one H100/H200: JSON to $OUT (else bench/out/), markdown on stdout
    python -m bench.gpu --dry-run    # every part on CPU at tiny shapes (tests/test_bench_gpu.py runs it)

Parts, each printed as it finishes:
- steps: d12 and d20 (nanochat's shapes: head dim 128, T 2048, auto total batch, device batch 32),
  compiled, bf16, tokens/sec and MFU, with SSSL through FlexAttention against L through SDPA, each
  with and without --fp8 (torchao tensorwise); compile time (first step minus a steady one) and
  peak GPU memory per variant. Each variant runs in its own process (bench.step.launch).
- loader: tokens/sec of raychat's TrainLoader (rank 0 of 1, Ray Data on this machine's cores)
  against bench/loader.py's nanochat-style reference loader, B 32 x T 2048, same corpus.
- correctness: the loss of one batch at d12, bf16 compiled against fp32 eager from the same
  weights (bf16 rounding moves a loss near ln(vocab) by well under 1%; a broken kernel moves it more).
- save and resume: d20 at device batch 16 (what one GPU holds with room to spare), two training
  steps, a sharded checkpoint saved and loaded back into a fresh model and optimizer; peak GPU
  memory while training and the extra during the save (torch.cuda.max_memory_allocated) next to
  the plan's estimate (raychat.memory), and the step after the resume bitwise equal to the step of
  the model that never stopped.
The dry run uses eager steps (FlexAttention has no CPU backward in torch 2.13, so SSSL runs as masked
SDPA there), torchao's emulated fp8, a 2-layer model at T 256, a synthetic corpus, and compiles only
the correctness check's forward: it proves the command runs, not how fast.
"""

import argparse
import datetime
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.loader import ReferenceLoader, corpus_and_tokenizer, reference_documents, timed
from bench.step import REPO_ROOT, BenchConfig, launch, run_variant
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.reader import load_checkpoint
from raychat.checkpoint.sharded import save_checkpoint
from raychat.common import RaychatError, run_cli
from raychat.memory import estimate_memory
from raychat.model.gpt import build_model, gpt_config
from raychat.model.precision import Precision
from raychat.optim.muon_adamw import build_optimizer
from raychat.tokenizer.core import Tokenizer

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


def step_variants(configs: list[BenchConfig], device: str, steps: int, warmup: int, tmp: str,
                  dry_run: bool) -> list[dict]:
    """Every (config, attention, fp8) variant: SSSL via FlexAttention and L via SDPA, fp8 off and on."""
    args = SimpleNamespace(steps=steps, warmup=warmup, threads=0)
    results = []
    for config in configs:
        for pattern, attention in (("SSSL", "flex"), ("L", "sdpa")):
            for fp8 in (None, "tensorwise"):
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


def loader_rates(workdir: Path, shape: tuple[int, int], seconds: float, dry_run: bool) -> dict:
    """raychat's TrainLoader against the reference loader on the same corpus, rank 0 of 1."""
    import ray

    from raychat.corpus.fixture import write_synthetic_corpus
    from raychat.data.loader import TrainLoader

    data_dir = ""
    if dry_run:
        data_dir = str(workdir / "data")
        write_synthetic_corpus(Path(data_dir), 2000, seed=0)
    args = SimpleNamespace(data_dir=data_dir, tokenizer_dir="", vocab_size=1024 if dry_run else 32768)
    index, tokenizer_dir, what = corpus_and_tokenizer(args, workdir)
    tokenizer = Tokenizer.load(tokenizer_dir)
    B, T = shape
    reference = ReferenceLoader(reference_documents(index, tokenizer), B, T)
    _, n, ref_seconds, _, _ = timed(reference.next_batch, 1, seconds=seconds)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False,
             log_to_driver=False)  # a fresh local instance, never a cluster found on the machine
    try:
        with TrainLoader(index, tokenizer_dir, T, rank=0, world_size=1) as ours:
            _, _, ours_seconds, _, _ = timed(lambda: ours.next_rows(B), 2, batches=n)
    finally:
        ray.shutdown()
    ref_rate, rate = n * B * T / ref_seconds, n * B * T / ours_seconds
    print(f"  loader B {B} x T {T} ({what}): raychat {rate / 1e6:.2f} M tok/s, reference "
          f"{ref_rate / 1e6:.2f} M tok/s ({rate / ref_rate:.2f}x), {os.cpu_count()} cores", flush=True)
    return {"B": B, "T": T, "corpus": what, "raychat_tok_per_sec": rate, "reference_tok_per_sec": ref_rate,
            "ratio": rate / ref_rate, "cores": os.cpu_count()}


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
    """The dated section for bench/RESULTS.md."""
    lines = [f"### {report['date']}: `python -m bench.gpu{' --dry-run' if report['dry_run'] else ''}` on "
             f"{report['device_name']} (torch {report['torch']})", "",
             "| config | window | attention | fp8 | tok/s | MFU | compile | peak memory |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["steps"]:
        lines.append(f"| {r['config']['name']} | {r['config']['window_pattern']} | {r['attention']} "
                     f"| {r['fp8']} | {r['tok_per_sec']:,.0f} | {_pct(r.get('mfu'))} "
                     f"| {r['compile_s']:.0f} s | {r['peak_memory_gb']:.1f} GB |")
    loader, check = report["loader"], report["correctness"]
    lines += ["", f"Loader B {loader['B']} x T {loader['T']}: raychat "
              f"{loader['raychat_tok_per_sec'] / 1e6:.2f} M tok/s vs reference "
              f"{loader['reference_tok_per_sec'] / 1e6:.2f} M tok/s ({loader['ratio']:.2f}x, "
              f"{loader['cores']} cores). Correctness: fp32 eager {check['fp32_eager']:.5f} vs bf16 compiled "
              f"{check['bf16_compiled']:.5f} (relative gap {check['relative_gap']:.1e}, "
              f"{'ok' if check['ok'] else 'FAILED'}). Total {report['seconds']:.0f} s."]
    saved = report["save_resume"]
    if saved["train_peak_bytes"] is not None:
        lines += ["", f"Save/resume {saved['config']}: {saved['checkpoint_bytes'] / 1e9:.2f} GB in "
                  f"{saved['save_s']:.1f} s, loaded in {saved['load_s']:.1f} s; peak "
                  f"{saved['train_peak_bytes'] / 2**30:.1f} GiB training against the plan's "
                  f"{saved['predicted_device_bytes'] / 2**30:.1f} GiB, "
                  f"+{saved['save_extra_bytes'] / 2**30:.2f} GiB during the save; next step bitwise: "
                  f"{saved['bitwise_after_resume']}."]
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="every part on CPU at tiny "
                        "shapes (< 1 minute)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant (default 4)")
    parser.add_argument("--out", default="", help="JSON path (default: $OUT/bench_gpu.json if $OUT is set, "
                        "else bench/out/bench_gpu_<date>.json)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise RaychatError("bench.gpu needs a CUDA GPU: run it on one, or pass --dry-run to check it on CPU")
    start = time.time()
    device = torch.device("cpu" if args.dry_run else "cuda")
    configs = DRY_CONFIGS if args.dry_run else GPU_CONFIGS
    date = datetime.date.today().isoformat()
    print(f"bench.gpu {date}: {'dry run on CPU' if args.dry_run else torch.cuda.get_device_name(device)}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="raychat_bench_gpu_") as tmp:
        steps = step_variants(configs, device.type, 1 if args.dry_run else args.steps,
                              1 if args.dry_run else 2, tmp, args.dry_run)
        loader = loader_rates(Path(tmp), DRY_LOADER_SHAPE if args.dry_run else LOADER_SHAPE,
                              2.0 if args.dry_run else 10.0, args.dry_run)
        check = correctness(configs[0], device)
        saved = save_resume(configs[0] if args.dry_run else SAVE_CONFIG, device, tmp)
    report = {"date": date, "dry_run": args.dry_run, "torch": torch.__version__,
              "device_name": "CPU" if args.dry_run else torch.cuda.get_device_name(device),
              "steps": steps, "loader": loader, "correctness": check, "save_resume": saved,
              "seconds": time.time() - start}
    if args.out:
        out = Path(args.out)
    elif os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "bench_gpu.json"
    else:
        out = Path(REPO_ROOT) / "bench" / "out" / f"bench_gpu_{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {out}\n\nFor bench/RESULTS.md:\n\n{markdown(report)}", flush=True)
    return 0 if check["ok"] and saved["bitwise_after_resume"] else 1


if __name__ == "__main__":
    run_cli(main)
