"""Depth -> training horizon, batch size, learning-rate and weight-decay scale; the per-step schedules.

raychat keeps nanochat's one-dial design (scripts/base_train.py): `--depth` sets the model, and rules
tuned on a d12 reference carry the hyperparameters to every other depth (muP style). All of it is
resolved by one pure function, `resolve_plan`, so `python -m raychat.plan` can show a run before it
starts, the trainer prints the same table at start-up, and tests can check every rule by hand.

The global batch is a whole number of rows of T tokens. How those rows are dealt to W workers and cut
into micro-batches also lives here, because the batch has to stay the same whatever W is: the
update is the same function of the same rows at any world size.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.model.gpt import GPT, GPTConfig, gpt_config
from raychat.model.precision import describe_precision
from raychat.records import Record

REF_DEPTH = 12  # nanochat tuned its hyperparameters at d12 and transfers them from there
B_REF = 2**19  # tokens per step that is optimal at d12 (measured by nanochat)
AUTO_DEVICE_BATCH_SIZE = 32  # --device-batch-size -1 where no device memory is known: nanochat's default
BATCH_EXPONENT = 0.383  # Power Lines (arxiv.org/abs/2505.13738): optimal batch grows as D**0.383

MOMENTUM_WARMUP_STEPS = 400
MOMENTUM_START = 0.85  # Muon momentum at step 0 ...
MOMENTUM_PEAK = 0.97  # ... after MOMENTUM_WARMUP_STEPS, held until the lr warmdown ...
MOMENTUM_END = 0.90  # ... and at the last step


@dataclass
class Plan(Record):
    """Everything the scaling rules decide for one run, at one world size."""

    model: GPTConfig
    params: dict[str, int]  # the model's parameter counts by group (GPT.num_scaling_params)
    scaling_params: int  # transformer matrices + lm_head: the N of the tokens:params ratio
    flops_per_token: int  # forward + backward
    total_batch_size: int  # tokens per optimizer step, all workers together
    num_iterations: int  # optimizer steps
    total_tokens: int  # total_batch_size * num_iterations
    tokens_per_param: float  # total_tokens / scaling_params
    target_tokens: int  # tokens the --target-param-data-ratio rule asks for (0 when that rule is off)
    lr_scale: float  # every learning rate is multiplied by this: sqrt(B / B_REF)
    weight_decay: float  # Muon weight decay at step 0, scaled from --weight-decay
    world_size: int
    rows_per_step: int  # rows of T tokens per optimizer step (global)
    grad_accum_steps: int  # max micro-batches any rank runs per step
    device_batch_size: int  # rows per micro-batch (at most)
    batch_rule: str  # "auto" (scaling rule) or "flag" (--total-batch-size)
    horizon_rule: str  # the flag that set num_iterations: num_iterations|target_flops|target_param_data_ratio
    # what the workers compute in on the machine that resolved the plan (raychat.model.precision)
    precision: str
    # "flag" (--device-batch-size N) or "auto" (-1: fitted to each GPU worker's memory, else
    # AUTO_DEVICE_BATCH_SIZE until then)
    device_batch_rule: str = "flag"

    @property
    def total_flops(self) -> int:
        return self.flops_per_token * self.total_tokens

    def to_json(self) -> dict[str, Any]:
        """The plan for people (`raychat.plan --json`, the metrics log): the record and its total
        FLOPs. Checkpoints store the record itself (`to_dict`)."""
        return {**self.to_dict(), "total_flops": self.total_flops}

    def at_world_size(self, world_size: int) -> "Plan":
        """The same run dealt to `world_size` workers: only the batch layout changes (an elastic
        group can run at any size of its range)."""
        accum = grad_accum_steps(self.rows_per_step, world_size, self.device_batch_size)
        return dataclasses.replace(self, world_size=world_size, grad_accum_steps=accum)

    def with_device_batch_size(self, rows: int) -> "Plan":
        """The same run in forward passes of at most `rows` rows (the step and its gradient do not change)."""
        accum = grad_accum_steps(self.rows_per_step, self.world_size, rows)
        return dataclasses.replace(self, device_batch_size=rows, grad_accum_steps=accum)

    @property
    def rows_per_rank(self) -> int:
        """Rows of a step on the busiest rank (rank 0)."""
        return rank_rows(self.rows_per_step, self.world_size, 0)


# ----------------------------------------------------------------------------------------------------
# Scaling rules


def scaling_params(param_counts: dict[str, int]) -> int:
    """The parameter count the scaling laws use: transformer matrices + lm_head (nanochat found this
    choice gives the cleanest laws; embeddings and scalars are left out)."""
    return param_counts["transformer_matrices"] + param_counts["lm_head"]


def auto_batch_size(horizon_ratio: float) -> int:
    """Optimal tokens per step for a run whose token horizon is `horizon_ratio` times d12's:
    B_REF * ratio**0.383, rounded to the nearest power of two (in log space)."""
    return 2 ** round(math.log2(B_REF * horizon_ratio**BATCH_EXPONENT))


def _meta_model(cfg: TrainConfig, depth: int, vocab_size: int) -> GPT:
    """The model for `depth` with the run's other shape flags, on the meta device: shapes only, so
    counting the parameters of even a huge model costs no memory."""
    config = gpt_config(depth, cfg.aspect_ratio, cfg.head_dim, cfg.max_seq_len, vocab_size,
                        cfg.window_pattern)
    with torch.device("meta"):
        return GPT(config)


def resolve_plan(cfg: TrainConfig, vocab_size: int, world_size: int = 1) -> Plan:
    """Apply nanochat's scaling rules to the flags: horizon, batch size, lr scale, weight decay, and
    the batch layout over `world_size` workers. RaychatError on anything impossible."""
    model = _meta_model(cfg, cfg.depth, vocab_size)
    params = model.num_scaling_params()
    n_params = scaling_params(params)
    flops_per_token = model.estimate_flops()
    ref_model = model if cfg.depth == REF_DEPTH else _meta_model(cfg, REF_DEPTH, vocab_size)
    n_ref = scaling_params(ref_model.num_scaling_params())

    # The token horizon relative to the d12 reference's (D / D_REF) drives batch size and weight
    # decay. The tokens:params ratio cancels out of it, so with the ratio rule off the relative
    # horizon is just the parameter ratio.
    ratio = cfg.target_param_data_ratio
    target_tokens = int(ratio * n_params) if ratio > 0 else 0
    horizon_ratio = target_tokens / (ratio * n_ref) if target_tokens > 0 else n_params / n_ref

    auto_batch = cfg.total_batch_size == -1
    total_batch_size = auto_batch_size(horizon_ratio) if auto_batch else cfg.total_batch_size
    # AdamW theory (and nanochat's assumption for Muon): lr grows as sqrt(B). Keeping the epoch time
    # scale B/(lr*wd*D) constant (arxiv.org/abs/2405.13698) then gives wd ~ sqrt(B/B_REF) * D_REF/D.
    lr_scale = math.sqrt(total_batch_size / B_REF)
    weight_decay = cfg.weight_decay * lr_scale / horizon_ratio

    rows = rows_per_step(total_batch_size, cfg.max_seq_len, auto_batch)
    auto_device_batch = cfg.device_batch_size == -1
    device_batch_size = AUTO_DEVICE_BATCH_SIZE if auto_device_batch else cfg.device_batch_size
    accum = grad_accum_steps(rows, world_size, device_batch_size)

    if cfg.num_iterations > 0:
        horizon_rule, num_iterations = "num_iterations", cfg.num_iterations
    elif cfg.target_flops > 0:
        horizon_rule = "target_flops"
        num_iterations = round(cfg.target_flops / (flops_per_token * total_batch_size))
    else:
        horizon_rule, num_iterations = "target_param_data_ratio", target_tokens // total_batch_size
    if num_iterations < 1:
        flag = "--" + horizon_rule.replace("_", "-")
        raise RaychatError(f"{flag} gives a horizon of 0 optimizer steps for a batch of {total_batch_size:,} "
                           f"tokens: raise {flag}, lower --total-batch-size, or pass --num-iterations")
    total_tokens = total_batch_size * num_iterations

    return Plan(
        model=model.config, params=dict(params), scaling_params=n_params, flops_per_token=flops_per_token,
        total_batch_size=total_batch_size, num_iterations=num_iterations, total_tokens=total_tokens,
        tokens_per_param=total_tokens / n_params, target_tokens=target_tokens, lr_scale=lr_scale,
        weight_decay=weight_decay, world_size=world_size, rows_per_step=rows, grad_accum_steps=accum,
        device_batch_size=device_batch_size, batch_rule="auto" if auto_batch else "flag",
        horizon_rule=horizon_rule,
        precision=describe_precision(cfg.dtype, cfg.fp8, cfg.fp8_recipe, cfg.gpus_per_worker),
        device_batch_rule="auto" if auto_device_batch else "flag",
    )


# ----------------------------------------------------------------------------------------------------
# Batch layout: R rows per step, dealt to W workers, cut into micro-batches


def rows_per_step(total_batch_size: int, max_seq_len: int, auto: bool = False) -> int:
    """Rows of T tokens in one optimizer step; the batch must be a whole number of rows."""
    if total_batch_size % max_seq_len == 0:
        return total_batch_size // max_seq_len
    suggestion = max(1, round(total_batch_size / max_seq_len)) * max_seq_len
    what = ("the auto batch size (from the scaling rule)" if auto else "--total-batch-size")
    raise RaychatError(f"{what} {total_batch_size:,} tokens is not a multiple of --max-seq-len "
                       f"{max_seq_len} (a step is a whole number of rows of T tokens): "
                       f"pass --total-batch-size {suggestion}")


def check_world_size(rows_per_step: int, world_size: int) -> None:
    """Every worker needs at least one row of every step; any world size from 1 to R works."""
    if not 1 <= world_size <= rows_per_step:
        raise RaychatError(f"--num-workers {world_size} does not fit a step of {rows_per_step} rows: every "
                           f"worker needs at least one row, so use 1 to {rows_per_step} workers "
                           f"(or raise --total-batch-size)")


def rank_rows(rows_per_step: int, world_size: int, rank: int) -> int:
    """Rows of each step that `rank` trains on: R//W, plus one for the first R%W ranks."""
    check_world_size(rows_per_step, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    return rows_per_step // world_size + (1 if rank < rows_per_step % world_size else 0)


def micro_batch_sizes(rows: int, device_batch_size: int) -> list[int]:
    """Cut one rank's rows into forward passes of at most device_batch_size rows (e.g. 20, 8 -> 8, 8, 4)."""
    if device_batch_size < 1:
        raise RaychatError(f"--device-batch-size must be at least 1, got {device_batch_size}")
    full, rest = divmod(rows, device_batch_size)
    return [device_batch_size] * full + ([rest] if rest else [])


def grad_accum_steps(rows_per_step: int, world_size: int, device_batch_size: int) -> int:
    """Micro-batches of the busiest rank per step (rank 0 always has the most rows)."""
    return len(micro_batch_sizes(rank_rows(rows_per_step, world_size, 0), device_batch_size))


# ----------------------------------------------------------------------------------------------------
# Per-step schedules (step counts from 0; the trainer applies them before each optimizer step)


def _warmdown_steps(num_iterations: int, warmdown_ratio: float) -> int:
    return round(warmdown_ratio * num_iterations)


def lr_multiplier(step: int, num_iterations: int, warmup_steps: int, warmdown_ratio: float,
                  final_lr_frac: float) -> float:
    """Linear warmup to 1 over warmup_steps, flat, then linear down to final_lr_frac over the last
    warmdown_ratio of the steps."""
    warmdown = _warmdown_steps(num_iterations, warmdown_ratio)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step <= num_iterations - warmdown:
        return 1.0
    progress = (num_iterations - step) / warmdown  # 1 at the start of the warmdown, 0 at the end
    return progress + (1 - progress) * final_lr_frac


def muon_momentum(step: int, num_iterations: int, warmdown_ratio: float) -> float:
    """Muon momentum: 0.85 -> 0.97 over the first 400 steps, held, then down to 0.90 during the lr
    warmdown (the warmup wins where the two overlap, as in nanochat)."""
    warmdown = _warmdown_steps(num_iterations, warmdown_ratio)
    warmdown_start = num_iterations - warmdown
    if step < MOMENTUM_WARMUP_STEPS:
        frac = step / MOMENTUM_WARMUP_STEPS
        return (1 - frac) * MOMENTUM_START + frac * MOMENTUM_PEAK
    if warmdown > 0 and step >= warmdown_start:
        progress = (step - warmdown_start) / warmdown
        return (1 - progress) * MOMENTUM_PEAK + progress * MOMENTUM_END
    return MOMENTUM_PEAK


def muon_weight_decay(step: int, num_iterations: int, weight_decay: float) -> float:
    """Muon weight decay: cosine from `weight_decay` (the plan's scaled value) at step 0 to 0 at the end."""
    return weight_decay * 0.5 * (1 + math.cos(math.pi * step / num_iterations))


# ----------------------------------------------------------------------------------------------------
# The readable table


def format_plan(plan: Plan) -> str:
    """The plan as a two-column table (printed by `python -m raychat.plan` and at the start of training)."""
    m = plan.model
    head_dim = m.n_embd // m.n_head
    horizon = {"num_iterations": "--num-iterations", "target_flops": "--target-flops",
               "target_param_data_ratio": "--target-param-data-ratio"}[plan.horizon_rule]
    batch = "auto, from the scaling rule" if plan.batch_rule == "auto" else "--total-batch-size"
    sections: list[tuple[str, list[tuple[str, str]]]] = [
        ("model", [
            ("depth (n_layer)", f"{m.n_layer}"),
            ("width (n_embd)", f"{m.n_embd:,}"),
            ("heads / kv heads", f"{m.n_head} / {m.n_kv_head} (head_dim {head_dim})"),
            ("sequence length", f"{m.sequence_len:,}"),
            ("vocab size", f"{m.vocab_size:,}"),
            ("window pattern", m.window_pattern),
            ("precision", plan.precision),
        ]),
        ("parameters", [(name, f"{count:,}") for name, count in plan.params.items()]
         + [("scaling (matrices+lm_head)", f"{plan.scaling_params:,}")]),
        ("horizon", [
            ("set by", horizon),
            ("optimizer steps", f"{plan.num_iterations:,}"),
            ("total tokens", f"{plan.total_tokens:,}"),
            ("tokens : scaling params", f"{plan.tokens_per_param:.2f}"),
            ("FLOPs per token", f"{plan.flops_per_token:.3e}"),
            ("total FLOPs", f"{plan.total_flops:.3e}"),
        ]),
        ("batch", [
            ("tokens per step", f"{plan.total_batch_size:,} ({batch})"),
            ("rows per step", f"{plan.rows_per_step:,} x {m.sequence_len:,} tokens"),
            ("workers", f"{plan.world_size} ({_rows_per_rank(plan)} rows each)"),
            ("micro-batches per step", f"{plan.grad_accum_steps} (rank 0: {_rank0_micro_batches(plan)})"
                                       + (", device batch auto" if plan.device_batch_rule == "auto" else "")),
        ]),
        ("optimizer", [
            ("lr scale sqrt(B/2^19)", f"{plan.lr_scale:.4f}"),
            ("weight decay (Muon)", f"{plan.weight_decay:.6f}"),
        ]),
    ]
    width = max(len(key) for _, rows in sections for key, _ in rows) + 2
    lines = []
    for title, rows in sections:
        lines.append(title)
        lines.extend(f"  {key:<{width}}{value}" for key, value in rows)
    return "\n".join(lines)


def _rank0_micro_batches(plan: Plan) -> str:
    """Rank 0's micro-batches in rows, e.g. '16 x 32 rows' or '8 + 3 rows'."""
    dbs = plan.device_batch_size
    sizes = micro_batch_sizes(plan.rows_per_rank, dbs)
    full = sizes.count(dbs)
    parts = [f"{full} x {dbs}" if full > 1 else str(dbs)] if full else []
    parts += [str(size) for size in sizes if size != dbs]
    return " + ".join(parts) + " rows"


def _rows_per_rank(plan: Plan) -> str:
    most = plan.rows_per_rank
    least = rank_rows(plan.rows_per_step, plan.world_size, plan.world_size - 1)
    return f"{most}" if most == least else f"{least}-{most}"
