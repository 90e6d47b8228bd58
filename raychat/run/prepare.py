"""A run prepared by the driver: every check it can make, cheapest first, before Ray is started.

`prepare_run` resolves the paths into the config once and checks precision, compile, the settings and
endpoints, the storage, the eval bundle, the corpus (its index built once, from the shards' footers),
the tokenizer, the plan and the checkpoint to resume from (or nanochat's weights to start from). The
workers get what it computed (raychat.run.driver): nothing they would resolve again differently.
"""

import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.train import Result

from raychat.checkpoint.format import read_meta
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.nanochat import NanochatCheckpoint, load_nanochat_checkpoint
from raychat.checkpoint.resume import driver_choice
from raychat.common import (
    RaychatError,
    default_data_dir,
    default_storage_path,
    default_tokenizer_dir,
)
from raychat.config import TrainConfig
from raychat.corpus.check import summarize
from raychat.corpus.default import prepare_default_corpus
from raychat.corpus.index import CorpusIndex, check_checkpoint_corpus
from raychat.data.loader import check_cursor_fits
from raychat.elastic.lease import heartbeat_from_env
from raychat.evaluation.download import check_eval_bundle
from raychat.faults import check_settings
from raychat.locations import is_uri, normalize_location
from raychat.model.compile_check import check_compile
from raychat.model.precision import check_precision
from raychat.optim.registry import check_same_optimizer
from raychat.ray_glue.cluster_address import check_cluster_answers
from raychat.scaling import Plan, resolve_plan
from raychat.storage import Storage
from raychat.tokenizer.core import Tokenizer, check_vocab
from raychat.tokenizer.train import train_tokenizer

Log = Callable[[str], None]


@dataclass
class PreparedRun:
    """A run that passed every check the driver can make: what `fit_run` and the workers need."""

    cfg: TrainConfig  # data_dir, tokenizer_dir and storage_path absolute (or URIs)
    plan: Plan  # at the largest world size of the range
    tokenizer: Tokenizer
    index: CorpusIndex  # every shard's footer, read once here: the workers never list the corpus
    resume_from: Storage | None = None  # the checkpoint the driver chose (hashes verified)
    resume_meta: CheckpointMeta | None = None  # its metadata
    init_weights: NanochatCheckpoint | None = None  # --init-from-nanochat, for a run with nothing to resume
    compile_checked: bool = False  # torch.compile already probed on the workers' device type
    session: str = field(default_factory=lambda: uuid.uuid4().hex)  # this driver's run, new each time
    lease_epoch: int = 0  # the run lease's epoch this driver holds (set by `hold_run`): the workers' fence
    checkpoint_suffix: str = ""  # set by `hold_run` when the run resumes below its newest checkpoint
    fitting: bool = False  # trainer.fit() is running (the lease may interrupt it)
    launched: float = field(default_factory=time.time)  # when prepare_run began: the run's start-up from here
    result: Result | None = None  # Ray Train's, once fit: its `checkpoint` is the run's newest

    @property
    def finished(self) -> bool:
        """The checkpoint resumed from is at the end of the plan: nothing is left to train."""
        return self.resume_meta is not None and self.resume_meta.step == self.plan.num_iterations

    @property
    def run_dir(self) -> Storage:
        """`<storage_path>/<run name>`: the run's checkpoints, stop note and metrics."""
        return Storage(self.cfg.storage_path).child(self.cfg.name)


def resolve_paths(cfg: TrainConfig) -> TrainConfig:
    """The config with its defaults filled in and its paths made absolute, once, here: the workers,
    trials and checkpoints all read the same directories whatever their working directory."""
    return dataclasses.replace(
        cfg,
        data_dir=normalize_location(cfg.data_dir or str(default_data_dir())),  # a path or a bucket URI
        tokenizer_dir=normalize_location(cfg.tokenizer_dir or str(default_tokenizer_dir())),  # path or URI
        storage_path=normalize_location(cfg.storage_path or str(default_storage_path())),
    )


