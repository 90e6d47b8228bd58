"""The function every Ray Train worker runs: nanochat's base_train loop, world-size-independent.

Each optimizer step consumes the same global rows whatever the number of workers: rank r takes its
share of rows (R//W or R//W+1), the loss is summed and divided by the global token count, and the
optimizer SUM-reduces gradients, so 1 worker and 8 workers compute the same update. Everything a
resume needs (model, optimizer, loader cursor, loop state) goes into each checkpoint, so Ray can
restart the group at any size. `setup` (raychat.worker.setup) builds what the loop runs on: the
worker's components `w`, its loop state and its fault tolerance `ft` (raychat.worker.fault_tolerance:
saves, memory replicas, resizes and spot notices); the step itself is plain PyTorch
(raychat.worker.step). The loop below reads top to bottom, each block a named function above it.
"""

import gc
import math
import resource
from typing import Any

import ray.train
import torch

from raychat.checkpoint.fence import Fence, LeaseLost
from raychat.checkpoint.meta import LoopState
from raychat.checkpoint.stop_note import StopNote, read_stop_note, write_stop_note
from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.data.validation import pack_validation_rows
from raychat.elastic.coordinator import FinalResult
from raychat.evaluation.bpb import evaluate_bpb
from raychat.model.compile_check import seconds_compiling
from raychat.model.flops import mfu as compute_mfu
from raychat.model.generate import SAMPLE_PROMPTS, generate
from raychat.ray_glue.quiet import quiet_ray
from raychat.storage import Storage
from raychat.telemetry.metrics import StepMetrics, counts_toward_total_time, eta_seconds, smooth_loss
from raychat.worker.components import Worker, WorkerRunConfig
from raychat.worker.core_metric import core_due, evaluate_core
from raychat.worker.fault_tolerance import FaultTolerance
from raychat.worker.setup import setup
from raychat.worker.step import train_step


class Validation:
    """This rank's share of the run's fixed validation rows: the first --eval-tokens of the val split
    packed as by one worker, row i evaluated by rank i % W. The same rows and so the same bpb for
    the same weights at any world size; read and packed in this process (raychat.data.validation)
    at the attempt's first evaluation, then reused."""

    def __init__(self, w: Worker):
        self.w = w
        self._rows: torch.Tensor | None = None

    def rows(self) -> torch.Tensor:
        w = self.w
        if self._rows is None:
            wanted = max(w.world_size, w.cfg.eval_tokens // w.cfg.max_seq_len)
            rows = pack_validation_rows(w.index, w.tokenizer_dir, w.cfg.max_seq_len, wanted,
                                        min_rows=w.world_size)
            if len(rows) < wanted:
                w.log(f"Validation: the val split's {w.index.num_val_docs:,} documents fill {len(rows):,} "
                      f"rows ({len(rows) * w.cfg.max_seq_len:,} tokens), fewer than --eval-tokens "
                      f"{w.cfg.eval_tokens:,}: each evaluation reads the split once")
            self._rows = torch.from_numpy(rows[w.rank::w.world_size].copy())
        return self._rows

    def evaluate(self, state: LoopState) -> float:
        """Validation bpb over --eval-tokens (all ranks), logged like nanochat."""
        w = self.w
        batches = ((chunk[:, :-1], chunk[:, 1:]) for chunk in self.rows().split(w.plan.device_batch_size))
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


def stop_on_nan(w: Worker, what: str, step: int) -> None:
    """Every rank sees the same global loss and weights, so all stop together. The save in flight
    holds the state from before: finish it, so the last good checkpoint is whole."""
    w.saver.finish()
    w.log(f"{what} at step {step}: stopping")
    # A superseded group's note would stop the new driver's run: only the run's writer leaves one.
    if w.master and w.saver.fence.newer() is None:
        write_stop_note(w.storage_path, w.cfg.name, StopNote(reason="nan", session=w.session, step=step))


def log_step(w: Worker, state: LoopState, train_loss: float, lrm: float, dt: float, data_wait: float,
             compile_s: float) -> None:
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
        flops_so_far=(step + 1) * tokens * w.plan.flops_per_token, compile_s=compile_s))


