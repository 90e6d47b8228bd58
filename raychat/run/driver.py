"""The driver of one raychat run, shared by `python -m raychat.train` and every `tune.sweep` trial.

A run goes through the same four stages whoever drives it:
  prepare_run  paths resolved into the config once; precision, compile, storage, corpus (its index
               built once, from the shards' footers), tokenizer, eval bundle, the plan and the
               checkpoint to resume from (or nanochat's weights to start from), all checked before
               any worker starts
  connect_ray  join the cluster (RAY_ADDRESS, `ray job submit`) or start a local Ray instance
  fit_run      Ray Train's TorchTrainer (its process group: Ray's TorchConfig), with the stop
               note cleared before and read after; a user error raised inside a worker comes back
               as its own one line
  summary      what the run reached (min val bpb, steps, tokens, time, restarts, memory, checkpoint)
The workers get the resolved config, the plan and corpus index computed here, the run's session and
the checkpoint to resume from: nothing they would have to resolve again differently.
"""

import os
import signal
import threading
from collections.abc import Callable

import ray
from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, Result, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

from raychat.checkpoint.catalog import highest_sequence, latest_valid_checkpoint
from raychat.checkpoint.format import lineage_suffix
from raychat.checkpoint.stop_note import clear_stop_note, read_stop_note
from raychat.common import (
    RaychatError,
)
from raychat.config import TrainConfig
from raychat.elastic.controller import (
    FreshClusterView,
    NoteRestart,
    PlannedResizeSave,
    RecordReservation,
    grow_when_it_pays,
    release_stale_reservation,
)
from raychat.elastic.coordinator import (
    FinalResult,
    coordinator_name,
    end_coordinator_taken_over,
    final_result,
    start_coordinator,
    stop_coordinator,
)
from raychat.elastic.lease import RunLease
from raychat.faults import retry_transient
from raychat.locations import is_uri, redact
from raychat.ray_glue.cluster_address import LOCAL
from raychat.ray_glue.quiet import VERBOSE_ENV, quiet_ray, verbose
from raychat.ray_glue.ray_internals import record_command_line_redacted, without_dataset_manager
from raychat.ray_glue.runtime_env import worker_runtime_env
from raychat.run.prepare import Log, PreparedRun, choose_checkpoint
from raychat.storage import Storage
from raychat.telemetry.console import install_driver_printer, plain_when_redirected
from raychat.worker.components import WorkerRunConfig
from raychat.worker.loop import train_loop_per_worker

# After a node loss Ray may size the restart from a view of the cluster that still has the node,
# then wait this long for it before retrying at the size that fits (Ray's default is 60 s). Read by
# the Train controller, to which the driver forwards RAY_TRAIN_* (bench/RESULTS.md, "Recovery").
ELASTIC_START_TIMEOUT_S = "5"
# How often Ray Train looks for drained nodes (a spot notice). Ray's 5 s default spends up to a sixth
# of a 30 s notice (GCP, Azure) before the workers hear of it, and the save on the notice must finish
# before the node goes; one GCS query a second per run costs nothing.
PREEMPTION_POLL_INTERVAL_S = "1"
# How often Ray Train's controller polls its workers: a dead worker is noticed, and a finished run
# ends, at the next poll. Ray's 2 s default cost every run seconds between its last report and its
# end, and every failure up to 2 s of detection (bench/RESULTS.md, "Start-up"). A poll is one small
# actor call per worker; a poll that hangs is waited on, not a failure (for 10 minutes).
HEALTH_CHECK_INTERVAL_S = "0.5"


