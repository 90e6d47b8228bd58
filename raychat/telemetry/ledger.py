"""Where a run's wall time went, by cause, from its metrics log (raychat.telemetry.metrics_log): its goodput.

Goodput is the share of the wall time spent in steps that advanced training: what a user renting
preemptible GPUs pays for. The rest is accounted by cause, so the causes partition the wall time:

  startup      a driver's launch to its first step (preparing inputs, Ray, the worker group, restore)
  detect       per restart or resize: from the last step of the attempt that ended to Ray's controller
               noticing (a dead node's health checks, a resize decision)
  reschedule   from then to the new worker group running the train function
  restore      the new group's setup: model, optimizer, checkpoint read, the loader started
  first_step   from the restored state to the new attempt's first step (evaluations apart)
  compile      steps' time in torch.compile (an attempt's first step, recompiles), from the step records,
               and the set-up's compile probe (COMPILE_PROBE) from the start record
  training     steps that advanced training (their time waiting for data and compiling apart)
  data_wait    those steps waiting for their batch
  redone       steps trained again after a restart (all their time: their work was lost)
  checkpoint   the step loop stalled by saves (the copy to host memory, the final synchronous save)
  eval         validation bpb, CORE and samples
  other        between steps and not in the above: logging, reports to Ray Train, metrics sinks

Every attempt's start record carries the times a restart is split by (`launched`, `setup_started`,
`noticed`, `last_progress`, written by raychat.worker.setup from the driver and the run's
coordinator), and every step and report record the attempt's running eval and checkpoint seconds
(`eval_s_so_far`, `checkpoint_s_so_far`). A rerun of the run name (a new driver, its own `session`)
starts a new stretch of wall time: the time between two drivers is not counted.
"""

import math
from dataclasses import dataclass, field
from typing import Any

CAUSES = ("startup", "detect", "reschedule", "restore", "first_step", "compile", "training", "data_wait",
          "redone", "checkpoint", "eval", "other")  # an attempt's causes roughly in the order its time passes
RESTART_CAUSES = ("detect", "reschedule", "restore", "first_step", "compile")
# The set-up phase (raychat.worker.setup) that compiles a tiny function to check torch.compile works:
# it pays inductor's start-up, which the first compiled step would pay otherwise, so it counts as compile.
COMPILE_PROBE = "compile_probe"


@dataclass
class AttemptTime:
    """One attempt of the worker group: its own wall time (the gap before it included) by cause."""

    step: int  # the step it started from
    kind: str  # "first" (a driver's first attempt), "restart" or "resize"
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    tail_s: float = 0.0  # of its "redone": the attempt before it's steps that never reached the log

    @property
    def wall_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float:
        return self.seconds["training"] / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class Ledger:
    """A run's wall time by cause, over all its attempts."""

    wall_s: float  # from each driver's launch to its last record, summed over drivers
    attempts: list[AttemptTime]

    @property
    def seconds(self) -> dict[str, float]:
        return {cause: sum(a.seconds[cause] for a in self.attempts) for cause in CAUSES}

    @property
    def goodput(self) -> float:
        return self.seconds["training"] / self.wall_s if self.wall_s > 0 else 0.0

    def lines(self) -> list[str]:
        """The ledger as the report and raychat.status print it."""
        if self.wall_s <= 0:
            return ["- no steps yet"]
        training = self.seconds["training"]
        lines = [f"- goodput {100 * self.goodput:.1f}%: {training / 60:.2f} min of steps that advanced "
                 f"training in {self.wall_s / 60:.2f} min of wall time"]
        parts = [f"{cause} {seconds:.1f}s ({100 * seconds / self.wall_s:.1f}%)"
                 for cause, seconds in self.seconds.items() if seconds > 0]
        lines.append("- by cause: " + ", ".join(parts))
        for before, a in zip(self.attempts, self.attempts[1:], strict=False):
            if a.kind == "first":  # a rerun of the run name: no restart to account
                continue
            parts = [f"{cause} {a.seconds[cause]:.1f}s" for cause in RESTART_CAUSES]
            # The steps it redid were trained (and lost) in the attempt before it: those the log has
            # (counted in that attempt's "redone") and those it lacks (counted in this one's tail).
            redone = before.seconds["redone"] - before.tail_s + a.tail_s
            lines.append(f"- {a.kind} at step {a.step}: " + ", ".join(parts)
                         + f", {redone:.1f}s of steps redone; attempt goodput {100 * a.goodput:.1f}%")
        return lines


