"""Rank 0's side of an elastic run: the requests to save now (a planned resize, a preemption notice)
that ride on the step's all-reduce, and the line a restarted attempt says about how it came to be.

The controller's side (raychat.elastic.controller) asks the run's coordinator for a save before a
planned resize; rank 0 polls the coordinator here without blocking, and the step's loss all-reduce
carries the answer to every rank, so they all save at the same step.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import ray

from raychat.elastic.coordinator import Attempt
from raychat.ray_glue.ray_internals import preemption_deadline


@dataclass
class AttemptStart:
    """How this attempt of the worker group came to be, for the log line and the run's counters."""

    kind: str  # "first" | "planned" | "failure"
    line: str | None
    redone_steps: int = 0


def describe_attempt(previous: Attempt, step: int, world_size: int, checkpoint: str | None) -> AttemptStart:
    """One log line for a restarted attempt (None for the first)."""
    if previous.attempt == 0:
        return AttemptStart("first", None)
    before = previous.world_size or world_size
    if previous.planned_step is not None:
        verb = "Grew" if world_size > before else "Resized"
        return AttemptStart("planned", f"{verb} to {world_size} workers at step {step} (no steps redone)")
    last = previous.last_step
    redone = max(0, last + 1 - step) if last is not None else 0
    lost = before - world_size
    what = f"Lost {lost} worker(s)" if lost > 0 else "A worker failed"
    if previous.notice_step is not None:
        # The notice's save comes as late as its deadline allows and the group then waits for the
        # node to go (raychat.worker.fault_tolerance.FaultTolerance.save_on_request): nothing is
        # redone unless Ray gave no deadline.
        what = f"Preempted (saved step {previous.notice_step} on the notice)"
    where = f"from step {step} ({checkpoint})" if checkpoint else f"from step {step} (no checkpoint yet)"
    return AttemptStart("failure", f"{what}: continuing on {world_size} {where}; {redone} steps redone",
                        redone)


# A spot notice's save: how close to the reclaim deadline the group saves at the latest (beside twice
# its last save and three steps): room for the work before a save (metrics flush, fence check, the
# cursors' gather, a periodic save still in flight) and for clocks that differ between the machine
# that set the deadline, Ray's controller and the workers.
NOTICE_SAVE_MARGIN_S = 15.0


def notice_margin(save_s: float, step_s: float) -> float:
    """Seconds before a notice's deadline by which its save starts (see NOTICE_SAVE_MARGIN_S)."""
    return max(NOTICE_SAVE_MARGIN_S, 2 * save_s + 3 * step_s)


def notice_save_due(deadline: float | None, now: float, save_s: float | None, step_s: float,
                    busy_next: bool = False) -> bool:
    """Whether the workers, told of a preemption (the node reclaimed at `deadline`, UNIX seconds;
    0.0: no deadline given; None: no notice), should save at this step boundary: late enough that
    the steps trained since the notice count, early enough that a save of `save_s` seconds (its
    stall and write, as this attempt last measured it) ends before the node goes. At once without a
    deadline or a measured save, and before work that does not look at the deadline (`busy_next`: an
    evaluation, CORE, samples or the final step come next)."""
    if deadline is None:
        return False
    if not deadline or save_s is None or busy_next:
        return True
    return now >= deadline - notice_margin(save_s, step_s)


