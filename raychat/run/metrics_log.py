"""The run's metrics log: `<storage>/<run>/metrics.jsonl`, one JSON object per line, in the run's own
directory (local disk or a bucket), so the run's numbers outlive the terminal and Ray's session and
`python -m raychat.report` can draw them while the run goes on or long after it ended.

Rank 0 writes it as it goes: an attempt's start (step, world size, plan, restart counts), every
step's record (raychat.run.metrics.StepMetrics), every eval, the samples and every report to Ray
Train. A restarted attempt redoes the steps after its checkpoint and appends them again; the
reader keeps the final timeline: at each start at step s, what earlier attempts wrote for steps
from s on is dropped (evals and samples at s itself are kept unless redone).

Step records are held back and written together: on local disk (appended to where it is) at most
every LOCAL_FLUSH_S seconds, in a bucket (which cannot append: the whole file is rewritten,
`Storage.open_append`) at most every REMOTE_FLUSH_S seconds. Every other record is written at once,
with the steps before it, and so is everything before a checkpoint and at the end of an attempt.
Each write lists the run's lease first (a superseded writer never appends), so a write per step
cost rank 0 about half a millisecond of every step, the whole gap between two steps of a small
model. What rank 0 holds back travels with its memory replicas (raychat.run.replicas): an attempt
resumed from peer memory does not redo those steps, so it writes their records first. What a killed
rank 0 held back past its last replica is known to the run's coordinator (its step count) and
counted as redone by the time ledger: the resumed attempt redoes those steps. A failed write never
stops training: it is retried with the next flush, on a line of its own.
"""

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from raychat.checkpoint.fence import Fence
from raychat.faults import StorageUnavailable
from raychat.run.ledger import Ledger, ledger
from raychat.run.metrics import (
    AttemptStarted,
    CoreEvaluated,
    Evaluated,
    Record,
    Reported,
    Sampled,
    Sink,
    StepDone,
)
from raychat.storage import Storage

METRICS_FILE = "metrics.jsonl"
LOCAL_FLUSH_S = 1.0
REMOTE_FLUSH_S = 30.0
CARRIED_MAX = 10_000  # records a memory replica carries (~4 MB of step records: 30 s at 300 steps/s)


def _clean(value: Any) -> Any:
    """JSON has no inf/nan: write them as null (min_val_bpb is inf before the first eval)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class MetricsLog(Sink):
    """Appends records to one run's metrics.jsonl (create on rank 0 only): every record the publisher
    hands it, with all its fields."""

    def __init__(self, run: Storage, fence: Fence | None = None, carried: list[str] | None = None):
        self._run = run
        self._fence = fence or Fence(run, 0)  # a superseded writer's lines never reach the file
        self._last_flush = time.monotonic()
        self._warned = False
        existing, self._file = run.open_append(METRICS_FILE)
        text = existing.decode(errors="replace")
        # What a memory replica carried (`held_back` when it was taken) and the file lacks: the killed
        # attempt's, written first. A write takes all it holds, in order, so the file lacks none of
        # them or the last ones (a write cut short: parse_records reads a repeated line once); none
        # when the killed attempt wrote them after the replica, or a restore from that set did.
        written = set(text.splitlines()) if carried else set()
        self._pending = [line for line in carried or [] if line not in written]
        # A killed attempt may have left half a line: start ours on a line of its own.
        self._needs_newline = bool(existing) and not existing.endswith(b"\n")
        # what earlier attempts wrote, the carried records included
        ours = "".join(line + "\n" for line in self._pending)
        self.earlier = parse_records(text + ("\n" if self._needs_newline and ours else "") + ours)

    def held_back(self) -> list[str]:
        """The records not yet written, at most the newest CARRIED_MAX: a storage outage holds back
        everything it lasts, and a memory replica that carries them is sent every step or two."""
        return self._pending[-CARRIED_MAX:]

    def publish(self, record: Record) -> None:
        match record:
            case AttemptStarted(time=started, fields=fields):
                self.write("start", **fields, time=started)
                self.earlier = []  # read once, for the publisher's ledger; not kept for the whole run
            case StepDone(metrics=m, so_far=so_far):
                self.write("step", **asdict(m), **so_far)
            case Evaluated(step=step, val_bpb=bpb, total_training_time=total):
                self.write("eval", step=step, val_bpb=bpb, total_training_time=total)
            case CoreEvaluated(step=step, core_metric=core, centered=centered, seconds=seconds):
                self.write("core", step=step, core_metric=core, centered=centered, seconds=seconds)
            case Sampled(step=step, texts=texts):
                self.write("samples", step=step, samples=texts)
            case Reported(metrics=metrics, so_far=so_far):
                self.write("report", **metrics, **so_far)  # written at once, as every record but steps

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Log one record; returns it as written (with its time)."""
        record = _clean({"kind": kind, "time": time.time(), **fields})  # a time in `fields` wins
        self._pending.append(json.dumps(record))
        every = LOCAL_FLUSH_S if self._run.appends_in_place else REMOTE_FLUSH_S
        if kind != "step" or time.monotonic() - self._last_flush >= every:
            self.flush()
        return record

    def flush(self) -> None:
        if not self._pending:
            return
        data = ("\n" if self._needs_newline else "") + "".join(line + "\n" for line in self._pending)
        try:
            if self._fence.newer() is not None:  # another driver holds the run: its log, not ours
                self._pending = []
                return
            self._file.append(data.encode())
        except (OSError, pa.ArrowException, StorageUnavailable) as e:
            # A write cut short (a full disk) that could not be cut off again left part of a line: the
            # retry starts on a line of its own (what it wrote whole and writes again, parse_records
            # reads once).
            self._needs_newline = True
            if not self._warned:  # the checkpoints matter more than this log: say so once, train on
                print(f"raychat: cannot write {self._run.child(METRICS_FILE)} ({e}); will retry",
                      file=sys.stderr, flush=True)
                self._warned = True
            return
        self._pending, self._needs_newline, self._last_flush = [], False, time.monotonic()