def prepare_inputs(cfg: TrainConfig, log: Log = print) -> tuple[Tokenizer, CorpusIndex]:
    """Corpus and tokenizer ready and valid (a local corpus and the tokenizer prepared when their
    directories are empty), with the corpus index, or a one-line error. `cfg` has resolved paths."""
    if not is_uri(cfg.data_dir) and not any(Path(cfg.data_dir).glob("shard_*.parquet")):
        log(f"No corpus in {cfg.data_dir}: preparing one")
        prepare_default_corpus(cfg.data_dir, log=log)
    index = CorpusIndex.load(cfg.data_dir)
    log(f"Corpus: {summarize(index)}")
    if is_uri(cfg.tokenizer_dir):  # a bucket's tokenizer is trained elsewhere and copied in
        return Tokenizer.load(cfg.tokenizer_dir), index
    tok_dir = Path(cfg.tokenizer_dir)
    if tok_dir.exists() and any(tok_dir.iterdir()):
        return Tokenizer.load(tok_dir), index
    log(f"No tokenizer in {tok_dir}: training one (vocab {cfg.vocab_size:,}) on {cfg.data_dir}")
    t0 = time.time()
    tokenizer = train_tokenizer(cfg.data_dir, tok_dir, vocab_size=cfg.vocab_size, log=log)
    log(f"Tokenizer trained in {time.time() - t0:.1f}s")
    return tokenizer, index


def plan_run(cfg: TrainConfig, vocab_size: int) -> Plan:
    """The plan at the largest world size; every size of an elastic range must work too."""
    min_workers, max_workers = cfg.worker_range()
    if min_workers != max_workers:
        resolve_plan(cfg, vocab_size, world_size=min_workers)
    return resolve_plan(cfg, vocab_size, world_size=max_workers)


def choose_checkpoint(cfg: TrainConfig, tokenizer: Tokenizer, index: CorpusIndex, plan: Plan,
                      log: Log = print) -> tuple[Storage, CheckpointMeta] | None:
    """The checkpoint this run resumes from (hashes verified) and its metadata. It must fit this
    tokenizer and lie within the plan's horizon: the flags of a rerun apply from its step on, but
    a horizon already passed cannot be trained to."""
    run_dir = Storage(cfg.storage_path).child(cfg.name)
    latest = driver_choice(run_dir, cfg.resume_from_step, log=lambda m: log(f"warning: {m}"))
    if latest is None:
        return None
    meta = read_meta(latest)
    check_vocab(tokenizer, meta.vocab_size, meta.tokenizer_fingerprint, str(latest))
    check_resume_fits(cfg, plan, index, meta, latest)
    if meta.step > plan.num_iterations:
        flag = "--" + plan.horizon_rule.replace("_", "-")
        raise RaychatError(f"{latest} is at step {meta.step:,}, past this plan's horizon of "
                           f"{plan.num_iterations:,} steps (set by {flag}): give a horizon beyond step "
                           f"{meta.step:,}, --resume-from-step an earlier checkpoint, or a new --run-name")
    log(f"Run {run_dir} exists: resuming from {latest.name} (step {meta.step})")
    return latest, meta


