"""`python -m raychat.train`: the driver. Prepares inputs, prints the plan, runs a TorchTrainer.

Alone on a machine it starts a local Ray instance (dashboard on 127.0.0.1) and, when the data dir
is empty, prepares a corpus and trains a tokenizer, so one command works offline on a fresh box.
Under `ray job submit` (or with RAY_ADDRESS) it joins that cluster. Everything is checked before any
worker starts: a bad corpus, tokenizer or storage path fails in seconds with one line, not hours in.
"""

import argparse
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from raychat.checkpoint.format import latest_valid_checkpoint, read_meta
from raychat.checkpoint.resume import driver_choice
from raychat.checkpoint.stop_note import clear_stop_note, read_stop_note
from raychat.common import (
    RaychatError,
    default_data_dir,
    default_storage_path,
    default_tokenizer_dir,
    run_cli,
)
from raychat.config import TrainConfig, add_config_flags, config_from_args
from raychat.corpus.check import validate_corpus
from raychat.corpus.default import prepare_default_corpus
from raychat.data.budget import corpus_budget_lines
from raychat.model.compile_check import check_compile
from raychat.model.precision import check_precision
from raychat.run.console import install_driver_printer, plain_when_redirected
from raychat.run.elastic import FreshClusterView, PlannedResizeSave, final_metrics, start_coordinator
from raychat.run.loop import train_loop_per_worker
from raychat.run.runtime_env import worker_runtime_env
from raychat.scaling import format_plan, resolve_plan
from raychat.storage import Storage, normalize_location
from raychat.tokenizer.core import Tokenizer, check_vocab
from raychat.tokenizer.train import train_tokenizer


@dataclass
class RunPaths:
    data_dir: str
    tokenizer_dir: str
    storage_path: str  # absolute local path or URI (query parameters kept)

    @classmethod
    def resolve(cls, cfg: TrainConfig) -> "RunPaths":
        return cls(
            data_dir=str(Path(cfg.data_dir or default_data_dir()).expanduser().resolve()),
            tokenizer_dir=str(Path(cfg.tokenizer_dir or default_tokenizer_dir()).expanduser().resolve()),
            storage_path=normalize_location(cfg.storage_path or str(default_storage_path())),
        )

    def run(self, name: str) -> Storage:
        """The run's directory: `<storage_path>/<name>`."""
        return Storage(self.storage_path).child(name)


ELASTIC_START_TIMEOUT_S = "5"  # seconds an elastic restart waits for its placement before resizing


def connect_ray(num_workers: int) -> None:
    """Join the cluster named by RAY_ADDRESS (set by `ray job submit`), else start a local one."""
    plain_when_redirected()
    if ray.is_initialized():
        install_driver_printer()
        return
    # Workers are started by the cluster's raylets, not by this process: pass our settings along
    # (never credentials: Ray shows the runtime env in its job list).
    runtime_env = worker_runtime_env(os.environ)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=runtime_env, log_to_driver=True)
    else:
        # Logical CPUs: one per worker plus room for Ray Data's read/tokenize tasks; threads are
        # sized by the workers themselves.
        cpus = max(os.cpu_count() or 1, num_workers) + 2
        ray.init(num_cpus=cpus, include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True,
                 runtime_env=runtime_env)
    install_driver_printer()


def prepare_inputs(cfg: TrainConfig, paths: RunPaths, log=print) -> Tokenizer:
    """Corpus and tokenizer ready and valid, or a one-line error before any worker starts."""
    data_dir = Path(paths.data_dir)
    if not any(data_dir.glob("shard_*.parquet")):
        log(f"No corpus in {data_dir}: preparing one")
        prepare_default_corpus(data_dir, log=log)
    summary = validate_corpus(data_dir)
    log(f"Corpus: {summary}")
    tok_dir = Path(paths.tokenizer_dir)
    if not tok_dir.exists() or not any(tok_dir.iterdir()):
        log(f"No tokenizer in {tok_dir}: training one (vocab {cfg.vocab_size:,}) on {data_dir}")
        t0 = time.time()
        tokenizer = train_tokenizer(data_dir, tok_dir, vocab_size=cfg.vocab_size, log=log)
        log(f"Tokenizer trained in {time.time() - t0:.1f}s")
    else:
        tokenizer = Tokenizer.load(tok_dir)
    return tokenizer


