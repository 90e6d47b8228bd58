"""The function every Ray Train worker runs: nanochat's base_train loop, world-size-independent.

Each optimizer step consumes the same global rows whatever the number of workers: rank r takes its
share of rows (R//W or R//W+1), the loss is summed and divided by the global token count, and the
optimizer SUM-reduces gradients, so 1 worker and 8 workers compute the same update. Everything a
resume needs (model, optimizer, loader cursor, loop state) goes into each checkpoint, so Ray can
restart the group at any size. `setup` (raychat.worker.setup) builds what the loop runs on: the
worker's components `w`, its loop state and its elastic signals; the step itself is plain PyTorch
(raychat.worker.step). The loop below reads top to bottom, each block a named function above it.
"""

import gc
import json
import math
import os
import resource
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import ray.train
import torch

import raychat
from raychat.checkpoint.fence import Fence, LeaseLost
from raychat.checkpoint.meta import CheckpointMeta, Totals
from raychat.checkpoint.stop_note import StopNote, read_stop_note, write_stop_note
from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.data.cursor import Cursor
from raychat.data.loader import merge_cursor
from raychat.data.validation import pack_validation_rows
from raychat.elastic.cadence import SaveCadence
from raychat.elastic.coordinator import FinalResult
from raychat.elastic.holders import Replica
from raychat.elastic.signals import ElasticSignals, notice_margin
from raychat.evaluation.bpb import evaluate_bpb
from raychat.model.flops import mfu as compute_mfu
from raychat.model.generate import SAMPLE_PROMPTS, generate
from raychat.ray_glue.quiet import quiet_ray
from raychat.ray_glue.ray_internals import preemption_deadline
from raychat.storage import Storage
from raychat.telemetry.metrics import StepMetrics, counts_toward_total_time, eta_seconds, smooth_loss
from raychat.telemetry.metrics_log import flush_soon
from raychat.worker.core_metric import core_due, evaluate_core
from raychat.worker.setup import LoopState, Worker, WorkerRunConfig, all_gather_objects, setup
from raychat.worker.state import state_pieces
from raychat.worker.step import train_step

PLANNED_RESIZE_WAIT_S = 120.0  # after a planned-resize save, how long to wait for Ray to restart the group
NOTICE_WAIT_GRACE_S = 30.0  # after a spot notice's save, how long past the deadline to wait for the reclaim


def validation_rows(w: Worker) -> torch.Tensor:
    """This rank's share of the run's fixed validation rows: the first --eval-tokens of the val split
    packed as by one worker, row i evaluated by rank i % W. The same rows and so the same bpb for
    the same weights at any world size; read and packed in this process (raychat.data.validation),
    once per attempt, then reused at every evaluation."""
    wanted = max(w.world_size, w.cfg.eval_tokens // w.cfg.max_seq_len)
    rows = pack_validation_rows(w.index, w.tokenizer_dir, w.cfg.max_seq_len, wanted, min_rows=w.world_size)
    if len(rows) < wanted:
        w.log(f"Validation: the val split's {w.index.num_val_docs:,} documents fill {len(rows):,} rows "
              f"({len(rows) * w.cfg.max_seq_len:,} tokens), fewer than --eval-tokens "
              f"{w.cfg.eval_tokens:,}: each evaluation reads the split once")
    return torch.from_numpy(rows[w.rank::w.world_size].copy())


def evaluate(w: Worker, state: LoopState) -> float:
    """Validation bpb over --eval-tokens (all ranks), logged like nanochat."""
    if w.val_rows is None:
        w.val_rows = validation_rows(w)
    rows = w.plan.device_batch_size
    batches = ((chunk[:, :-1], chunk[:, 1:]) for chunk in w.val_rows.split(rows))
    w.model.eval()
    bpb = evaluate_bpb(w.model, batches, w.tokenizer.token_bytes(), w.device)
    w.model.train()
    state.val_bpb = bpb
    state.min_val_bpb = min(state.min_val_bpb, bpb)
    w.publisher.eval(state.step, bpb, state.total_training_time)
    return bpb


def sample(w: Worker, step: int) -> None:
    """Greedy continuations of nanochat's prompts (rank 0, uncompiled model: prompt shapes vary)."""
    w.orig_model.eval()
    texts = []
    for prompt in SAMPLE_PROMPTS:
        tokens = [w.tokenizer.bos_id] + w.tokenizer.encode(prompt)
        completion = generate(w.orig_model, tokens, max_tokens=16, temperature=0.0)
        texts.append(prompt + w.tokenizer.decode(completion))
    w.orig_model.train()
    w.publisher.samples(step, texts)


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


def weights_are_finite(model: torch.nn.Module) -> bool:
    """Every parameter finite (one host sync). The weights are the same on every rank after a step,
    so every rank reaches the same answer without a collective; non-finite moments make non-finite
    weights at the next step, which the next save or the loss catches."""
    return bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())