def check_resume_fits(cfg: TrainConfig, plan: Plan, index: CorpusIndex, meta: CheckpointMeta,
                      checkpoint: Storage) -> None:
    """What cannot change on resume, refused here in one line instead of a retried traceback in
    every worker: the model's shape and vocabulary, the optimizer whose state it saved, and a corpus
    the saved cursor cannot continue (other shards, or as many row groups in another order)."""
    saved = dataclasses.asdict(meta.model_config)
    changed = [f"{key} {saved[key]} -> {value}" for key, value in dataclasses.asdict(plan.model).items()
               if saved[key] != value]
    if changed:
        raise RaychatError(f"{checkpoint} holds another model than these flags build ({', '.join(changed)}): "
                           "resume with the run's model flags (--depth, --aspect-ratio, --head-dim, "
                           "--max-seq-len, --window-pattern, tokenizer) or start a new --run-name")
    saved_optimizer = meta.user_config.optimizer if meta.user_config else None  # None: saved before the flag
    check_same_optimizer(saved_optimizer, cfg.optimizer, str(checkpoint))
    if meta.cursor is not None:
        check_cursor_fits(meta.cursor, len(index.train), cfg.shuffle_seed if cfg.shuffle_seed >= 0 else None,
                          cfg.data_dir)
    check_checkpoint_corpus(meta.corpus, index, str(checkpoint))


def choose_initial_weights(cfg: TrainConfig, plan: Plan, tokenizer: Tokenizer, resume_from: Storage | None,
                           log: Log = print) -> NanochatCheckpoint | None:
    """The nanochat checkpoint a new run starts from (--init-from-nanochat), read and checked here;
    a run that already has a checkpoint of its own resumes from that (a rerun of the same command)."""
    if not cfg.init_from_nanochat:
        return None
    if resume_from is not None:
        log(f"--init-from-nanochat ignored: the run resumes from its own {resume_from.name}")
        return None
    seed = load_nanochat_checkpoint(cfg.init_from_nanochat, cfg.init_from_nanochat_step, plan.model,
                                    tokenizer)
    unchecked = "" if seed.tokenizer_checked else (" (no nanochat token_bytes.pt beside it: only the vocab "
                                                   "size of --tokenizer-dir could be checked)")
    log(f"Starting from nanochat's {seed.model_file} (step {seed.step}): its weights, a fresh optimizer, the "
        f"corpus from its start{unchecked}")
    return seed


def check_start(cfg: TrainConfig) -> None:
    """What the environment and the locations' endpoints must be, checked before anything runs: a
    malformed RAYCHAT_* setting would otherwise end the run at its first storage fault, and a typo'd
    endpoint host be retried for minutes as if it were a DNS hiccup (which mid-run it may be)."""
    check_settings()
    heartbeat_from_env()
    for flag, location in (("--storage-path", cfg.storage_path), ("--data-dir", cfg.data_dir),
                           ("--tokenizer-dir", cfg.tokenizer_dir)):
        if is_uri(location):
            try:
                storage = Storage(location)
            except RaychatError as e:  # a URI no filesystem can open: say which flag gave it
                raise RaychatError(f"{flag} {e}") from None
            storage.check_endpoint(flag)


def prepare_run(cfg: TrainConfig, log: Log = print) -> PreparedRun:
    """Every check the driver can make, cheapest first, before Ray is even started."""
    launched = time.time()
    if not ray.is_initialized():  # (a sweep's trial runs inside the sweep's Ray)
        check_cluster_answers(os.environ.get("RAY_ADDRESS", ""))
    check_precision(cfg.dtype, cfg.fp8, cfg.fp8_recipe, cfg.gpus_per_worker)
    compile_checked = check_compile(cfg.compile, cfg.gpus_per_worker)
    check_start(cfg)
    cfg = resolve_paths(cfg)
    Storage(cfg.storage_path).check_writable()
    cfg = check_eval_bundle(cfg, log)
    tokenizer, index = prepare_inputs(cfg, log)
    plan = plan_run(cfg, tokenizer.vocab_size)
    resume_from, resume_meta = choose_checkpoint(cfg, tokenizer, index, plan, log) or (None, None)
    init_weights = choose_initial_weights(cfg, plan, tokenizer, resume_from, log)
    return PreparedRun(cfg=cfg, plan=plan, tokenizer=tokenizer, index=index, resume_from=resume_from,
                       resume_meta=resume_meta, init_weights=init_weights, compile_checked=compile_checked,
                       launched=launched)