def check_resumable(cfg: TrainConfig, paths: RunPaths, tokenizer: Tokenizer, log=print) -> Storage | None:
    """The checkpoint this run resumes from (hashes verified), which must fit this tokenizer."""
    latest = driver_choice(paths.run(cfg.name), cfg.resume_from_step, log=lambda m: log(f"warning: {m}"))
    if latest is None:
        return None
    meta = read_meta(latest)
    check_vocab(tokenizer, meta["vocab_size"], meta.get("tokenizer_fingerprint"), str(latest))
    log(f"Run {paths.run(cfg.name)} exists: resuming from {latest.name} (step {meta['step']})")
    return latest


def build_trainer(cfg: TrainConfig, *, session: str, resume_from: Storage | None = None,
                  run_config_overrides: dict | None = None, callbacks: list | None = None,
                  compile_checked: bool = False) -> TorchTrainer:
    """The TorchTrainer for one raychat run (used by the CLI and by every tune.sweep trial).

    `session` names this driver's run (a new one each time): checkpoints carry it, so a restarted
    worker group resumes from what this run wrote and a new run from the driver's choice; the run's
    coordinator actor (raychat.run.elastic) is named after it. `compile_checked`: the driver already
    compiled on the workers' device type (raychat.model.compile_check), so the workers need not."""
    # The dashboard's Train view (runs, attempts, workers) needs Ray Train's state tracking, which
    # is off by default in Ray 2.60 and read here, where the trainer is built.
    os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
    paths = RunPaths.resolve(cfg)
    min_workers, max_workers = cfg.worker_range()
    gpus = cfg.gpus_per_worker
    if gpus < 0:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    cpus = cfg.cpus_per_worker if cfg.cpus_per_worker > 0 else 1.0
    resources = {"CPU": cpus}
    if gpus > 0:
        resources["GPU"] = gpus
    elastic = min_workers != max_workers
    scaling = ScalingConfig(
        num_workers=(min_workers, max_workers) if elastic else max_workers,
        use_gpu=gpus > 0,
        resources_per_worker=resources,
        placement_strategy=cfg.placement_strategy,
        elastic_resize_monitor_interval_s=cfg.resize_check_every,
    )
    start_coordinator(session)
    callbacks = [*(callbacks or []), *([PlannedResizeSave(session), FreshClusterView()] if elastic else [])]
    run_kwargs = dict(
        name=cfg.name,
        storage_path=paths.storage_path,
        failure_config=FailureConfig(max_failures=cfg.max_failures),
        callbacks=callbacks,
    )
    run_kwargs.update(run_config_overrides or {})
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "train_config": cfg.to_dict(),
            "data_dir": paths.data_dir,
            "tokenizer_dir": paths.tokenizer_dir,
            "storage_path": paths.storage_path,
            "session": session,
            "resume_from": resume_from.name if resume_from is not None else None,
            "compile_checked": compile_checked,
        },
        scaling_config=scaling,
        run_config=RunConfig(**run_kwargs),
    )