def save(w: Worker, state: LoopState, wait: bool) -> bool:
    """Checkpoint the state before step `state.step` (all ranks: each writes what it owns, no gather;
    the cursors' gather also hands every rank rank 0's token for this save). A step is saved once
    per attempt (a spot notice's save is not repeated at a --save-every step: rewriting a whole
    checkpoint would leave none at that step while it is rewritten). Returns False, saving nothing,
    when the weights are not finite: a NaN is never checkpointed."""
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
        # The metrics log is asked to write every step the checkpoint covers, in its own thread: the
        # save does not wait on it (a replica carries what it still holds).
        flush_soon()
        w.saver.prepare(state.step)  # rank 0: the save in flight ends first; a fenced one sets `lost`
    if w.master:
        lost = lost or w.saver.lost
    held = w.replicator.held_step if w.replicator is not None else None  # the step a peer node holds
    gathered = all_gather_objects((w.loader.state(), uuid.uuid4().hex, lost, held), w.world_size)
    if gathered[0][2] is not None:
        raise LeaseLost(gathered[0][2])
    if w.master and w.replicator is not None:
        w.peer_every = w.replicator.peer_interval(state.step, [h for _, _, _, h in gathered])
    pieces, plain = state_pieces(w.orig_model, w.optimizer, w.world_size, w.rank)
    cursors = [cursor for cursor, _, _, _ in gathered]
    merged = merge_cursor(cursors, w.loader.num_units, w.loader.shuffle_seed) if w.master else None
    meta = checkpoint_meta(w, state, merged) if w.master else None
    with suppress(LeaseLost):  # kept in w.saver.lost: every rank hears it below or at the next step
        w.saver.save(state.step, pieces, gathered[0][1], meta, extra=plain, wait=wait)
    if wait:
        stop_if_lost(w, max(all_gather_objects(w.saver.lost is not None, w.world_size)))
    return True


def stop_if_lost(w: Worker, any_rank_lost: float) -> None:
    """LeaseLost on every rank once any rank's save was fenced (`any_rank_lost`: summed or
    gathered across ranks): another driver holds the run, and the group stops at the same step
    on every rank instead of leaving the others in the next collective."""
    if any_rank_lost:
        raise LeaseLost(w.saver.lost or f"run {w.saver.run} was taken over by another driver (lease epoch "
                        f"above {w.saver.fence.epoch}, found by another rank): this worker stopped")


def agreed_flags(w: Worker, elastic: Callable[[], tuple[float, ...]]) -> tuple[float, ...]:
    """What this rank adds to the step's all-reduce: the elastic flags, and whether its last save
    was fenced (raychat.checkpoint.saver: `lost`), for `stop_if_lost`."""
    return (*elastic(), float(w.saver.lost is not None))


