"""The CORE metric in a training run: when the loop evaluates it, and the evaluation across ranks
(the driver's check of the eval bundle is raychat.evaluation.download.check_eval_bundle).

As nanochat's base_train: every --core-metric-every steps and at the last step, every rank scores
its share of --core-metric-max-per-task examples per task on the uncompiled model (prompt shapes
vary), the per-example results are gathered, and rank 0 logs `Step 02000 | CORE metric: 0.1234`.
The value goes to Ray Train / Tune (`core_metric`, and its cost in `core_metric_seconds`), the gauge
raychat_core_metric, wandb (core_metric and the centered results per task) and the loop state saved
in each checkpoint.
"""

import time

from raychat.checkpoint.meta import LoopState
from raychat.config import TrainConfig
from raychat.evaluation.bundle import cached_bundle
from raychat.evaluation.core import combine, format_core_line, score_shard
from raychat.evaluation.download import bundle_dir
from raychat.worker.components import Worker, all_gather_objects


def core_due(cfg: TrainConfig, step: int, last_step: bool) -> bool:
    """nanochat's rule: at the last step and every N steps after step 0, when on."""
    every = cfg.core_metric_every
    return every > 0 and (last_step or (step > 0 and step % every == 0))


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
