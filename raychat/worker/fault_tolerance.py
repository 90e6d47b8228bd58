"""Fault tolerance as the step loop sees it: one object that saves and mirrors the state when due,
hears through the step's all-reduce what any rank was told (a planned resize, a spot notice, a lost
lease), and after a save that was asked for waits for the group to be stopped.

The loop calls it around each step, in this order:
    before_step(state, last_step)  mirror the state in peer memory, when the last step's flags said so
    save_due(step, last_step)      whether the state before `step` is to be checkpointed now
    save(state, wait)              checkpoint it: every rank writes what it owns
    flags(step, busy_next)         what this rank adds to the step's all-reduce (StepFlags)
    after_step(state, result)      the summed flags read back: a lost lease stops every rank here
    step_logged(state)             the coordinator told the step is done; the compile cache kept
    save_requested / save_on_request(state)  a planned resize or a notice heard: save now, then wait
Behind it: the checkpoint saver (raychat.checkpoint.saver), the auto cadence (raychat.elastic.cadence),
the memory replicas (raychat.elastic.replicas), rank 0's line to the run's coordinator
(raychat.elastic.signals) and the observer tests install (raychat.worker.observer).
"""

import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch

import raychat
from raychat.checkpoint.fence import LeaseLost
from raychat.checkpoint.meta import CheckpointMeta, LoopState, Totals
from raychat.data.cursor import Cursor
from raychat.data.loader import merge_cursor
from raychat.elastic.cadence import SaveCadence
from raychat.elastic.holders import Replica
from raychat.elastic.replicas import Replicator
from raychat.elastic.signals import ElasticSignals, StepFlags, notice_margin
from raychat.model.compile_cache import CompileCache
from raychat.ray_glue.ray_internals import preemption_deadline
from raychat.storage import Storage
from raychat.telemetry.metrics_log import flush_soon
from raychat.worker.components import Worker, all_gather_objects
from raychat.worker.observer import StepObserver, StepSeen
from raychat.worker.state import state_pieces
from raychat.worker.step import StepResult

PLANNED_RESIZE_WAIT_S = 120.0  # after a planned-resize save, how long to wait for Ray to restart the group
NOTICE_WAIT_GRACE_S = 30.0  # after a spot notice's save, how long past the deadline to wait for the reclaim


@dataclass(frozen=True)
class SaveVote:
    """What each rank brings to a save's one gather: its loader's cursor (rank 0 merges them), a
    token naming this save (rank 0's is used by all), whether its lease check found another driver
    (rank 0's is heard by all) and the newest step a peer node holds of its state."""

    cursor: Cursor
    token: str
    lost: str | None
    held: int | None


def weights_are_finite(model: torch.nn.Module) -> bool:
    """Every parameter finite (one host sync). The weights are the same on every rank after a step,
    so every rank reaches the same answer without a collective; non-finite moments make non-finite
    weights at the next step, which the next save or the loss catches."""
    return bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())


def checkpoint_meta(w: Worker, state: LoopState, cursor: Cursor) -> CheckpointMeta:
    """Rank 0's record of the state before step `state.step` (lineage is filled in by the saver)."""
    tokens = state.step * w.plan.total_batch_size
    return CheckpointMeta(
        step=state.step, model_config=w.plan.model, world_size=w.world_size,
        vocab_size=w.tokenizer.vocab_size, tokenizer_fingerprint=w.tokenizer.fingerprint, session=w.session,
        raychat_version=raychat.__version__, plan=w.plan, user_config=w.cfg, corpus=w.corpus_meta,
        cursor=cursor, loop_state=replace(state),  # a copy: the loop trains on while the save is written
        val_bpb=state.val_bpb, metrics=Totals(tokens, tokens * w.plan.flops_per_token),
    )


