"""What checkpointing costs a run, on local disk and on S3: the stall, the upload, the resume.

A save must not stall training (the issue's target: less than one step at d12 on S3), and a resume
should read each byte once per rank that needs it. Both depend on the bytes in a checkpoint and on
where it goes, so this measures them on real raychat models and optimizer state (built as a worker
builds them, one optimizer step taken so the state is populated), once on local disk and once on S3
in the same invocation:

  save    the snapshot stall (`CheckpointSaver.save` -> `AsyncCheckpointWriter.snapshot_seconds`,
          all the training thread waits for), one training step taken while the write runs, the
          background write + upload (`write_seconds`) and the bytes it wrote;
  memory  the memory tier (raychat.elastic.replicas): one replication's copy (the stall), its put and two
          holders' receipt (background), what a holder keeps, a restore from the holders; per rank
          at d24 for W = 8, 16, 64 with --network-gbps between nodes;
  resume  the driver's check (`damage`: manifest and sizes), a full hash pass (`damage(deep=True)`,
          what the driver did before sharded checkpoints) and one rank's `read_share` +
          `apply_share`, with the bytes each read.

One process saves here (world size 1); what W ranks each write and read is measured by
tests/test_checkpoint_sharded.py (gloo, 2 ranks).

Bytes are counted by the operating system, not by the code under test: /proc/self/io (rchar, wchar)
for local disk, loopback traffic (/proc/net/dev `lo`, HTTP headers included, and anything else on
the machine's loopback meanwhile) for S3. The S3 server is moto, started here as its own process on
127.0.0.1 (so its Python does not share this process's GIL) and stopped at the end. moto is far
slower than a real object store and shares this machine's CPUs, so its figures bound the overhead
from above. Local reads come from the page cache (the files were just written).

A training step (forward, backward, optimizer) of the same model on one 1 x 512-token batch gives
the "stall / step" ratio. From the largest depth measured, a d24 estimate is plain arithmetic:
model = params x 4 bytes, optimizer = params x the measured optimizer bytes per parameter,
seconds = bytes / the measured MB/s; bytes per rank at W ranks, sharded (each rank writes and reads
1/W) against gathered (raychat before sharding: rank 0 wrote everything, every rank and the driver
read everything).

    python -m bench.checkpoint                      # d4 and d12 (a few minutes on 2 cores)
    python -m bench.checkpoint --depths 2 --quick   # smoke test (seconds)

The numbers go to $OUT/checkpoint.json when $OUT is set, else bench/out/checkpoint.json.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

from bench.os_bytes import os_bytes
from raychat.checkpoint.format import MANIFEST_FILE, checkpoint_dir_name, damage, rank_file
from raychat.checkpoint.meta import CheckpointMeta, LoopState
from raychat.checkpoint.reader import CheckpointReader
from raychat.checkpoint.saver import CheckpointSaver
from raychat.checkpoint.shardfile import io_count
from raychat.common import RaychatError, run_cli
from raychat.config import TrainConfig
from raychat.data.cursor import RankCursor
from raychat.elastic.cadence import holder_bytes
from raychat.elastic.holders import Replica, ReplicaHolder
from raychat.elastic.replicas import MemoryRestore, Replicator
from raychat.model.gpt import GPTConfig, build_model
from raychat.optim.muon_adamw import build_optimizer
from raychat.scaling import resolve_plan
from raychat.storage import Storage
from raychat.worker.state import apply_share, read_share, state_pieces
from testkit.s3_server import start_moto

BUCKET = "raychat-bench"
MB = 1e6


def measure(depth: int, args: argparse.Namespace, locations: dict[str, str]) -> dict:
    """Build the model at `depth`, time its training step, then save and load it at each location."""
    cfg = TrainConfig(depth=depth, max_seq_len=args.seq_len, device_batch_size=1,
                      total_batch_size=args.seq_len, window_pattern="L", vocab_size=args.vocab_size)
    plan = resolve_plan(cfg, args.vocab_size)
    torch.manual_seed(0)
    model = build_model(plan.model, "cpu")
    optimizer = build_optimizer(model, embedding_lr=cfg.embedding_lr, unembedding_lr=cfg.unembedding_lr,
                                matrix_lr=cfg.matrix_lr, scalar_lr=cfg.scalar_lr,
                                weight_decay=plan.weight_decay)
    tokens = torch.randint(0, args.vocab_size, (1, args.seq_len + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> float:
        start = time.perf_counter()
        model(x, y).backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()  # populates the optimizer state; also the slow first step, so not timed
    step_s = statistics.median(step() for _ in range(args.steps))
    pieces, plain = state_pieces(model, optimizer, 1, 0)
    meta = CheckpointMeta(step=1, model_config=plan.model)
    result = {"depth": depth, "params": plan.params["total"], "flops_per_token": plan.flops_per_token,
              "batch": f"1 x {args.seq_len} tokens", "step_s": step_s, "backends": {}}
    print(f"d{depth}: {plan.params['total'] / 1e6:,.1f} M params, training step {step_s:.2f} s "
          f"(median of {args.steps}, batch 1 x {args.seq_len} tokens)", flush=True)

    for backend, location in locations.items():
        run = Storage(location).child(f"d{depth}")
        saver = CheckpointSaver(run, keep=0, rank=0, world_size=1, log=lambda _: None)
        read0, written0 = os_bytes(backend)
        saver.save(1, pieces, "bench", meta, extra=plain)
        stall_s = saver.writer.snapshot_seconds
        step_during_write_s = step()  # what the 2 cores give training while the writer hashes and uploads
        write_outlasted_step = not saver.writer.done()
        saver.close()
        written = os_bytes(backend)[1] - written0
        directory = run.child(checkpoint_dir_name(1))
        files = json.loads(directory.read_bytes(MANIFEST_FILE))["files"]

        read0 = os_bytes(backend)[0]
        problem = damage(directory)
        driver_read = os_bytes(backend)[0] - read0
        read0 = os_bytes(backend)[0]
        start = time.perf_counter()
        problem = problem or damage(directory, deep=True)
        verify_s, verify_read = time.perf_counter() - start, os_bytes(backend)[0] - read0
        if problem is not None:
            raise RaychatError(f"the checkpoint just written to {directory} is damaged: {problem}")
        read0 = os_bytes(backend)[0]
        start = time.perf_counter()
        with CheckpointReader(directory) as reader:
            share = read_share(reader, model, optimizer, 1, 0)
        apply_share(share, model, optimizer, 1, torch.device("cpu"))
        load_s, load_read = time.perf_counter() - start, os_bytes(backend)[0] - read0
        del share
        checkpoint_bytes = sum(entry["bytes"] for entry in files.values())
        params = plan.params["total"]
        result["backends"][backend] = {
            "stall_s": stall_s, "stall_per_step": stall_s / step_s,
            "step_during_write_s": step_during_write_s,
            "write_outlasted_step": write_outlasted_step, "write_s": saver.writer.write_seconds,
            "bytes_written": written, "checkpoint_bytes": checkpoint_bytes,
            "model_bytes": 4 * params, "optim_bytes": checkpoint_bytes - 4 * params,
            "shard_bytes": files[rank_file(0, 1)]["bytes"], "driver_bytes_read": driver_read,
            "verify_s": verify_s, "verify_bytes_read": verify_read,
            "load_s": load_s, "load_bytes_read": load_read,
        }
        print(row(result, backend), flush=True)  # a d12 run takes minutes: show each as it lands
    if args.memory:
        result["memory"] = measure_memory_tier(model, optimizer, step_s, step)
        print(memory_row(result), flush=True)
    return result


def measure_memory_tier(model: torch.nn.Module, optimizer, step_s: float, step) -> dict:
    """The memory tier's costs (raychat.elastic.replicas) on this machine's Ray: one replication (the copy
    the loop waits for; the put and the two holders' receipt, in the background while a step trains),
    what the holders keep, and a restore through the sharded reader's interface. Both holders are on
    this node here: the network transfer a peer node adds is estimated for d24 from --network-gbps."""
    holders = [ReplicaHolder.remote(), ReplicaHolder.remote()]
    replicator = Replicator(holders[0], holders[1], epoch=1, attempt=0, log=lambda _: None, warn=print,
                            every=1)
    try:
        ray.get([h.nbytes.remote() for h in holders])  # the holders' processes are up
        stalls, sends = [], []
        for i in range(3):  # the first copy allocates its host buffers: the median is the steady state
            pieces, plain = state_pieces(model, optimizer, 1, 0)
            replica = Replica(epoch=1, attempt=0, step=i + 1, rank=0, world_size=1, pieces=pieces,
                              cursor=RankCursor(0, 1, 0, []), loop_state=LoopState(step=i + 1), extra=plain,
                              units=(1, None))
            replicator.replicate(replica)
            stalls.append(replicator.writer.snapshot_seconds)
            step_during_send_s = step()
            replicator.writer.wait()
            sends.append(replicator.writer.write_seconds)
        held = ray.get(holders[1].nbytes.remote())
        read0 = io_count.read
        start = time.perf_counter()
        restore = MemoryRestore.agree(holders, epoch=1, min_step=0, model=GPTConfig(), rank=0,
                                      all_gather=lambda obj: [obj], log=print)
        share = restore.load(lambda reader: read_share(reader, model, optimizer, 1, 0))
        apply_share(share, model, optimizer, 1, torch.device("cpu"))
        restore_s = time.perf_counter() - start
        stall_s = statistics.median(stalls)
        return {"bytes_per_rank": replica.nbytes, "stall_s": stall_s, "stall_per_step": stall_s / step_s,
                "send_s": statistics.median(sends), "step_during_send_s": step_during_send_s,
                "holder_bytes": held, "restore_s": restore_s, "storage_bytes_read": io_count.read - read0,
                "copy_bytes_per_s": replica.nbytes / stall_s}
    finally:
        replicator.close()
        for holder in holders:
            ray.kill(holder)


def memory_row(r: dict) -> str:
    m = r["memory"]
    copy = f"copy {1000 * m['stall_s']:.1f} ms ({m['stall_per_step']:.3f} step)"
    return (f"d{r['depth']:<4} memory  | {copy} | "
            f"put + 2 holders {m['send_s']:.2f} s (step meanwhile {m['step_during_send_s']:.2f} s) | "
            f"{m['bytes_per_rank'] / 1e9:.3f} GB per rank per replication | holder keeps "
            f"{m['holder_bytes'] / 1e9:.3f} GB (2 steps) | restore {m['restore_s']:.2f} s, "
            f"{m['storage_bytes_read']} B from storage")


def d24_estimate(base: dict, args: argparse.Namespace) -> dict:
    """Bytes at d24 from its parameter count and `base`'s optimizer bytes per parameter; seconds
    from `base`'s measured throughputs; the step scaled by FLOPs per token."""
    plan = resolve_plan(TrainConfig(depth=24, max_seq_len=args.seq_len, device_batch_size=1,
                                    total_batch_size=args.seq_len, window_pattern="L",
                                    vocab_size=args.vocab_size), args.vocab_size)
    params = plan.params["total"]
    local = base["backends"]["local"]
    model_bytes = 4 * params
    optim_bytes = params * local["optim_bytes"] / base["params"]
    total = model_bytes + optim_bytes
    step_s = base["step_s"] * plan.flops_per_token / base["flops_per_token"]
    estimate = {"params": params, "model_bytes": model_bytes, "optim_bytes": optim_bytes,
                "optim_bytes_per_param": optim_bytes / params, "step_s": step_s, "from_depth": base["depth"],
                "backends": {}}
    for backend, m in base["backends"].items():
        scale = total / m["checkpoint_bytes"]
        estimate["backends"][backend] = {key: m[key] * scale for key in ("stall_s", "write_s", "verify_s",
                                                                           "load_s")}
        estimate["backends"][backend]["stall_per_step"] = m["stall_s"] * scale / step_s
    if "memory" in base:  # per rank at W ranks: its 1/W, copied at the measured rate, sent at the network's
        m, link = base["memory"], args.network_gbps * 1e9 / 8
        estimate["memory"] = {str(world): {
            "bytes_per_rank": total / world, "copy_s": total / world / m["copy_bytes_per_s"],
            "node_send_s": 8 * total / world / link,
            "holder_bytes_per_node": holder_bytes(int(total / world), 8),
            "copy_per_step": total / world / m["copy_bytes_per_s"] / step_s} for world in (8, 16, 64)}
        estimate["network_gbps"] = args.network_gbps
    return estimate


HEADER = ("depth backend | stall ms | stall/step | step while writing s | write s (MB/s)  | written GB "
          "| verify s (MB/s)  | load s (MB/s)    | driver read B | read per rank GB (x ckpt)")


def row(r: dict, backend: str) -> str:
    m, gb = r["backends"][backend], r["backends"][backend]["checkpoint_bytes"] / 1e9
    return (f"d{r['depth']:<4} {backend:<7} | {1000 * m['stall_s']:8.0f} | {m['stall_per_step']:10.3f} | "
            f"{m['step_during_write_s']:8.2f} (alone {r['step_s']:.2f}) | "
            f"{m['write_s']:6.2f} ({gb * 1e3 / m['write_s']:5.0f}) | {m['bytes_written'] / 1e9:10.3f} | "
            f"{m['verify_s']:6.2f} ({gb * 1e3 / m['verify_s']:5.0f}) | "
            f"{m['load_s']:6.2f} ({gb * 1e3 / m['load_s']:5.0f}) | {m['driver_bytes_read']:>11,} | "
            f"{m['load_bytes_read'] / 1e9:.3f} ({m['load_bytes_read'] / m['checkpoint_bytes']:.2f}x)")


def report(results: list[dict], estimate: dict) -> None:
    print("\n" + HEADER)
    for r in results:
        for backend in r["backends"]:
            print(row(r, backend))
        if "memory" in r:
            print(memory_row(r))
    print("\nS3 / local (time ratios):")
    for r in results:
        s3, local = r["backends"]["s3"], r["backends"]["local"]
        print(f"d{r['depth']:<4} " + ", ".join(f"{key.removesuffix('_s')} {s3[key] / local[key]:.2f}x"
                                              for key in ("stall_s", "write_s", "verify_s", "load_s")))
    e = estimate
    total = e["model_bytes"] + e["optim_bytes"]
    print(f"\nd24 estimate (arithmetic from d{e['from_depth']}): {e['params'] / 1e6:,.0f} M params; model "
          f"{e['model_bytes'] / 1e9:.2f} GB (4 B/param) + optimizer {e['optim_bytes'] / 1e9:.2f} GB "
          f"({e['optim_bytes_per_param']:.2f} B/param) = {total / 1e9:.2f} GB; step ~{e['step_s']:.1f} s "
          "(FLOPs-scaled)")
    for world in (8, 16, 64):
        print(f"  W={world:<3} per rank: sharded writes/reads {total / world / 1e9:.2f} GB, gathered "
              f"rank 0 wrote {total / 1e9:.2f} GB and every rank read {total / 1e9:.2f} GB "
              f"(x{world}); a resume reads {total / 1e9:.2f} GB in all, gathered "
              f"{total * (world + 1) / 1e9:.0f} GB")
    for backend, b in e["backends"].items():
        print(f"  {backend:<6} stall {b['stall_s']:.1f} s ({b['stall_per_step']:.2f} step), write "
              f"{b['write_s']:.0f} s, driver verify {b['verify_s']:.0f} s, load per rank {b['load_s']:.0f} s")
    for world, m in e.get("memory", {}).items():
        print(f"  memory W={world:<3} per rank {m['bytes_per_rank'] / 1e9:.2f} GB a replication: copy "
              f"{m['copy_s']:.2f} s ({m['copy_per_step']:.3f} step, this host's copy rate; a GPU's copy to "
              f"pinned memory differs); a node of 8 ranks sends {8 * m['bytes_per_rank'] / 1e9:.1f} GB to "
              f"its peer in {m['node_send_s']:.2f} s at {e['network_gbps']:g} Gbit/s and holds "
              f"{m['holder_bytes_per_node'] / 1e9:.1f} GB")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--workers" or a.startswith("--workers=") for a in argv):
        # Several world sizes are bench.checkpoint_scale's table (gloo ranks), under the name the
        # checkpoint issue gave it: `python -m bench.checkpoint --workers 1,2,4 --depth 6 --json`.
        from bench import checkpoint_scale

        return checkpoint_scale.main(argv)
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__,
                                     epilog="With --workers W1,W2,... [--depth D] [--storage local,s3] "
                                     "[--json]: bytes per rank at each world size "
                                     "(python -m bench.checkpoint_scale).",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="4,12", help="comma-separated model depths (default 4,12)")
    parser.add_argument("--steps", type=int, default=2, help="timed training steps per depth (default 2)")
    parser.add_argument("--local-dir", default=None, help="where the local-disk checkpoints go, in a "
                        "temporary directory removed at the end (default: the system temp dir)")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory tier "
                        "(peer-memory replicas: starts a local Ray instance)")
    parser.add_argument("--network-gbps", type=float, default=100.0, help="the network between nodes for "
                        "the memory tier's d24 estimate, in Gbit/s (default 100)")
    parser.add_argument("--quick", action="store_true", help="smoke test: vocab 4096, 128-token batch, "
                        "one timed step")
    args = parser.parse_args(argv)
    try:
        depths = [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        raise RaychatError(f"--depths must be comma-separated integers, got {args.depths!r}") from None
    if not depths or min(depths) < 1 or args.steps < 1:
        raise RaychatError("--depths needs at least one depth >= 1 and --steps must be at least 1")
    args.vocab_size, args.seq_len = (4096, 128) if args.quick else (32768, 512)
    args.steps = 1 if args.quick else args.steps
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    server, endpoint = start_moto(BUCKET)
    if args.memory:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    print(HEADER, flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="raychat_bench_ckpt_", dir=args.local_dir) as local:
            locations = {"local": local,
                         "s3": f"s3://{BUCKET}/bench?endpoint_override={endpoint}&scheme=http"}
            results = [measure(depth, args, locations) for depth in depths]
    finally:
        server.terminate()
        server.wait(timeout=30)
        if args.memory:
            ray.shutdown()
    estimate = d24_estimate(results[-1], args)
    report(results, estimate)

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "checkpoint.json"
    numbers = {"quick": args.quick, "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
               "depths": results, "d24_estimate": estimate}
    out.write_text(json.dumps(numbers, indent=2) + "\n")
    print(f"\nnumbers written to {out}; load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    run_cli(main)
