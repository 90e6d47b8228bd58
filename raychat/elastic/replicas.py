"""The memory tier: every rank's state mirrored in host memory on its own node and a peer node, so a
lost node costs at most a few steps and no read from the bucket.

A durable checkpoint writes the whole state to storage, too much to do every step at scale, and a
restart reads it all back (16 GB for d24 on 8 GPUs). GEMINI (SOSP '23) keeps the newest checkpoint
in CPU memory instead, one copy on the rank's own machine and one on a peer's; raychat does the same
with Ray actors:

- `ReplicaHolder` (raychat.elastic.holders): one zero-CPU actor per node of the worker group, created
  and owned by the run's coordinator (on the driver's node, so holders outlive any worker and end
  with the driver's run). It keeps, for each rank that sends to it, the replicas of the two newest
  steps: a step whose set was still in flight when a node died has the one before it complete.
- The rank's side (`Replicator`): at a replication step, the pieces the rank owns (the very pieces
  and names of a sharded checkpoint: raychat.worker.state.state_pieces) are copied to reused
  host buffers (the only stall), then a background thread puts them in Ray's object store once and
  hands them to two holders: its own node's (survives the worker process, not the node) and the next
  node's in the group's ring (survives the node). Any single node lost leaves every rank's replica
  somewhere.
- The restore (`MemoryRestore`): rank 0 asks every holder what it has, takes the newest step of this
  run's lease epoch for which every rank of the saving group is held, and each rank reads only the
  byte ranges it will own at its world size (`MemoryReader`, the sharded reader's interface), so a
  resize re-shards as a checkpoint does. The cursors of all ranks travel with their replicas and are
  merged on restore, as a save merges them. A set that cannot be read whole (its holder died during
  the restore) is abandoned by every rank together, for the durable checkpoint.

Durable checkpoints remain the truth for a cluster lost whole; while peer nodes hold every rank's
recent state they are as rare as --max-lost-minutes allows (raychat.elastic.cadence).
"""

import dataclasses
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import ray
import torch

from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.saver import AsyncCheckpointWriter
from raychat.checkpoint.sharded import Piece
from raychat.data.cursor import Cursor, merge_cursor
from raychat.elastic.cadence import REPLICA_KEEP_STEPS, REPLICA_STALL_BUDGET, WRITER_DUTY, least_loss_s
from raychat.elastic.holders import HOLDER_CALL_S, Replica
from raychat.model.gpt import GPTConfig

T = TypeVar("T")

REPLICA_RECENT_STEPS = 20  # auto: the step time is the median of this many recent steps
REPLICA_CHANGE = 1.5  # auto: the interval changes when what it needs moves this far from it
REPLICA_PROBE_STEPS = 2  # auto: the attempt's first replica this many steps in, past the first's warm-up


def peer_nodes(node_of_rank: list[str]) -> list[str | None]:
    """Each rank's peer node: the next of the group's nodes in a fixed ring (None on a one-node group:
    its ranks keep their own node's copy only, which outlives a worker's process, not the node)."""
    ring = sorted(set(node_of_rank))
    if len(ring) < 2:
        return [None] * len(node_of_rank)
    return [ring[(ring.index(node) + 1) % len(ring)] for node in node_of_rank]


def replicas_needed(step_s: float, stall_s: float, send_s: float, sends_compete: bool = False,
                    at_most: int = 0) -> float:
    """Auto --replicate-every, unrounded: the interval that loses least to the copies' stalls and to the
    steps a node lost without notice redoes (`least_loss_s`, at the loss rate auto plans for), but no
    fewer steps than keep the copy within REPLICA_STALL_BUDGET of training and the background send
    idle half the time, as the checkpoint writer's. Where training itself runs on the host's CPUs
    (`sends_compete`), the send's CPU time is taken from training: copy and send together are the cost.
    A copy that fits in the step's shadow (a GPU's) is nearly free: every step or two. `at_most` (an
    explicit --save-every N) caps the least-loss interval, never the budgets: a restore reads the newer
    of memory and storage, so a replica older than the newest checkpoint is never read."""
    step_s = max(step_s, 1e-6)
    cost_s = stall_s + send_s if sends_compete else stall_s
    by_budget = cost_s / REPLICA_STALL_BUDGET if sends_compete else max(stall_s / REPLICA_STALL_BUDGET,
                                                                         send_s / WRITER_DUTY)
    least_loss = least_loss_s(cost_s) / step_s
    return max(by_budget / step_s, min(least_loss, at_most) if at_most else least_loss)