class FaultTolerance:
    """One rank's saves, replicas and elastic signals for one attempt (see the module)."""

    def __init__(self, w: Worker, signals: ElasticSignals, replicator: Replicator | None, first_step: int,
                 observer: StepObserver | None = None, attempt_id: str = "",
                 compile_cache: CompileCache | None = None):
        self.w, self.signals, self.replicator = w, signals, replicator
        self.first_step = first_step  # the step this attempt resumed at: in storage already
        self.observer, self.attempt_id = observer, attempt_id
        self.compile_cache = compile_cache  # rank 0 of a compiled run: saved after the first step
        # --save-every 0: rank 0 measures steps and saves and asks for the next save through the flags
        auto = w.master and w.cfg.save_every == 0
        self.cadence = SaveCadence(w.cfg.max_lost_minutes, first_step, w.log) if auto else None
        # Rank 0: the replica interval at which a peer node held every rank's state at the last save
        # (None: not all of it), which the storage cadence leans on (Replicator.peer_interval).
        self.peer_every: int | None = None

    @property
    def coordinator(self) -> Any:
        """Rank 0: the run's coordinator actor (None on other ranks)."""
        return self.signals.coordinator

    def before_step(self, state: LoopState, last_step: bool) -> None:
        """Mirror the state in peer memory when rank 0 asked at the last step's all-reduce (a step some
        rank was still sending for then is skipped by all), and at the last step before its
        evaluation, which a node lost meanwhile then repeats without retraining."""
        signals = self.signals
        if self.replicator is None or state.step == self.first_step:
            return
        if (last_step and not signals.any_sending) or signals.replicate_due:
            with self.w.publisher.clock("checkpoint"):
                self._replicate(state)
        elif signals.replicate_skipped:
            self.replicator.skipped(state.step)

    def save_due(self, step: int, last_step: bool) -> bool:
        """At the end, and on the cadence (--save-every N; auto: when rank 0 asked at the last step's
        all-reduce, so every rank saves this step), never at the step this attempt resumed from. A
        save the writer finished meanwhile teaches the cadence how long writes take."""
        if self.w.saver.poll() is not None and self.cadence is not None:
            self.cadence.save_written(self.w.saver.writer.write_seconds, replica_every=self.peer_every)
        every = self.w.cfg.save_every  # N, 0 (auto) or -1 (only at the end)
        due = self.signals.checkpoint_due if every == 0 else every > 0 and step % every == 0
        return last_step or (step != self.first_step and due)

    def save(self, state: LoopState, wait: bool) -> bool:
        """Checkpoint the state before step `state.step` (see `_save`), timed as the ledger's
        "checkpoint" and, for the cadence, as the stall it cost the loop."""
        with self.w.publisher.clock("checkpoint") as stall:
            saved = self._save(state, wait)
        if saved and self.cadence is not None:
            self.cadence.save_stalled(stall["seconds"])
        return saved

    def flags(self, step: int, busy_next: bool) -> Callable[[], tuple[float, ...]]:
        """What this rank adds to the all-reduce of step `step`, asked just before it (whether a send
        begun before the step has finished needs the step's time to have gone by). `busy_next`: an
        evaluation or the last step follows, so a notice's save goes first."""
        w, signals, replicator = self.w, self.signals, self.replicator
        save_next = self.cadence is not None and self.cadence.due(step + 1, w.saver.submitted_step)
        writer = w.saver.writer  # its last save this attempt, however it was waited for: a notice's margin
        signals.save_s = writer.snapshot_seconds + writer.write_seconds if writer.write_seconds else None
        replicate_next = w.master and replicator is not None and replicator.wanted(step + 1, self.first_step,
                                                                                   signals.step_s)

        def asked() -> tuple[float, ...]:
            mine = signals.local_flags(save_next, busy_next=busy_next, replicate_due=replicate_next,
                                       still_sending=replicator.sending if replicator is not None else None)
            return replace(mine, lost=float(w.saver.lost is not None)).values()

        return asked

    def after_step(self, state: LoopState, result: StepResult) -> None:
        """The flags summed over the ranks: every rank stops on a lost lease, or acts on the rest."""
        summed = StepFlags.from_values(result.summed)
        self._stop_if_lost(summed.lost)
        self.signals.update(summed)
        self.signals.step_s = result.dt
        if self.cadence is not None:
            self.cadence.step_done(result.dt)
        if self.observer is not None:
            w, replicator = self.w, self.replicator
            self.observer.step_done(StepSeen(
                attempt=self.attempt_id, step=state.step, rank=w.rank, world_size=w.world_size,
                documents=([list(i) for i in w.loader.consumed_doc_ids()]
                           if self.observer.records_documents else []),
                replica=replicator.held_step if replicator is not None else None,
                sent=replicator.sent_step if replicator is not None else None))

    def step_logged(self, state: LoopState) -> None:
        """Rank 0 tells the coordinator the step is done (what a restart redoes); after the attempt's
        first compiled step the compile cache is kept, so a restart compiles nothing."""
        self.signals.progress(state.step, outside_s=sum(self.w.publisher.seconds_so_far.values()))
        if state.step == self.first_step and self.compile_cache is not None:
            self.compile_cache.save()

    def save_requested(self, state: LoopState) -> bool:
        """A planned resize or a preemption notice was heard at the step's all-reduce (at the last step
        the final save follows instead)."""
        asked = self.signals.preempt_requested or self.signals.resize_requested
        return asked and state.step < self.w.plan.num_iterations

    def save_on_request(self, state: LoopState) -> bool:
        """Checkpoint this step now (synchronously), so the restarted group loses nothing, then wait to
        be stopped instead of training steps the next group would redo: before a resize until Ray
        restarts the group, after a notice's last save until the node's deadline. A notice's save
        made early (its deadline still far off: before an evaluation, or before any save was timed) is
        followed by training and a later one. A notice without a deadline is saved at once and
        trained past (Ray restarts the group within two minutes). Ray stops the group; if it does
        not, train on. False: the weights were not finite, nothing saved."""
        w, signals = self.w, self.signals
        with w.publisher.clock("checkpoint"):
            if not self._save(state, wait=True):
                return False
            wait_s = 0.0
            if signals.preempt_requested:
                wait_s = self._after_notice_save(state.step)
            if signals.resize_requested:
                signals.resize_saved(state.step)
                w.log(f"Planned resize: saved step {state.step}, waiting for the new worker group")
                wait_s = max(wait_s, PLANNED_RESIZE_WAIT_S)
            stop_waiting = time.monotonic() + wait_s
            while time.monotonic() < stop_waiting:
                time.sleep(0.5)
        return True

    def newest_checkpoint(self) -> Storage | None:
        """Rank 0: the run's newest whole checkpoint (this attempt's last finished save, else the one it
        resumed from), what Ray Train's Result names and a rerun resumes from."""
        saver = self.w.saver
        name = saver.latest_name or saver.resumed_from
        return saver.run.child(name) if name else None

    def _after_notice_save(self, step: int) -> float:
        """A notice's save is done: how long to wait for the node to go (0: train on)."""
        w, signals = self.w, self.signals
        if signals.coordinator is not None:
            ray.get(signals.coordinator.preemption_saved.remote(step))  # for the next attempt's line
        # Ray tells each worker of a notice in its own time: every rank takes the earliest deadline
        # any rank heard of (0.0: none given) from one gather, so all reach the same answer.
        heard = [d for d in all_gather_objects(preemption_deadline(), w.world_size) if d]
        deadline, writer = min(heard, default=0.0), w.saver.writer
        left = max(0.0, deadline - time.time())
        saved = f"Preemption notice: saved step {step}"
        if not deadline:
            signals.preempt_saved = True
            w.log(f"{saved} (no deadline given: training on)")
            return 0.0
        if left > notice_margin(writer.snapshot_seconds + writer.write_seconds, signals.step_s):
            w.log(f"{saved}, training on ({left:.0f}s before the node goes)")
            return 0.0
        signals.preempt_saved = True
        w.log(f"{saved}, waiting for the node to go ({left:.0f}s)")
        return left + NOTICE_WAIT_GRACE_S

    def _save(self, state: LoopState, wait: bool) -> bool:
        """Checkpoint the state before step `state.step` (all ranks: each writes what it owns, no
        gather of tensors; the cursors' gather also hands every rank rank 0's token for this save). A
        step is saved once per attempt (a spot notice's save is not repeated at a --save-every step:
        rewriting a whole checkpoint would leave none at that step while it is rewritten). Returns
        False, saving nothing, when the weights are not finite: a NaN is never checkpointed."""
        w = self.w
        if w.saver.already_saved(state.step):
            return True
        if not weights_are_finite(w.orig_model):
            return False
        # Rank 0 checks the run lease's fence and every rank hears its verdict in the gather below: a
        # group whose driver lost the run writes nothing more (not even the metrics log) and stops.
        lost = None
        if w.master:
            try:
                w.saver.fence.check()
            except LeaseLost as e:
                lost = str(e)
        if lost is None:
            # The metrics log is asked to write every step the checkpoint covers, in its own thread:
            # the save does not wait on it (a replica carries what it still holds).
            flush_soon()
            w.saver.prepare(state.step)  # rank 0: the save in flight ends first; a fenced one sets `lost`
        if w.master:
            lost = lost or w.saver.lost
        held = self.replicator.held_step if self.replicator is not None else None
        votes: list[SaveVote] = all_gather_objects(SaveVote(w.loader.state(), uuid.uuid4().hex, lost, held),
                                                   w.world_size)
        if votes[0].lost is not None:
            raise LeaseLost(votes[0].lost)
        if w.master and self.replicator is not None:
            self.peer_every = self.replicator.peer_interval(state.step, [v.held for v in votes])
        pieces, plain = state_pieces(w.orig_model, w.optimizer, w.world_size, w.rank)
        merged = (merge_cursor([v.cursor for v in votes], w.loader.num_units, w.loader.shuffle_seed)
                  if w.master else None)
        meta = checkpoint_meta(w, state, merged) if w.master else None
        with suppress(LeaseLost):  # kept in w.saver.lost: every rank hears it below or at the next step
            w.saver.save(state.step, pieces, votes[0].token, meta, extra=plain, wait=wait)
        if wait:
            self._stop_if_lost(max(all_gather_objects(w.saver.lost is not None, w.world_size)))
        return True

    def _stop_if_lost(self, any_rank_lost: float) -> None:
        """LeaseLost on every rank once any rank's save was fenced (`any_rank_lost`: summed or gathered
        across ranks): another driver holds the run, and the group stops at the same step on every
        rank instead of leaving the others in the next collective."""
        saver = self.w.saver
        if any_rank_lost:
            raise LeaseLost(saver.lost or f"run {saver.run} was taken over by another driver (lease epoch "
                            f"above {saver.fence.epoch}, found by another rank): this worker stopped")

    def _replicate(self, state: LoopState) -> None:
        """Mirror this rank's state before step `state.step` in its holders' memory
        (raychat.elastic.replicas): the pieces a checkpoint would write and the rank's cursor (rank 0:
        also the loop state, the optimizer's plain data and the step records its metrics log holds
        back, which an attempt resumed from this set writes: nothing redoes those steps). No
        collective: the cursors are merged at a restore."""
        w, replicator = self.w, self.replicator
        pieces, plain = state_pieces(w.orig_model, w.optimizer, w.world_size, w.rank)
        first = w.master
        replicator.replicate(Replica(
            epoch=replicator.epoch, attempt=replicator.attempt, step=state.step, rank=w.rank,
            world_size=w.world_size, pieces=pieces, cursor=w.loader.state(),
            loop_state=replace(state) if first else None, extra=plain if first else None,
            units=(w.loader.num_units, w.loader.shuffle_seed) if first else None,
            log_tail=w.publisher.held_back() if first else None))