@dataclass(frozen=True)
class StepFlags:
    """What every rank must agree on at a step boundary, one float each so that they ride, summed
    across ranks, on the step's loss all-reduce (raychat.worker.step.train_step): a sum above 0 means
    some rank said yes. Fields in the order they travel."""

    resize: float = 0.0  # rank 0: the controller asked for a save before a planned resize
    preempt: float = 0.0  # a rank's node got a preemption notice and its save is due now
    checkpoint: float = 0.0  # rank 0's auto cadence wants the next step saved
    replicate: float = 0.0  # rank 0 wants the next step mirrored in peer memory
    sending: float = 0.0  # a rank's last replica is still being sent
    lost: float = 0.0  # a rank's last save found another driver holds the run

    def values(self) -> tuple[float, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def from_values(cls, values: Sequence[float]) -> "StepFlags":
        return cls(*values)


@dataclass
class ElasticSignals:
    """A worker's side of the elastic protocol: whether any rank was asked to save now (rank 0 by
    the coordinator for a planned resize or by its checkpoint cadence, any rank whose node got a
    preemption notice). Each rank reads its own flags without blocking (`local_flags`) beside the
    step; they ride on the step's loss all-reduce (raychat.worker.step.train_step), and `update` takes
    the sums back."""

    coordinator: "ray.actor.ActorHandle | None" = None  # rank 0: the run's Coordinator actor
    save_request: "ray.ObjectRef | None" = None  # rank 0: the oldest Coordinator.progress() reply not read
    preempt_saved: bool = False  # saved on this attempt's preemption notice already
    resize_requested: bool = False
    preempt_requested: bool = False
    checkpoint_due: bool = False  # rank 0's auto cadence (raychat.elastic.cadence) wants the next step saved
    replicate_due: bool = False  # rank 0 wants the next step replicated and no rank is still sending
    replicate_skipped: bool = False  # rank 0 wanted it, but some rank's last replica is still being sent
    any_sending: bool = False  # some rank's last replica was still being sent at the last step's all-reduce
    step_s: float = 0.0  # this rank's last step
    save_s: float | None = None  # this rank's last save in this attempt: its stall and write

    def local_flags(self, checkpoint_due: bool = False, busy_next: bool = False, replicate_due: bool = False,
                    still_sending: Callable[[], bool] | None = None) -> "StepFlags":
        """This rank's flags, asked just before the step's all-reduce. `busy_next`: an evaluation or
        the final step comes after this step (a notice's save goes before it)."""
        due = notice_save_due(preemption_deadline(), time.time(), self.save_s, self.step_s, busy_next)
        return StepFlags(resize=float(self._poll_resize()), preempt=float(not self.preempt_saved and due),
                         checkpoint=float(checkpoint_due), replicate=float(replicate_due),
                         sending=float(still_sending is not None and still_sending()))

    def update(self, summed: "StepFlags") -> None:
        """Take the flags summed over the ranks: every rank then acts on the same answers."""
        self.resize_requested, self.preempt_requested = summed.resize > 0, summed.preempt > 0
        self.checkpoint_due = summed.checkpoint > 0
        # Every rank replicates the same steps (a restore needs a whole set), none waits for a send:
        # a step some rank is still sending for is skipped by all.
        self.any_sending = summed.sending > 0
        self.replicate_due = summed.replicate > 0 and not self.any_sending
        self.replicate_skipped = summed.replicate > 0 and self.any_sending

    def progress(self, step: int, outside_s: float = 0.0) -> None:
        """Rank 0, after each step: tell the coordinator the step, its time and the attempt's seconds
        of evaluations and saves so far (fire and forget: what a restart redoes, and what a grow is
        judged by). Its reply carries the planned-resize flag `_poll_resize` reads; while an older
        reply is unread it stays the one read, so replies slower than a step still get through."""
        if self.coordinator is None:
            return
        reply = self.coordinator.progress.remote(step, self.step_s, outside_s)
        if self.save_request is None:
            self.save_request = reply

    def resize_saved(self, step: int) -> None:
        """Rank 0: the planned resize's save of `step` is done; tell the coordinator. The progress reply
        sent after the step that heard the request was computed before this and still says "save":
        dropped, or a group Ray has not stopped by then would save and wait a second time."""
        if self.coordinator is not None:
            ray.get(self.coordinator.saved.remote(step))
        self.save_request = None

    def _poll_resize(self) -> bool:
        """Rank 0: has the controller asked for a save before a planned resize? (never blocks; the
        answer of the last step's progress call)"""
        if self.coordinator is None or self.save_request is None:
            return False
        ready, _ = ray.wait([self.save_request], timeout=0)
        if not ready:
            return False
        self.save_request = None
        try:
            return bool(ray.get(ready[0]))
        except ray.exceptions.ActorUnavailableError:
            # Unreachable for now (Ray's word: "may be available later"): this reply is lost, the next
            # step's is read. (A RayActorError too: it must not end the polling below.)
            return False
        except ray.exceptions.RayActorError:
            # Ended by the driver that took the run over (`end_coordinator_taken_over`): nothing will
            # ask for a save; the lease's fence stops these workers at their next save.
            self.coordinator = None
            return False
