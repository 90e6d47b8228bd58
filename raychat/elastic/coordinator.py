"""The run's coordinator: a small named actor the driver creates for one run, which outlives every
worker group of it.

The controller's callbacks (raychat.elastic) ask it for a save before a planned resize; rank 0
polls it without blocking (the request reaches every rank through the step's loss all-reduce); it
remembers the last step each attempt trained and any step it saved on a preemption notice, so a new
attempt can say "Lost 1 worker(s) ...; 7 steps redone" or "Grew to 3 workers at step 160 (no steps
redone)"; it measures what a restart of the group costs and what a step takes, so the controller's
scaling policy grows the group only when that pays (`grow_verdict`); it owns the run's replica
holders (raychat.elastic.holders), which end with it; and it keeps rank 0's final report for the
driver.

It imports no torch: its process starts on the run's start path (raychat.elastic.holders says why that
matters).
"""

import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raychat.checkpoint.fence import LeaseRecord
from raychat.elastic.holders import start_holders
from raychat.records import Record


@dataclass
class Attempt(Record):
    """What the coordinator knows of the attempt before the one starting (`Coordinator.start_attempt`):
    what its log line and the time ledger say about the restart."""

    attempt: int  # how many attempts started before this one (0: this is the first)
    last_step: int | None  # the last step it finished
    world_size: int | None
    planned_step: int | None  # the step it saved for a planned resize
    notice_step: int | None  # the step it saved on a preemption notice
    last_progress: float | None  # when it last finished a step
    noticed: float | None  # when the controller began the restart or resize
    failed_starts: int = 0  # worker groups that failed to start between it and this one (Ray retried)


@dataclass
class FinalResult(Record):
    """What a run reached, from rank 0's last report (`Coordinator.finish`) or, for a run already at
    its horizon, its last checkpoint: the driver's summary."""

    step: int
    tokens_so_far: int
    min_val_bpb: float
    total_training_time: float
    core_metric: float | None = None
    restarts: int = 0
    resizes: int = 0
    redone_steps: int = 0
    peak_memory_mib: float | None = None


@dataclass(frozen=True)
class GrowVerdict(Record):
    """Whether growing the worker group now finishes the run sooner, and the line that says why."""

    pays: bool
    line: str


RECENT_STEPS = 20  # the step time a grow is judged by: the median of this many recent steps


def grow_verdict(world_size: int, to_workers: int, steps_left: int, step_s: float, restart_s: float
                 ) -> GrowVerdict:
    """A grow stops the group, loses `restart_s` (the run's measured cost of a restart: detection,
    a new group, its restore and first step, compile included) and then trains the steps left
    `to_workers / world_size` times as fast (every step is the same global batch, shared by more
    ranks). It pays when the time saved over the steps left exceeds that cost."""
    saved_s = steps_left * step_s * (1 - world_size / to_workers)
    pays = saved_s > restart_s
    verb = "Growing" if pays else "Not growing"
    return GrowVerdict(pays, f"{verb} from {world_size} to {to_workers} workers: {steps_left} steps left at "
                             f"{step_s:.2f}s would save {saved_s:.0f}s against a restart's {restart_s:.0f}s")