def connect_ray(cfg: TrainConfig) -> bool:
    """Join the cluster named by RAY_ADDRESS (set by `ray job submit`), else start a local one sized
    for the run's workers; False where this process was connected already (its caller's Ray, which
    disconnect_ray leaves alone). --verbose keeps Ray's own chatter, here and in the workers
    (raychat.ray_glue.quiet)."""
    min_workers, max_workers = cfg.worker_range()
    # Before the runtime env below is built: it forwards RAY_TRAIN_* and RAYCHAT_* to the workers.
    if min_workers != max_workers:
        os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", ELASTIC_START_TIMEOUT_S)
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", PREEMPTION_POLL_INTERVAL_S)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", HEALTH_CHECK_INTERVAL_S)
    if cfg.verbose:
        os.environ[VERBOSE_ENV] = "1"
    plain_when_redirected()
    quiet_ray(main_is_raychat=True)
    if ray.is_initialized():
        install_driver_printer()
        return False
    # Workers are started by the cluster's raylets, not by this process: pass our settings along
    # (never credentials: Ray shows the runtime env in its job list, and this command line).
    runtime_env = worker_runtime_env(os.environ)
    record_command_line_redacted(redact)
    joined = bool(os.environ.get("RAY_ADDRESS"))
    if joined:
        context = ray.init(runtime_env=runtime_env, log_to_driver=True)
    else:
        # Logical CPUs: one per worker plus room for Ray Data's read/tokenize tasks; threads are
        # sized by the workers themselves. "local": a new instance, never the cluster the machine's
        # last `ray start` recorded in /tmp/ray/ray_current_cluster, which Ray would otherwise join
        # (and refuse num_cpus for), or fail to reach when that cluster is gone. Joining one is
        # what RAY_ADDRESS is for.
        cpus = max(os.cpu_count() or 1, max_workers) + 2
        context = ray.init(address=LOCAL, num_cpus=cpus, include_dashboard=True, dashboard_host="127.0.0.1",
                           log_to_driver=True, runtime_env=runtime_env)
    install_driver_printer()
    print(ray_line(context.address_info.get("gcs_address", ""), context.dashboard_url, joined), flush=True)
    return True


def disconnect_ray() -> None:
    """Leave the cluster (or stop the local instance) connect_ray joined, once the run is over. Ray
    does it at exit as well, but only after sleeping 0.5 s for the workers' last log lines, which a
    finished run no longer needs: its workers printed theirs before returning from the loop, and
    fit() returned only after Ray Train saw that at its next poll and ended the group."""
    ray.shutdown()


def ray_line(address: str, dashboard: str | None, joined: bool) -> str:
    """raychat's one line about Ray, in place of Ray's own (raychat.ray_glue.quiet): the cluster, its
    dashboard and, where token authentication is on (a local Ray's default), how to get the token the
    dashboard asks for."""
    where = f"joined the cluster at {address}" if joined else "started a local instance"
    line = f"Ray: {where}"
    if dashboard:
        line += f"; dashboard {dashboard if '://' in dashboard else 'http://' + dashboard}"
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":  # set by ray.init for a local Ray
            line += " (it asks for the cluster's token: `ray get-auth-token` prints it)"
    return line


def scaling_config(cfg: TrainConfig) -> ScalingConfig:
    """Workers, their resources and placement: GPUs per worker auto-detected from the cluster."""
    min_workers, max_workers = cfg.worker_range()
    gpus = cfg.gpus_per_worker
    if gpus < 0:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    resources = {"CPU": cfg.cpus_per_worker if cfg.cpus_per_worker > 0 else 1.0}
    if gpus > 0:
        resources["GPU"] = gpus
    return ScalingConfig(
        num_workers=(min_workers, max_workers) if min_workers != max_workers else max_workers,
        use_gpu=gpus > 0,
        resources_per_worker=resources,
        placement_strategy=cfg.placement_strategy,
        elastic_resize_monitor_interval_s=cfg.resize_check_every,
    )


def process_group(cfg: TrainConfig) -> TorchConfig:
    """The workers' torch.distributed group, as Ray's TorchTrainer sets it up (NCCL on GPUs, gloo
    otherwise, env:// rendezvous), with raychat's collective timeout."""
    return TorchConfig(timeout_s=cfg.process_group_timeout_s)


def ray_storage(location: str) -> dict:
    """Ray Train's storage settings for `location`. Ray shows its run settings in the dashboard's
    state API, so a URI (which may carry credentials) reaches it as a filesystem object and a bare path."""
    if not is_uri(location):
        return {"storage_path": location}
    storage = Storage(location)
    return {"storage_path": storage.root, "storage_filesystem": storage.fs}


def train_logging() -> LoggingConfig:
    """Ray Train's own lines on the console at WARNING and above unless --verbose: its controller and
    workers narrate every attempt at INFO (resource requests, state transitions, the worker group and
    its list, the failure policy's retry), which raychat says in one line per attempt. Ray Train's
    system log files in the session directory keep every level."""
    return LoggingConfig(log_level="INFO" if verbose() else "WARNING")


