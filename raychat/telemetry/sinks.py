"""Where a run's records go (raychat.telemetry.metrics.Publisher fans each out to these): nanochat's
log line, Ray dashboard gauges, wandb and Ray Train/Tune reports. The run's metrics log is a sink too
(raychat.telemetry.metrics_log).

Ray custom metrics (`ray.util.metrics` gauges) are scraped by Ray's per-node metrics agent and
served on the node's Prometheus endpoint (`http://<node>:<metrics_export_port>/metrics`, the
names there gain Ray's `ray_` prefix: `ray_raychat_loss{run="..."}`), which is what the Ray
dashboard's Grafana panels and any Prometheus read.

wandb: one run per raychat run, its id kept in the run's directory (`wandb_run.json`), so every
attempt, rerun and resize continues it.
"""

import json
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

from raychat.common import RaychatError
from raychat.storage import Storage
from raychat.telemetry.metrics import (
    CoreEvaluated,
    Evaluated,
    Record,
    Reported,
    Sampled,
    Sink,
    StepDone,
    format_val_line,
)


class LogLines(Sink):
    """nanochat's lines on the worker's log: the step line, the validation and CORE lines, samples."""

    def __init__(self, log: Callable[[str], None]):
        self._log = log

    def publish(self, record: Record) -> None:
        match record:
            case StepDone(metrics=m):
                self._log(m.line())
            case Evaluated(step=step, val_bpb=bpb):
                self._log(format_val_line(step, bpb))
            case CoreEvaluated(line=line):
                self._log(line)
            case Sampled(texts=texts):
                for text in texts:
                    self._log(text)


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
    "goodput": "share of the run's wall time so far in steps that advanced training (telemetry.ledger)",
}


class RayMetrics(Sink):
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

    def publish(self, record: Record) -> None:
        match record:
            case StepDone(metrics=m, goodput=goodput):
                self.update(**m.gauges(), goodput=goodput)
            case Evaluated(val_bpb=bpb):
                self.update(val_bpb=bpb)
            case CoreEvaluated(core_metric=core):
                self.update(core_metric=core)


# -----------------------------------------------------------------------------
# wandb


def _redact(text: str) -> str:
    key = os.environ.get("WANDB_API_KEY")
    return text.replace(key, "***") if key else text


WANDB_EVERY = 100  # nanochat logs the training curve to wandb every 100 steps
# In the run's directory: the run's wandb id (created once: whoever creates it first wins, every later
# attempt, rerun, resize or sweep trial restart reads it) and the last step an attempt logged to it.
WANDB_RUN_FILE = "wandb_run.json"


def wandb_run_record(run_dir: Storage) -> dict[str, Any]:
    """The run's wandb record {"id", "logged_step"}: created if the run has none yet (atomically, so
    two attempts racing get the same id), else the one there."""
    fresh = {"id": uuid.uuid4().hex[:16], "logged_step": -1}
    if run_dir.create_exclusive(WANDB_RUN_FILE, json.dumps(fresh).encode()):
        return fresh
    return json.loads(run_dir.read_replaceable(WANDB_RUN_FILE))