@ray.remote(num_cpus=0)
class Coordinator:
    """Shared state of one run's attempts (one actor per driver run, named after its session)."""

    def __init__(self):
        self.save_requested = False  # a planned resize asked the running group for a save, unanswered
        self.requests = self.answered = 0  # planned-resize saves asked for, and answered, so far
        self.saved_step: int | None = None  # the latest answered request's step, until an attempt starts
        self.group_size: int | None = None  # the size of the group the controller started last
        self.last_step: int | None = None  # the last step the current attempt finished
        self.world_size: int | None = None
        self.notice_step: int | None = None  # the step saved on a preemption notice, this attempt
        self.last_progress: float | None = None  # when the current attempt last finished a step
        self.noticed: float | None = None  # when the controller last began a restart or resize
        self.failed_starts = 0  # worker groups that failed to start since the current attempt began
        self.at_start: tuple[float | None, int] | None = None  # (noticed, failed_starts) of the group started
        self.attempts = 0
        self.total_steps: int | None = None  # the run's last step + 1
        self.start_step = 0  # the step the current attempt started at
        # Recent steps as worker-seconds (seconds x world size), each attempt's first step left out
        # (compile, warm-up): a step's time at any size, as the verdict assumes steps scale.
        self.step_work: deque[float] = deque(maxlen=RECENT_STEPS)
        self.began: float | None = None  # when the current attempt's start began costing (see start_attempt)
        self.began_kind = "first"  # what that start was: "first", "planned" or "failure"
        # What each kind of start cost, the latest of each: from `began` to the end of the attempt's
        # first step, less the evaluations and saves before it (None: none measured yet)
        self.start_s: dict[str, float] = {}
        self.said_grow: set[tuple[int, int, bool]] = set()  # the verdicts said, by (from, to, pays)
        self.final: FinalResult | None = None
        self.holders: dict[str, ray.actor.ActorHandle] = {}  # by node id (raychat.elastic.holders)

    def request_save(self) -> None:
        """A planned resize asks the running group for a save. After the last step there is nothing
        left to save (the final checkpoint is written before `finish`): answered at once, so the
        controller's hold ends now instead of after SAVE_WAIT_S."""
        self.requests += 1
        if self.final is not None:
            self.saved(self.final.step)
            return
        self.save_requested = True

    def poll_request(self) -> bool:
        return self.save_requested

    def saved(self, step: int) -> None:
        self.save_requested, self.answered, self.saved_step = False, self.requests, step

    def get_saved_step(self) -> int | None:
        """The step saved for the latest request; None while it is unanswered."""
        return self.saved_step if self.answered == self.requests else None

    def group_running(self, num_workers: int) -> None:
        """The controller started a new group of `num_workers` (SchedulingState -> RunningState;
        `PlannedResizeSave`). A request still open was the group before's, which never answered it
        (it came at the last step, or the save outlasted the controller's wait): this group must
        not save and sleep for it, nor a later failure be logged as a planned resize. A request
        from now on is this group's, even one that comes before its rank 0 starts the attempt (a
        grow decided as soon as the group runs, the node back already)."""
        self.save_requested = False
        self.group_size = num_workers
        self.said_grow.clear()  # a verdict is said once per group
        # The notice and failed starts that led to this group are its attempt's (start_attempt); a
        # resize the controller begins before that attempt has started is the next one's.
        self.at_start, self.noticed, self.failed_starts = (self.noticed, self.failed_starts), None, 0

    def preemption_saved(self, step: int) -> None:
        self.notice_step = step

    def progress(self, step: int, step_s: float | None = None, outside_s: float = 0.0) -> bool:
        """Rank 0 finished `step` in `step_s` seconds, `outside_s` seconds of evaluations and saves
        having passed in this attempt so far (what a restart redoes, and what a grow is judged by);
        the reply says whether a planned resize asked for a save, so the one call per step serves
        both. An attempt's first step closes the measurement of what its start cost."""
        now = time.time()
        if self.last_step is None:  # the attempt's first step: compile and warm-up are the start's
            if self.began is not None:
                self.start_s[self.began_kind] = max(0.0, now - self.began - outside_s)
        elif step_s is not None and self.world_size:
            self.step_work.append(step_s * self.world_size)
        self.last_step, self.last_progress = step, now
        return self.poll_request()

    def grow_verdict(self, to_workers: int) -> GrowVerdict | None:
        """Whether growing the current group to `to_workers` pays (`grow_verdict`). The cost is what a
        planned resize cost this run, else a restart after a failure (from the controller noticing
        it: a grow waits for no detection), else the first attempt's own start (from its workers'
        setup: no wait for resources), less the one step it trained. None while nothing is measured
        yet (Ray's decision stands)."""
        cost = next((self.start_s[k] for k in ("planned", "failure", "first") if k in self.start_s), None)
        size = self.group_size or self.world_size  # the group running now, though still setting up
        if cost is None or not self.step_work or not size or self.total_steps is None:
            return None
        step_s = statistics.median(self.step_work) / size
        next_step = self.last_step + 1 if self.last_step is not None else self.start_step
        return grow_verdict(size, to_workers, self.total_steps - next_step, step_s, max(0.0, cost - step_s))

    def say_once(self, key: tuple[int, int, bool]) -> bool:
        """True the first time a verdict (from, to, pays) is to be said in this attempt."""
        if key in self.said_grow:
            return False
        self.said_grow.add(key)
        return True

    def restart_noticed(self, at: float) -> None:
        """The controller began restarting or resizing the group (`NoteRestart`), at `at`."""
        self.noticed = at

    def start_failed(self) -> None:
        """A new worker group failed to start and the controller is scheduling another (`NoteRestart`):
        a restart that costs two group starts or more."""
        self.failed_starts += 1

    def finish(self, result: FinalResult) -> None:
        """Rank 0's last report: Ray Train hands the driver only metrics reported with a checkpoint,
        and raychat writes its checkpoints itself. A resize request still open (it came at the last
        step, when the loop saves no more) is answered with the final step."""
        self.final = result
        if self.save_requested:
            self.saved(result.step)

    def final_result(self) -> FinalResult | None:
        return self.final

    def replica_holders(self, node_ids: list[str]) -> dict[str, "ray.actor.ActorHandle"]:
        """Every replica holder of the run by node id, one started on each of `node_ids` that has none:
        created here, so they end with this actor (the driver's run), not with a worker or its node."""
        return dict(start_holders(self.holders, node_ids))

    def start_attempt(self, step: int, world_size: int, total_steps: int | None = None,
                      setup_started: float | None = None) -> Attempt:
        """Called by rank 0 of each new attempt: what the previous attempt did. `setup_started`: when
        this attempt's workers began their setup."""
        # What the controller said of this group's start, as group_running kept it: a resize it
        # began since (this group running) is the next attempt's.
        noticed, failed_starts = self.at_start if self.at_start is not None else (self.noticed,
                                                                                 self.failed_starts)
        previous = Attempt(attempt=self.attempts, last_step=self.last_step, world_size=self.world_size,
                           planned_step=self.saved_step, notice_step=self.notice_step,
                           last_progress=self.last_progress, noticed=noticed, failed_starts=failed_starts)
        if self.attempts:  # a restart costs from the controller's notice (else the old group's last step)
            self.began = noticed or self.last_progress
            self.began_kind = "planned" if self.saved_step is not None else "failure"
        else:  # the first start, from its workers' setup: not the driver's wait for resources
            self.began, self.began_kind = setup_started, "first"
        self.attempts += 1
        self.start_step = step
        self.total_steps = total_steps if total_steps is not None else self.total_steps
        self.last_step, self.world_size, self.saved_step, self.notice_step = None, world_size, None, None
        self.last_progress = None
        if self.at_start is None:  # no group_running heard (its callback missing): all is this start's,
            self.noticed, self.failed_starts = None, 0
            self.save_requested = False  # an open request the old group's,
            self.said_grow.clear()  # and the verdicts said the old group's
        # Else an open save request, and the verdicts said, are this group's (group_running did the above).
        self.at_start = None
        return previous