class RaychatTrainer(TorchTrainer):
    """Ray Train's TorchTrainer (its process group: Ray's TorchConfig, NCCL on GPUs, gloo otherwise),
    less the Ray Data manager it would start on every attempt for datasets raychat never hands it: one
    process less on every start's and restart's path. Nothing public leaves it out; the override of
    Ray's private hook and why are in raychat.ray_glue.ray_internals.without_dataset_manager."""

    def _create_default_callbacks(self) -> list:
        return without_dataset_manager(super()._create_default_callbacks(), self.datasets)

    def _initialize_and_run_controller(self, **controller_kwargs) -> Result:
        """An elastic run grows only when that pays (raychat.elastic.controller.GrowWhenItPays)."""
        if self.scaling_config.elasticity_enabled:  # (bench.gpu's process-group check runs a plain function)
            config = WorkerRunConfig.from_dict(self.train_loop_config, where="train_loop_config")
            controller_kwargs = grow_when_it_pays(controller_kwargs, config.session,
                                                  always=config.train_config.grow == "always")
        return super()._initialize_and_run_controller(**controller_kwargs)


def build_trainer(run: PreparedRun, *, callbacks: list | None = None,
                  run_config_overrides: dict | None = None) -> RaychatTrainer:
    """The trainer of one run. Checkpoints carry `run.session`, so a restarted worker group
    resumes from what this run wrote and a new run from the driver's choice; the run's coordinator
    actor (raychat.elastic.coordinator) is named after it."""
    # The dashboard's Train view (runs, attempts, workers) needs Ray Train's state tracking, which
    # is off by default in Ray 2.60 and read here, where the trainer is built.
    os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
    cfg = run.cfg
    start_coordinator(run.session)
    callbacks = list(callbacks or [])
    if len(set(cfg.worker_range())) > 1:  # elastic
        callbacks += [NoteRestart(run.session), PlannedResizeSave(run.session), FreshClusterView()]
    else:
        callbacks += [NoteRestart(run.session)]
    # NoteRestart before FreshClusterView: a restart is noticed when it begins, not after the re-read.
    callbacks += [RecordReservation(run.run_dir.location, run.lease_epoch)]
    # Rank 0 names each checkpoint to Ray Train without upload (raychat.telemetry.sinks.TrainReport). Ray
    # keeps them all (num_to_keep None): with a number, Ray deletes raychat's checkpoint directories;
    # raychat's saver prunes them (--keep-checkpoints).
    run_kwargs = dict(name=cfg.name, failure_config=FailureConfig(max_failures=cfg.max_failures),
                      checkpoint_config=CheckpointConfig(num_to_keep=None), callbacks=callbacks,
                      logging_config=train_logging(), **ray_storage(cfg.storage_path))
    run_kwargs.update(run_config_overrides or {})
    worker_config = WorkerRunConfig(
        train_config=cfg, plan=run.plan, corpus_index=ray.put(run.index),
        tokenizer_fingerprint=run.tokenizer.fingerprint, session=run.session, lease_epoch=run.lease_epoch,
        launched=run.launched, resume_from=run.resume_from.name if run.resume_from is not None else None,
        init_weights=ray.put(run.init_weights.state) if run.init_weights is not None else None,
        compile_checked=run.compile_checked, checkpoint_suffix=run.checkpoint_suffix)
    return RaychatTrainer(
        train_loop_per_worker,
        train_loop_config=worker_config.to_dict(),
        torch_config=process_group(cfg),
        scaling_config=scaling_config(cfg),
        run_config=RunConfig(**run_kwargs),
    )


def worker_error(error: BaseException) -> RaychatError | None:
    """The RaychatError a worker raised, if that is what ended the run."""
    failures = getattr(error, "worker_failures", None) or {}
    for failure in failures.values():
        seen = failure
        while seen is not None:
            if isinstance(seen, RaychatError):
                return seen
            seen = seen.__cause__ or getattr(seen, "cause", None)
        text = str(failure)
        marker = "RaychatError: "
        if marker in text:
            return RaychatError(text.split(marker, 1)[1].strip().splitlines()[0])
    return None