def replicate(w: Worker, state: LoopState) -> None:
    """Mirror this rank's state before step `state.step` in its holders' memory (raychat.elastic.replicas):
    the pieces a checkpoint would write and the rank's cursor (rank 0: the loop state, the optimizer's
    plain data and the step records its metrics log holds back, which an attempt resumed from this set
    writes: nothing redoes those steps). No collective: the cursors are merged at a restore."""
    pieces, plain = state_pieces(w.orig_model, w.optimizer, w.world_size, w.rank)
    first = w.master
    w.replicator.replicate(Replica(
        epoch=w.replicator.epoch, attempt=w.replicator.attempt, step=state.step, rank=w.rank,
        world_size=w.world_size, pieces=pieces, cursor=w.loader.state(),
        loop_state=replace(state) if first else None, extra=plain if first else None,
        units=(w.loader.num_units, w.loader.shuffle_seed) if first else None,
        log_tail=w.publisher.held_back() if first else None))


def stop_on_nan(w: Worker, what: str, step: int) -> None:
    """Every rank sees the same global loss and weights, so all stop together. The save in flight
    holds the state from before: finish it, so the last good checkpoint is whole."""
    w.saver.finish()
    w.log(f"{what} at step {step}: stopping")
    # A superseded group's note would stop the new driver's run: only the run's writer leaves one.
    if w.master and w.saver.fence.newer() is None:
        write_stop_note(w.storage_path, w.cfg.name, StopNote(reason="nan", session=w.session, step=step))


def notice_deadline(w: Worker) -> float:
    """The earliest reclaim deadline any rank has heard of (UNIX seconds), 0.0 for none: Ray tells
    each worker of a notice in its own time, so every rank reads the same answer from a gather."""
    heard = [d for d in all_gather_objects(preemption_deadline(), w.world_size) if d]
    return min(heard, default=0.0)


def save_on_request(w: Worker, state: LoopState, signals: ElasticSignals) -> bool:
    """A planned resize or a preemption notice: checkpoint this step now (synchronously), so the
    restarted group loses nothing, then wait to be stopped instead of training steps the next group
    would redo: before a resize until Ray restarts the group, after a notice's last save until the
    node's deadline. A notice's save made early (its deadline still far off: before an evaluation,
    or before any save was timed) is followed by training and a later one. A notice without a
    deadline is saved at once and trained past (Ray restarts the group within two minutes). Ray
    stops the group; if it does not, train on. False: the weights were not finite, nothing saved."""
    if not save(w, state, wait=True):
        return False
    wait_s = 0.0
    if signals.preempt_requested:
        if signals.coordinator is not None:
            ray.get(signals.coordinator.preemption_saved.remote(state.step))  # for the next attempt's line
        deadline, writer = notice_deadline(w), w.saver.writer
        left = max(0.0, deadline - time.time())
        saved = f"Preemption notice: saved step {state.step}"
        if not deadline:
            signals.preempt_saved = True
            w.log(f"{saved} (no deadline given: training on)")
        elif left > notice_margin(writer.snapshot_seconds + writer.write_seconds, signals.step_s):
            w.log(f"{saved}, training on ({left:.0f}s before the node goes)")
        else:
            signals.preempt_saved = True
            wait_s = left + NOTICE_WAIT_GRACE_S
            w.log(f"{saved}, waiting for the node to go ({left:.0f}s)")
    if signals.resize_requested:
        signals.resize_saved(state.step)
        w.log(f"Planned resize: saved step {state.step}, waiting for the new worker group")
        wait_s = max(wait_s, PLANNED_RESIZE_WAIT_S)
    stop_waiting = time.monotonic() + wait_s
    while time.monotonic() < stop_waiting:
        time.sleep(0.5)
    return True


def log_step(w: Worker, state: LoopState, train_loss: float, lrm: float, dt: float, data_wait: float) -> None:
    """This step's record (nanochat's loop arithmetic), out to the line, gauges, wandb and metrics log."""
    step, n, tokens = state.step, w.plan.num_iterations, w.plan.total_batch_size
    state.smooth_train_loss, debiased = smooth_loss(state.smooth_train_loss, train_loss, step)
    if counts_toward_total_time(step):
        state.total_training_time += dt
    epoch, pq, rg = w.loader.position()
    total_time = state.total_training_time
    w.publisher.step(StepMetrics(
        step=step, num_iterations=n, loss=debiased, raw_loss=train_loss, lrm=lrm, dt=dt,
        tokens_per_sec=tokens / dt, mfu=compute_mfu(w.plan.flops_per_token, tokens / dt, w.peak_flops,
                                                    w.world_size),
        epoch=epoch, pq=pq, rg=rg, total_time_s=total_time, eta_s=eta_seconds(step, n, total_time),
        data_wait_s=data_wait, world_size=w.world_size, tokens_so_far=(step + 1) * tokens,
        flops_so_far=(step + 1) * tokens * w.plan.flops_per_token))