def choose_replica_interval(needed: float, current: int = 0) -> int:
    """The interval for `needed` steps per replica: `current` while it is within a factor of
    REPLICA_CHANGE of it (measurements wobble around a boundary), else the least whole number of steps."""
    if current and needed / REPLICA_CHANGE <= current <= math.ceil(needed * REPLICA_CHANGE):
        return current
    return max(1, math.ceil(round(needed, 6)))  # (15 s / 0.3 s is 50.000000000000014 in floats)


class Replicator:
    """A rank's side: copy its pieces at a replication step, send them in the background."""

    def __init__(self, own: Any, peer: Any | None, epoch: int, attempt: int, log: Callable[[str], None],
                 warn: Callable[[str], None], every: int = 0, sends_compete: bool = False,
                 saves_every: int = 0):
        self.holders = [own] if peer is None else [own, peer]
        self.epoch, self.attempt = epoch, attempt
        self.log, self.warn = log, warn  # rank 0's lines; any rank's warnings
        self.fixed = every > 0  # --replicate-every N; 0: auto, rank 0 chooses from the replicas' costs
        self.every = every
        self.saves_every = max(0, saves_every)  # --save-every N caps auto (replicas_needed's at_most)
        self.sends_compete = sends_compete  # training on the CPUs the send uses (replicas_needed)
        self.writer = AsyncCheckpointWriter()
        # The steps this rank last replicated, newest last (every rank replicates at the same steps):
        # what a holder keeps of each rank while its sends keep up (`peer_interval`).
        self.replicated: deque[int] = deque(maxlen=REPLICA_KEEP_STEPS)
        self.sent_step: int | None = None  # the newest step every holder of this rank took (send's thread)
        self.failed: str | None = None  # the last send's fault: a lost holder is said, never raised
        self.skipping_since: int | None = None  # the first step skipped while a send was in flight
        # The last send's CPU time in its thread (serializing, copying into the object store): what
        # it takes from training on a CPU device; its wall time is mostly waiting on the holders.
        self.send_cpu_s = 0.0
        self._steps: deque[float] = deque(maxlen=REPLICA_RECENT_STEPS)

    def replicate(self, replica: Replica) -> None:
        """Copy `replica`'s pieces now (the stall); put and send them in a background thread. A state
        that is not finite is never sent (its holders keep the last good one, as storage does). A
        replica a holder did not take (its node going, Ray's object store full) is a warning: the
        loop goes on, with the durable checkpoints. The steps' flags skip a step while any rank is
        still sending (`skipped`), so a send in flight here is a fault of the caller's: it is said,
        never waited for (a slow or hung holder takes up to HOLDER_CALL_S)."""
        if self.sending():
            self.warn(f"memory replica of step {replica.step} skipped: the one of step {self.last_step} is "
                      "still being sent (a slow or unresponsive holder); training does not wait for it")
            return
        if self.skipping_since is not None:
            self.log(f"Memory replicas: go on at step {replica.step} (skipped from {self.skipping_since})")
            self.skipping_since = None
        self.writer.wait()  # finished: its fault, if any, is said before this one's copy
        if self.failed is not None:
            self.warn(f"memory replica of step {self.last_step} not kept: {self.failed}")
            self.failed = None

        def send(snapshot: list[Piece]) -> None:
            started = time.thread_time()
            try:
                if not all(bool(p.tensor.isfinite().all()) for p in snapshot if p.tensor.is_floating_point()):
                    self.failed = "the weights or optimizer state are not finite"
                    return
                ref = ray.put(dataclasses.replace(replica, pieces=snapshot))
                ray.get([h.put.remote(ref) for h in self.holders], timeout=HOLDER_CALL_S)
                self.sent_step = replica.step
            except Exception as e:  # noqa: BLE001 -- any fault of a copy is said, none ends training
                self.failed = f"{type(e).__name__}: {e}".splitlines()[0]
            finally:
                self.send_cpu_s = time.thread_time() - started

        self.writer.submit("memory replicas", replica.pieces, send)
        self.replicated.append(replica.step)

    @property
    def last_step(self) -> int | None:
        """The step this rank last replicated (None: none yet this attempt)."""
        return self.replicated[-1] if self.replicated else None

    @property
    def held_step(self) -> int | None:
        """The newest step a peer node's holder took too: what survives this node (a one-node group
        keeps its own node's copy only: None)."""
        return self.sent_step if len(self.holders) > 1 else None

    def peer_interval(self, step: int, held_steps: list[int | None]) -> int | None:
        """Rank 0, at a save of `step`: the replica interval while a peer node holds every rank's recent
        state (each rank's `held_step`, gathered at the save), else None (a one-node group, a rank with
        no replica held yet, or one whose sends fail or hang): what the storage cadence may lean on.
        Every rank must hold one of the REPLICA_KEEP_STEPS steps last replicated, which a holder keeps
        of each rank (then every rank holds the oldest: a whole set). Sends slower than the interval (a
        loaded host, a holder starting) skip steps but keep up: the interval they keep is the gap
        between the last two. A send in flight skips every step after it on all ranks, so while a
        hung holder keeps one going (up to HOLDER_CALL_S) nothing above moves: a set held for two such
        intervals and a step is stale."""
        if len(self.holders) < 2 or self.every < 1 or not held_steps or None in held_steps:
            return None
        if len(self.replicated) < REPLICA_KEEP_STEPS or min(held_steps) < self.replicated[0]:
            return None
        interval = max(self.every, self.replicated[-1] - self.replicated[0])
        return interval if step - min(held_steps) <= 2 * interval + 1 else None

    def sending(self) -> bool:
        """Whether this rank's last replica is still being put and handed to its holders."""
        return not self.writer.done()

    def wanted(self, step: int, first_step: int, step_s: float) -> bool:
        """Rank 0: whether the state before `step` is to be replicated (every rank hears it through the
        step's flags: raychat.elastic.signals.ElasticSignals). Fixed --replicate-every N: every N steps;
        auto: `auto_due`."""
        if self.fixed:
            return step != first_step and step % self.every == 0
        return self.auto_due(step, first_step, step_s)

    def skipped(self, step: int) -> None:
        """Every rank, at a step wanted but skipped because some rank was still sending: said once
        (rank 0) until replicas go on."""
        if self.skipping_since is None:
            self.skipping_since = step
            self.log(f"Memory replicas: step {step} skipped: a rank's last replica is still being sent (a "
                     "slow or unresponsive holder); training does not wait for it")

    def auto_due(self, step: int, first_step: int, step_s: float) -> bool:
        """Rank 0, auto: whether the state before `step` is to be replicated, at the interval chosen
        from the last finished replica's copy and send and the median of recent steps (`step_s`: the
        last one); a change is logged. (A send still in flight at the step's all-reduce skips the step
        on every rank: ElasticSignals.)"""
        if step_s > 0 and step > first_step + 1:  # the attempt's first step is its warm-up: not a sample
            self._steps.append(step_s)
        if self.last_step is None:
            return step >= first_step + REPLICA_PROBE_STEPS
        if not self._steps or (not self.every and not self.writer.done()):  # the probe's send, still
            return False                                                  # going, has no cost yet
        median_s = statistics.median(self._steps)
        send_s = self.send_cpu_s if self.sends_compete else self.writer.write_seconds
        needed = replicas_needed(median_s, self.writer.snapshot_seconds, send_s, self.sends_compete,
                                 at_most=self.saves_every)
        every = choose_replica_interval(needed, self.every)
        capped = every == self.saves_every
        if every != self.every:
            copy_s = self.writer.snapshot_seconds
            sent = f"{1000 * send_s:.0f}ms of CPU" if self.sends_compete else f"in {1000 * send_s:.0f}ms"
            self.log(f"Memory replicas: every {every} step(s) (copy {1000 * copy_s:.0f}ms = "
                     f"{100 * copy_s / (every * median_s):.1f}% of training, sent {sent}, "
                     f"step {1000 * median_s:.0f}ms" + (", as often as --save-every" if capped else "") + ")")
            self.every = every
        return step - self.last_step >= self.every

    def close(self) -> None:
        self.writer.close()


