"""What a run tells the people watching it: nanochat's log line, Ray dashboard gauges, wandb.

The step line is nanochat's, character for character, so its users' scripts and habits keep
working (`grep "Validation bpb:"`, `tok/sec: 129,360`). The loop arithmetic behind its fields
(debiased EMA loss, total time from step 11, eta from the mean step time) is here too, so the
numbers mean what they mean in nanochat.

On CPU there is no meaningful MFU (no bf16 peak to compare against): the field stays, reading
`bf16_mfu: n/a`, so the line keeps the same fields in the same order on every device.

Ray custom metrics (`ray.util.metrics` gauges) are scraped by Ray's per-node metrics agent and
served on the node's Prometheus endpoint (`http://<node>:<metrics_export_port>/metrics`, the
names there gain Ray's `ray_` prefix: `ray_raychat_loss{run="..."}`), which is what the Ray
dashboard's Grafana panels and any Prometheus read.
"""

import os

from raychat.common import RaychatError

EMA_BETA = 0.9  # nanochat's smoothing of the logged training loss
UNTIMED_STEPS = 10  # nanochat leaves the first 10 steps (compilation, warm-up) out of total time


def smooth_loss(smooth: float, loss: float, step: int) -> tuple[float, float]:
    """nanochat's EMA of the training loss: returns (new EMA, debiased EMA for the log line).

    Start with smooth = 0 at step 0; the debiasing (as in Adam) keeps early values from reading low.
    """
    smooth = EMA_BETA * smooth + (1 - EMA_BETA) * loss
    return smooth, smooth / (1 - EMA_BETA ** (step + 1))


def counts_toward_total_time(step: int) -> bool:
    """Whether step `step`'s duration is added to the run's total training time (nanochat: step > 10)."""
    return step > UNTIMED_STEPS


def eta_seconds(step: int, num_iterations: int, total_time_s: float) -> float | None:
    """Remaining time from the mean timed step so far, or None before any step was timed."""
    timed_steps = step - UNTIMED_STEPS
    if timed_steps <= 0:
        return None
    return (num_iterations - step) * total_time_s / timed_steps


def format_step_line(step: int, num_iterations: int, loss: float, lrm: float, dt: float, tok_per_sec: float,
                     mfu: float | None, epoch: int, pq: int, rg: int, total_time_s: float,
                     eta_s: float | None) -> str:
    """nanochat's per-step line. dt, total_time_s and eta_s in seconds; mfu in percent (None: n/a)."""
    mfu_text = "n/a" if mfu is None else f"{mfu:.2f}"
    eta_text = "" if eta_s is None else f" | eta: {eta_s / 60:.1f}m"
    return (f"step {step:05d}/{num_iterations:05d} ({100 * step / num_iterations:.2f}%) "
            f"| loss: {loss:.6f} | lrm: {lrm:.2f} | dt: {dt * 1000:.2f}ms | tok/sec: {int(tok_per_sec):,} "
            f"| bf16_mfu: {mfu_text} | epoch: {epoch} pq: {pq} rg: {rg} "
            f"| total time: {total_time_s / 60:.2f}m{eta_text}")


def format_val_line(step: int, bpb: float) -> str:
    """nanochat's evaluation line."""
    return f"Step {step:05d} | Validation bpb: {bpb:.6f}"


# -----------------------------------------------------------------------------
# Ray dashboard / Prometheus

GAUGES = {
    "loss": "training loss (debiased EMA, as in the log line)",
    "tokens_per_sec": "training throughput in tokens per second, all workers together",
    "mfu": "model FLOPs utilisation in percent of the bf16 peak (not set on CPU)",
    "val_bpb": "validation bits per byte at the last evaluation",
    "step": "optimizer steps done",
    "world_size": "training workers in the current worker group",
    "data_wait_seconds": "seconds the last step waited for its batch",
}


class RayMetrics:
    """The run's gauges, `raychat_<name>` tagged with run=<run name>. Create inside a Ray worker
    (the Train worker of rank 0), where Ray's metrics agent picks them up."""

    def __init__(self, run_name: str):
        from ray.util.metrics import Gauge

        self._tags = {"run": run_name}
        self._gauges = {name: Gauge(f"raychat_{name}", description=description, tag_keys=("run",))
                        for name, description in GAUGES.items()}

    def update(self, **values: float | None) -> None:
        """Set gauges by name (loss=..., step=...); None leaves a gauge as it was."""
        for name, value in values.items():
            if name not in self._gauges:
                raise ValueError(f"unknown raychat metric {name!r}; known: {', '.join(GAUGES)}")
            if value is not None:
                self._gauges[name].set(float(value), tags=self._tags)


# -----------------------------------------------------------------------------
# wandb


def _redact(text: str) -> str:
    key = os.environ.get("WANDB_API_KEY")
    return text.replace(key, "***") if key else text


class WandbLogger:
    """wandb logging as nanochat does it: off for run "dummy", else project "raychat".

    WANDB_MODE (offline, disabled, ...) is honoured as wandb honours it; with RAYCHAT_OFFLINE set
    and no WANDB_MODE the run is logged offline (sync later with `wandb sync`). Credentials are
    wandb's own (`wandb login` or WANDB_API_KEY); nothing here prints them. Create on rank 0 only.
    """

    def __init__(self, run: str, config: dict | None = None, project: str = "raychat"):
        self._run = None
        if run == "dummy":
            return
        import wandb

        mode = "offline" if os.environ.get("RAYCHAT_OFFLINE") and "WANDB_MODE" not in os.environ else None
        try:
            self._run = wandb.init(project=project, name=run, config=config, mode=mode)
        except wandb.errors.Error as e:
            reason = _redact((str(e).strip().splitlines() or [type(e).__name__])[0])
            # `from None`: wandb's own exception chain is not ours to print
            raise RaychatError(f"wandb could not start run {run!r}: {reason} Run `wandb login`, set "
                               "WANDB_MODE=offline to log locally, or pass --run dummy") from None

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def log(self, data: dict, step: int) -> None:
        if self._run is not None:
            self._run.log(data, step=step)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
