"""The run's metrics log: `<storage>/<run>/metrics.jsonl`, one JSON object per line, in the run's own
directory (local disk or a bucket), so the run's numbers outlive the terminal and Ray's session and
`python -m raychat.report` can draw them while the run goes on or long after it ended.

Rank 0 writes it as it goes: an attempt's start (step, world size, plan, restart counts), every
step's record (raychat.telemetry.metrics.StepMetrics), every eval, the samples and every report to Ray
Train. A restarted attempt redoes the steps after its checkpoint and appends them again; the
reader keeps the final timeline: at each start at step s, what earlier attempts wrote for steps
from s on is dropped (evals and samples at s itself are kept unless redone).

Rank 0's training thread never waits on storage for it: records are handed to a writer thread
(raychat.telemetry.append_writer), which writes what it holds when asked. Step records are held back and
written together: on local disk (appended to where it is) at most every LOCAL_FLUSH_S seconds, in a
bucket at most every REMOTE_FLUSH_S seconds. Every other record is asked to be written at once, with
the steps before it, and so is everything before a checkpoint (without waiting: `flush_soon`). At
the end of an attempt, by error too, `flush` waits for the write, at most FLUSH_BUDGET_S seconds.
A bucket cannot append, and rewriting the log whole at every flush uploaded it again and again: there
each flush is a new object, `metrics.jsonl.parts/part_<attempt>_<seq>.jsonl`, none ever rewritten,
and `read_log` reads the log a writer of the whole file left (if one did) then the parts in order, as
one log. Each write lists the run's lease first (a superseded writer never appends). What rank 0
holds back, what is being written included, travels with its memory replicas
(raychat.elastic.replicas): an attempt resumed from peer memory does not redo those steps, so it writes
their records first. What a killed rank 0 held back past its last replica is known to the run's
coordinator (its step count) and counted as redone by the time ledger: the resumed attempt redoes
those steps. A failed write never stops training: transient faults are retried
(raychat.faults.retry_transient), and a write that still fails is said in one line and its records
kept for the next flush.
"""

import json
import math
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

from raychat.checkpoint.fence import Fence
from raychat.faults import retry_transient
from raychat.storage import AppendFile, Storage
from raychat.telemetry.append_writer import BackgroundWriter, PartedFile, part_names, read_whole
from raychat.telemetry.ledger import Ledger, ledger
from raychat.telemetry.metrics import (
    AttemptStarted,
    CoreEvaluated,
    Evaluated,
    Record,
    Reported,
    Sampled,
    Sink,
    StepDone,
)