def coordinator_name(session: str) -> str:
    return f"raychat-coordinator-{session}"


_LIVE: dict[str, "ray.actor.ActorHandle"] = {}  # Ray ends an actor when its last handle is dropped


def start_coordinator(session: str) -> "ray.actor.ActorHandle":
    """Create the run's coordinator (owned by the calling driver: it ends with the driver), on the
    driver's own node: a zero-CPU actor could otherwise land on a worker node and die with it."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    _LIVE[session] = Coordinator.options(name=coordinator_name(session), num_cpus=0,
                                         scheduling_strategy=here).remote()
    return _LIVE[session]


def stop_coordinator(session: str) -> None:
    """End the run's coordinator, and with it the replica holders it owns (their memory)."""
    coordinator = _LIVE.pop(session, None)
    if coordinator is not None:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.kill(coordinator)


def end_coordinator_taken_over(taken_over: LeaseRecord | None, log: Callable[[str], None] = print) -> None:
    """End the coordinator of the driver this one took the run over from (`RunLease.taken_over`: its
    epoch's record, which names it), and with it the replica holders it owns. A driver that died
    took them along; one that is paused (a long GC, a partition) still owns them, and their memory
    (its ranks' replicas, twice over) would stay held on the nodes the new group trains on until it
    woke. Their replicas are of a superseded epoch, never restored. A driver that released the run
    is never taken over from: its coordinator is its own business until it exits."""
    if taken_over is None or not (taken_over.coordinator or "").startswith(coordinator_name("")):
        return  # a clean hand-over, a driver outside Ray, or a record raychat did not write
    try:
        coordinator = ray.get_actor(taken_over.coordinator, namespace=taken_over.namespace)
    except (ValueError, TypeError, ray.exceptions.RayError):
        return  # its driver ended and took it along
    try:
        holders = list(ray.get(coordinator.replica_holders.remote([]), timeout=10).values())
        held = sum(ray.get([holder.nbytes.remote() for holder in holders], timeout=10))
    except Exception:  # noqa: BLE001 (ending it is what matters; the line only says less)
        holders, held = [], 0
    with contextlib.suppress(ray.exceptions.RayError):
        ray.kill(coordinator)
    log(f"Ended the coordinator of the driver this one took the run over from (lease epoch "
        f"{taken_over.epoch}), with its {len(holders)} replica holder(s) ({held / 2**20:.1f} MiB of memory "
        "freed)")


def final_result(session: str) -> FinalResult | None:
    """What rank 0 reported at the last step of the run started with `session` (None: nothing yet)."""
    return ray.get(_LIVE[session].final_result.remote())
