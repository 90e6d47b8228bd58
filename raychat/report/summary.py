"""What a run's metrics log says, as the summary nanochat users write by hand from train.log: the
model, batch and horizon, tokens:params against Chinchilla's ~20 and the plan, throughput and
memory, val bpb by eval, the last samples, and diagnostics stated as findings with their numbers.

Everything here is computed from the final timeline (raychat.telemetry.metrics_log) and the plan the
latest attempt recorded at its start, so it is the same for a run still going and a finished one.
"""

import statistics
from dataclasses import dataclass
from typing import Any

from raychat.telemetry.metrics import UNTIMED_STEPS
from raychat.telemetry.metrics_log import Timeline

CHINCHILLA_RATIO = 20.0  # compute-optimal tokens per parameter (Hoffmann et al. 2022)
IMPROVING = 0.005  # val bpb still falling by more than 0.5% per eval: the run has not converged
SPIKE = 1.25  # a step's loss above 1.25x the median of the 10 before it is a spike
DATA_BOUND = 0.10  # steps waiting more than 10% of their time for data: the feed holds training back


@dataclass(frozen=True)
class Marker:
    """An attempt that began after the first: at which step, and why (restart, resize or resume)."""

    step: int
    kind: str


@dataclass
class Facts:
    """The numbers the summary and the plots share."""

    plan: dict[str, Any]
    start: dict[str, Any]  # the latest attempt's start record
    last_step: int  # steps done
    finished: bool
    tokens_so_far: int
    markers: list[Marker]
    eval_flops: list[float]

    @property
    def ratio(self) -> float:
        return self.tokens_so_far / self.plan["scaling_params"]


def attempt_kind(previous: dict[str, Any], start: dict[str, Any]) -> str:
    """Why an attempt began: a failure restart, a planned resize, or a rerun of the run name."""
    if start.get("restarts", 0) > previous.get("restarts", 0):
        return "restart"
    if start.get("resizes", 0) > previous.get("resizes", 0):
        return "resize"
    return "resume"


def facts(t: Timeline) -> Facts:
    start = t.starts[-1]
    plan = start["plan"]
    last_step = t.steps[-1]["step"] + 1 if t.steps else start["step"]
    markers = [Marker(b["step"], attempt_kind(a, b)) for a, b in zip(t.starts, t.starts[1:], strict=False)]
    per_token = plan["total_batch_size"] * plan["flops_per_token"]
    return Facts(plan, start, last_step, bool(t.last_report.get("train_done")),
                 last_step * plan["total_batch_size"], markers, [e["step"] * per_token for e in t.evals])


def mfu_note(start: dict[str, Any]) -> str:
    source = start.get("peak_flops_source")
    if source == "cpu":
        return "MFU not available: the workers ran on CPU, and a CPU has no bf16 peak in raychat's table"
    if source == "measured":
        return f"MFU against a measured peak of {start['peak_flops']:.3g} FLOP/s (GPU not in the peak table)"
    return f"MFU against the table's bf16 peak of {start.get('peak_flops') or 0:.3g} FLOP/s"


def timed_steps(t: Timeline) -> list[dict[str, Any]]:
    """Steps past nanochat's untimed warm-up (all steps if the run has not got that far)."""
    return [r for r in t.steps if r["step"] > UNTIMED_STEPS] or t.steps


def model_lines(f: Facts) -> list[str]:
    m, p = f.plan["model"], f.plan
    lines = [f"- depth {m['n_layer']}, width {m['n_embd']}, {m['n_head']} heads ({m['n_kv_head']} kv heads, "
             f"head dim {m['n_embd'] // m['n_head']}), sequence length {m['sequence_len']}, "
             f"vocab {m['vocab_size']:,}",
             "- parameters: " + ", ".join(f"{k} {v:,}" for k, v in p["params"].items())
             + f"; scaling (matrices + lm_head) {p['scaling_params']:,}",
             f"- precision {f.start.get('precision')} on {f.start.get('device')}, "
             f"{f.start.get('world_size')} worker(s) in the latest attempt"]
    return lines


def horizon_lines(f: Facts, t: Timeline) -> list[str]:
    p = f.plan
    target = f.start.get("config", {}).get("target_param_data_ratio")
    rule = f" (target ratio {target:g})" if p["horizon_rule"] == "target_param_data_ratio" else ""
    return [
        f"- batch: {p['total_batch_size']:,} tokens per step = {p['rows_per_step']} rows x "
        f"{p['model']['sequence_len']} tokens",
        f"- horizon: {p['num_iterations']:,} steps, {p['total_tokens']:,} tokens, set by "
        f"--{p['horizon_rule'].replace('_', '-')}{rule}",
        f"- trained: {f.last_step:,} of {p['num_iterations']:,} steps, {f.tokens_so_far:,} tokens "
        f"({'finished' if f.finished else 'snapshot: running or stopped'})",
        f"- tokens:params {f.ratio:.2f} so far, {p['tokens_per_param']:.2f} planned; Chinchilla's "
        f"compute-optimal ratio is ~{CHINCHILLA_RATIO:g}",
    ]


def throughput_lines(f: Facts, t: Timeline) -> list[str]:
    timed = timed_steps(t)
    if not timed:
        return ["- no steps yet"]
    tok = statistics.median(r["tokens_per_sec"] for r in timed)
    dt = statistics.median(r["dt"] for r in timed)
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    peak = t.last_report.get("peak_memory_mib")
    total = t.steps[-1]["total_time_s"]
    wall = t.steps[-1]["time"] - t.starts[0]["time"]
    return [
        f"- {tok:,.0f} tokens/s (median of {len(timed)} steps), {dt * 1000:.1f} ms per step",
        f"- MFU: {statistics.median(mfus):.2f}% median" if mfus else f"- {mfu_note(f.start)}",
        f"- peak memory (rank 0): {peak:,.0f} MiB" if peak else "- peak memory: known at the end of the run",
        f"- training time {total / 60:.2f} min (nanochat's: steps after the 10th), wall {wall / 60:.2f} min",
    ]


def eval_table(f: Facts, t: Timeline) -> list[str]:
    if not t.evals:
        return ["no evals yet"]
    rows = ["| step | tokens | FLOPs | val bpb |", "|---:|---:|---:|---:|"]
    for e, flops in zip(t.evals, f.eval_flops, strict=True):
        rows.append(f"| {e['step']} | {e['step'] * f.plan['total_batch_size']:,} | {flops:.3e} "
                    f"| {e['val_bpb']:.4f} |")
    return rows


def sample_lines(t: Timeline) -> list[str]:
    if not t.samples:
        return ["no samples yet (--sample-every)"]
    last = t.samples[-1]
    return [f"At step {last['step']}:", "", *(f"    {text}" for text in last["samples"])]