def report(w: Worker, state: LoopState, metrics: dict, last_step: bool, coordinator: Any = None) -> None:
    """Metrics to Ray Train (and Tune). Every rank reports at the same steps: report is a barrier."""
    tokens_so_far = state.step * w.plan.total_batch_size
    metrics.update(step=state.step, world_size=w.world_size, tokens_so_far=tokens_so_far,
                   flops_so_far=tokens_so_far * w.plan.flops_per_token,
                   min_val_bpb=state.min_val_bpb, total_training_time=state.total_training_time,
                   checkpoint_step=w.saver.latest_step, train_done=last_step, restarts=state.restarts,
                   resizes=state.resizes, redone_steps=state.redone_steps)
    if last_step:
        usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        on_cuda = w.device.type == "cuda"
        metrics["peak_memory_mib"] = torch.cuda.max_memory_allocated(w.device) / 2**20 if on_cuda else usage
        if coordinator is not None:  # the driver's summary
            ray.get(coordinator.finish.remote(FinalResult(
                step=state.step, tokens_so_far=tokens_so_far, min_val_bpb=state.min_val_bpb,
                total_training_time=state.total_training_time, core_metric=metrics.get("core_metric"),
                restarts=state.restarts, resizes=state.resizes, redone_steps=state.redone_steps,
                peak_memory_mib=metrics["peak_memory_mib"])))
    w.publisher.report(metrics, checkpoint=newest_checkpoint(w) if w.master else None)


def newest_checkpoint(w: Worker) -> Storage | None:
    """Rank 0: the run's newest whole checkpoint (this attempt's last finished save, else the one it
    resumed from), what Ray Train's Result names and a rerun resumes from."""
    saver = w.saver
    name = saver.latest_name or saver.resumed_from
    return saver.run.child(name) if name else None


def _trace_consumed(w: Worker, step: int) -> None:
    """Test hook ($RAYCHAT_TRACE_DIR): append the documents this rank trained on at this step, and the
    newest step of its state that its memory-tier holders took: a peer node's ("replica") and all of
    them, its own node's included ("sent"; None: none yet this attempt)."""
    path = Path(w.trace_dir) / f"{w.attempt}_rank{w.rank}_{os.getpid()}.jsonl"
    with path.open("a") as f:
        ids = [list(i) for i in w.loader.consumed_doc_ids()]
        held = w.replicator.held_step if w.replicator is not None else None
        sent = w.replicator.sent_step if w.replicator is not None else None
        f.write(json.dumps({"attempt": w.attempt, "step": step, "rank": w.rank, "world_size": w.world_size,
                            "pid": os.getpid(), "ids": ids, "replica": held, "sent": sent}) + "\n")


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _evaluations_due(cfg: TrainConfig, step: int, last_step: bool) -> tuple[bool, bool, bool]:
    """(val bpb, CORE, samples) due at `step`, before training it: every N steps and at the last."""
    return (last_step or _due(step, cfg.eval_every), core_due(cfg, step, last_step),
            last_step or (step > 0 and _due(step, cfg.sample_every)))


