"""What Ray costs: raychat with one worker against a plain single-process loop, same work, same rows.

Both sides train the same model (same seed, same init) with the same optimizer, learning-rate
schedules and rows, and print nanochat's step line, which this script parses:

- raychat: `python -m raychat.train` as a subprocess, the real driver path: a local Ray instance,
  Ray Train's trainer with one worker, the Ray Data loader feeding it.
- plain: this script's child process, no Ray: the rows raychat's TrainLoader delivers (materialised
  once into the cache dir), fed to the worker's own step function (raychat.worker.step.train_step:
  micro-batches, loss scaled by the global token count, schedules, MuonAdamW step, one host sync)
  and nothing else.

Same rows and the same arithmetic give the same losses, so the losses of the two step lines must
agree (checked); anything else would mean the comparison is not like for like. Reported: steady-state
tokens/sec (median dt after the first --skip steps) of both and their ratio (target >= 0.97), raychat's
time between steps (outside each step's dt, evaluations and saves: the time ledger's "other", from
its metrics log; the plain loop has none worth counting), and
the time from launching each process to the end of its first step (raychat: Ray start-up, worker
start, model build, loader start; broken down from the driver's output).

The corpus (the offline sample corpus), the tokenizer (vocab --vocab-size) and the rows are prepared
once in --cache-dir and reused by later invocations.

    python -m bench.overhead                     # configuration A (d4, T 512, batch 8 x 512), 25 steps
    python -m bench.overhead --quick             # smoke test: 6 steps
    python -m bench.overhead --steps 40 --repeats 2
"""

import argparse
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from raychat.common import RaychatError, raychat_home, run_cli
from raychat.config import TrainConfig
from raychat.corpus.index import CorpusIndex, list_shards
from raychat.telemetry.metrics_log import METRICS_FILE, parse_records

if TYPE_CHECKING:
    import torch

    from raychat.optim.base import ShardedOptimizer
    from raychat.scaling import Plan

REPO_ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
Snapshot = dict[int, tuple[str, float]]  # pid -> (command line, CPU seconds so far)
STEP_LINE = re.compile(r"step (\d+)/(\d+) \([\d.]+%\) \| loss: ([\d.naif]+) \| lrm: [\d.]+ \| dt: ([\d.]+)ms")
TARGET_RATIO = 0.97


def bench_config(args: argparse.Namespace) -> TrainConfig:
    """The run both sides train (d4, T 512, batch 8 x 512 by default), evaluation kept out of the way:
    raychat evaluates, samples and saves once, after the last step."""
    return TrainConfig(depth=args.depth, head_dim=64, max_seq_len=args.max_seq_len, window_pattern="L",
                       device_batch_size=args.device_batch_size, total_batch_size=args.total_batch_size,
                       num_iterations=args.steps, vocab_size=args.vocab_size, eval_every=-1,
                       eval_tokens=args.device_batch_size * args.max_seq_len, sample_every=-1, save_every=-1)


# ----------------------------------------------------------------------------------------------------
# Inputs, prepared once


def prepare_inputs(cache_dir: Path, vocab_size: int) -> tuple[Path, Path]:
    """(corpus dir, tokenizer dir) in cache_dir: the sample corpus and a tokenizer trained on it."""
    from raychat.corpus.sample import write_sample_corpus
    from raychat.tokenizer.train import train_tokenizer

    data_dir, tokenizer_dir = cache_dir / "data", cache_dir / f"tokenizer_{vocab_size}"
    if not data_dir.is_dir() or not list_shards(data_dir):
        print(f"writing the sample corpus to {data_dir}", flush=True)
        write_sample_corpus(data_dir, overwrite=True, log=lambda _: None)
    if not (tokenizer_dir / "meta.json").exists():
        print(f"training a tokenizer (vocab {vocab_size:,}) into {tokenizer_dir}", flush=True)
        train_tokenizer(data_dir, tokenizer_dir, vocab_size=vocab_size, log=lambda _: None)
    return data_dir, tokenizer_dir


