"""What a run tells the people watching it: nanochat's log line, Ray dashboard gauges, wandb, Ray
Train/Tune reports and the run's metrics log (raychat.run.metrics_log).

Each step is one `StepMetrics` record, built once by the loop; `Publisher` is the one place records
go out from to every sink, so adding a metric means adding a field, not editing five call sites.

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
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from raychat.common import RaychatError
from raychat.run.ledger import Ledger, ledger
from raychat.run.metrics_log import MetricsLog

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


@dataclass
class StepMetrics:
    """One optimizer step as everyone watching sees it. Built once by the loop (raychat.run.loop.log_step)
    and handed to `Publisher.step`, which writes it to every sink, so a new field is added here once.
    Running totals end in `_so_far`; the Plan's `total_tokens`/`total_flops` are the planned totals."""

    step: int
    num_iterations: int
    loss: float  # debiased EMA of the training loss, as in nanochat's line
    raw_loss: float  # this step's global mean loss
    lrm: float  # learning-rate multiplier
    dt: float  # seconds
    tokens_per_sec: float  # all workers together
    mfu: float | None  # percent of the bf16 peak; None where there is no peak (CPU)
    epoch: int  # the cursor's frontier: epoch, parquet shard, row group
    pq: int
    rg: int
    total_time_s: float  # nanochat's total training time (steps after the 10th)
    eta_s: float | None
    data_wait_s: float  # seconds this step waited for its batch
    world_size: int
    tokens_so_far: int  # tokens trained, this step included
    flops_so_far: float

    def line(self) -> str:
        """nanochat's per-step line, character for character."""
        mfu_text = "n/a" if self.mfu is None else f"{self.mfu:.2f}"
        eta_text = "" if self.eta_s is None else f" | eta: {self.eta_s / 60:.1f}m"
        n = self.num_iterations
        return (f"step {self.step:05d}/{n:05d} ({100 * self.step / n:.2f}%) "
                f"| loss: {self.loss:.6f} | lrm: {self.lrm:.2f} | dt: {self.dt * 1000:.2f}ms "
                f"| tok/sec: {int(self.tokens_per_sec):,} | bf16_mfu: {mfu_text} "
                f"| epoch: {self.epoch} pq: {self.pq} rg: {self.rg} "
                f"| total time: {self.total_time_s / 60:.2f}m{eta_text}")

    def gauges(self) -> dict[str, float | None]:
        return {"loss": self.loss, "tokens_per_sec": self.tokens_per_sec, "mfu": self.mfu or 0.0,
                "step": self.step, "world_size": self.world_size, "data_wait_seconds": self.data_wait_s}

    def wandb(self) -> dict[str, float]:
        return {"train/loss": self.loss, "train/lrm": self.lrm, "train/dt": self.dt,
                "train/tok_per_sec": self.tokens_per_sec, "train/mfu": self.mfu or 0.0}

    def tune(self) -> dict[str, float | None]:
        """What a Tune result carries of the latest step (beside the report's own fields)."""
        return {"loss": self.loss, "tokens_per_sec": self.tokens_per_sec, "mfu": self.mfu}


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
    "core_metric": "nanochat's CORE metric at the last evaluation (centered accuracy on the eval bundle)",
    "step": "optimizer steps done",
    "world_size": "training workers in the current worker group",
    "data_wait_seconds": "seconds the last step waited for its batch",
    "goodput": "share of the run's wall time so far in steps that advanced training (raychat.run.ledger)",
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


# -----------------------------------------------------------------------------
# The one place records go out from


WANDB_EVERY = 100  # nanochat logs the training curve to wandb every 100 steps


