"""What a worker computes with, and what the driver hands every worker: built once per attempt by
raychat.worker.setup, read by the loop and the fault tolerance beside it, changed by neither.
"""

from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist

from raychat.checkpoint.saver import CheckpointSaver
from raychat.config import TrainConfig
from raychat.corpus.index import CorpusIndex, CorpusRecord
from raychat.data.loader import TrainLoader
from raychat.optim.base import ShardedOptimizer
from raychat.records import Record
from raychat.scaling import Plan
from raychat.telemetry.console import log_line
from raychat.telemetry.metrics import Publisher
from raychat.telemetry.sinks import WandbLogger
from raychat.tokenizer.core import Tokenizer


@dataclass
class WorkerRunConfig(Record):
    """What the driver hands every worker of a run through Ray Train's train_loop_config (as a dict:
    Ray Train keeps it in its run state), read back as this record by `train_loop_per_worker`."""

    train_config: TrainConfig  # resolved paths; locations pickle with their credentials (SafeLocation)
    plan: Plan  # at the largest world size of the range; each group deals it to its own size
    # Where the index is, not the index (megabytes for a real corpus): the workers get it from the
    # object store and check its identity.
    corpus_index: ray.ObjectRef
    tokenizer_fingerprint: str  # every rank must load this one
    session: str  # the driver's run: its coordinator's name, and which checkpoints a restart prefers
    lease_epoch: int  # checked before every save and prune (raychat.checkpoint.fence)
    launched: float  # the time ledger's start (raychat.telemetry.ledger)
    resume_from: str | None  # the checkpoint the driver chose
    init_weights: ray.ObjectRef | None  # nanochat's state, through the object store: no file on the workers
    compile_checked: bool  # torch.compile already probed on the workers' device type
    checkpoint_suffix: str = ""  # the names this run saves under (raychat.checkpoint.format.lineage_suffix)


@dataclass(frozen=True, eq=False)
class Worker:
    """The worker's components, built once by `setup`: what the loop computes with (model, optimizer,
    loader: see raychat.worker.step.StepComponents) and where its results go (saver, metrics, log)."""

    cfg: TrainConfig
    plan: Plan
    rank: int
    world_size: int
    device: torch.device
    tokenizer: Tokenizer
    index: CorpusIndex
    tokenizer_dir: str
    loader: TrainLoader
    orig_model: torch.nn.Module
    model: torch.nn.Module  # orig_model, compiled or not
    optimizer: ShardedOptimizer
    saver: CheckpointSaver
    storage_path: str
    session: str
    corpus_meta: CorpusRecord  # what made the corpus (source; Hub repo, revision), kept with each checkpoint
    micro_slices: list[slice]
    peak_flops: float
    publisher: Publisher  # where the run's records go out (every rank)
    wandb: WandbLogger | None = None  # rank 0's wandb run, finished when the attempt ends

    @property
    def master(self) -> bool:
        return self.rank == 0

    def log(self, message: str) -> None:
        if self.master:
            log_line(message)


def all_gather_objects(obj: Any, world_size: int) -> list[Any]:
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out
