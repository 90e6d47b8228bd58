"""How often a run checkpoints when --save-every is 0 (auto, the default).

What a checkpoint interval trades: a node lost without notice redoes the steps since the last whole
checkpoint, plus those trained while the newest one was still being written; every save stalls the
step loop (the copy to host memory, the cursors' gather) and keeps a writer busy in the background.
So the interval is chosen from what the run measures, not guessed:

- the interval that loses least at the loss rate auto plans for (PLANNED_LOSS_EVERY_S): a save's
  stall every T seconds against the T/2 seconds a loss redoes on average, least at T = sqrt(2 x stall
  x time between losses) (Young's and Daly's optimum: `least_loss_s`);
- but no shorter than lets saves stall training by at most STALL_BUDGET of its time and leaves the
  writer idle at least half of it (one save in flight: a save due while the last one is still
  writing would wait for it, and a writer never idle competes with the loader for the host);
- capped so that a node lost just before a save is whole redoes at most --max-lost-minutes of
  training (the interval plus the write time).

At a 100 ms stall and 4 s steps the loop saves every 3 steps for 0.8% of its time, and a loss redoes
seconds, not a minute. When the memory tier holds every rank's state on a peer node (a group on two
nodes or more, raychat.elastic.replicas), a node lost without notice resumes from that memory, not from
storage: what storage saves then protect against (a node lost with its peer, the cluster lost whole)
is far rarer, so they are as rare as the loss cap allows. When the constraints cannot all hold (a
long stall, a slow write), the loss cap the user set wins over the stall budget and the writer's
idle half, never over one save in flight, and the log says what the saves then cost. A first save
that also allocated its host buffers stalls longer than the next ones: the next save, within the
cap, measures again.

A save's stall and write time are known only after a save, so each attempt saves once PROBE_STEPS
steps in, then chooses. Rank 0 decides (`SaveCadence`) and its "save now" rides on the step's loss
all-reduce (raychat.elastic.signals.ElasticSignals), so every rank saves at the same step.
"""

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

STALL_BUDGET = 0.01  # the share of training time saves may stall the loop
WRITER_DUTY = 0.5  # the share of the interval a save's background write may take
PROBE_STEPS = 5  # the first save of an attempt, this many steps in: past compilation's first step
RECENT_STEPS = 50  # the step time is the median of this many recent steps
CHANGE = 1.25  # a longer interval is adopted only when it is this much longer (no flapping)
# The rate of node losses without notice both auto cadences plan for: one every 10 minutes, a busy
# spot market (the goodput goal's rate). Where nodes go less often, saving for this rate costs a
# fraction of a percent more stall than the optimum; where they go more often, more redone steps.
PLANNED_LOSS_EVERY_S = 600.0


def least_loss_s(stall_s: float) -> float:
    """The interval in seconds that loses least to saves stalling `stall_s` each and to the steps a
    loss redoes (half an interval on average) at one loss per PLANNED_LOSS_EVERY_S: stall/T + T/2M is
    least at T = sqrt(2 x stall x M) (Young 1974, Daly 2006)."""
    return math.sqrt(2.0 * max(stall_s, 0.0) * PLANNED_LOSS_EVERY_S)


