"""What a run tells the people watching it: nanochat's log line, Ray dashboard gauges, wandb, Ray
Train/Tune reports and the run's metrics log (raychat.telemetry.metrics_log).

Each step is one `StepMetrics` record, built once by the loop; `Publisher` is the one place records
go out from: it wraps each in a typed record (`StepDone`, `Evaluated`, ...) and fans it out to a list
of sinks (raychat.telemetry.sinks: `LogLines`, `RayMetrics`, `WandbLogger`, `TrainReport`; and
raychat.telemetry.metrics_log.MetricsLog), each of which takes what it shows from the record. Adding
a metric means adding a field to `StepMetrics`; adding a sink means one class and one entry in the
list (raychat.worker.setup).

The step line is nanochat's, character for character, so its users' scripts and habits keep
working (`grep "Validation bpb:"`, `tok/sec: 129,360`). The loop arithmetic behind its fields
(debiased EMA loss, total time from step 11, eta from the mean step time) is here too, so the
numbers mean what they mean in nanochat.

On CPU there is no meaningful MFU (no bf16 peak to compare against): the field stays, reading
`bf16_mfu: n/a`, so the line keeps the same fields in the same order on every device.
"""

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from raychat.storage import Storage
from raychat.telemetry.ledger import Ledger, ledger

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
    """One optimizer step as everyone watching sees it. Built once by the loop (raychat.worker.loop.log_step)
    and handed to `Publisher.step`, which hands it to every sink, so a new field is added here once.
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
    compile_s: float = 0.0  # of `dt`, seconds spent in torch.compile (an attempt's first step; recompiles)

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
# The records sinks take, and the log line


@dataclass(frozen=True)
class AttemptStarted:
    """An attempt started (rank 0, after setup): the time and what the metrics log records of it."""
    time: float
    fields: dict[str, Any]


@dataclass(frozen=True)
class StepDone:
    """One optimizer step, with the run's totals as of it."""
    metrics: StepMetrics
    goodput: float | None  # the run's so far (rank 0 after its start record; None before)
    so_far: dict[str, float]  # this attempt's seconds outside steps by cause: eval_s_so_far, ...


@dataclass(frozen=True)
class Evaluated:
    step: int
    val_bpb: float
    total_training_time: float


@dataclass(frozen=True)
class CoreEvaluated:
    """A CORE evaluation (raychat.worker.core_metric): nanochat's line and the centered result per task."""
    step: int
    line: str
    core_metric: float
    centered: dict[str, float]
    seconds: float


@dataclass(frozen=True)
class Sampled:
    step: int
    texts: list[str]


@dataclass(frozen=True)
class Reported:
    """Ray Train's report (Tune's result): its metrics, this attempt's seconds outside steps, and (rank 0)
    the run's newest whole checkpoint, which Ray Train then names in its Result."""
    metrics: dict[str, Any]
    so_far: dict[str, float] = field(default_factory=dict)
    checkpoint: Storage | None = None


Record = AttemptStarted | StepDone | Evaluated | CoreEvaluated | Sampled | Reported


class Sink(ABC):
    """Somewhere the run's records go (`Publisher` hands each record to every sink in its list)."""

    @abstractmethod
    def publish(self, record: Record) -> None:
        """Show or store what this sink keeps of `record`; records it has no use for are passed over."""

    def flush(self) -> None:  # noqa: B027 (only a sink that holds records back has work here)
        """Write what this sink holds back (before a checkpoint, at the end of a run)."""

    def held_back(self) -> list[str]:
        """What this sink holds back, as it would write it: a memory replica carries it, so an attempt
        resumed past those steps writes what the killed one could not (raychat.telemetry.metrics_log)."""
        return []


class Publisher:
    """Hands each of the run's records to every sink in `sinks`, in order. Every rank has one, because
    Ray Train's report is a barrier (its sinks: the log line and `TrainReport`); rank 0's also has the
    gauges, wandb and the run's metrics log (raychat.worker.setup)."""

    def __init__(self, sinks: list[Sink]):
        self._sinks = list(sinks)
        self.last: StepMetrics | None = None  # the latest step, for the next report
        # This attempt's time outside steps, by cause (raychat.telemetry.ledger), written with every step.
        self.seconds_so_far = {"eval": 0.0, "checkpoint": 0.0}
        self._before: Ledger | None = None  # the run's ledger up to this attempt's start (rank 0)
        self._started = 0.0  # this attempt's start record's time
        self._advanced_s = 0.0  # this attempt's step time that advanced training, data waits apart

    def _publish(self, record: Record) -> None:
        for sink in self._sinks:
            sink.publish(record)

    def start(self, earlier: list[dict[str, Any]], **fields: Any) -> None:
        """An attempt started (rank 0, after setup): its step, world size, plan, restart counts and the
        times the ledger splits a restart by. The ledger of the run before it (`earlier`: the records
        earlier attempts wrote to the metrics log) is computed once, here."""
        started = AttemptStarted(time.time(), fields)
        self._before = ledger([*earlier, {"kind": "start", "time": started.time, **fields}])
        self._started = started.time
        self._publish(started)

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
        self._advanced_s += m.dt - m.data_wait_s - m.compile_s  # as the ledger counts training
        self._publish(StepDone(m, self.goodput(), self._so_far()))

    def eval(self, step: int, val_bpb: float, total_training_time: float) -> None:
        self._publish(Evaluated(step, val_bpb, total_training_time))

    def core(self, step: int, line: str, core_metric: float, centered: dict[str, float],
             seconds: float) -> None:
        """A CORE evaluation (raychat.worker.core_metric): nanochat's line, the gauge, wandb with the
        centered result per task, and the metrics log (raychat.report plots it)."""
        self._publish(CoreEvaluated(step, line, core_metric, centered, seconds))

    def samples(self, step: int, texts: list[str]) -> None:
        self._publish(Sampled(step, texts))

    def report(self, metrics: dict[str, Any], checkpoint: Storage | None = None) -> None:
        """Ray Train's report (Tune's result) with the latest step's numbers; all ranks, same steps.
        `checkpoint` (rank 0): the run's newest whole checkpoint, for Ray Train to name."""
        if self.last is not None:
            metrics = {**self.last.tune(), **metrics}
        goodput = self.goodput()
        if goodput is not None:
            metrics["goodput"] = goodput
        self._publish(Reported(metrics, self._so_far(), checkpoint))

    def flush(self) -> None:
        """Write what the sinks hold back (a bucket's metrics log is rewritten every 30 s otherwise)."""
        for sink in self._sinks:
            sink.flush()

    def held_back(self) -> list[str]:
        """What the sinks hold back now (rank 0's metrics log: the records it has not written yet)."""
        return [line for sink in self._sinks for line in sink.held_back()]
