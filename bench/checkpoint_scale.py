"""What one rank writes, reads and holds for a checkpoint as the world size grows (gloo on CPU).

The headline run saves from 8-16 GPUs; a checkpoint's cost must fall as 1/W per rank. For each W
this spawns W real gloo processes that build the model as a worker does (a real GPT and MuonAdamW,
one optimizer step taken so the state is populated), save through the worker's path
(raychat.worker.state.state_pieces -> CheckpointSaver: each rank writes what it owns, no
gather), then resume at the same W through it (Restore -> read_share -> apply_share) and check the
state came back bit for bit. It prints one JSON object per W:

  checkpoint_bytes              the files of the checkpoint directory
  written_bytes_max_rank        the largest share one rank wrote
  read_bytes_total / _max_rank  bytes read on resume, all ranks / the worst rank
  driver_read_bytes             what the driver's pre-flight check reads (manifest, meta: no tensors)
  save_stall_s                  the longest a rank's training thread waited for its save
  step_s                        one training step of the same model, for the stall / step ratio
  peak_rss_delta_save_max_rank  extra host memory of the worst rank during the save, over its
                                peak after the training step (ru_maxrss, KiB resolution)
  save_host_bytes_max_rank      the host buffers the worst rank's save snapshot fills (its share)
  bitwise                       every rank's model and optimizer state equal after the resume

Each world size runs on local disk and on S3 (moto's server, started here on 127.0.0.1; --storage).
Bytes are the checkpoint layer's own counters (raychat.checkpoint.shardfile.io_count: every byte
a rank file writes or a verified read returns); the driver's are the kernel's (bench.os_bytes:
/proc/self/io locally, loopback traffic on S3).
The targets (issue 19) are checked and printed beside the numbers: per-rank writes and reads
<= 1.5 x checkpoint / W + the model's share; resume total <= 1.1 x checkpoint; driver <= 1 MB;
a save's host memory <= 1.5 x checkpoint / W; the stall <= one step.

    python -m bench.checkpoint_scale --workers 1,2,4 --depth 6 --json
"""

import argparse
import json
import resource
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.os_bytes import os_bytes
from raychat.checkpoint.catalog import latest_valid_checkpoint
from raychat.checkpoint.format import damage, read_manifest, read_meta
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.resume import Restore
from raychat.checkpoint.saver import CheckpointSaver
from raychat.checkpoint.shardfile import io_count
from raychat.common import RaychatError, run_cli
from raychat.model.gpt import GPTConfig, build_model, gpt_config
from raychat.optim.base import ShardedOptimizer
from raychat.optim.muon_adamw import build_optimizer
from raychat.storage import Storage
from raychat.worker.state import apply_share, read_share, state_pieces
from testkit.s3_server import start_moto

VOCAB, SEQ, ROWS, STEP = 8192, 256, 4, 1
MB_FIELDS = ("checkpoint_bytes", "written_bytes_max_rank", "read_bytes_max_rank", "read_bytes_total",
             "peak_rss_delta_save_max_rank", "save_host_bytes_max_rank")
BUCKET = "raychat-bench"


def _build(depth: int) -> tuple[torch.nn.Module, ShardedOptimizer]:
    torch.manual_seed(0)
    model = build_model(gpt_config(depth=depth, aspect_ratio=64, head_dim=64, max_seq_len=SEQ,
                                   vocab_size=VOCAB, window_pattern="L"), "cpu")
    optimizer = build_optimizer(model, embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02,
                                scalar_lr=0.5, weight_decay=0.2)
    return model, optimizer