def _worker_error(error: BaseException) -> RaychatError | None:
    """The RaychatError a worker raised, if that is what ended the run."""
    failures = getattr(error, "worker_failures", None) or {}
    for failure in failures.values():
        seen = failure
        while seen is not None:
            if isinstance(seen, RaychatError):
                return seen
            seen = seen.__cause__ or getattr(seen, "cause", None)
        text = str(failure)
        marker = "RaychatError: "
        if marker in text:
            return RaychatError(text.split(marker, 1)[1].strip().splitlines()[0])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raychat.train",
        description="Pretrain a nanochat-style GPT on a Ray cluster (or a local Ray instance). "
                    "--depth sets the model; the scaling rules derive horizon, batch size, learning rates "
                    "and weight decay from it. Prints the plan, then one line per step.",
        epilog="Examples:\n"
               "  python -m raychat.train --preset cpu     # small model, a few minutes on a laptop CPU\n"
               "  python -m raychat.train --depth 12 --num-workers 8\n"
               "  ray job submit --working-dir . -- python -m raychat.train --depth 24 \\\n"
               "      --num-workers 8:16 --storage-path s3://bucket/runs\n"
               "Re-running with the same --run-name resumes that run from its latest checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(parser)
    cfg = config_from_args(parser.parse_args(argv))
    check_precision(cfg.dtype, cfg.fp8, cfg.fp8_recipe, cfg.gpus_per_worker)
    compile_checked = check_compile(cfg.compile, cfg.gpus_per_worker)
    paths = RunPaths.resolve(cfg)
    Storage(paths.storage_path).check_writable()
    tokenizer = prepare_inputs(cfg, paths)
    min_workers, max_workers = cfg.worker_range()
    plan = resolve_plan(cfg, tokenizer.vocab_size, world_size=max_workers)
    if min_workers != max_workers:
        resolve_plan(cfg, tokenizer.vocab_size, world_size=min_workers)  # every size in range must work
    print(format_plan(plan), flush=True)
    for line in corpus_budget_lines(plan, paths.data_dir, tokenizer):
        print(line, flush=True)
    resume_from = check_resumable(cfg, paths, tokenizer)

    if min_workers != max_workers:
        # After a node loss Ray may size the restart from a view of the cluster that still has the
        # node, then wait this long for it before retrying at the size that fits (Ray's default 60 s;
        # raychat.run.elastic.FreshClusterView makes the retry see the truth). Read by the Train controller,
        # to which the driver forwards RAY_TRAIN_* (bench/RESULTS.md, "Recovery").
        os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", ELASTIC_START_TIMEOUT_S)
    connect_ray(max_workers)
    session = uuid.uuid4().hex
    trainer = build_trainer(cfg, session=session, resume_from=resume_from, compile_checked=compile_checked)
    clear_stop_note(paths.storage_path, cfg.name)
    t0 = time.time()
    try:
        result = trainer.fit()
    except Exception as e:  # Ray wraps worker errors; surface a user error as its one line
        user_error = _worker_error(e)
        if user_error is not None:
            raise user_error from None
        raise
    stop = read_stop_note(paths.storage_path, cfg.name)
    if stop is not None:
        raise RaychatError(f"loss became NaN/inf at step {stop['step']}: training stopped; the last good "
                           f"checkpoint is kept in {paths.run(cfg.name)} (lower the "
                           "learning rates or check the data, then re-run to resume)")
    metrics = final_metrics(session) or result.metrics or {}
    print("Training done.", flush=True)
    print(f"  min val bpb     : {metrics.get('min_val_bpb', float('nan')):.6f}")
    print(f"  steps           : {metrics.get('step', 0):,}")
    print(f"  tokens trained  : {metrics.get('total_tokens', 0):,}")
    print(f"  training time   : {metrics.get('total_training_time', 0.0) / 60:.2f}m "
          f"(wall {(time.time() - t0) / 60:.2f}m)")
    if metrics.get("restarts") or metrics.get("resizes"):
        redone = metrics.get("redone_steps", 0)
        print(f"  restarts        : {metrics.get('restarts', 0)} ({redone} steps redone), "
              f"planned resizes: {metrics.get('resizes', 0)}")
    if metrics.get("peak_memory_mib"):
        print(f"  peak memory     : {metrics['peak_memory_mib']:,.0f} MiB (rank 0)")
    final = latest_valid_checkpoint(paths.run(cfg.name), deep=False)
    if final is not None:
        print(f"  checkpoint      : {final}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    run_cli(main)