@dataclass
class Timeline:
    """A run's final timeline, as read from its metrics log."""

    starts: list[dict[str, Any]] = field(default_factory=list)  # every attempt, in order
    steps: list[dict[str, Any]] = field(default_factory=list)  # one per step, in step order
    evals: list[dict[str, Any]] = field(default_factory=list)  # one per eval step, in step order
    samples: list[dict[str, Any]] = field(default_factory=list)
    reports: list[dict[str, Any]] = field(default_factory=list)
    ledger: Ledger = field(default_factory=lambda: Ledger(0.0, []))  # the run's wall time by cause

    @property
    def last_report(self) -> dict[str, Any]:
        return self.reports[-1] if self.reports else {}


def parse_records(text: str) -> list[dict[str, Any]]:
    """The log's records in file order; a torn line (an attempt killed mid-write) is skipped, and so
    is a line seen before: a write cut short that the filesystem would not cut off again leaves what it
    wrote whole, and its retry writes it again (each record carries its time to the microsecond, so
    two records are never the same line otherwise)."""
    records, seen = [], set()
    for line in text.splitlines():
        if line in seen:
            continue
        seen.add(line)
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "kind" in record:
            records.append(record)
    return records


def final_timeline(records: list[dict[str, Any]]) -> Timeline:
    """Replay the records: an attempt starting at step s supersedes what earlier attempts wrote from
    step s on; a record for a step seen before replaces the earlier one. Every attempt's time, the
    superseded included, goes into the ledger."""
    starts: list[dict[str, Any]] = []
    by_kind: dict[str, dict[int, dict[str, Any]]] = {"step": {}, "eval": {}, "samples": {}, "report": {}}
    last_time = None
    for record in records:
        kind = record["kind"]
        if kind == "start":
            s = record.get("step", 0)
            starts.append({**record, "previous_time": last_time})  # when the attempt before wrote last
            for k, by_step in by_kind.items():
                # Steps from s on are redone; an eval, samples or report at s ran before step s and
                # stays unless the new attempt does it again.
                for step in [t for t in by_step if t > s or (k == "step" and t >= s)]:
                    del by_step[step]
        elif kind in by_kind and isinstance(record.get("step"), int):
            by_kind[kind][record["step"]] = record
        last_time = record.get("time", last_time)
    ordered = {k: [v[s] for s in sorted(v)] for k, v in by_kind.items()}
    return Timeline(starts, ordered["step"], ordered["eval"], ordered["samples"], ordered["report"],
                    ledger(records))


def read_timeline(run: Storage) -> Timeline | None:
    """The final timeline of the run at `run`, or None when it has no metrics log (yet)."""
    if not run.exists(METRICS_FILE):
        return None
    return final_timeline(parse_records(run.read_text(METRICS_FILE)))