def prepare_rows(cache_dir: Path, data_dir: Path, tokenizer_dir: Path, seq_len: int,
                 rows_needed: int) -> Path:
    """The first `rows_needed` rows raychat's TrainLoader gives rank 0 of 1 (what a one-worker run
    trains on), saved as int32 [rows, T+1]; a saved file with at least as many rows is reused."""
    from raychat.tokenizer.core import Tokenizer

    fingerprint = Tokenizer.load(tokenizer_dir).fingerprint
    path = cache_dir / f"rows_{fingerprint}_T{seq_len}.npy"
    if path.exists() and np.load(path, mmap_mode="r").shape[0] >= rows_needed:
        return path
    import ray

    from raychat.data.loader import TrainLoader

    print(f"materialising {rows_needed} rows of the training stream into {path}", flush=True)
    ray.init(num_cpus=(os.cpu_count() or 1) + 2, include_dashboard=False, configure_logging=False,
             log_to_driver=False)
    try:
        with TrainLoader(CorpusIndex.load(data_dir), str(tokenizer_dir), seq_len, rank=0, world_size=1,
                         record_consumed=False) as loader:
            x, y = loader.next_rows(rows_needed)
    finally:
        ray.shutdown()
    rows = np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1).astype(np.int32)
    np.save(path, rows)
    return path


# ----------------------------------------------------------------------------------------------------
# The plain loop (child process)


