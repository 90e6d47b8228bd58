"""Elastic runs that lose no work on a planned resize, and say what happened at every restart.

Ray Train V2's elastic policy (`ScalingConfig(num_workers=(min, max))`) restarts the worker group
in two cases: a failure (a worker or its node died; the group restarts with as many workers as fit)
and a planned resize (the group is healthy and more workers now fit: the controller goes
RunningState -> ResizingState -> SchedulingState and calls
`ControllerCallback.before_controller_execute_resize_decision` before it shuts the old group down;
ray/train/v2/_internal/execution/controller/controller.py, `_execute_resize_decision`). Both restart
from the latest checkpoint. A failure cannot be planned for, but a resize can: `PlannedResizeSave`
holds the controller in that hook until the workers have saved a checkpoint at their next step
boundary, so the larger group resumes exactly where the smaller one stopped.

The run's `Coordinator` actor (raychat.run.coordinator) carries the request to the workers and
remembers each attempt, so a new attempt can log "Lost 1 worker(s) ...; 7 steps redone",
"Preempted (saved step 23 on the notice): ..." or "Grew to 3 workers at step 160 (no steps
redone)".
"""

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from raychat.checkpoint.fence import LeaseRecord
from raychat.run.coordinator import Attempt, coordinator_name
from raychat.run.ray_internals import (
    AUTOSCALING_COORDINATOR,
    ControllerCallback,
    ReschedulingState,
    ResizingState,
    RestartingState,
    preemption_deadline,
    train_requester_id,
)
from raychat.storage import Storage

SAVE_WAIT_S = 300.0  # how long the controller waits for the planned save before resizing anyway
RESERVATION_FILE = "raychat_reservation.json"  # in the run directory: the controller's resource request


class PlannedResizeSave(ControllerCallback):
    """Before a planned resize restarts the group, have the workers checkpoint the current step."""

    def __init__(self, session: str, wait_s: float = SAVE_WAIT_S):
        self.session = session
        self.wait_s = wait_s
        self._planned = False

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if isinstance(current_state, ResizingState):
            self._planned = True  # a healthy group about to be resized (not a restart after a failure)

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        if not self._planned:
            return
        self._planned = False
        coordinator = ray.get_actor(coordinator_name(self.session))
        ray.get(coordinator.request_save.remote())
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            if ray.get(coordinator.get_saved_step.remote()) is not None:
                return
            time.sleep(0.2)


class NoteRestart(ControllerCallback):
    """Tell the run's coordinator when the controller starts a restart (it noticed a failure) or a
    resize: the time ledger's end of detection (raychat.run.ledger)."""

    def __init__(self, session: str):
        self.session = session

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if isinstance(current_state, (RestartingState, ResizingState)):
            with contextlib.suppress(ValueError, ray.exceptions.RayError):  # the ledger only loses a split
                ray.get_actor(coordinator_name(self.session)).restart_noticed.remote(time.time())


class FreshClusterView(ControllerCallback):
    """After a failure, size the restarted group from the cluster as it is now.

    Ray Train's elastic policy counts the workers that fit from Ray's autoscaling coordinator
    (ray/data/_internal/cluster_autoscaler), which re-reads the cluster only every 20 s. Right after
    a node dies it still lists that node, so the controller asks for the old size and waits out
    RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S for resources that are gone (`python -m bench.recovery
    --timeline` shows the wait). Asking the coordinator to re-read once when the controller starts
    a restart (or reschedules after such a timeout) removes that wait."""

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if isinstance(current_state, (RestartingState, ReschedulingState)):
            refresh_cluster_view()


def refresh_cluster_view() -> None:
    """Make Ray's autoscaling coordinator re-read the cluster now (a best effort: a Ray without that
    actor or its `recompute` argument keeps its own 20 s timing)."""
    with contextlib.suppress(ValueError, TypeError, ray.exceptions.RayError):
        coordinator = autoscaling_coordinator()
        ray.get(coordinator.get_reserved_resources.remote("raychat", recompute=True), timeout=10)


def autoscaling_coordinator() -> ray.actor.ActorHandle:
    """Ray's autoscaling coordinator actor; ValueError where the cluster has none (yet)."""
    name, namespace = AUTOSCALING_COORDINATOR
    return ray.get_actor(name, namespace=namespace)


