"""How much memory one rank of a run needs, before the run starts: an estimate from the plan.

Why: a run that does not fit fails at its first step or its first save, minutes to hours after the
launch; the plan knows every size that decides it. Per rank, with N parameters, at W ranks, in bytes:

    parameters     4 N                 fp32 master weights (compute may be bf16)
    gradients      4 N                 full gradients on every rank (reduced at the optimizer step)
    optimizer      S                   the --optimizer's state on this rank, and its buffers alive
    step buffers   B                   during the step (its OptimizerSpec.state_bytes, raychat.optim).
                                       muon_adamw, A parameters trained by AdamW and M by Muon:
                                       S = (8 A + 4 M) / W, AdamW's two moments and Muon's momentum,
                                       sharded ZeRO-style (Muon's factored second moment, one value
                                       per row, is left out); B = 4 M + 4 A / W, a Muon group's
                                       stacked matrices (its all-gather buffer) and the
                                       reduce-scattered AdamW shards. sgd: S = 4 N, its momentum,
                                       whole on every rank (0 with --sgd-momentum 0: no state);
                                       B = 0 (gradients reduced in place)
    activations    what autograd keeps for the backward of one micro-batch (below)
    transients     the forward's short-lived peak on top of them: the loss's logits

The parts are not all alive at once. Gradients exist from the backward to the optimizer step
(zero_grad sets them to None), the step buffers only during the step, the activations only from
the forward to the backward. So the peak is

    parameters + optimizer + max(activations + transients (+ gradients when a step has several
                                 micro-batches: the earlier ones' gradients wait for the step),
                                 gradients + step buffers)

Activations, per micro-batch of B rows of T tokens, width C, L layers, compute dtype of b bytes
(2 bf16, 4 fp32), V the padded vocabulary:
- eager (the CPU path, and GPUs with --compile off), counted from raychat.model.gpt's forward and
  checked against autograd's own saved-tensor count (tests/test_memory.py): per layer and token
  channel 15 b bytes (q, k, v and the attention output; the relu output and its square, 4 C wide
  each; the normed input and the attention's projection input; the residual the lambdas scale)
  plus 16 (four fp32 RMSNorm inputs: PyTorch's rms_norm keeps its input upcast to fp32), value
  embeddings b per channel on alternate layers, 8 + 4 b for the embedding, smear, final norm and
  the loss's dL/dx; every block weight once more in the compute dtype when that is not fp32 (the
  Linear's cast, kept for the backward); and the fused loss's fp32 dL/dW of lm_head, 4 V C. Its
  transients are the loss's chunk buffers (raychat.model.loss: fp32 logits and exponentials of
  n = min(B T, chunk) rows, plus a compute-dtype copy) and the lm_head weight in the compute dtype
  with its gradient's product (2 b + 4 bytes per weight when b < 4).
- compiled (GPUs): 34 B T C b/2 per layer (Korthikanti et al. 2022, attention without the T^2
  scores: flash/SDPA/FlexAttention; inductor fuses the elementwise chain) with 8 B T V transients
  for the fp32 logits and their gradient (the plain loss chain, which inductor fuses). Not yet
  checked against a GPU's torch.cuda.max_memory_allocated (python -m bench.gpu prints both).

A save needs no device memory: each rank copies its own share of the state, 4 N / W bytes of the
model and the optimizer state it writes (muon_adamw: S; sgd: rank 0 all 4 N, none without momentum),
into host buffers (raychat.checkpoint.saver). The estimate counts what the allocator hands out: on
GPUs the CUDA context and the caching allocator's fragmentation (typically 1-3 GiB) come on top, so
"fits" keeps a 10% margin. On CPUs glibc keeps freed heap pages resident, so peak RSS runs well
above this figure (bench/memory.py measures both; bench/RESULTS.md, "Memory").
"""

from dataclasses import asdict, dataclass

from raychat.config import TrainConfig
from raychat.model.gpt import GPTConfig, has_value_embedding
from raychat.model.loss import chunk_rows_for
from raychat.optim.registry import optimizer_spec
from raychat.scaling import Plan

GIB = 2**30
MARGIN = 0.9  # fraction of the device the estimate may fill: context and fragmentation take the rest
COMPILED_ACTIVATION_BYTES_PER_LAYER_TOKEN_WIDTH = 34  # bf16 (Korthikanti et al. 2022)
EAGER_BYTES_PER_LAYER_TOKEN_WIDTH = (15, 16)  # (times the compute dtype's bytes, fp32 bytes)