class SavedRows:
    """The rows prepare_rows saved, handed out in order (a loader without Ray for train_step)."""

    def __init__(self, rows: "torch.Tensor"):
        self.rows, self.next = rows, 0

    def next_rows(self, n: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        chunk = self.rows[self.next:self.next + n]
        self.next += n
        return chunk[:, :-1], chunk[:, 1:]


@dataclass
class PlainComponents:
    """What raychat.worker.step.train_step computes with, built without Ray (no saver, no metrics)."""

    cfg: TrainConfig
    plan: "Plan"
    device: "torch.device"
    model: "torch.nn.Module"
    optimizer: "ShardedOptimizer"
    loader: SavedRows
    micro_slices: list[slice]


def plain_main(spec: dict) -> int:
    """raychat worker's step (raychat.worker.step.train_step) without Ray: same model, optimizer,
    schedules and rows."""
    import torch

    from raychat.model.gpt import build_model
    from raychat.model.precision import configure_matmuls, resolve_precision
    from raychat.optim.muon_adamw import build_optimizer
    from raychat.scaling import resolve_plan
    from raychat.telemetry.metrics import StepMetrics, counts_toward_total_time, eta_seconds, smooth_loss
    from raychat.tokenizer.core import Tokenizer
    from raychat.worker.step import micro_slices, train_step

    cfg = TrainConfig.from_dict(spec["config"])
    plan = resolve_plan(cfg, Tokenizer.load(spec["tokenizer_dir"]).vocab_size)
    torch.manual_seed(cfg.seed)
    # the precision a raychat worker resolves (--dtype auto: bf16 on a CPU with native bf16, else fp32)
    precision = resolve_precision(cfg.dtype, cfg.fp8, cfg.fp8_recipe, "cpu")
    configure_matmuls(torch.device("cpu"))
    model = build_model(plan.model, "cpu", precision)
    scale = plan.lr_scale
    optimizer = build_optimizer(model, embedding_lr=cfg.embedding_lr * scale,
                                unembedding_lr=cfg.unembedding_lr * scale, matrix_lr=cfg.matrix_lr * scale,
                                scalar_lr=cfg.scalar_lr * scale, weight_decay=plan.weight_decay)
    steps = plan.num_iterations
    rows = torch.from_numpy(np.load(spec["rows_file"])[:plan.rows_per_step * steps].astype(np.int64))
    slices = micro_slices(plan.rows_per_step, cfg.device_batch_size)
    parts = PlainComponents(cfg, plan, torch.device("cpu"), model, optimizer, SavedRows(rows), slices)
    print(f"plain loop: {torch.get_num_threads()} torch threads, micro-batches "
          f"{[s.stop - s.start for s in slices]}", flush=True)

    smooth, total_time = 0.0, 0.0
    for step in range(steps):
        result = train_step(parts, step)
        dt = result.dt
        smooth, debiased = smooth_loss(smooth, result.loss, step)
        if counts_toward_total_time(step):
            total_time += dt
        tokens = (step + 1) * plan.total_batch_size
        record = StepMetrics(step, steps, debiased, result.loss, result.lrm, dt, plan.total_batch_size / dt,
                             None, 1, 0, 0, total_time, eta_seconds(step, steps, total_time), 0.0, 1, tokens,
                             tokens * plan.flops_per_token)
        print(record.line(), flush=True)
        if step == 0:  # nanochat's (and raychat's) GC handling
            gc.collect()
            gc.freeze()
            gc.disable()
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------------
# Running and parsing both sides


def tree_cpu(root: int) -> Snapshot:
    """CPU seconds (user + system) so far of `root` and every process below it (a local Ray instance's
    GCS, raylet, dashboard and workers are all started below its driver), by pid, with the command."""
    parents, info = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            command = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (name) ": state, ppid, ...
        parents[int(entry.name)] = int(fields[1])
        info[int(entry.name)] = (command.strip(), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    tree, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - tree
        tree |= frontier
    return {pid: info[pid] for pid in tree if pid in info}


def process_name(command: str) -> str:
    """A short name for a process: a Ray worker's title (ray::IDLE, ray::TrainController.run, ...),
    else its program or script (raylet, gcs_server, dashboard.py, agent.py, ...)."""
    words = command.split()
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return words[0]
    scripts = [w for w in words[1:4] if w.endswith(".py")]
    if "-m" in words[:3]:
        return "python -m " + words[words.index("-m") + 1]
    return os.path.basename(scripts[0] if scripts else words[0])


def role_of(command: str) -> str:
    if "RayTrainWorker" in command:
        return "train worker"
    if command.startswith("ray::"):
        return "other Ray workers (Ray Data tasks, actors)"
    if "raychat.train" in command or "bench.overhead" in command:
        return "driver / plain loop"
    return "Ray services (GCS, raylet, dashboard, agents)"


def cpu_spent(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds each process (by short name, same names summed) spent between two snapshots."""
    spent: dict[str, float] = {}
    for pid, (command, seconds) in after.items():
        name = f"{role_of(command)}|{process_name(command)}"
        spent[name] = spent.get(name, 0.0) + seconds - before.get(pid, ("", 0.0))[1]
    return spent


@dataclass
class Run:
    name: str
    launched: float
    steps: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (loss, dt seconds)
    first_step_at: float | None = None        # seconds after launch when step 0's line arrived
    marks: dict[str, float] = field(default_factory=dict)  # driver milestones, seconds after launch
    steady_cpu: dict[str, float] = field(default_factory=dict)  # "role|process" -> CPU s per steady step
    wall: float = 0.0
    log: list[str] = field(default_factory=list)

    def steady(self, skip: int) -> list[float]:
        return [dt for step, (_, dt) in sorted(self.steps.items()) if step >= skip]


# raychat driver output that marks where its start-up time goes (first occurrence, seconds after launch)
MILESTONES = {"corpus checked": "Corpus:", "plan printed": "tokens per step",
              "worker started": ": training to step ", "step 0 done": "step 00000/"}


def run_and_parse(name: str, command: list[str], env: dict, log_path: Path, skip: int, last: int) -> Run:
    """Run `command`, timestamping its output lines, and parse its step lines; the CPU its process
    tree spends from the end of step skip-1 to the end of step `last` is recorded by role."""
    run = Run(name, time.perf_counter())
    cpu_before: Snapshot = {}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=REPO_ROOT, bufsize=1) as process, log_path.open("w") as log:
        for line in process.stdout:
            now = time.perf_counter() - run.launched
            log.write(f"{now:9.3f} {line}")
            run.log.append(line.rstrip())
            for mark, text in MILESTONES.items():
                if text in line and mark not in run.marks:
                    run.marks[mark] = now
            match = STEP_LINE.search(line)
            if match:
                step = int(match[1])
                run.steps[step] = (float(match[3]), float(match[4]) / 1000)
                if step == 0:
                    run.first_step_at = now
                if step == skip - 1:
                    cpu_before = tree_cpu(process.pid)
                elif step == last and cpu_before:
                    spent = cpu_spent(cpu_before, tree_cpu(process.pid))
                    run.steady_cpu = {name: seconds / (last - skip + 1) for name, seconds in spent.items()}
        process.wait()
    run.wall = time.perf_counter() - run.launched
    if process.returncode != 0 or not run.steps:
        tail = "\n".join(run.log[-15:])
        raise RaychatError(f"the {name} run failed (exit code {process.returncode}, full log in {log_path}); "
                           f"its last lines:\n{tail}")
    return run


def summarise(run: Run, skip: int, total_batch_size: int) -> str:
    steady = run.steady(skip)
    median = statistics.median(steady)
    low, high = 1000 * min(steady), 1000 * max(steady)
    return (f"{run.name:>7}: {total_batch_size / median:8,.0f} tok/s (median dt {1000 * median:,.0f} ms "
            f"over steps {skip}-{max(run.steps)}, min {low:,.0f}, max {high:,.0f}) | first step done "
            f"{run.first_step_at:.1f}s after launch (its dt {1000 * run.steps[0][1]:,.0f} ms) | "
            f"process wall {run.wall:.1f}s")


def step_gaps(run_dir: Path, skip: int) -> list[float]:
    """Seconds between one step's end and the next one's start, outside evaluations and saves: what the
    time ledger counts as "other" (raychat.telemetry.ledger), per steady step, from the run's metrics log
    (each step record is timed as the step ends; its dt is the step's own time)."""
    records = parse_records((run_dir / METRICS_FILE).read_text())
    steps = [r for r in records if r["kind"] == "step" and r["step"] >= skip - 1]

    def outside(a: dict, b: dict, name: str) -> float:
        return b.get(name, 0.0) - a.get(name, 0.0)

    return [b["time"] - a["time"] - b["dt"] - outside(a, b, "eval_s_so_far")
            - outside(a, b, "checkpoint_s_so_far") for a, b in zip(steps, steps[1:], strict=False)]


def describe_cpu(run: Run) -> str:
    """CPU seconds per steady step by role, and the processes besides the training loop that used most."""
    roles: dict[str, float] = {}
    for name, seconds in run.steady_cpu.items():
        role = name.split("|")[0]
        roles[role] = roles.get(role, 0.0) + seconds
    text = ", ".join(f"{role} {seconds:.2f}s" for role, seconds in sorted(roles.items(), key=lambda r: -r[1])
                     if seconds >= 0.005)
    others = sorted(((seconds, name.split("|")[1]) for name, seconds in run.steady_cpu.items()
                     if not name.startswith(("train worker", "driver"))), reverse=True)[:10]
    busiest = ", ".join(f"{name} {seconds:.2f}s" for seconds, name in others if seconds >= 0.005)
    if busiest:
        text += f"\n           busiest other processes: {busiest}"
    return f"{run.name:>7}: CPU per steady step: {text}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default="", help="where the corpus, tokenizer and rows are kept "
                        "(default: $RAYCHAT_HOME/bench/overhead)")
    parser.add_argument("--vocab-size", type=int, default=32768, help="tokenizer vocabulary (default 32768)")
    parser.add_argument("--depth", type=int, default=4, help="model depth (default 4)")
    parser.add_argument("--max-seq-len", type=int, default=512, help="T (default 512)")
    parser.add_argument("--device-batch-size", type=int, default=8, help="rows per micro-batch (default 8)")
    parser.add_argument("--total-batch-size", type=int, default=4096, help="tokens per step (default 4096)")
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per run (default 25)")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the steady state "
                        "(default 5)")
    parser.add_argument("--repeats", type=int, default=1, help="plain/raychat pairs, alternated (default 1)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 6 steps, 2 skipped")
    parser.add_argument("--plain-child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_child:
        return plain_main(json.loads(args.plain_child))
    if args.quick:
        args.steps, args.skip = 6, 2
    if args.steps <= args.skip:
        raise RaychatError(f"--steps ({args.steps}) must exceed --skip ({args.skip}): nothing left to time")

    cfg = bench_config(args)
    cache_dir = Path(args.cache_dir or raychat_home() / "bench" / "overhead").expanduser().resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    data_dir, tokenizer_dir = prepare_inputs(cache_dir, args.vocab_size)
    rows_needed = cfg.total_batch_size // cfg.max_seq_len * args.steps
    rows_file = prepare_rows(cache_dir, data_dir, tokenizer_dir, cfg.max_seq_len, rows_needed)
    if Path("/tmp/ray/ray_current_cluster").exists():
        print("note: a `ray start` cluster may be running on this machine; raychat.train starts its own",
              flush=True)

    # Ray must start its own local instance, as for a user running `python -m raychat.train` alone.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAYCHAT_OFFLINE="1", PYTHONUNBUFFERED="1")
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in cfg.to_public_dict().items()
             if value != getattr(TrainConfig, key, None) and key not in ("data_dir", "tokenizer_dir")]
    print(f"load average {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs; cache {cache_dir}\n"
          f"config: {' '.join(flags)}", flush=True)

    log_dir = cache_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    last = args.steps - 1
    pairs = []
    with tempfile.TemporaryDirectory(prefix="raychat_bench_overhead_") as tmp:
        for repeat in range(args.repeats):
            spec = {"config": cfg.to_dict(), "tokenizer_dir": str(tokenizer_dir), "rows_file": str(rows_file)}
            plain_cmd = [sys.executable, "-m", "bench.overhead", "--plain-child", json.dumps(spec)]
            plain = run_and_parse("plain", plain_cmd, env, log_dir / f"plain_{repeat}.log", args.skip, last)
            print(summarise(plain, args.skip, cfg.total_batch_size), flush=True)
            raychat_cmd = [sys.executable, "-m", "raychat.train", *flags, f"--data-dir={data_dir}",
                           f"--tokenizer-dir={tokenizer_dir}", f"--storage-path={tmp}/runs",
                           f"--run-name=overhead_{repeat}", "--core-metric-every=-1"]
            ours = run_and_parse("raychat", raychat_cmd, env, log_dir / f"raychat_{repeat}.log", args.skip,
                                 last)
            print(summarise(ours, args.skip, cfg.total_batch_size), flush=True)
            gaps = step_gaps(Path(tmp) / "runs" / f"overhead_{repeat}", args.skip)
            median_dt, mean_gap = statistics.median(ours.steady(args.skip)), statistics.mean(gaps)
            print(f"         raychat between steps (the ledger's 'other'): median "
                  f"{1000 * statistics.median(gaps):.2f} ms, mean {1000 * mean_gap:.2f} ms = "
                  f"{100 * mean_gap / median_dt:.2f}% of the median dt", flush=True)
            marks = ", ".join(f"{mark} {seconds:.1f}s" for mark, seconds in ours.marks.items())
            print(f"         raychat start-up (seconds after launch): {marks}", flush=True)
            for run in (plain, ours):
                print(describe_cpu(run), flush=True)
            pairs.append((plain, ours))
    print(f"logs (timestamped output of every run): {log_dir}")

    print("\nResults:")
    for i, (plain, ours) in enumerate(pairs):
        p_med, r_med = statistics.median(plain.steady(args.skip)), statistics.median(ours.steady(args.skip))
        common = sorted(set(plain.steps) & set(ours.steps))
        worst = max(abs(plain.steps[s][0] - ours.steps[s][0]) for s in common)
        print(f"pair {i}: raychat / plain steady-state tok/s {p_med / r_med:.3f} (target >= {TARGET_RATIO}); "
              f"time to first step {ours.first_step_at:.1f}s vs {plain.first_step_at:.1f}s "
              f"(+{ours.first_step_at - plain.first_step_at:.1f}s); logged losses over {len(common)} steps "
              f"{'identical' if worst == 0 else f'differ by up to {worst:.6f}'}")
    if len(pairs) > 1:
        p_all = statistics.median([dt for plain, _ in pairs for dt in plain.steady(args.skip)])
        r_all = statistics.median([dt for _, ours in pairs for dt in ours.steady(args.skip)])
        print(f"all pairs: raychat / plain steady-state tok/s {p_all / r_all:.3f}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