METRICS_FILE = "metrics.jsonl"
LOCAL_FLUSH_S = 1.0
REMOTE_FLUSH_S = 30.0
CARRIED_MAX = 10_000  # records a memory replica carries (~4 MB of step records: 30 s at 300 steps/s)
HELD_MAX = 200_000  # records held while storage fails (~80 MB): past it the oldest go, said in a line
FLUSH_BUDGET_S = 10.0  # how long the end of an attempt waits for the log's last write
_open_logs: "weakref.WeakSet[MetricsLog]" = weakref.WeakSet()  # this process's (rank 0's) logs


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
    """Appends records to one run's metrics log (create on rank 0 only): every record the publisher
    hands it, with all its fields, written by a thread of its own."""

    def __init__(self, run: Storage, fence: Fence | None = None, carried: list[str] | None = None):
        self._run = run
        self._last_flush = time.monotonic()
        parts = part_names(run, METRICS_FILE)
        if run.appends_in_place and not parts:
            existing, file = run.open_append(METRICS_FILE)
            text = existing.decode(errors="replace")
            # A killed attempt may have left half a line: start ours on a line of its own.
            torn = bool(existing) and not existing.endswith(b"\n")
            destination: _InPlace | PartedFile = _InPlace(file, torn)
        else:  # a bucket (or a run whose log is in parts already: appending to the file would misorder it)
            text = read_whole(run, METRICS_FILE, parts) or ""
            destination = PartedFile(run, METRICS_FILE, parts)
        # What a memory replica carried (`held_back` when it was taken) and the log lacks: the killed
        # attempt's, written first. A write takes all it holds, in order, so the log lacks none of
        # them or the last ones (a write cut short: parse_records reads a repeated line once); none
        # when the killed attempt wrote them after the replica, or a restore from that set did.
        written = set(text.splitlines()) if carried else set()
        missing = [line for line in carried or [] if line not in written]
        # what earlier attempts wrote, the carried records included
        ours = "".join(line + "\n" for line in missing)
        apart = "\n" if text and not text.endswith("\n") and ours else ""
        self.earlier = parse_records(text + apart + ours)
        where = str(run.child(METRICS_FILE))
        # The writer's thread holds no reference to this object: one the publisher dropped ends it.
        self._writer = BackgroundWriter(_Write(destination, fence or Fence(run, 0), where), where, HELD_MAX)
        weakref.finalize(self, self._writer.stop)
        for line in missing:
            self._writer.add(line, flush=False)
        _open_logs.add(self)

    def held_back(self) -> list[str]:
        """The records not written yet, at most the newest CARRIED_MAX: a storage outage holds back
        everything it lasts, and a memory replica that carries them is sent every step or two."""
        return self._writer.held()[-CARRIED_MAX:]

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
        """Log one record (handed to the writer: never waits on storage); returns it as written (with
        its time)."""
        record = _clean({"kind": kind, "time": time.time(), **fields})  # a time in `fields` wins
        every = LOCAL_FLUSH_S if self._run.appends_in_place else REMOTE_FLUSH_S
        now = time.monotonic()
        due = kind != "step" or now - self._last_flush >= every
        if due:
            self._last_flush = now
        self._writer.add(json.dumps(record), flush=due)
        return record

    def flush(self, wait_s: float | None = None) -> bool:
        """Write every record held now, waiting up to `wait_s` seconds (default FLUSH_BUDGET_S: the end
        of an attempt, by error too; 0: ask and go on). True once all of them are written."""
        self._last_flush = time.monotonic()
        budget = FLUSH_BUDGET_S if wait_s is None else wait_s
        done = self._writer.flush(budget)
        if not done and budget > 0:
            held = len(self._writer.held())
            if held:  # at an attempt's end: what may never be written is said, not lost silently
                print(f"raychat: {held} records of {self._run.child(METRICS_FILE)} are not written yet "
                      "(storage failing or slow): a memory replica carries the newest", file=sys.stderr,
                      flush=True)
        return done

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the writes asked for so far; True if they all succeeded."""
        return self._writer.wait(timeout)


class _InPlace:
    """Appends to the log where it is (local disk, NFS)."""

    def __init__(self, file: AppendFile, needs_newline: bool):
        self._file, self._needs_newline = file, needs_newline

    def append(self, data: bytes) -> None:
        try:
            self._file.append((b"\n" if self._needs_newline else b"") + data)
        except BaseException:
            # A write cut short (a full disk) that could not be cut off again left part of a line: the
            # retry starts on a line of its own (what it wrote whole and writes again, parse_records
            # reads once).
            self._needs_newline = True
            raise
        self._needs_newline = False


class _Write:
    """One write of the writer thread: the lease checked, then the lines appended, transient faults
    retried."""

    def __init__(self, destination: "_InPlace | PartedFile", fence: Fence, where: str):
        self._destination, self._fence, self._where = destination, fence, where

    def __call__(self, lines: list[str]) -> None:
        if self._fence.newer() is not None:  # another driver holds the run: its log, not ours
            return
        data = "".join(line + "\n" for line in lines).encode()
        retry_transient(lambda: self._destination.append(data), f"writing {self._where}")


def flush_soon() -> None:
    """Ask this process's metrics log (rank 0's) to write what it holds, without waiting (before a
    checkpoint: the log then holds the steps the checkpoint covers, and the save does not wait)."""
    for log in list(_open_logs):
        log.flush(wait_s=0)


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


def read_log(run: Storage) -> str | None:
    """The run's metrics log as one text (the whole file, then a bucket's parts in order), or None
    when it has none (yet)."""
    return read_whole(run, METRICS_FILE)


def has_log(run: Storage) -> bool:
    return run.exists(METRICS_FILE) or bool(part_names(run, METRICS_FILE))


def read_timeline(run: Storage) -> Timeline | None:
    """The final timeline of the run at `run`, or None when it has no metrics log (yet)."""
    text = read_log(run)
    return None if text is None else final_timeline(parse_records(text))