# Usable memory of known devices (GiB, as torch reports it), by the same names as the FLOPs table.
GPU_MEMORY_GIB: dict[str, float] = {
    "h100": 79.6, "h100 pcie": 79.6, "h100 nvl": 93.6, "h200": 139.8, "gh200": 94.5, "h800": 79.6,
    "a100": 79.2, "a100 40gb": 39.4, "b200": 178.4, "l4": 22.0, "l40s": 44.4, "rtx 4090": 23.6,
    "rtx 3090": 23.6, "rtx 4070": 11.6, "mi300x": 191.5, "mi325x": 255.5, "mi250x": 63.9,
}


@dataclass
class MemoryEstimate:
    """Bytes one rank needs, by part (see the module docstring); `save_host` is host memory."""

    parameters: int
    gradients: int
    optimizer: int
    step_buffers: int
    activations: int
    transients: int
    accumulates: bool  # several micro-batches per step: gradients live through the later forwards
    save_host: int

    @property
    def peak(self) -> int:
        compute = self.activations + self.transients + (self.gradients if self.accumulates else 0)
        return self.parameters + self.optimizer + max(compute, self.gradients + self.step_buffers)

    def to_json(self) -> dict[str, int | bool]:
        return {**asdict(self), "peak": self.peak}


def activation_bytes(config: GPTConfig, rows: int, compute_bytes: int, compiled: bool,
                     matrix_params: int) -> tuple[int, int]:
    """(activations kept for the backward, forward transients) of one micro-batch of `rows` rows."""
    tokens = rows * config.sequence_len
    width, vocab = config.n_embd, config.padded_vocab_size
    if compiled:
        per_layer = COMPILED_ACTIVATION_BYTES_PER_LAYER_TOKEN_WIDTH * compute_bytes // 2
        return config.n_layer * per_layer * tokens * width, 8 * tokens * config.vocab_size
    b = compute_bytes
    low = b if b < 4 else 0  # the bytes of a compute-dtype copy, where it is a copy and not the tensor
    per_channel, fp32 = EAGER_BYTES_PER_LAYER_TOKEN_WIDTH
    value_layers = sum(has_value_embedding(i, config.n_layer) for i in range(config.n_layer))
    kv_width = config.n_kv_head * config.head_dim
    saved = (tokens * width * (config.n_layer * (per_channel * b + fp32) + 8 + 4 * b)
             + value_layers * tokens * kv_width * b + low * matrix_params + 4 * vocab * width)
    chunk = min(tokens, chunk_rows_for(config.vocab_size))
    transients = chunk * config.vocab_size * (8 + low) + vocab * width * (2 * low + (4 if low else 0))
    return saved, transients


def estimate_memory(config: GPTConfig, params: dict[str, int], micro_batch_rows: int, micro_batches: int,
                    world_size: int, compute_bytes: int, compiled: bool,
                    cfg: TrainConfig | None = None) -> MemoryEstimate:
    """The estimate above for a model with `params` counts by group (GPT.num_scaling_params), trained
    by the --optimizer of the flags `cfg`, with its hyperparameters (None: the default flags)."""
    total = params["total"]
    activations, transients = activation_bytes(config, micro_batch_rows, compute_bytes, compiled,
                                               params["transformer_matrices"])
    cfg = cfg or TrainConfig()
    state = optimizer_spec(cfg.optimizer).state_bytes(cfg, params, world_size)
    return MemoryEstimate(
        parameters=4 * total,
        gradients=4 * total,
        optimizer=state.state,
        step_buffers=state.step_buffers,
        activations=activations,
        transients=transients,
        accumulates=micro_batches > 1,
        save_host=4 * total // world_size + state.saved,
    )


def plan_memory(plan: Plan, compute_bytes: int, compiled: bool,
                cfg: TrainConfig | None = None) -> MemoryEstimate:
    """The estimate for the busiest rank of `plan` (the one with the most rows per step)."""
    return estimate_memory(plan.model, plan.params, min(plan.device_batch_size, plan.rows_per_rank),
                           plan.grad_accum_steps, plan.world_size, compute_bytes, compiled, cfg)


def fit_device_batch_size(plan: Plan, device_bytes: int, compute_bytes: int, compiled: bool,
                          cfg: TrainConfig | None = None) -> int:
    """--device-batch-size -1 on a device of `device_bytes`: the largest power of two, up to the rows a
    rank trains per step, whose estimated peak fits MARGIN of it (1 when none does: the warning of
    `memory_warning` then says so)."""
    rows = 1
    while rows * 2 <= plan.rows_per_rank and plan_memory(plan.with_device_batch_size(rows * 2), compute_bytes,
                                                         compiled, cfg).peak <= MARGIN * device_bytes:
        rows *= 2
    return rows