def _train_step(model: torch.nn.Module, optimizer: ShardedOptimizer, world: int, rank: int) -> float:
    """One step on this rank's rows (the optimizer reduces the gradients over the group)."""
    t0 = time.perf_counter()
    tokens = torch.randint(0, VOCAB, (ROWS * world, SEQ + 1), generator=torch.Generator().manual_seed(0))
    mine = tokens[rank * ROWS:(rank + 1) * ROWS]
    model(mine[:, :-1], mine[:, 1:]).backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _states_equal(a: tuple, b: tuple, world: int, rank: int) -> bool:
    """The model and this rank's optimizer pieces and plain data, bit for bit."""
    (pieces_a, plain_a), (pieces_b, plain_b) = state_pieces(*a, world, rank), state_pieces(*b, world, rank)
    same_pieces = len(pieces_a) == len(pieces_b) and all(
        p.name == q.name and p.start == q.start and torch.equal(p.tensor, q.tensor)
        for p, q in zip(pieces_a, pieces_b, strict=True))
    models = zip(a[0].state_dict().values(), b[0].state_dict().values(), strict=True)
    return plain_a == plain_b and same_pieces and all(torch.equal(x, y) for x, y in models)


def _rank(rank: int, world: int, depth: int, tmp: str, run_uri: str) -> None:
    torch.set_num_threads(1)
    tmp_dir = Path(tmp)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{tmp_dir / 'store'}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=600))

    def gather(obj):
        if world == 1:
            return [obj]
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    run = Storage(run_uri)
    model, optimizer = _build(depth)
    step_s = _train_step(model, optimizer, world, rank)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    saver = CheckpointSaver(run, keep=0, rank=rank, world_size=world, log=lambda _: None)
    saver.prepare(STEP)
    token = gather(f"bench-{time.time()}")[0]
    written0 = io_count.written
    t0 = time.perf_counter()
    pieces, plain = state_pieces(model, optimizer, world, rank)
    meta = CheckpointMeta(step=STEP, model_config=GPTConfig(), world_size=world) if rank == 0 else None
    saver.save(STEP, pieces, token, meta, extra=plain)
    stall = time.perf_counter() - t0
    host_bytes = saver.writer.buffer_bytes
    saver.close()
    written = io_count.written - written0
    peak_delta = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    gather(None)  # every rank's part, and rank 0's manifest, are written

    read0 = io_count.read
    resumed = _build(depth)
    names = gather([latest_valid_checkpoint(run).name] if rank == 0 else None)[0]
    restore = Restore(run, names, gather, lambda _: None)
    share = restore.load(lambda reader: read_share(reader, resumed[0], resumed[1], world, rank))
    apply_share(share, resumed[0], resumed[1], world, torch.device("cpu"))
    read = io_count.read - read0
    bitwise = _states_equal((model, optimizer), resumed, world, rank)
    result = {"rank": rank, "written": written, "read": read, "stall_s": stall, "step_s": step_s,
              "peak_rss_delta_kib": peak_delta, "save_host_bytes": host_bytes, "bitwise": bitwise}
    (tmp_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def driver_check_bytes(checkpoint: Storage, storage: str) -> int:
    """Bytes the driver's pre-flight reads (the manifest and sizes: damage; meta.json), as the kernel
    counts them: this process's reads on local disk, loopback traffic (HTTP included) on S3."""
    read0, _ = os_bytes(storage)
    damage(checkpoint, deep=False)
    read_meta(checkpoint)
    return os_bytes(storage)[0] - read0


def measure(world: int, depth: int, storage: str, endpoint: str | None) -> dict:
    """One world size on `storage` (local or s3: a fresh prefix in the bench's moto bucket)."""
    tmp = tempfile.mkdtemp(prefix="raychat-ckpt-scale-")
    run_uri = (str(Path(tmp) / "run") if storage == "local" else
               f"s3://{BUCKET}/scale-{world}-{time.time_ns()}?endpoint_override={endpoint}&scheme=http")
    try:
        if world == 1:
            _rank(0, 1, depth, tmp, run_uri)
        else:
            mp.spawn(_rank, args=(world, depth, tmp, run_uri), nprocs=world, join=True)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
        directory = Storage(run_uri).child("checkpoint_000001")
        size = sum(entry["bytes"] for entry in read_manifest(directory).values())
        model_bytes = sum(t.numel() * t.element_size() for t in _build(depth)[0].state_dict().values())
        return {
            "workers": world, "depth": depth, "storage": storage, "checkpoint_bytes": size,
            "written_bytes_max_rank": max(r["written"] for r in ranks),
            "read_bytes_total": sum(r["read"] for r in ranks),
            "read_bytes_max_rank": max(r["read"] for r in ranks),
            "driver_read_bytes": driver_check_bytes(directory, storage),
            "save_stall_s": round(max(r["stall_s"] for r in ranks), 4),
            "step_s": round(max(r["step_s"] for r in ranks), 4),
            "peak_rss_delta_save_max_rank": 1024 * max(r["peak_rss_delta_kib"] for r in ranks),
            "save_host_bytes_max_rank": max(r["save_host_bytes"] for r in ranks),
            "bitwise": all(r["bitwise"] for r in ranks),
            "model_share_bytes": model_bytes // world,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def targets(r: dict) -> dict[str, bool]:
    """Issue 19's targets for one row."""
    per_rank = 1.5 * r["checkpoint_bytes"] / r["workers"] + r["model_share_bytes"]
    return {"written_per_rank": r["written_bytes_max_rank"] <= per_rank,
            "read_per_rank": r["read_bytes_max_rank"] <= per_rank,
            "read_total": r["read_bytes_total"] <= 1.1 * r["checkpoint_bytes"],
            "driver": r["driver_read_bytes"] <= 1_000_000,
            "save_host_memory": max(r["peak_rss_delta_save_max_rank"], r["save_host_bytes_max_rank"])
            <= 1.5 * r["checkpoint_bytes"] / r["workers"],
            "stall_under_a_step": r["save_stall_s"] <= r["step_s"]}


def describe(row: dict) -> str:
    ok = ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in row["targets_met"].items())
    mb = {k: row[k] / 1e6 for k in MB_FIELDS}
    return (f"W={row['workers']} ({row['storage']}): checkpoint {mb['checkpoint_bytes']:.1f} MB, max rank "
            f"wrote {mb['written_bytes_max_rank']:.1f} MB and read {mb['read_bytes_max_rank']:.1f} MB, all "
            f"ranks read {mb['read_bytes_total']:.1f} MB, driver {row['driver_read_bytes']:,} B, stall "
            f"{row['save_stall_s']:.3f}s vs step {row['step_s']:.3f}s, save host buffers "
            f"{mb['save_host_bytes_max_rank']:.1f} MB (RSS +{mb['peak_rss_delta_save_max_rank']:.1f} MB over "
            f"the training peak), bitwise {row['bitwise']}; {ok}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.checkpoint_scale",
        description="Bytes each rank writes and reads for a sharded checkpoint, the driver's check, the "
                    "save stall and host memory, at several world sizes (gloo processes on this CPU).")
    parser.add_argument("--workers", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    parser.add_argument("--depth", type=int, default=6, help="model depth (width 64 x depth; default 6)")
    parser.add_argument("--storage", default="local,s3", help="where the run lives, comma-separated: local "
                        "(a temp dir) and/or s3 (moto's S3 server, started here on 127.0.0.1; default both)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per row only")
    args = parser.parse_args(argv)
    storages = [s.strip() for s in args.storage.split(",") if s.strip()]
    if not storages or set(storages) - {"local", "s3"}:
        raise RaychatError(f"--storage takes local and/or s3, got {args.storage!r}")
    server, endpoint = start_moto(BUCKET) if "s3" in storages else (None, None)
    try:
        for storage in storages:
            for world in [int(w) for w in args.workers.split(",")]:
                row = measure(world, args.depth, storage, endpoint)
                row["targets_met"] = targets(row)
                print(json.dumps(row) if args.json else describe(row), flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    run_cli(main)
