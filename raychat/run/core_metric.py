"""The CORE metric in a training run: the driver's check of the eval bundle and the loop's evaluation.

As nanochat's base_train: every --core-metric-every steps and at the last step, every rank scores
its share of --core-metric-max-per-task examples per task on the uncompiled model (prompt shapes
vary), the per-example results are gathered, and rank 0 logs `Step 02000 | CORE metric: 0.1234`.
The value goes to Ray Train / Tune (`core_metric`, and its cost in `core_metric_seconds`), the gauge
raychat_core_metric, wandb (core_metric and the centered results per task) and the loop state saved
in each checkpoint.
"""

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

from raychat.config import TrainConfig
from raychat.evaluation.bundle import CONFIG_FILE, cached_bundle, default_bundle_dir, load_bundle
from raychat.evaluation.core import combine, format_core_line, score_shard
from raychat.evaluation.download import EVAL_BUNDLE_URL, download_eval_bundle, offline_error
from raychat.run.worker_setup import LoopState, Worker, all_gather_objects


def bundle_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.eval_bundle or default_bundle_dir()).expanduser().resolve()


def core_enabled(cfg: TrainConfig) -> bool:
    return cfg.core_metric_every > 0


def core_due(cfg: TrainConfig, step: int, last_step: bool) -> bool:
    """nanochat's rule: at the last step and every N steps after step 0, when on."""
    every = cfg.core_metric_every
    return every > 0 and (last_step or (step > 0 and step % every == 0))


def check_eval_bundle(cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainConfig:
    """Driver side, before any worker starts: with CORE on, the bundle must be there and whole. A
    missing one is fetched (as nanochat does on first use, from $RAYCHAT_EVAL_BUNDLE_URL if set);
    offline (or with RAYCHAT_OFFLINE set) that fails in one line saying where to put it. Workers on
    other nodes read the same path, so it must exist there too. Returns cfg with that path made
    absolute (the workers' working directory is not the driver's)."""
    if not core_enabled(cfg):
        return cfg
    directory = bundle_dir(cfg)
    if not (directory / CONFIG_FILE).is_file():
        url = os.environ.get("RAYCHAT_EVAL_BUNDLE_URL") or EVAL_BUNDLE_URL
        if os.environ.get("RAYCHAT_OFFLINE", "") not in ("", "0"):
            raise offline_error(url, directory, "RAYCHAT_OFFLINE is set")
        log(f"No eval bundle in {directory}: fetching it (CORE metric every {cfg.core_metric_every} steps)")
        download_eval_bundle(directory, url=url, log=log)
    bundle = load_bundle(directory)
    log(f"CORE: {len(bundle.tasks)} tasks from {directory}, every {cfg.core_metric_every} steps, "
        f"at most {cfg.core_metric_max_per_task} examples per task")
    return dataclasses.replace(cfg, eval_bundle=str(directory))


def evaluate_core(w: Worker, state: LoopState) -> dict[str, float]:
    """Score CORE on every rank, gather the per-example results, log and record the metric; returns
    what goes to Ray Train / Tune."""
    cfg = w.cfg
    bundle = cached_bundle(str(bundle_dir(cfg)))
    t0 = time.perf_counter()
    part = score_shard(w.orig_model, w.tokenizer, bundle, cfg.core_metric_max_per_task, w.rank, w.world_size,
                       w.device)
    result = combine(bundle, cfg.core_metric_max_per_task, all_gather_objects(part, w.world_size))
    seconds = time.perf_counter() - t0
    state.core_metric = result.core_metric
    w.publisher.core(state.step, format_core_line(state.step, result.core_metric), result.core_metric,
                     result.centered, seconds)
    return {"core_metric": result.core_metric, "core_metric_seconds": seconds}