def report(w: Worker, ft: FaultTolerance, state: LoopState, metrics: dict, last_step: bool) -> None:
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
        if ft.coordinator is not None:  # the driver's summary
            ray.get(ft.coordinator.finish.remote(FinalResult(
                step=state.step, tokens_so_far=tokens_so_far, min_val_bpb=state.min_val_bpb,
                total_training_time=state.total_training_time, core_metric=metrics.get("core_metric"),
                restarts=state.restarts, resizes=state.resizes, redone_steps=state.redone_steps,
                peak_memory_mib=metrics["peak_memory_mib"])))
    w.publisher.report(metrics, checkpoint=ft.newest_checkpoint() if w.master else None)


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _evaluations_due(cfg: TrainConfig, step: int, last_step: bool) -> tuple[bool, bool, bool]:
    """(val bpb, CORE, samples) due at `step`, before training it: every N steps and at the last."""
    return (last_step or _due(step, cfg.eval_every), core_due(cfg, step, last_step),
            last_step or (step > 0 and _due(step, cfg.sample_every)))


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
    attempt = setup(config)
    w, state, ft = attempt.worker, attempt.state, attempt.fault_tolerance
    try:
        _steps(w, state, ft)
    finally:
        # the step records the metrics log holds back, a failed attempt's too (a superseded
        # writer's are dropped): the ledger then needs no estimate of this attempt's last steps
        w.publisher.flush()
    w.saver.close()
    # Nothing else is waited for: Ray Train kills this process once the loop returns. The attempt
    # ended on its final save (or a stop), which storage holds whole, so a memory replica still being
    # sent holds no newer state than storage does, and the loader's reads ahead are not needed; a
    # hung holder would hold the run's end for up to HOLDER_CALL_S.
    if w.wandb:
        w.wandb.finish()


def _steps(w: Worker, state: LoopState, ft: FaultTolerance) -> None:
    """The step loop of one attempt, from the state `setup` restored to the last step or a stop."""
    cfg, num_iterations = w.cfg, w.plan.num_iterations
    first_step = state.step
    validation = Validation(w)
    # An attempt restarted after the final save (a node lost during the final report, a planned
    # resize at the last step) finds everything done: its final eval and CORE are in the checkpoint's
    # loop state, and the checkpoint is not written again. The memory tier's replica of the last
    # step is taken before the final evaluation: an attempt resumed from it evaluates again.
    done_before = (state.step >= num_iterations and w.saver.already_saved(state.step)
                   and state.final_evaluated)
    clock = w.publisher.clock  # the time ledger's causes outside steps (raychat.telemetry.ledger)
    while True:
        last_step = state.step >= num_iterations  # the driver refuses a resume past the horizon
        metrics: dict[str, Any] = {}
        ft.before_step(state, last_step)

        with clock("eval"):
            bpb_due, core_is_due, sample_due = _evaluations_due(cfg, state.step, last_step)
            # once in a while: evaluate the val bpb (all ranks participate)
            if done_before:
                metrics["val_bpb"] = state.val_bpb
                if state.core_metric is not None:
                    metrics["core_metric"] = state.core_metric
            elif bpb_due:
                metrics["val_bpb"] = validation.evaluate(state)
            # once in a while: estimate the CORE metric (all ranks participate)
            if core_is_due and not done_before:
                metrics.update(evaluate_core(w, state))
            # once in a while: sample from the model (rank 0 only)
            if w.master and not done_before and sample_due:
                sample(w, state.step)
            state.final_evaluated = last_step

        # save a checkpoint: on the cadence and at the end; the writer works in the background
        if ft.save_due(state.step, last_step) and not ft.save(state, wait=last_step):
            stop_on_nan(w, "Weights are not finite", state.step)
            break

        # report to Ray Train (and Tune) whenever there is something to report: a barrier
        if metrics or last_step:
            report(w, ft, state, metrics, last_step)
        if last_step:
            break

        # single training step: gradients over this rank's micro-batches, all-reduced, one optimizer
        # step. Its all-reduce also carries the flags every rank must agree on (a save due at the
        # next step, a resize or a preemption notice): the step's one host sync serves them too.
        next_step = state.step + 1  # an evaluation or the last step next: a notice's save goes first
        busy_next = any(_evaluations_due(cfg, next_step, next_step >= num_iterations))
        compiled_before = seconds_compiling()
        result = train_step(w, state.step, also_sum=ft.flags(state.step, busy_next))
        compile_s = seconds_compiling() - compiled_before
        ft.after_step(state, result)
        if not math.isfinite(result.loss):
            stop_on_nan(w, f"Loss is {result.loss}", state.step)
            break

        # logging
        log_step(w, state, result.loss, result.lrm, result.dt, result.data_wait, compile_s)
        ft.step_logged(state)

        # nanochat's GC handling: the collector scans often and finds little; freeze after setup.
        if state.step == first_step:
            gc.collect()
            gc.freeze()
            gc.disable()
        elif state.step % 5000 == 0:
            gc.collect()
        state.step += 1

        # a planned resize or a preemption notice heard in this step's all-reduce: save now (at the
        # last step the final save follows; its evaluation may outlast a notice: the memory tier's
        # replica of the last step, taken before it, is what a restart then resumes from)
        if ft.save_requested(state) and not ft.save_on_request(state):
            stop_on_nan(w, "Weights are not finite", state.step)
            break