def choose_set(inventories: list[list[dict]], epoch: int, min_step: int
               ) -> tuple[tuple[int, int], int] | None:
    """(key, world size) of the newest set of this epoch at or after `min_step` (the durable
    checkpoint's step) whose every rank is held by some holder, or None."""
    ranks: dict[tuple[tuple[int, int], int], set[int]] = {}
    for inventory in inventories:
        for replica in inventory:
            if replica["epoch"] == epoch and replica["key"][0] >= min_step:
                ranks.setdefault((tuple(replica["key"]), replica["world_size"]), set()).add(replica["rank"])
    whole = [k for k, held in ranks.items() if held == set(range(k[1]))]
    return max(whole, default=None)


class MemoryReader:
    """One replica set, read by byte range like a checkpoint (raychat.checkpoint.reader's interface
    for `read_share`): each read asks the holders that keep the pieces it spans."""

    def __init__(self, holders: list[Any], found: list[list[dict]], key: tuple[int, int], world: int,
                 extra: dict, local: Any | None = None):
        self.directory = f"peer memory (step {key[0]})"
        self.key, self.extra = key, extra
        self.tensors: dict[str, dict] = {}
        self.failed: set[Any] = set()  # holders that died or hung on a read: the other copy is read
        # A piece two holders keep is read from this rank's own node's (`local`) first: through the
        # node's shared memory, not the network.
        pairs = sorted(zip(holders, found, strict=True), key=lambda pair: pair[0] != local)
        for holder, inventory in pairs:
            for replica in inventory:
                if tuple(replica["key"]) != key or replica["world_size"] != world:
                    continue
                for name, shape, start, numel, dtype in replica["pieces"]:
                    entry = self.tensors.setdefault(name, {"shape": tuple(shape), "dtype": dtype,
                                                           "pieces": {}})
                    entry["pieces"].setdefault(start, []).append((numel, holder, replica["rank"]))

    def read_many(self, wanted: list[tuple[str, int, int, tuple[int, ...]]]) -> list[torch.Tensor]:
        """Elements [start, start + numel) of each (name, start, numel, shape) of `wanted`, flat, in
        order: one call to each holder that keeps a part of them (a resume reads hundreds of ranges,
        and an actor call is milliseconds on a loaded host). A holder that dies or does not answer
        within HOLDER_CALL_S is read no more: its parts come from the other copy, where one lives."""
        while True:
            spans = [self._parts(name, start, numel, shape) for name, start, numel, shape in wanted]
            by_holder: dict[Any, list[tuple]] = {}
            for parts in spans:
                for holder, part in parts:
                    by_holder.setdefault(holder, []).append(part)
            refs = {holder: holder.read.remote(self.key, parts) for holder, parts in by_holder.items()}
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=HOLDER_CALL_S)
            answers = {}
            for holder, ref in refs.items():
                try:
                    if ref in ready:
                        answers[holder] = iter(ray.get(ref))
                        continue
                except ray.exceptions.RayError:
                    pass
                self.failed.add(holder)
            if len(answers) == len(refs):
                break
        out = []
        for (name, _, _, _), parts in zip(wanted, spans, strict=True):
            tensors = [next(answers[holder]) for holder, _ in parts]
            dtype = self.tensors[name]["dtype"]
            out.append(torch.cat(tensors) if len(tensors) > 1 else tensors[0] if tensors else
                       torch.empty(0, dtype=dtype))
        return out

    def _parts(self, name: str, start: int, numel: int, shape: tuple[int, ...]) -> list[tuple[Any, tuple]]:
        """The (holder, part) reads that cover one range, each from the first holder of its piece that
        has not failed."""
        entry = self.tensors.get(name)
        if entry is None or entry["shape"] != tuple(shape):
            raise ReplicaLost(f"the replicas have no {name} of shape {tuple(shape)}")
        stop, covered, parts = start + numel, start, []
        for piece_start in sorted(entry["pieces"]):
            live = [copy for copy in entry["pieces"][piece_start] if copy[1] not in self.failed]
            if not live:
                continue
            piece_numel, holder, rank = live[0]
            low, high = max(covered, piece_start), min(stop, piece_start + piece_numel)
            if low < high and low == covered:
                parts.append((holder, (rank, name, piece_start, low - piece_start, high - low)))
                covered = high
        if covered != stop:
            raise ReplicaLost(f"the replicas do not cover elements {covered}..{stop} of {name}"
                              + (f" ({len(self.failed)} holder(s) did not answer)" if self.failed else ""))
        return parts