@dataclass(frozen=True)
class Interval:
    """A chosen checkpoint interval and the numbers it was chosen from."""

    every: int  # steps
    step_s: float
    stall_s: float
    write_s: float
    max_lost_s: float
    met: bool  # the loss cap holds within the stall budget and the writer's idle half
    peer_memory: bool = False  # the memory tier covers a lost node: storage saves as rarely as the cap allows

    @property
    def lost_s(self) -> float:
        """The most training a node lost without notice redoes at this interval."""
        return self.every * self.step_s + self.write_s

    @property
    def stall_share(self) -> float:
        return self.stall_s / (self.every * self.step_s)

    def describe(self) -> str:
        why = (f"a node lost without notice redoes at most ~{self.lost_s:.0f}s of training "
               f"(--max-lost-minutes {self.max_lost_s / 60:g}), saves stall it {100 * self.stall_share:.2f}%")
        if self.peer_memory:
            why = (f"peer memory holds every rank's state, so a node lost without notice resumes from it; "
                   f"these saves are for a node lost with its peer or the whole cluster, as rare as "
                   f"--max-lost-minutes {self.max_lost_s / 60:g} allows (~{self.lost_s:.0f}s redone then), "
                   f"and stall training {100 * self.stall_share:.2f}%")
        if not self.met:
            why = (f"--max-lost-minutes {self.max_lost_s / 60:g} needs saves that stall training more than "
                   f"{100 * STALL_BUDGET:g}% or keep the writer busy more than half the time: a node lost "
                   f"without notice redoes at most ~{self.lost_s:.0f}s, saves stall it "
                   f"{100 * self.stall_share:.2f}% (a longer --max-lost-minutes saves less often)")
        return (f"every {self.every} steps (~{self.every * self.step_s:.1f}s; "
                f"step {1000 * self.step_s:.0f}ms, save stall {1000 * self.stall_s:.0f}ms, "
                f"written in {self.write_s:.1f}s): {why}")


def choose_interval(step_s: float, stall_s: float, write_s: float, max_lost_s: float,
                    replica_every: int | None = None) -> Interval:
    """The checkpoint interval for these measurements (see the module's docstring). `replica_every`:
    the memory tier's interval while it holds every rank's state on another node (None: it does not).
    Storage saves go as rarely as the cap allows only where replicas come at least as often as they
    would (a sparse --replicate-every bounds a loss worse than the saves do)."""
    step_s = max(step_s, 1e-6)
    by_stall = math.ceil(stall_s / (STALL_BUDGET * step_s))
    by_write = math.ceil(write_s / (WRITER_DUTY * step_s))
    shortest = max(1, by_stall, by_write)
    longest = math.floor((max_lost_s - write_s) / step_s)  # interval + write within the loss cap
    if shortest <= longest:
        every = min(longest, max(shortest, math.ceil(least_loss_s(stall_s) / step_s)))
        peer_memory = replica_every is not None and replica_every <= every
        return Interval(longest if peer_memory else every, step_s, stall_s, write_s, max_lost_s, True,
                        peer_memory)
    one_in_flight = max(1, math.ceil(write_s / step_s))  # the next save is due after this one is written
    return Interval(max(one_in_flight, longest), step_s, stall_s, write_s, max_lost_s, False)


def plan_line(save_every: int, max_lost_minutes: float) -> str:
    """What the driver prints about checkpoints before the run starts."""
    if save_every > 0:
        return f"Checkpoints: every {save_every} steps and at the end (--save-every {save_every})"
    if save_every < 0:
        return ("Checkpoints: only at the end (--save-every -1): a node lost without notice restarts the run "
                "from its last checkpoint, which may be its start")
    return (f"Checkpoints: auto (--save-every 0): a save {PROBE_STEPS} steps into each attempt measures its "
            f"stall and write time, then every N steps: the interval that loses least to saves' stalls "
            f"and to a node lost every {PLANNED_LOSS_EVERY_S / 60:g} minutes, stalling training <= "
            f"{100 * STALL_BUDGET:g}% and leaving the writer idle half the time, and no longer than lets a "
            f"node lost without notice redo {max_lost_minutes:g} min of training (--max-lost-minutes); as "
            f"long as that allows where peer memory holds the state (replicas on two nodes or more); "
            f"the log says N and each change")


# The memory tier (raychat.elastic.replicas), whose cadence and footprint the plan states.
REPLICA_STALL_BUDGET = 0.02  # auto --replicate-every: the share of step time the copies may stall the loop
REPLICA_KEEP_STEPS = 2  # replicas a holder keeps per rank: the newest step and the one before


def holder_bytes(share_bytes: int, ranks_per_node: int) -> int:
    """Host memory one node's holder keeps: its own ranks' replicas and its peer node's ranks', each
    rank's share (model and optimizer state it owns) at REPLICA_KEEP_STEPS steps."""
    return REPLICA_KEEP_STEPS * 2 * ranks_per_node * share_bytes


