"""How much device memory one rank of a run needs, before the run starts: an estimate from the plan.

Why: a run that does not fit fails at its first step or its first save, minutes to hours after the
launch; the plan knows every size that decides it. Per rank, with N parameters of which A are
trained by AdamW and M by Muon, at W ranks:

    parameters     4 N                 fp32 (raychat keeps fp32 master weights; compute may be bf16)
    gradients      4 N                 full gradients on every rank (reduce-scattered at the step)
    optimizer      (8 A + 4 M) / W     AdamW's two moments, Muon's momentum, sharded ZeRO-style
                                       (Muon's factored second moment, one value per row, is left out)
    step buffers   4 M + 4 A / W       a Muon group's stacked matrices (its all-gather buffer) and the
                                       reduce-scattered AdamW shards, alive during the step
    activations    L x 34 B T d bf16 bytes per layer (Korthikanti et al. 2022, attention without the
                   T^2 scores: flash/SDPA/FlexAttention) + 8 B T V for the fp32 logits and their
                   gradient (the compiled loss; eager runs chunk them and need less)

with B the device batch (rows per micro-batch), T the sequence length, d the width, L the depth and V
the vocabulary. A save needs no device memory: each rank copies its own share of the state,
(4 N + 8 A + 4 M) / W bytes, into host buffers (raychat.checkpoint.saver). The estimate ignores the
CUDA context and allocator fragmentation (typically 1-3 GiB), so "fits" keeps a 10% margin.
"""

from dataclasses import asdict, dataclass

GIB = 2**30
MARGIN = 0.9  # fraction of the device the estimate may fill: context and fragmentation take the rest
ACTIVATION_BYTES_PER_LAYER_TOKEN_WIDTH = 34

# Usable memory of known devices (GiB, as torch reports it), by the same names as the FLOPs table.
GPU_MEMORY_GIB: dict[str, float] = {
    "h100": 79.6, "h100 pcie": 79.6, "h100 nvl": 93.6, "h200": 139.8, "gh200": 94.5, "h800": 79.6,
    "a100": 79.2, "a100 40gb": 39.4, "b200": 178.4, "l4": 22.0, "l40s": 44.4, "rtx 4090": 23.6,
    "rtx 3090": 23.6, "rtx 4070": 11.6, "mi300x": 191.5, "mi325x": 255.5, "mi250x": 63.9,
}


@dataclass
class MemoryEstimate:
    """Bytes one rank needs on its device, by part; `save_host` is host memory for a save."""

    parameters: int
    gradients: int
    optimizer: int
    step_buffers: int
    activations: int
    save_host: int

    @property
    def device_total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.step_buffers + self.activations

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "device_total": self.device_total}


def estimate_memory(params: dict[str, int], n_layer: int, n_embd: int, vocab_size: int, seq_len: int,
                    device_batch_size: int, world_size: int) -> MemoryEstimate:
    """The estimate above for a model with `params` counts by group (GPT.num_scaling_params)."""
    total = params["total"]
    muon = params["transformer_matrices"]
    adamw = total - muon
    tokens = device_batch_size * seq_len
    return MemoryEstimate(
        parameters=4 * total,
        gradients=4 * total,
        optimizer=(8 * adamw + 4 * muon) // world_size,
        step_buffers=4 * muon + 4 * adamw // world_size,
        activations=(n_layer * ACTIVATION_BYTES_PER_LAYER_TOKEN_WIDTH * tokens * n_embd
                     + 8 * tokens * vocab_size),
        save_host=(4 * total + 8 * adamw + 4 * muon) // world_size,
    )


def gpu_memory_gib(name: str) -> float | None:
    """Usable GiB of a device named like "H100" or "NVIDIA H100 80GB HBM3"; None if unknown."""
    lowered = name.lower()
    matches = [key for key in GPU_MEMORY_GIB if all(word in lowered for word in key.split())]
    return GPU_MEMORY_GIB[max(matches, key=len)] if matches else None


def format_memory(estimate: MemoryEstimate, device_gib: float | None, device: str) -> list[str]:
    """The plan's memory section: each part in GiB, then whether it fits `device`."""
    rows = [("parameters (fp32)", estimate.parameters), ("gradients (fp32)", estimate.gradients),
            ("optimizer shard", estimate.optimizer), ("optimizer step buffers", estimate.step_buffers),
            ("activations", estimate.activations), ("total per device", estimate.device_total),
            ("save (host memory)", estimate.save_host)]
    lines = ["memory per rank (estimate)"] + [f"  {key:<28}{value / GIB:,.2f} GiB" for key, value in rows]
    if device_gib is not None:
        share = estimate.device_total / GIB / device_gib
        if share <= MARGIN:
            lines.append(f"  fits {device} ({device_gib:g} GiB): {share:.0%} of it")
        else:
            lines.append(f"  warning: does not fit {device} ({device_gib:g} GiB): {share:.0%} of it; lower "
                         "--device-batch-size or add workers")
    return lines