def stopped_by_error(run: PreparedRun) -> RaychatError | None:
    """The user error a worker of this run left in the stop note (raychat.worker.loop), if any."""
    note = read_stop_note(run.cfg.storage_path, run.cfg.name)
    if note is not None and note.of(run.session, "error"):
        return RaychatError(note.message)
    return None


def finished_result(run: PreparedRun, log: Log = print) -> FinalResult:
    """The result of a run that already reached its horizon (from its last checkpoint): re-running
    it trains nothing and rewrites no checkpoint."""
    meta = run.resume_meta
    log(f"Run {run.run_dir} already reached its horizon ({run.resume_from.name}, step {meta.step:,} of "
        f"{run.plan.num_iterations:,}): nothing to train; raise the horizon to train on")
    loop = meta.loop_state
    return FinalResult(step=meta.step, tokens_so_far=meta.step * run.plan.total_batch_size,
                       min_val_bpb=loop.min_val_bpb, total_training_time=loop.total_training_time,
                       core_metric=loop.core_metric)


def final_report(run: PreparedRun) -> dict:
    """The metrics of the final report (raychat.worker.loop.report, train_done=True) of a run already at
    its horizon, from its last checkpoint: the final save follows the final evaluation and CORE, so
    its loop state holds them (as an attempt restarted after the final save reports them). For a
    caller that records the run's reports (a Tune trial) when `fit_run` trained nothing: the run may
    have made its final save after the caller stopped listening (a sweep interrupted then), so the
    final report was never recorded."""
    meta, plan = run.resume_meta, run.plan
    loop = meta.loop_state
    tokens = meta.step * plan.total_batch_size
    metrics = dict(step=meta.step, world_size=meta.world_size, tokens_so_far=tokens,
                   flops_so_far=tokens * plan.flops_per_token, min_val_bpb=loop.min_val_bpb,
                   total_training_time=loop.total_training_time, checkpoint_step=meta.step, train_done=True,
                   restarts=loop.restarts, resizes=loop.resizes, redone_steps=loop.redone_steps)
    if loop.val_bpb is not None:
        metrics["val_bpb"] = loop.val_bpb
    if loop.core_metric is not None:
        metrics["core_metric"] = loop.core_metric
    return metrics


def hold_run(run: PreparedRun, log: Log = print) -> RunLease:
    """Take the run's lease (the next epoch, created atomically: raychat.elastic.lease), then choose
    again under it what to resume from: the choice made before the run was held may be stale (a
    driver it took over from went on saving while it waited). The choice is recorded in the lease,
    so checkpoints an older epoch writes after this point (a superseded writer's late save, an
    abandoned branch) are never chosen or kept."""
    lease = RunLease(run.run_dir, on_lost=_interrupt_fit(run),
                     coordinator=(ray.get_runtime_context().namespace, coordinator_name(run.session)))
    lease.acquire(floor=lambda: highest_sequence(run.run_dir), log=log)
    try:
        chosen = run.resume_from.name if run.resume_from is not None else None
        now = choose_checkpoint(run.cfg, run.tokenizer, run.index, run.plan, log=lambda _: None)
        if (now[0].name if now is not None else None) != chosen:
            log(f"Run {run.run_dir} moved on while this driver waited for it: resuming from "
                f"{now[0].name if now is not None else 'the start'} instead of {chosen or 'the start'}")
            run.resume_from, run.resume_meta = now or (None, None)
            if run.resume_from is not None:
                run.init_weights = None
        # Only a rewind the user asked for may disown checkpoints above it. A fallback from damaged
        # newer checkpoints (a restore still copying them) resumes below them without a rewind: they
        # stay off the branch, for --resume-from-step once whole, until the branch's prunes pass them.
        rewound = run.cfg.resume_from_step >= 0 and run.resume_meta is not None
        lease.record_resume(run.resume_meta.sequence if rewound else lease.record.floor)
        if run.resume_meta is not None and run.resume_meta.sequence < lease.record.floor:
            # Below the newest checkpoint: this run's saves reach steps the run has checkpoints at
            # (the branch it rewound from, one still being restored), which are never written over.
            run.checkpoint_suffix = lineage_suffix(lease.epoch)
    except BaseException:
        lease.release()
        raise
    run.lease_epoch = lease.epoch
    return lease