def replica_line(replicate_every: int, share_bytes: int | None = None) -> str:
    """What the driver and the plan print about the memory tier before the run starts."""
    if replicate_every < 0:
        return ("Memory replicas: off (--replicate-every -1): a node lost without notice restarts from the "
                "last checkpoint in storage")
    every = (f"every {replicate_every} steps" if replicate_every > 0 else
             f"auto (--replicate-every 0): every step or more, the interval that loses least to the copies' "
             f"stalls and to a node lost every {PLANNED_LOSS_EVERY_S / 60:g} minutes, the copy stalling "
             f"training <= {100 * REPLICA_STALL_BUDGET:g}% and the send leaving the host idle half the time "
             f"(training on CPUs: copy and send together <= {100 * REPLICA_STALL_BUDGET:g}%)")
    line = (f"Memory replicas: {every}; each rank's state on its own node and the next node: a lost worker "
            f"or node resumes from memory, nothing read from storage (a one-node group keeps its own node's "
            f"copy, for a lost worker process)")
    if share_bytes is not None:
        line += (f"; host memory: {holder_bytes(share_bytes, 1) / 2**30:,.2f} GiB held per rank on each node "
                 f"(two steps, its own ranks' and a peer's; half as much again while a replica arrives), "
                 f"beside a {share_bytes / 2**30:,.2f} GiB copy buffer per rank and its send through Ray's "
                 f"object store")
    return line


class SaveCadence:
    """Rank 0's side of --save-every 0: measures steps and saves, says when the next save is due."""

    def __init__(self, max_lost_minutes: float, first_step: int, log: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.max_lost_s = 60.0 * max_lost_minutes
        self.first_step = first_step
        self.log = log
        self.clock = clock
        self.interval: Interval | None = None  # None until the attempt's first save is measured
        self._saved_at = clock()  # when the last save was taken (the attempt's start before any)
        self._steps: deque[float] = deque(maxlen=RECENT_STEPS)
        self._stall_s = 0.0

    def step_done(self, dt: float) -> None:
        self._steps.append(dt)

    def save_stalled(self, seconds: float) -> None:
        self._stall_s = seconds
        self._saved_at = self.clock()

    def save_written(self, write_s: float, replica_every: int | None = None) -> None:
        """A save is whole: choose the interval again from the latest numbers (`replica_every`: the
        memory tier's interval while peer nodes hold every rank's recent state, choose_interval);
        log a change."""
        if len(self._steps) < 2:
            return
        # The attempt's first step (compilation, the loader's start) is no step time to plan with.
        steps = list(self._steps)[1:] if len(self._steps) < RECENT_STEPS else list(self._steps)
        new = choose_interval(statistics.median(steps), self._stall_s, write_s, self.max_lost_s,
                              replica_every)
        old = self.interval
        if old is not None:
            # Hysteresis both ways: measurements wobble (a save stalls 3.4 or 3.6 steps' worth), and
            # flipping between neighbours says nothing. A shorter interval is taken at once only
            # when the current one no longer keeps a loss within --max-lost-minutes.
            close = abs(new.every - old.every) < 2 or old.every / CHANGE <= new.every <= CHANGE * old.every
            within_cap = old.every * new.step_s + new.write_s <= self.max_lost_s
            if close and (within_cap or new.every >= old.every):
                return
        self.interval = new
        self.log(f"Checkpoint cadence: {new.describe()}" if old is None else
                 f"Checkpoint cadence changed from every {old.every} steps: {new.describe()}")

    def due(self, step: int, last_saved: int | None) -> bool:
        """Whether the state before `step` is to be saved: `interval.every` steps on, or sooner when
        the wall time since the last save, its write and a step would pass --max-lost-minutes (steps
        that slowed since the interval was measured, evaluations between saves)."""
        since = step - (last_saved if last_saved is not None else self.first_step)
        if self.interval is None:
            return since >= PROBE_STEPS
        late = self.clock() - self._saved_at + self.interval.write_s + self.interval.step_s >= self.max_lost_s
        return since >= self.interval.every or (since > 0 and late)