class WandbLogger(Sink):
    """wandb logging as nanochat does it: off for run "dummy", else project "raychat".

    One wandb run per raychat run: with `run_dir` (the run's directory) its id is kept there
    (`WANDB_RUN_FILE`) and every attempt resumes it, so a restart, a resize, a rerun or a sweep
    trial's restart continues one wandb run. A step is logged once: an attempt redoes the steps after
    its checkpoint, which an earlier attempt may have logged already, so steps up to the last one
    logged (kept in the same file after each log; a resumed online run also knows its own) are left
    out; the step axis stays monotonic, as wandb requires.

    WANDB_MODE (offline, disabled, ...) is honoured as wandb honours it; with RAYCHAT_OFFLINE set
    and no WANDB_MODE the run is logged offline (sync later with `wandb sync`: the attempts' offline
    directories share the run's id). Credentials are wandb's own (`wandb login` or WANDB_API_KEY);
    nothing here prints them. Create on rank 0 only.
    """

    def __init__(self, run: str, config: dict | None = None, project: str = "raychat",
                 run_dir: Storage | None = None):
        self._run = None
        self._run_dir = run_dir
        self._id: str | None = None
        self._logged_before = -1  # steps up to this one were logged by an earlier attempt
        self._kept = -1  # the last step recorded in the run's directory
        if run == "dummy":
            return
        import wandb

        if run_dir is not None:
            record = wandb_run_record(run_dir)
            self._id, self._logged_before = record["id"], record["logged_step"]
            self._kept = self._logged_before
        mode = "offline" if os.environ.get("RAYCHAT_OFFLINE") and "WANDB_MODE" not in os.environ else None
        try:
            # allow_val_change: a rerun may change flags (a longer horizon): the config shows the latest
            self._run = wandb.init(project=project, name=run, config=config, mode=mode, id=self._id,
                                   resume="allow" if self._id else None,
                                   allow_val_change=self._id is not None)
        except wandb.errors.Error as e:
            reason = _redact((str(e).strip().splitlines() or [type(e).__name__])[0])
            # `from None`: wandb's own exception chain is not ours to print
            raise RaychatError(f"wandb could not start run {run!r}: {reason} Run `wandb login`, set "
                               "WANDB_MODE=offline to log locally, or pass --run dummy") from None
        # Online, a resumed run starts at the step after its last one (offline it starts at 0).
        self._logged_before = max(self._logged_before, (self._run.step or 0) - 1)

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def log(self, data: dict, step: int) -> None:
        if self._run is None or step <= self._logged_before:
            return
        self._run.log(data, step=step)
        if self._id is not None and step > self._kept:
            self._keep(step)

    def _keep(self, step: int) -> None:
        """Record `step` as logged, after logging it: an attempt killed in between logs it again."""
        record = json.dumps({"id": self._id, "logged_step": step}).encode()
        try:
            self._run_dir.replace_atomically(WANDB_RUN_FILE, record)
            self._kept = step
        except OSError as e:  # wandb is for watching: a storage fault here never stops training
            print(f"raychat: could not record wandb step {step} in {self._run_dir.child(WANDB_RUN_FILE)} "
                  f"({type(e).__name__}): a restart may log steps after {self._kept} to wandb again",
                  file=sys.stderr, flush=True)

    def publish(self, record: Record) -> None:
        match record:
            case StepDone(metrics=m) if m.step % WANDB_EVERY == 0:
                self.log(m.wandb(), m.step)
            case Evaluated(step=step, val_bpb=bpb, total_training_time=total):
                self.log({"val/bpb": bpb, "total_training_time": total}, step)
            case CoreEvaluated(step=step, core_metric=core, centered=centered):
                self.log({"core_metric": core, "centered_results": centered}, step)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


# -----------------------------------------------------------------------------
# Ray Train's report, and the one place records go out from


class TrainReport(Sink):
    """`ray.train.report` (Tune's result). Every rank's publisher has one: the report is a barrier.

    Rank 0's report names the run's newest whole checkpoint when it is new to Ray Train, so that
    `Result.checkpoint` is the checkpoint a rerun resumes from and a Tune trial's result has its
    `checkpoint_path`. Ray Train gets metadata only (NO_UPLOAD): raychat's storage stays the source
    of truth, Ray copies nothing and deletes nothing (raychat.run.driver keeps its num_to_keep None).
    """

    def __init__(self):
        self._registered: str | None = None  # the checkpoint Ray Train has from this attempt

    def publish(self, record: Record) -> None:
        if not isinstance(record, Reported):
            return
        import ray.train

        checkpoint = record.checkpoint
        if checkpoint is None or checkpoint.location == self._registered:
            ray.train.report(record.metrics)
            return
        ray.train.report(record.metrics, checkpoint=ray.train.Checkpoint(checkpoint.root, checkpoint.fs),
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
                         delete_local_checkpoint_after_upload=False)
        self._registered = checkpoint.location