def _attempts(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(start record, the records after it) per attempt, in file order."""
    attempts: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for record in records:
        if record["kind"] == "start":
            attempts.append((record, []))
        elif attempts and isinstance(record.get("time"), int | float):
            attempts[-1][1].append(record)
    return attempts


def _running(records: list[dict[str, Any]], name: str) -> float:
    """The attempt's running total `name` at its last record that has it."""
    return max((r[name] for r in records if isinstance(r.get(name), int | float)), default=0.0)


def ledger(records: list[dict[str, Any]]) -> Ledger:
    """The time ledger of a run from its metrics log's records in file order (parse_records)."""
    attempts = _attempts(records)
    # A step is redone when a later attempt started at or before it (as final_timeline replays them).
    later_start = [math.inf] * len(attempts)
    for i in range(len(attempts) - 2, -1, -1):
        later_start[i] = min(later_start[i + 1], attempts[i + 1][0].get("step", 0))
    out: list[AttemptTime] = []
    wall = 0.0
    end = None  # the time of the previous attempt's last record
    last_logged = -1  # the previous attempt's last step in the log
    previous: dict[str, Any] = {}
    for i, (start, body) in enumerate(attempts):
        t_start = start["time"]
        steps = [r for r in body if r["kind"] == "step"]
        resized = start.get("resizes", 0) > previous.get("resizes", 0)
        restarted = resized or start.get("restarts", 0) > previous.get("restarts", 0)
        # The driver's session says which attempts are one run of the driver; a log written before
        # attempts recorded it tells by the restart counters, as the report's markers do.
        same = start.get("session") == previous.get("session") if "session" in start else restarted
        new_driver = end is None or not same
        kind = "first" if new_driver else ("resize" if resized else "restart")
        a = AttemptTime(start.get("step", 0), kind)
        s = a.seconds
        # Before the attempt's first step: evaluations and saves at its first step have their own causes.
        before = steps[0] if steps else {}
        if steps:
            first_start = before["time"] - before.get("dt", 0.0)
        else:  # no step yet: the attempt so far is all start-up (or restart)
            first_start = body[-1]["time"] if body else t_start
        pre_eval, pre_ckpt = before.get("eval_s_so_far", 0.0), before.get("checkpoint_s_so_far", 0.0)
        probe = float((start.get("setup_phases") or {}).get(COMPILE_PROBE, 0.0))
        if new_driver:
            launched = start.get("launched", t_start)
            startup = max(0.0, first_start - launched - pre_eval - pre_ckpt)
            probe = min(probe, startup)
            s["startup"], s["compile"] = startup - probe, s["compile"] + probe
            wall_from = launched
        else:
            # Some steps the ended attempt finished never reached the log: rank 0 was killed while it
            # held their records back (up to a second on local disk, 30 s in a bucket), and they lie
            # past the memory replica the next attempt resumed from, which carried the records before
            # it. The coordinator knows those steps, and they count as redone, not waiting. That is
            # only when the coordinator saw a step the log did not, as rank 0's progress call follows
            # each step's record.
            unlogged = (start.get("last_progress_step") or -1) > last_logged
            lost_at = max(end, min(start.get("last_progress") or end, t_start)) if unlogged else end
            noticed = min(max(start.get("noticed") or lost_at, lost_at), t_start)
            setup = min(max(start.get("setup_started") or noticed, noticed), t_start)
            a.tail_s = lost_at - end
            s["redone"] += a.tail_s
            s["detect"], s["reschedule"], s["restore"] = noticed - lost_at, setup - noticed, t_start - setup
            probe = min(probe, s["restore"])
            s["restore"] -= probe
            s["compile"] += probe
            s["first_step"] = max(0.0, first_start - t_start - pre_eval - pre_ckpt)
            wall_from = end
        for r in steps:
            compiling = r.get("compile_s", 0.0)  # a cost of its own, redone step or not
            s["compile"] += compiling
            if r["step"] >= later_start[i]:
                s["redone"] += r.get("dt", 0.0) - compiling
            else:
                s["training"] += r.get("dt", 0.0) - r.get("data_wait_s", 0.0) - compiling
                s["data_wait"] += r.get("data_wait_s", 0.0)
        s["eval"] = _running(body, "eval_s_so_far")
        s["checkpoint"] = _running(body, "checkpoint_s_so_far")
        end = body[-1]["time"] if body else t_start
        last_logged = steps[-1]["step"] if steps else start.get("step", 0) - 1
        attempt_wall = end - wall_from
        s["other"] = max(0.0, attempt_wall - a.wall_s)
        wall += attempt_wall
        previous = start
        out.append(a)
    return Ledger(wall, out)
