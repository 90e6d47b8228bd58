"""What one Ray Train worker builds before its first step: the three things the loop runs on.

- `Worker` (raychat.worker.components): the model, optimizer, loader, saver and metrics sinks;
- `LoopState`: the step and the counters a resume restores, which the loop advances;
- `FaultTolerance` (raychat.worker.fault_tolerance): saves, memory replicas and the elastic signals
  (rank 0's handle on the run's coordinator, the requests to save now).

`setup` reads the run's config, agrees with the other ranks on the checkpoint to resume from (see
raychat.checkpoint.resume), starts the data loader on its cursor first (so Ray Data's start-up and the first
documents' tokenizing overlap building and restoring the model), builds the model, the optimizer
and the checkpoint saver, and tells the run's coordinator that an attempt started (raychat.elastic),
which logs why, if this is a restart. The train loop itself is in raychat.worker.loop.
"""

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray.train
import torch

from raychat.checkpoint.fence import Fence, LeaseLost
from raychat.checkpoint.meta import CheckpointMeta, LoopState
from raychat.checkpoint.resume import Restore, candidates
from raychat.checkpoint.saver import CheckpointSaver
from raychat.checkpoint.shardfile import io_count
from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.corpus.index import CorpusIndex, confirm_identity, corpus_record
from raychat.data.loader import TrainLoader
from raychat.elastic.coordinator import coordinator_name
from raychat.elastic.replicas import MemoryRestore, Replicator, peer_nodes, retain_only
from raychat.elastic.signals import ElasticSignals, describe_attempt
from raychat.memory import fit_plan_to_device
from raychat.model.compile_cache import CompileCache, cache_key, use_run_cache_dir
from raychat.model.compile_check import probe_compile, uses_compile
from raychat.model.flops import peak_flops
from raychat.model.gpt import build_model
from raychat.model.precision import configure_matmuls, resolve_precision
from raychat.optim.base import ShardedOptimizer
from raychat.optim.registry import optimizer_spec
from raychat.ray_glue.nccl_transport import NcclReport
from raychat.scaling import Plan, rank_rows
from raychat.storage import Storage
from raychat.telemetry.console import log_line
from raychat.telemetry.metrics import Publisher
from raychat.telemetry.metrics_log import MetricsLog
from raychat.telemetry.sinks import LogLines, RayMetrics, TrainReport, WandbLogger
from raychat.tokenizer.core import Tokenizer, check_vocab
from raychat.worker.components import Worker, WorkerRunConfig, all_gather_objects
from raychat.worker.fault_tolerance import FaultTolerance
from raychat.worker.observer import load_observer
from raychat.worker.state import Share, apply_share, read_share
from raychat.worker.step import micro_slices