class ReplicaLost(Exception):
    """A replica set could not be read whole: the restore falls back to the durable checkpoint."""


def inventories(holders: list[Any]) -> list[list[dict]]:
    """What each holder keeps; a holder that does not answer (its node is gone) keeps nothing."""
    refs = [h.inventory.remote() for h in holders]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=HOLDER_CALL_S)
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref) if ref in ready else [])
        except ray.exceptions.RayError:
            out.append([])
    return out


class MemoryRestore:
    """The replica set every rank resumes from (rank 0 chooses; `agree` returns None when there is
    none newer than the durable checkpoint). `meta` first (the loader starts on its cursor), then
    `load` the tensors, None for every rank if any rank could not read its share."""

    def __init__(self, holders: list[Any], found: list[list[dict]], key: tuple[int, int], world: int,
                 meta: CheckpointMeta, extra: dict, log_tail: list[str],
                 all_gather: Callable[[Any], list[Any]], log: Callable[[str], None]):
        self.holders, self.found, self.key, self.world = holders, found, key, world
        self.meta, self.extra, self.all_gather, self.log = meta, extra, all_gather, log
        self.log_tail = log_tail  # rank 0: the metrics log's records it held back when the set was taken
        self.checkpoint = "peer memory"

    @classmethod
    def agree(cls, holders: list[Any], epoch: int, min_step: int, model: GPTConfig, rank: int,
              all_gather: Callable[[Any], list[Any]], log: Callable[[str], None]) -> "MemoryRestore | None":
        """Rank 0 finds the newest whole set and reads its cursors and loop state; every rank hears."""
        choice, log_tail = None, []
        if rank == 0 and holders:
            try:
                choice = _read_choice(holders, epoch, min_step, model, log)
            except (ray.exceptions.RayError, TimeoutError, KeyError) as e:
                log(f"Memory replicas: could not be read ({type(e).__name__}); resuming from storage")
            if choice is not None:  # rank 0's alone: the others have no metrics log to write it to
                *choice, log_tail = choice
        choice = all_gather(choice)[0]
        if choice is None:
            return None
        found, key, world, meta, extra = choice
        return cls(holders, found, key, world, meta, extra, log_tail, all_gather, log)

    def load(self, read: Callable[[MemoryReader], T], local: Any | None = None) -> T | None:
        """`read(reader)` on every rank, or None on every rank when any of them could not. `local`:
        the holder on this rank's node, read from first."""
        try:
            reader = MemoryReader(self.holders, self.found, self.key, self.world, self.extra, local)
            share, problem = read(reader), None
        except (ReplicaLost, ray.exceptions.RayError, TimeoutError, KeyError) as e:
            share, problem = None, f"{type(e).__name__}: {e}".splitlines()[0]
        problems = [p for p in self.all_gather(problem) if p is not None]
        if problems:
            self.log(f"Memory replicas of step {self.key[0]} could not be read whole ({problems[0]}); "
                     "resuming from storage")
            return None
        return share