def fit_plan_to_device(plan: Plan, device_bytes: int, device: str, compute_bytes: int,
                       compiled: bool, cfg: TrainConfig | None = None) -> tuple[Plan, list[str]]:
    """`plan` on a device of `device_bytes`: --device-batch-size -1 resolved (fit_device_batch_size),
    and the lines to log: the choice, and a warning when the estimate does not fit."""
    lines = []
    if plan.device_batch_rule == "auto":
        plan = plan.with_device_batch_size(fit_device_batch_size(plan, device_bytes, compute_bytes, compiled,
                                                                 cfg))
        peak = plan_memory(plan, compute_bytes, compiled, cfg).peak
        lines.append(f"--device-batch-size -1: {plan.device_batch_size} rows per forward pass on {device} "
                     f"(estimated peak {peak / GIB:.1f} of {device_bytes / GIB:.1f} GiB)")
    warning = memory_warning(plan_memory(plan, compute_bytes, compiled, cfg), device_bytes, device)
    return plan, lines + ([warning] if warning else [])


def memory_warning(estimate: MemoryEstimate, device_bytes: int, device: str) -> str | None:
    """One line when the estimated peak does not fit MARGIN of `device_bytes`, else None."""
    share = estimate.peak / device_bytes
    if share <= MARGIN:
        return None
    return (f"warning: does not fit {device} ({device_bytes / GIB:g} GiB): {share:.0%} of it; lower "
            "--device-batch-size (-1 picks the largest that fits) or add workers")


@dataclass
class EmbeddingTables:
    """The token and value embedding tables' bytes per rank: raychat's fp32 against nanochat's bf16."""

    params: int
    fp32_bytes: int  # weights, gradients, the optimizer's state for them (AdamW's moments, sharded)
    bf16_bytes: int  # the same in bf16, as nanochat keeps them (its AdamW moments follow the weights)

    @property
    def saving(self) -> int:
        return self.fp32_bytes - self.bf16_bytes


def embedding_tables(params: dict[str, int], world_size: int, cfg: TrainConfig) -> EmbeddingTables:
    """The tables' share of a rank's memory, their optimizer state as --optimizer keeps it (the state
    of a model that had only these tables: AdamW's for Muon + AdamW, SGD's momentum or nothing)."""
    n = params["wte"] + params["value_embeds"]
    only_tables = {**dict.fromkeys(params, 0), "wte": params["wte"], "value_embeds": params["value_embeds"],
                   "total": n}
    state = optimizer_spec(cfg.optimizer).state_bytes(cfg, only_tables, world_size).state
    return EmbeddingTables(n, 4 * n + 4 * n + state, 2 * n + 2 * n + state // 2)


def gpu_memory_gib(name: str) -> float | None:
    """Usable GiB of a device named like "H100" or "NVIDIA H100 80GB HBM3"; None if unknown."""
    lowered = name.lower()
    matches = [key for key in GPU_MEMORY_GIB if all(word in lowered for word in key.split())]
    return GPU_MEMORY_GIB[max(matches, key=len)] if matches else None


def format_memory(estimate: MemoryEstimate, tables: EmbeddingTables, mode: str, device_gib: float | None,
                  device: str) -> list[str]:
    """The plan's memory section: each part in GiB, the peak, the embeddings' share, whether it fits."""
    rows = [("parameters (fp32)", estimate.parameters), ("gradients (fp32)", estimate.gradients),
            ("optimizer shard", estimate.optimizer), ("optimizer step buffers", estimate.step_buffers),
            ("activations (a micro-batch)", estimate.activations),
            ("forward transients", estimate.transients),
            ("peak per device", estimate.peak), ("save (host memory)", estimate.save_host)]
    lines = [f"memory per rank (estimate, {mode})"]
    lines += [f"  {key:<30}{value / GIB:,.2f} GiB" for key, value in rows]
    lines.append(f"  {'embedding tables':<30}{tables.fp32_bytes / GIB:,.2f} GiB of it (fp32, with gradients "
                 f"and optimizer state); in bf16 as nanochat keeps them {tables.bf16_bytes / GIB:,.2f} GiB, "
                 f"{tables.saving / max(estimate.peak, 1):.1%} off the peak")
    if device_gib is not None:
        warning = memory_warning(estimate, int(device_gib * GIB), device)
        lines.append(f"  {warning}" if warning else
                     f"  fits {device} ({device_gib:g} GiB): {estimate.peak / GIB / device_gib:.0%} of it")
    return lines