def cpu_threads(usable_cores: int, node_cpus: float | None, local_world_size: int) -> int:
    """Torch threads for each of a node's `local_world_size` CPU workers: they share the cores this
    process may run on (a container or taskset can limit them), but no more than the CPUs the node
    declared to Ray: nodes that share a machine (ray.cluster_utils' test clusters, several raylets in
    one VM) each declare their part, and threads beyond it oversubscribe the cores the others use
    (steps of a 3-node cluster on 2 cores: 10% slower). Ray would otherwise leave one thread each."""
    cores = min(usable_cores, max(1, int(node_cpus))) if node_cpus else usable_cores
    return max(1, cores // local_world_size)


def _node_cpus() -> float | None:
    """The CPUs this process's node declared to Ray (None: not found, or the GCS did not answer: the
    thread count is not worth failing an attempt for)."""
    try:
        node_id = ray.get_runtime_context().get_node_id()
        return next((n["Resources"].get("CPU") for n in ray.nodes() if n["NodeID"] == node_id), None)
    except Exception:  # noqa: BLE001 -- see the docstring
        return None


def _set_cpu_threads(local_world_size: int) -> None:
    torch.set_num_threads(cpu_threads(len(os.sched_getaffinity(0)), _node_cpus(), local_world_size))


@dataclass
class _Rank:
    """Where this worker stands in the group, and its logger (rank 0 prints)."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    def log(self, message: str) -> None:
        if self.rank == 0:
            log_line(message)

    def gather(self, obj: Any) -> list[Any]:
        return all_gather_objects(obj, self.world_size)


def _this_rank() -> _Rank:
    ctx = ray.train.get_context()
    me = _Rank(ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_world_size(),
               ray.train.torch.get_device())
    if me.device.type == "cpu":
        _set_cpu_threads(me.local_world_size)
    return me


def _the_drivers_tokenizer(directory: str, fingerprint: str, where: str) -> Tokenizer:
    """The tokenizer at `directory`, which must be the one the driver checked: node-local copies
    made at different times differ, and a rank with another vocabulary trains on other tokens."""
    tokenizer = Tokenizer.load(directory)
    if tokenizer.fingerprint != fingerprint:
        raise RaychatError(f"{where} loads another tokenizer from {directory} than the driver checked "
                           f"(fingerprint {tokenizer.fingerprint[:12]}, the driver's {fingerprint[:12]}): "
                           "every node must have the same tokenizer directory (copy the driver's to every "
                           "node)")
    return tokenizer


def _agree_on_restore(config: WorkerRunConfig, run: Storage, tokenizer: Tokenizer, me: _Rank) -> Restore:
    """The checkpoint every rank resumes from (rank 0 decides), its vocabulary checked."""
    mine = candidates(run, config.session, config.resume_from) if me.rank == 0 else None
    names = me.gather(mine)[0]
    restore = Restore(run, names, me.gather, me.log)
    if restore.meta is not None:
        check_vocab(tokenizer, restore.meta.vocab_size, restore.meta.tokenizer_fingerprint,
                    str(restore.checkpoint))
    return restore


def _replica_holders(config: WorkerRunConfig, node_of_rank: list[str], me: _Rank
                     ) -> tuple[list[Any], dict[str, Any]]:
    """The run's replica holders (raychat.elastic.replicas): those earlier groups started, which may keep
    the set to resume from, and all of them by node once rank 0 has started one on each of this
    group's nodes that has none (unless --replicate-every is -1). New holders keep nothing: a first
    attempt asks none of them."""
    coordinator = ray.get_actor(coordinator_name(config.session))
    earlier = ray.get(coordinator.replica_holders.remote([])) if me.rank == 0 else None
    if me.rank == 0 and config.train_config.replicate_every >= 0:
        ray.get(coordinator.replica_holders.remote(node_of_rank))
    earlier = me.gather(list(earlier) if earlier is not None else None)[0]  # after rank 0 started them
    everyone = ray.get(coordinator.replica_holders.remote([]))
    return [everyone[node] for node in earlier], everyone


def _replicator(config: WorkerRunConfig, holders: dict[str, Any], node_of_rank: list[str], attempt: int,
                me: _Rank) -> Replicator | None:
    """This rank's sender to its own node's holder and its peer node's (none on a one-node group), or
    None with --replicate-every -1."""
    every = config.train_config.replicate_every
    if every < 0:
        return None
    peer = peer_nodes(node_of_rank)[me.rank]
    def warn(message: str) -> None:  # from any rank: the peer holder of rank 3 is as much the run's
        print(f"raychat: warning: rank {me.rank}: {message}", flush=True)

    return Replicator(holders[node_of_rank[me.rank]], holders[peer] if peer is not None else None,
                      config.lease_epoch, attempt, me.log, warn, every, sends_compete=me.device.type == "cpu",
                      saves_every=config.train_config.save_every)


def _loader_starter(cfg: TrainConfig, index: CorpusIndex, me: _Rank, record_documents: bool
                    ) -> Callable[[CheckpointMeta | None], TrainLoader]:
    """Starts this rank's loader on a checkpoint's cursor (None: the start of the corpus)."""

    def start(meta: CheckpointMeta | None) -> TrainLoader:
        return TrainLoader(index, cfg.tokenizer_dir, cfg.max_seq_len, me.rank, me.world_size,
                           cursor=meta.cursor if meta else None,
                           shuffle_seed=cfg.shuffle_seed if cfg.shuffle_seed >= 0 else None,
                           data_tasks=max(1, int(cfg.cpus_per_worker)), record_consumed=record_documents)

    return start


def _build_model_and_optimizer(cfg: TrainConfig, plan: Plan, device: torch.device, use_compile: bool
                               ) -> tuple[torch.nn.Module, torch.nn.Module, ShardedOptimizer, str]:
    """(model, model compiled or not, the --optimizer over it, the precision's name)."""
    torch.manual_seed(cfg.seed)  # same seed on every rank: identical initial weights without a broadcast
    precision = resolve_precision(cfg.dtype, cfg.fp8, cfg.fp8_recipe, device)
    configure_matmuls(device)
    orig_model = build_model(plan.model, device, precision)
    model = torch.compile(orig_model, dynamic=False) if use_compile else orig_model
    optimizer = optimizer_spec(cfg.optimizer).build(orig_model, cfg, plan)
    return orig_model, model, optimizer, precision.name


@dataclass(frozen=True)
class AttemptStarted:
    """What rank 0 learnt from the run's coordinator as this attempt started (other ranks: nothing)."""

    signals: ElasticSignals  # rank 0's line to the coordinator
    number: int = 0  # how many attempts came before this one
    # When the attempt before it was noticed to have ended and its last step, for the time ledger
    # (raychat.telemetry.ledger); None on other ranks and on a first attempt.
    times: dict[str, float | int | None] = field(default_factory=dict)


def _start_attempt(config: WorkerRunConfig, state: LoopState, resumed_from: str | None, me: _Rank,
                   setup_started: float) -> AttemptStarted:
    """Rank 0 tells the run's coordinator an attempt started, logs why if it is a restart and counts it."""
    if me.rank != 0:
        return AttemptStarted(ElasticSignals())
    coordinator = ray.get_actor(coordinator_name(config.session))
    previous = ray.get(coordinator.start_attempt.remote(state.step, me.world_size, config.plan.num_iterations,
                                                        setup_started))
    start = describe_attempt(previous, state.step, me.world_size, resumed_from)
    if start.line:
        me.log(start.line)
    state.restarts += start.kind == "failure"
    state.resizes += start.kind == "planned"
    state.redone_steps += start.redone_steps
    return AttemptStarted(ElasticSignals(coordinator), previous.attempt,
                          {"noticed": previous.noticed, "last_progress": previous.last_progress,
                           "last_progress_step": previous.last_step, "failed_starts": previous.failed_starts})


def _publisher(me: _Rank, cfg: TrainConfig, plan: Plan, run: Storage, fence: Fence, wandb: WandbLogger | None,
               state: LoopState, start: dict[str, Any], carried: list[str]) -> Publisher:
    """Rank 0's sinks (gauges, wandb, the run's metrics log, which records this attempt's start:
    `start`, with the plan, for raychat.report and the time ledger); the other ranks only report to
    Ray Train. `carried`: the records a memory replica brought (what rank 0 held back when it was
    taken), written before the start."""
    if me.rank != 0:
        return Publisher([LogLines(me.log), TrainReport()])
    # The log's fence check gives up at once on a storage fault: the log retries at its next flush.
    metrics_log = MetricsLog(run, Fence(run, fence.epoch, budget_s=0), carried=carried)
    sinks = [LogLines(me.log), RayMetrics(run_name=cfg.name), wandb, metrics_log, TrainReport()]
    publisher = Publisher(sinks)
    publisher.start(metrics_log.earlier, step=state.step, world_size=me.world_size, restarts=state.restarts,
                    resizes=state.resizes, redone_steps=state.redone_steps, plan=plan.to_json(),
                    config=cfg.to_public_dict(), **start)
    return publisher


def _fit_to_device(plan: Plan, cfg: TrainConfig, me: _Rank, use_compile: bool) -> Plan:
    """On a GPU: --device-batch-size -1 fitted to its memory, and a line when the plan's estimate does
    not fit it (the driver's machine may have no GPU to check against). CPUs keep the plan's."""
    if me.device.type != "cuda":
        return plan
    compute_bytes = resolve_precision(cfg.dtype, cfg.fp8, cfg.fp8_recipe, me.device).dtype.itemsize
    device_bytes = torch.cuda.get_device_properties(me.device).total_memory
    plan, lines = fit_plan_to_device(plan, device_bytes, torch.cuda.get_device_name(me.device), compute_bytes,
                                     use_compile, cfg)
    for line in lines:
        me.log(line)
    return plan


@dataclass(frozen=True)
class Attempt:
    """What the loop runs on for one attempt of the worker group (see the module)."""

    worker: Worker
    state: LoopState  # the step and counters restored, which the loop advances
    fault_tolerance: FaultTolerance


def setup(config: WorkerRunConfig) -> "Attempt":
    """This rank's components, the loop state to start from and its fault tolerance.

    The resume position comes first: with the cursor known the loader starts now, so Ray Data's
    start-up and the tokenizing of the packer's first documents overlap building and restoring the
    model."""
    setup_started = time.time()  # the time ledger's end of rescheduling and start of restore
    # Where the restore's time goes, every second of it from setup_started (the attempt's start
    # record; raychat.report shows the ledger, bench.goodput takes the undisturbed run's sum for a floor).
    phases: dict[str, float] = {}
    lap = [setup_started]

    def done(phase: str) -> None:
        now = time.time()
        phases[phase], lap[0] = round(now - lap[0], 3), now

    cfg = config.train_config
    me = _this_rank()
    nccl = NcclReport.watch(me.device.type, me.world_size, me.local_world_size, me.rank)  # before collectives
    use_compile = uses_compile(cfg.compile, me.device)
    run = Storage(cfg.storage_path).child(cfg.name)
    if use_compile and not cfg.no_compile_cache:
        use_run_cache_dir(run)  # before the probe compiles: inductor fixes its directory at first use
    if use_compile and not config.compile_checked:
        probe_compile(me.device)  # one line instead of a traceback at the first forward
    done("compile_probe")
    where = f"rank {me.rank} ({ray.util.get_node_ip_address()})"
    tokenizer = _the_drivers_tokenizer(cfg.tokenizer_dir, config.tokenizer_fingerprint, where)
    done("tokenizer")
    plan = config.plan.at_world_size(me.world_size)  # the driver's, dealt to this group
    plan = _fit_to_device(plan, cfg, me, use_compile)
    # A group Ray restarted after its driver lost the run's lease ends here, before it reads or
    # writes anything; rank 0 looks and every rank follows (raychat.checkpoint.fence).
    fence = Fence(run, config.lease_epoch)
    newer = me.gather(fence.newer() if me.rank == 0 else None)[0]
    nccl.report(me.log)  # that first collective made NCCL's communicator: its network is in the report now
    done("fence")  # the lease read and the group's first collective
    if newer is not None:
        raise LeaseLost(f"run {run} is held by a newer driver (lease epoch {newer}, this group's "
                        f"{fence.epoch}): this worker group stops without training")
    index: CorpusIndex = ray.get(config.corpus_index)   # the driver's, from the footers: no listing here
    confirm_identity(index, where)
    done("corpus_index")
    observer = load_observer()
    node_of_rank = me.gather(ray.get_runtime_context().get_node_id())
    earlier_holders, holders = _replica_holders(config, node_of_rank, me)
    done("holders")
    restore = _agree_on_restore(config, run, tokenizer, me)
    done("choose_checkpoint")
    # Peer memory first when it holds a whole set at least as new as the durable checkpoint: nothing
    # is read from storage then (raychat.elastic.replicas).
    durable_step = restore.meta.step if restore.meta is not None else 0
    if durable_step >= plan.num_iterations:  # the final checkpoint holds the final evaluation: it wins
        durable_step += 1
    memory = MemoryRestore.agree(earlier_holders, config.lease_epoch, durable_step, plan.model,
                                 me.rank, me.gather, me.log) if earlier_holders else None
    start_loader = _loader_starter(cfg, index, me, observer is not None and observer.records_documents)
    loader_meta = memory.meta if memory is not None else restore.meta
    done("choose_replicas")
    loader = start_loader(loader_meta)
    done("start_loader")

    compile_cache = None
    if use_compile and not cfg.no_compile_cache:  # filled from the run's before anything compiles
        precision_name = resolve_precision(cfg.dtype, cfg.fp8, cfg.fp8_recipe, me.device).name
        key = cache_key(plan.model, me.device, precision_name)
        compile_cache = CompileCache(run, key, me.log if me.rank == 0 else lambda _: None)
        compile_cache.load()
    orig_model, model, optimizer, precision = _build_model_and_optimizer(cfg, plan, me.device, use_compile)
    state = LoopState()
    done("build_model")

    def read(reader: Any) -> Share:
        return read_share(reader, orig_model, optimizer, me.world_size, me.rank)

    share = memory.load(read, holders.get(node_of_rank[me.rank])) if memory is not None else None
    source = memory if share is not None else restore
    if share is None:
        share = restore.load(read)
    # The saver's lineage goes on from the newest durable checkpoint whichever tier the state came from.
    resumed_from = restore.checkpoint.name if share is not None and restore.checkpoint is not None else None
    resumed_label = (source.checkpoint if source is memory else resumed_from) if share is not None else None
    carried = memory.log_tail if source is memory else []  # the records the killed attempt held back
    done("read_state")
    if earlier_holders and me.rank == 0:  # they keep the set resumed from, until this attempt has its own
        retain_only(earlier_holders, memory.key if source is memory else None)
    done("retain_replicas")
    if share is not None:
        if source.meta is not loader_meta:  # fell back from memory or to an older checkpoint: its cursor
            loader.close()
            loader = start_loader(source.meta)
        apply_share(share, orig_model, optimizer, me.world_size, me.device)
        del share
        state = dataclasses.replace(source.meta.loop_state, step=source.meta.step)
        saved_by = source.meta.world_size
        what = "replicas of" if source is memory else "saved by"
        origin = (f"Resumed from {source.checkpoint} at step {state.step} ({what} {saved_by} workers, "
                  f"now {me.world_size})")
    elif config.init_weights is not None:  # a new run from nanochat's weights (every attempt
        orig_model.load_state_dict(ray.get(config.init_weights), strict=True)  # until its first save)
        origin = "Starting from nanochat's weights at step 0"
    else:
        origin = "Starting at step 0 (no checkpoint)"
    done("apply_state")
    started = _start_attempt(config, state, resumed_label, me, setup_started)
    replicator = _replicator(config, holders, node_of_rank, me.gather(started.number)[0], me)
    done("start_attempt")

    slices = micro_slices(rank_rows(plan.rows_per_step, me.world_size, me.rank), plan.device_batch_size)
    peak, peak_source = peak_flops(me.device)
    if peak_source == "measured":
        gpu = torch.cuda.get_device_name(me.device)
        me.log(f"Peak bf16 FLOPS: {peak:.3e} (measured: {gpu} is not in the table)")
    saver = CheckpointSaver(run, cfg.keep_checkpoints, me.rank, me.world_size, me.log, parent=restore.meta,
                            parent_name=resumed_from, fence=fence, suffix=config.checkpoint_suffix)
    wandb = WandbLogger(cfg.run, config=cfg.to_public_dict(), run_dir=run) if me.rank == 0 else None
    done("components")
    # What this attempt's restore read from checkpoint files in storage, all ranks (0 from peer memory).
    start = dict(started.times, launched=config.launched, setup_started=setup_started, setup_phases=phases,
                 storage_read_bytes=sum(me.gather(io_count.read)), resumed_from=resumed_label,
                 precision=precision, device=str(me.device), peak_flops=peak, peak_flops_source=peak_source,
                 session=config.session)
    worker = Worker(
        cfg=cfg, plan=plan, rank=me.rank, world_size=me.world_size, device=me.device, tokenizer=tokenizer,
        index=index, tokenizer_dir=cfg.tokenizer_dir, loader=loader, orig_model=orig_model,
        model=model, optimizer=optimizer, storage_path=cfg.storage_path, session=config.session,
        corpus_meta=corpus_record(index), saver=saver, micro_slices=slices, peak_flops=peak,
        publisher=_publisher(me, cfg, plan, run, fence, wandb, state, start, carried), wandb=wandb,
    )
    attempt_id = me.gather(f"{time.time():.3f}")[0] if observer is not None else ""
    ft = FaultTolerance(worker, started.signals, replicator, state.step, observer, attempt_id,
                        compile_cache if me.rank == 0 else None)
    # The attempt's one line (Ray's own narration of it is silenced: raychat.ray_glue.quiet).
    nodes = len(set(node_of_rank))
    me.log(f"{origin}: training to step {plan.num_iterations} at world size {me.world_size} ({me.world_size} "
           f"worker(s) on {nodes} node(s)), {slices[-1].stop} rows/step on rank 0 in micro-batches "
           f"{[s.stop - s.start for s in slices]}, device {me.device}, {precision}")
    return Attempt(worker, state, ft)