def _read_choice(holders: list[Any], epoch: int, min_step: int, model: GPTConfig,
                 log: Callable[[str], None]) -> tuple | None:
    found = inventories(holders)
    chosen = choose_set(found, epoch, min_step)
    if chosen is None:
        if any(r["epoch"] == epoch and r["key"][0] >= min_step for inventory in found for r in inventory):
            log("Memory replicas: no whole set as new as the checkpoint survives (some rank's copies were "
                "all on nodes that are gone): resuming from storage")
        return None
    key, world = chosen
    where = {}
    for holder, inventory in zip(holders, found, strict=True):
        for replica in inventory:
            if tuple(replica["key"]) == key and replica["world_size"] == world:
                where.setdefault(replica["rank"], holder)
    states = ray.get([where[r].state.remote(key, r) for r in range(world)], timeout=HOLDER_CALL_S)
    cursors = [cursor for cursor, _, _, _, _ in states]
    _, loop_state, extra, (num_units, seed), log_tail = states[0]
    cursor: Cursor = merge_cursor(cursors, num_units, seed)
    meta = CheckpointMeta(step=key[0], model_config=model, world_size=world, lease_epoch=epoch, cursor=cursor,
                          loop_state=loop_state)
    return found, key, world, meta, extra, log_tail or []


def retain_only(holders: list[Any], key: tuple[int, int] | None) -> None:
    """Rank 0 of a new attempt, before any rank replicates: every holder that answers keeps only the
    set resumed from (`ReplicaHolder.retain`)."""
    refs = [h.retain.remote(key) for h in holders]
    ray.wait(refs, num_returns=len(refs), timeout=HOLDER_CALL_S)