class Publisher:
    """Writes each of the run's records to every sink: the log line, the Ray gauges, wandb, Tune's
    report and the run's metrics log (raychat.run.metrics_log). Every rank has one, because Ray
    Train's report is a barrier; only rank 0's has the other sinks."""

    def __init__(self, log: Callable[[str], None], gauges: RayMetrics | None = None,
                 wandb: WandbLogger | None = None, metrics_log: MetricsLog | None = None):
        self._log, self._gauges, self._wandb, self._metrics_log = log, gauges, wandb, metrics_log
        self.last: StepMetrics | None = None  # the latest step, for the next report
        # This attempt's time outside steps, by cause (raychat.run.ledger), written with every step.
        self.seconds_so_far = {"eval": 0.0, "checkpoint": 0.0}
        self._before: Ledger | None = None  # the run's ledger up to this attempt's start (rank 0)
        self._started = 0.0  # this attempt's start record's time
        self._advanced_s = 0.0  # this attempt's step time that advanced training, data waits apart

    def _record(self, kind: str, **fields: Any) -> None:
        if self._metrics_log is not None:
            self._metrics_log.write(kind, **fields)

    def start(self, **fields: Any) -> None:
        """An attempt started (rank 0, after setup): its step, world size, plan, restart counts and the
        times the ledger splits a restart by. The ledger of the run before it is computed once, here."""
        if self._metrics_log is None:
            return
        record = self._metrics_log.write("start", **fields)
        earlier, self._metrics_log.earlier = self._metrics_log.earlier, []  # read once, not kept
        self._before, self._started = ledger([*earlier, record]), record["time"]

    @contextmanager
    def clock(self, cause: str) -> Iterator[dict[str, float]]:
        """Count the time of the block under `cause` ("eval", "checkpoint"); the dict it yields holds
        the block's own `seconds` afterwards."""
        span, t0 = {"seconds": 0.0}, time.perf_counter()
        try:
            yield span
        finally:
            span["seconds"] = time.perf_counter() - t0
            self.seconds_so_far[cause] += span["seconds"]

    def goodput(self) -> float | None:
        """The run's goodput so far (rank 0): the ledger before this attempt and this attempt's steps."""
        if self._before is None:
            return None
        wall = self._before.wall_s + time.time() - self._started
        return (self._before.seconds["training"] + self._advanced_s) / wall if wall > 0 else None

    def _so_far(self) -> dict[str, float]:
        return {f"{cause}_s_so_far": seconds for cause, seconds in self.seconds_so_far.items()}

    def step(self, m: StepMetrics) -> None:
        self.last = m
        self._advanced_s += m.dt - m.data_wait_s
        self._log(m.line())
        if self._gauges is not None:
            self._gauges.update(**m.gauges(), goodput=self.goodput())
        if self._wandb is not None and m.step % WANDB_EVERY == 0:
            self._wandb.log(m.wandb(), m.step)
        self._record("step", **asdict(m), **self._so_far())

    def eval(self, step: int, val_bpb: float, total_training_time: float) -> None:
        self._log(format_val_line(step, val_bpb))
        if self._gauges is not None:
            self._gauges.update(val_bpb=val_bpb)
        if self._wandb is not None:
            self._wandb.log({"val/bpb": val_bpb, "total_training_time": total_training_time}, step)
        self._record("eval", step=step, val_bpb=val_bpb, total_training_time=total_training_time)

    def core(self, step: int, line: str, core_metric: float, centered: dict[str, float],
             seconds: float) -> None:
        """A CORE evaluation (raychat.run.core_metric): nanochat's line, the gauge, wandb with the
        centered result per task, and the metrics log (raychat.report plots it)."""
        self._log(line)
        if self._gauges is not None:
            self._gauges.update(core_metric=core_metric)
        if self._wandb is not None:
            self._wandb.log({"core_metric": core_metric, "centered_results": centered}, step)
        self._record("core", step=step, core_metric=core_metric, centered=centered, seconds=seconds)

    def samples(self, step: int, texts: list[str]) -> None:
        for text in texts:
            self._log(text)
        self._record("samples", step=step, samples=texts)

    def report(self, metrics: dict[str, Any]) -> None:
        """Ray Train's report (Tune's result) with the latest step's numbers; all ranks, same steps."""
        import ray.train

        if self.last is not None:
            metrics = {**self.last.tune(), **metrics}
        goodput = self.goodput()
        if goodput is not None:
            metrics["goodput"] = goodput
        self._record("report", **metrics, **self._so_far())  # written at once, as every record but steps
        ray.train.report(metrics)

    def flush(self) -> None:
        """Write what the metrics log holds back (a bucket's copy is rewritten every 30 s otherwise)."""
        if self._metrics_log is not None:
            self._metrics_log.flush()