def _save_due(cfg: TrainConfig, step: int, signals: ElasticSignals) -> bool:
    """--save-every N: every N steps; 0 (auto): when rank 0's cadence asked for it at the last step
    (raychat.elastic.cadence), agreed through that step's all-reduce so every rank saves this step."""
    return signals.checkpoint_due if cfg.save_every == 0 else _due(step, cfg.save_every)


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point: `config` is the WorkerRunConfig raychat.run.driver.build_trainer wrote.

    Ray's failure policy retries every worker exception, but a RaychatError is the user's to fix (a
    corpus that no longer fits the checkpoint's cursor, a wrong tokenizer): no retry can succeed,
    and with --max-failures -1 the run would loop forever. So the error is left in the stop note
    and a retry of this session ends at once, without an error, for the driver to report it."""
    quiet_ray()  # again: Ray Data's console handler came with its import, after the setup hook's call
    run_config = WorkerRunConfig.from_dict(config, where="train_loop_config")
    cfg = run_config.train_config
    note = read_stop_note(cfg.storage_path, cfg.name)
    if note is not None and note.of(run_config.session, "error"):
        return
    try:
        _train(run_config)
    except LeaseLost as e:
        # Another driver holds the run: this group ends without a word to storage (no stop note),
        # and a restart of it by Ray ends at its start (raychat.worker.setup). The driver,
        # once it runs again, says so in one line.
        print(f"raychat: {e}", flush=True)
    except RaychatError as e:
        run = Storage(cfg.storage_path).child(cfg.name)
        if Fence(run, run_config.lease_epoch).newer() is None:  # only the run's writer leaves a note
            write_stop_note(cfg.storage_path, cfg.name,
                            StopNote(reason="error", session=run_config.session, message=str(e)))
        raise


def _train(config: WorkerRunConfig) -> None:
    w, state, signals = setup(config)
    try:
        _steps(w, state, signals)
    finally:
        # the step records the metrics log holds back, a failed attempt's too (a superseded
        # writer's are dropped): the ledger then needs no estimate of this attempt's last steps
        w.publisher.flush()
    w.saver.close()
    # Nothing else is waited for: Ray Train kills this process once the loop returns. The attempt
    # ended on its final save (or a stop), which storage holds whole, so a memory replica still being
    # sent holds no newer state than storage does, and the loader's reads ahead are not needed.
    # (Waiting for both cost every run's end 1-1.5 s on a loaded 2-core host: Ray Data's executor
    # stopping, the holders' first replica; a hung holder, up to HOLDER_CALL_S.)
    if w.wandb:
        w.wandb.finish()


def _steps(w: Worker, state: LoopState, signals: ElasticSignals) -> None:
    """The step loop of one attempt, from the state `setup` restored to the last step or a stop."""
    cfg, num_iterations = w.cfg, w.plan.num_iterations
    first_step = state.step
    # An attempt restarted after the final save (a node lost during the final report, a planned
    # resize at the last step) finds everything done: its final eval and CORE are in the checkpoint's
    # loop state, and the checkpoint is not written again. The memory tier's replica of the last
    # step is taken before the final evaluation: an attempt resumed from it evaluates again.
    done_before = (state.step >= num_iterations and w.saver.already_saved(state.step)
                   and state.final_evaluated)
    auto_save = w.master and cfg.save_every == 0
    cadence = SaveCadence(cfg.max_lost_minutes, first_step, w.log) if auto_save else None
    clock = w.publisher.clock  # the time ledger's causes outside steps (raychat.telemetry.ledger)
    while True:
        last_step = state.step >= num_iterations  # the driver refuses a resume past the horizon
        metrics: dict[str, Any] = {}

        # mirror the state in peer memory when rank 0 asked at the last step's all-reduce (every
        # --replicate-every steps, or its auto choice; a step some rank was still sending for at that
        # all-reduce is skipped by all), and at the last step before its evaluation, which a node
        # lost meanwhile then repeats without retraining (a copy to host memory, sent in the
        # background)
        if w.replicator is not None and state.step != first_step:
            if (last_step and not signals.any_sending) or signals.replicate_due:
                with clock("checkpoint"):
                    replicate(w, state)
            elif signals.replicate_skipped:
                w.replicator.skipped(state.step)

        with clock("eval"):
            bpb_due, core_is_due, sample_due = _evaluations_due(cfg, state.step, last_step)
            # once in a while: evaluate the val bpb (all ranks participate)
            if done_before:
                metrics["val_bpb"] = state.val_bpb
                if state.core_metric is not None:
                    metrics["core_metric"] = state.core_metric
            elif bpb_due:
                metrics["val_bpb"] = evaluate(w, state)
            # once in a while: estimate the CORE metric (all ranks participate)
            if core_is_due and not done_before:
                metrics.update(evaluate_core(w, state))
            # once in a while: sample from the model (rank 0 only)
            if w.master and not done_before and sample_due:
                sample(w, state.step)
            state.final_evaluated = last_step

        # save a checkpoint: on the cadence and at the end, never at the step this attempt resumed
        # from (it is in storage already). The writer works in the background; the cadence learns
        # from each save how long it stalled the loop and how long the write took.
        if w.saver.poll() is not None and cadence is not None:
            cadence.save_written(w.saver.writer.write_seconds, replica_every=w.peer_every)
        if last_step or (state.step != first_step and _save_due(cfg, state.step, signals)):
            with clock("checkpoint") as stall:
                saved = save(w, state, wait=last_step)
            if not saved:
                stop_on_nan(w, "Weights are not finite", state.step)
                break
            if cadence is not None:
                cadence.save_stalled(stall["seconds"])

        # report to Ray Train (and Tune) whenever there is something to report: a barrier
        if metrics or last_step:
            report(w, state, metrics, last_step, signals.coordinator)
        if last_step:
            break

        # single training step: gradients over this rank's micro-batches, all-reduced, one optimizer
        # step. Its all-reduce also carries the flags every rank must agree on (a save due at the
        # next step, a resize or a preemption notice): the step's one host sync serves them too.
        save_next = cadence is not None and cadence.due(state.step + 1, w.saver.submitted_step)
        writer = w.saver.writer  # its last save this attempt, however it was waited for: a notice's margin
        signals.save_s = writer.snapshot_seconds + writer.write_seconds if writer.write_seconds else None
        replicate_next = (w.master and w.replicator is not None
                          and w.replicator.wanted(state.step + 1, first_step, signals.step_s))
        next_step = state.step + 1  # an evaluation or the last step next: a notice's save goes first
        busy_next = any(_evaluations_due(cfg, next_step, next_step >= num_iterations))
        elastic = partial(signals.local_flags, save_next, busy_next=busy_next, replicate_due=replicate_next,
                          still_sending=w.replicator.sending if w.replicator is not None else None)
        result = train_step(w, state.step, also_sum=partial(agreed_flags, w, elastic))  # asked then
        *summed, lost = result.summed
        stop_if_lost(w, lost)
        signals.update(summed)
        signals.step_s = result.dt
        if cadence is not None:
            cadence.step_done(result.dt)
        if w.trace_dir:
            _trace_consumed(w, state.step)
        if not math.isfinite(result.loss):
            stop_on_nan(w, f"Loss is {result.loss}", state.step)
            break

        # logging
        log_step(w, state, result.loss, result.lrm, result.dt, result.data_wait)
        signals.progress(state.step)  # rank 0 tells the run's coordinator: what a restart redoes

        # nanochat's GC handling: the collector scans often and finds little; freeze after setup.
        if state.step == first_step:
            gc.collect()
            gc.freeze()
            gc.disable()
            if w.compile_cache is not None:  # the first compiled step is done: a restart needs no compile
                w.compile_cache.save()
        elif state.step % 5000 == 0:
            gc.collect()
        state.step += 1

        # a planned resize or a preemption notice heard in this step's all-reduce: save now (at the
        # last step the final save follows; its evaluation may outlast a notice: the memory tier's
        # replica of the last step, taken before it, is what a restart then resumes from)
        if (signals.preempt_requested or signals.resize_requested) and state.step < num_iterations:
            with clock("checkpoint"):
                saved = save_on_request(w, state, signals)
            if not saved:
                stop_on_nan(w, "Weights are not finite", state.step)
                break