def forget_ray_checkpoints(run: PreparedRun) -> None:
    """Drop Ray Train's list of the checkpoints an earlier fit of this run named (its snapshot, in the
    run's directory): raychat has pruned some of them since, and Ray refuses to start a run whose
    snapshot names a checkpoint that is gone. What a run resumes from is raychat's storage's to say;
    this fit names its own checkpoints."""
    retry_transient(lambda: run.run_dir.delete(CHECKPOINT_MANAGER_SNAPSHOT_FILENAME),
                    f"removing Ray Train's checkpoint list from {run.run_dir}")


def _interrupt_fit(run: PreparedRun) -> Callable[[str], None] | None:
    """What the lease does when it finds itself superseded: a driver training in its main thread
    gets Ray Train's own Ctrl-C while `trainer.fit()` runs (its handler aborts the controller and
    with it the workers); under Tune (a trial's thread) the workers stop at their next save, when
    they check the lease themselves."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(_: str) -> None:
        if run.fitting:
            os.kill(os.getpid(), signal.SIGINT)

    return interrupt


def fit_run(run: PreparedRun, callbacks: list | None = None) -> FinalResult:
    """Train the run to its end; what it reached. A user error from a worker, a NaN stop, or the
    loss of the run's lease to another driver comes back as one RaychatError line. The run's
    coordinator and its replica holders end with it, whichever way it ends."""
    if run.finished:
        return finished_result(run)
    try:
        return _fit(run, callbacks)
    finally:
        stop_coordinator(run.session)


def _fit(run: PreparedRun, callbacks: list | None) -> FinalResult:
    lease = hold_run(run)
    try:
        release_stale_reservation(run.run_dir, lease.taken_over)
        end_coordinator_taken_over(lease.taken_over)
        if run.finished:  # the driver it took over from reached the horizon meanwhile
            return finished_result(run)
        trainer = build_trainer(run, callbacks=callbacks)
        clear_stop_note(run.cfg.storage_path, run.cfg.name)
        forget_ray_checkpoints(run)
        try:
            run.fitting = True
            run.result = trainer.fit()
        except (Exception, KeyboardInterrupt, SystemExit) as e:  # Ray wraps worker errors: one line
            if lease.lost is not None:  # (Ray's Ctrl-C handler exits 0 if the controller is gone)
                raise RaychatError(lease.lost) from None
            user_error = stopped_by_error(run) or worker_error(e)
            if user_error is not None:
                raise user_error from None
            raise
        finally:
            run.fitting = False
        lease.check()  # the workers stopped because another driver holds the run: say so
    finally:
        lease.release()
    user_error = stopped_by_error(run)
    if user_error is not None:
        raise user_error
    stop = read_stop_note(run.cfg.storage_path, run.cfg.name)
    if stop is not None and stop.of(run.session, "nan"):
        raise RaychatError(f"loss or weights became NaN/inf at step {stop.step}: training stopped; the "
                           f"last good checkpoint is kept in {run.run_dir} (lower the learning rates or "
                           "check the data, then re-run to resume)")
    result = final_result(run.session)
    if result is None:  # every way a run ends without its last report raised above
        raise RuntimeError(f"the workers of run {run.run_dir} ended without reporting its last step")
    return result


def summary_lines(run: PreparedRun, result: FinalResult, wall_seconds: float) -> list[str]:
    """The end-of-run summary the CLI prints."""
    lines = [
        "Training done.",
        f"  min val bpb     : {result.min_val_bpb:.6f}",
        f"  steps           : {result.step:,}",
        f"  tokens trained  : {result.tokens_so_far:,}",
        f"  training time   : {result.total_training_time / 60:.2f}m (wall {wall_seconds / 60:.2f}m)",
    ]
    if result.core_metric is not None:
        lines.append(f"  CORE metric     : {result.core_metric:.4f}")
    if result.restarts or result.resizes:
        lines.append(f"  restarts        : {result.restarts} ({result.redone_steps} steps redone), planned "
                     f"resizes: {result.resizes}")
    if result.peak_memory_mib:
        lines.append(f"  peak memory     : {result.peak_memory_mib:,.0f} MiB (rank 0)")
    final = latest_valid_checkpoint(run.run_dir, deep=False)
    if final is not None:
        lines.append(f"  checkpoint      : {final}")
    return lines