class RecordReservation(ControllerCallback):
    """Write down, in the run directory, the resource request this run's controller holds with Ray's
    autoscaling coordinator.

    The controller cancels that request when it shuts down, but one killed with its driver (the job
    stopped, the driver's process or node gone) never does, and the coordinator keeps the workers'
    resources reserved for it until it expires, 180 s later. A relaunched run then sees "ready
    resources for 0 workers" on a cluster sized for it and waits those minutes (174 s against 34 s
    with the request released, 2-node cluster, bench/RESULTS.md "Chaos"). The next driver of the
    run, holding its lease, releases what this file names (`release_stale_reservation`), when it
    took the run over from this controller's driver (the file says its lease epoch)."""

    def __init__(self, run_dir: str, lease_epoch: int):
        self.run_dir, self.lease_epoch = run_dir, lease_epoch

    def after_controller_start(self, train_run_context) -> None:
        record = {"requester": train_requester_id(train_run_context.run_id), "epoch": self.lease_epoch}
        with contextlib.suppress(OSError):  # without the record a relaunch only waits longer
            Storage(self.run_dir).replace_atomically(RESERVATION_FILE, json.dumps(record).encode())


def release_stale_reservation(run_dir: Storage, taken_over: LeaseRecord | None,
                              log: Callable[[str], None] = print) -> None:
    """Cancel the resource request the controller of the driver this one took the run over from
    (`RunLease.taken_over`) left behind. A driver that released the run had its controller cancel
    its own; a record of another epoch is not this takeover's (a superseded driver that wakes must
    not release its successor's)."""
    if taken_over is None:
        return
    try:
        record = json.loads(run_dir.read_replaceable(RESERVATION_FILE))
        requester, epoch = record["requester"], record["epoch"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no previous controller recorded one
    if epoch != taken_over.epoch:
        return
    try:
        coordinator = autoscaling_coordinator()
        held = ray.get(coordinator.get_reserved_resources.remote(requester), timeout=10)
        if held:
            ray.get(coordinator.cancel_request.remote(requester), timeout=10)
    except (ValueError, TypeError, ray.exceptions.RayError):
        return  # no coordinator on this cluster (yet): nothing is reserved
    if held:
        log(f"Released the resources Ray still reserved for this run's previous controller ({requester}, "
            f"{len(held)} node(s)): its driver ended without releasing them")


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
        # node to go (raychat.run.loop.save_on_request): nothing is redone unless Ray gave no deadline.
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


@dataclass
class ElasticSignals:
    """A worker's side of the elastic protocol: whether any rank was asked to save now (rank 0 by
    the coordinator for a planned resize or by its checkpoint cadence, any rank whose node got a
    preemption notice). Each rank reads its own flags without blocking (`local_flags`) beside the
    step; they ride on the step's loss all-reduce (raychat.run.step.train_step), and `update` takes
    the sums back."""

    coordinator: "ray.actor.ActorHandle | None" = None  # rank 0: the run's Coordinator actor
    save_request: "ray.ObjectRef | None" = None  # rank 0: the oldest Coordinator.progress() reply not read
    preempt_saved: bool = False  # saved on this attempt's preemption notice already
    resize_requested: bool = False
    preempt_requested: bool = False
    checkpoint_due: bool = False  # rank 0's auto cadence (raychat.run.cadence) wants the next step saved
    replicate_due: bool = False  # rank 0 wants the next step replicated and no rank is still sending
    replicate_skipped: bool = False  # rank 0 wanted it, but some rank's last replica is still being sent
    any_sending: bool = False  # some rank's last replica was still being sent at the last step's all-reduce
    step_s: float = 0.0  # this rank's last step
    save_s: float | None = None  # this rank's last save in this attempt: its stall and write

    def local_flags(self, checkpoint_due: bool = False, busy_next: bool = False, replicate_due: bool = False,
                    still_sending: Callable[[], bool] | None = None) -> tuple[float, ...]:
        """(resize requested here, a preemption notice's save due here, a periodic save due by rank 0's
        cadence, a memory replica due by rank 0's, this rank's last replica still being sent) as
        numbers to sum across ranks; asked just before the step's all-reduce. `busy_next`: an
        evaluation or the final step comes after this step (a notice's save goes before it)."""
        due = notice_save_due(preemption_deadline(), time.time(), self.save_s, self.step_s, busy_next)
        preempted = not self.preempt_saved and due
        sending = still_sending is not None and still_sending()
        return (float(self._poll_resize()), float(preempted), float(checkpoint_due), float(replicate_due),
                float(sending))

    def update(self, summed: list[float]) -> None:
        resize, preempt, due, replicate, sending = summed
        self.resize_requested, self.preempt_requested, self.checkpoint_due = resize > 0, preempt > 0, due > 0
        # Every rank replicates the same steps (a restore needs a whole set), none waits for a send:
        # a step some rank is still sending for is skipped by all.
        self.any_sending = sending > 0
        self.replicate_due = replicate > 0 and not self.any_sending
        self.replicate_skipped = replicate > 0 and self.any_sending

    def progress(self, step: int) -> None:
        """Rank 0, after each step: tell the coordinator (fire and forget: what a restart redoes).
        Its reply carries the planned-resize flag `_poll_resize` reads; while an older reply is
        unread it stays the one read, so replies slower than a step still get through."""
        if self.coordinator is None:
            return
        reply = self.coordinator.progress.remote(step)
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
