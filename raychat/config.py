"""The one configuration of a raychat run, and the command line built from it.

Every flag of `python -m raychat.train` (and of `raychat.plan`, `tune.sweep`) is a field of
`TrainConfig`; argparse is generated from the fields so names, defaults and help never drift apart.
Flag names and defaults follow nanochat's `scripts/base_train.py` where nanochat has the flag.
Precedence: dataclass default < `--preset` < flags given on the command line.
"""

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from raychat.common import RaychatError, check_name
from raychat.locations import SafeLocation
from raychat.records import Record


def _flag(default: Any, help: str, group: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, "group": group, **kw})


# --optimizer's choices: each name's module in raychat/optim, whose SPEC builds it (the first is the
# default). Names and paths only: the flag is offered and checked here, and the optimizers, which read
# these flags, are imported by raychat.optim.registry when a run builds one.
OPTIMIZERS: dict[str, str] = {
    "muon_adamw": "raychat.optim.muon_adamw",
    "sgd": "raychat.optim.sgd",
}
DEFAULT_OPTIMIZER = next(iter(OPTIMIZERS))


@dataclass
class TrainConfig(Record):
    # --- model ---
    depth: int = _flag(20, "number of transformer layers; the one dial that sets model size and, "
                       "through the scaling rules, horizon, batch size, learning rates", "model")
    aspect_ratio: int = _flag(64, "model_dim = depth * aspect_ratio (rounded up to a multiple of head_dim)",
                              "model")
    head_dim: int = _flag(128, "attention head dimension; n_head = model_dim // head_dim", "model")
    max_seq_len: int = _flag(2048, "context length T in tokens", "model")
    window_pattern: str = _flag("SSSL", "sliding-window pattern tiled over layers: L = full context, "
                                "S = short window (T/4); the last layer is always L", "model")
    init_from_nanochat: str = _flag("", "start a new run from the weights of a nanochat base checkpoint: its "
                                    "directory, NANOCHAT_BASE_DIR/base_checkpoints/<tag> (fresh optimizer "
                                    "and data order; the model flags and tokenizer must be nanochat's)",
                                    "model")
    init_from_nanochat_step: int = _flag(-1, "step of that nanochat checkpoint (-1 = its latest)", "model")
    # --- horizon (first one set wins) ---
    num_iterations: int = _flag(-1, "explicit number of optimizer steps (-1 = use the next rule)", "horizon")
    target_flops: float = _flag(-1.0, "train until this many FLOPs (-1 = use the next rule)", "horizon")
    target_param_data_ratio: float = _flag(12.0, "train on ratio x scaling params tokens (Chinchilla ~20)",
                                           "horizon")
    # --- optimization ---
    device_batch_size: int = _flag(32, "rows of T tokens per forward pass per worker (lower it if you run "
                                   "out of memory; the global batch does not change). -1 = auto: on a GPU "
                                   "the largest power of two whose estimated peak memory fits it (python -m "
                                   "raychat.plan shows the estimate), on a CPU 32", "optimization")
    total_batch_size: int = _flag(-1, "tokens per optimizer step across all workers (-1 = auto from the "
                                  "scaling rule)", "optimization")
    embedding_lr: float = _flag(0.3, "AdamW learning rate of the token and value embeddings", "optimization")
    unembedding_lr: float = _flag(0.008, "AdamW learning rate of lm_head", "optimization")
    matrix_lr: float = _flag(0.02, "Muon learning rate of the transformer matrices", "optimization")
    scalar_lr: float = _flag(0.5, "AdamW learning rate of the per-layer scalars", "optimization")
    weight_decay: float = _flag(0.28, "Muon cautious weight decay at d12 (scaled with batch and horizon)",
                                "optimization")
    optimizer: str = _flag(DEFAULT_OPTIMIZER, "what trains the model: muon_adamw (nanochat's Muon for the "
                           "transformer's matrices, AdamW for the rest: the four lrs above) or sgd (plain "
                           "SGD over every parameter: --sgd-lr, --sgd-momentum); a run resumes only under "
                           "the optimizer it was saved with", "optimization", choices=tuple(OPTIMIZERS))
    sgd_lr: float = _flag(0.5, "--optimizer sgd: learning rate (times the batch-size lr scale, with the lr "
                          "schedule)", "optimization")
    sgd_momentum: float = _flag(0.9, "--optimizer sgd: momentum (0 = none)", "optimization")
    warmup_steps: int = _flag(40, "linear learning-rate warmup steps", "optimization")
    warmdown_ratio: float = _flag(0.65, "fraction of steps spent in the final linear warmdown",
                                  "optimization")
    final_lr_frac: float = _flag(0.05, "learning rate at the end, as a fraction of the peak", "optimization")
    seed: int = _flag(42, "seed for weight init", "optimization")
    shuffle_seed: int = _flag(-1, "shuffle the order of the corpus's row groups in each epoch with this seed "
                              "(-1 = corpus order, as nanochat reads it)", "data")
    compile: str = _flag("auto", "torch.compile the model: auto (on for CUDA, off on CPU), on, off",
                         "optimization", choices=("auto", "on", "off"))
    no_compile_cache: bool = _flag(False, "do not keep torch.compile's cache with the run (by default a "
                                   "restart on a new node loads it instead of compiling again; it holds "
                                   "code the workers run, so a run's storage must be writable only by "
                                   "those trusted to run it)", "optimization")
    dtype: str = _flag("auto", "activation dtype (weights stay fp32): auto (bf16 on CUDA SM80+ and on CPUs "
                       "with avx512_bf16/amx_bf16, else fp32), bf16, fp32", "optimization",
                       choices=("auto", "bf16", "fp32"))
    fp8: bool = _flag(False, "FP8 training of the transformer's large matmuls through torchao (CUDA SM89+; "
                      "pip install 'raychat[fp8]')", "optimization")
    fp8_recipe: str = _flag("tensorwise", "FP8 scaling recipe: tensorwise (faster) or rowwise (more "
                            "accurate)", "optimization", choices=("tensorwise", "rowwise"))
    # --- evaluation and output ---
    eval_every: int = _flag(250, "evaluate validation bits-per-byte every N steps (-1 = only at the end)",
                            "evaluation")
    eval_tokens: int = _flag(80 * 524288, "validation tokens per evaluation (at most the val split's "
                             "documents once)", "evaluation")
    sample_every: int = _flag(2000, "print greedy samples every N steps (-1 = only at the end)", "evaluation")
    save_every: int = _flag(0, "save a checkpoint every N steps and at the end (0 = auto: the interval that "
                            "loses least to saves' stalls and to a node lost every 10 minutes, saves "
                            "stalling training at most 1/100 of its time and written before the next, "
                            "at least every --max-lost-minutes of training, and that often where memory "
                            "replicas on a peer node hold the state; -1 = only at the end)",
                            "evaluation")
    max_lost_minutes: float = _flag(1.0, "--save-every 0: the most training a node lost without notice "
                                    "should redo, in minutes (the checkpoint interval plus a save's write); "
                                    "where memory replicas on a peer node cover a lost node, the most a node "
                                    "lost with its peer, or the whole cluster, should redo",
                                    "evaluation")
    replicate_every: int = _flag(0, "mirror every rank's state in host memory on its own node and a peer "
                                 "node every N steps, so a node lost without notice redoes about N steps "
                                 "(more while a slow send skips some) and its restart reads nothing from "
                                 "storage (0 = auto: the interval that loses least to the copies' stalls "
                                 "and to a node lost every 10 minutes, the copies stalling training at "
                                 "most 2/100 of its time, and at least as often as a --save-every N, "
                                 "since a replica older than the newest checkpoint is never read; -1 = "
                                 "off; a one-node "
                                 "group keeps its own node's copy only, for a lost worker process)",
                                 "evaluation")
    core_metric_every: int = _flag(2000, "evaluate nanochat's CORE metric every N steps and at the end "
                                   "(-1 or 0 = off); needs the eval bundle (see --eval-bundle)", "evaluation")
    core_metric_max_per_task: int = _flag(500, "examples per CORE task, a fixed seeded subsample (-1 = all)",
                                          "evaluation")
    eval_bundle: str = _flag("", "CORE eval bundle directory (default $RAYCHAT_HOME/eval_bundle; fetched on "
                             "first use when the network allows: python -m raychat.corpus "
                             "download-eval-bundle)", "evaluation")
    run: str = _flag("dummy", "wandb run name ('dummy' disables wandb)", "evaluation")
    model_tag: str = _flag("", "name of the model in checkpoints and the default run name (default d<depth>)",
                           "evaluation")
    verbose: bool = _flag(False, "also show Ray's own chatter: its line per report to Ray Train, Ray Data's "
                          "lines per dataset, Ray's warnings about its own internals (or RAYCHAT_VERBOSE=1)",
                          "evaluation")
    resume_from_step: int = _flag(-1, "resume the run from its checkpoint at this step (-1 = latest, if any)",
                                  "evaluation")
    # --- data ---
    data_dir: str = _flag("", "corpus directory of shard_*.parquet, or a bucket URI such as "
                          "s3://bucket/climbmix (default $RAYCHAT_HOME/data)", "data")
    tokenizer_dir: str = _flag("", "tokenizer directory, or a bucket URI read once per node into "
                                   "$RAYCHAT_HOME/tokenizers (default $RAYCHAT_HOME/tokenizer)", "data")
    vocab_size: int = _flag(32768, "vocabulary size when a tokenizer has to be trained first", "data")
    # --- Ray ---
    num_workers: str = _flag("1", "training workers: N, or MIN:MAX for an elastic run that continues on "
                             "fewer workers when nodes are lost", "ray")
    gpus_per_worker: float = _flag(-1.0, "GPUs per worker (-1 = 1 if the cluster has GPUs, else 0)", "ray")
    cpus_per_worker: float = _flag(-1.0, "CPUs reserved per worker, for its step and its data feed: up to "
                                   "that many read/tokenize tasks run at once on its node (-1 = 1)", "ray")
    max_failures: int = _flag(3, "worker-group restarts Ray attempts after failures (-1 = unlimited)", "ray")
    process_group_timeout_s: int = _flag(1800, "seconds a torch.distributed collective (NCCL on GPUs, gloo "
                                         "on CPUs) waits for every worker before it fails the attempt, which "
                                         "Ray then restarts (Ray Train's TorchConfig timeout_s; its default)",
                                         "ray")
    storage_path: str = _flag("", "where runs and checkpoints live: a local path or a URI such as "
                              "s3://bucket/runs or gs://bucket/runs (default $RAYCHAT_HOME/runs)", "ray")
    run_name: str = _flag("", "run directory under storage-path; re-running a name resumes it "
                          "(default: the model tag)", "ray")
    keep_checkpoints: int = _flag(3, "how many recent checkpoints to keep", "ray")
    resize_check_every: float = _flag(60.0, "elastic runs: seconds between Ray's checks whether more workers "
                                      "fit (then the group is restarted larger, after a checkpoint)", "ray")
    grow: str = _flag("when-it-pays", "elastic runs: grow the group when more workers fit only if the "
                      "steps left at the larger size save more than a restart costs (measured in this "
                      "run), or always; the verdict is said in one line", "ray",
                      choices=("when-it-pays", "always"))
    placement_strategy: str = _flag("PACK", "how workers are placed on nodes: PACK fills nodes (GPU runs), "
                                    "SPREAD / STRICT_SPREAD put them on different nodes (a node loss then "
                                    "takes fewer workers)", "ray", choices=("PACK", "SPREAD", "STRICT_PACK",
                                                                           "STRICT_SPREAD"))
    preset: str = _flag("", "start from a named preset, then apply the other flags: 'cpu' trains a "
                        "small model in a few minutes on a laptop CPU", "ray", choices=("", "cpu"))

    def __post_init__(self) -> None:
        for name in LOCATION_FIELDS:  # their credentials never in a message, a log or Ray's state
            setattr(self, name, SafeLocation(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        """Reject impossible values with the flag's name and the fix."""
        for f in dataclasses.fields(self):
            # argparse's float() takes "inf" and "nan", which pass every comparison below that a number
            # would fail (nan) or break the arithmetic they feed long after the start (inf).
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise RaychatError(f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
        positive = ["depth", "aspect_ratio", "head_dim", "max_seq_len", "vocab_size",
                    "process_group_timeout_s"]
        for name in positive:
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise RaychatError(f"{flag} must be at least 1, got {getattr(self, name)}")
        if not self.window_pattern or set(self.window_pattern.upper()) - {"S", "L"}:
            raise RaychatError(f"--window-pattern must be letters S and L (e.g. SSSL or L), "
                               f"got {self.window_pattern!r}")
        if self.num_iterations <= 0 and self.target_flops <= 0 and self.target_param_data_ratio <= 0:
            raise RaychatError("no training horizon: set --num-iterations, --target-flops or "
                               "--target-param-data-ratio to a positive value")
        if self.device_batch_size != -1 and self.device_batch_size < 1:
            raise RaychatError(f"--device-batch-size must be positive or -1 (auto), "
                               f"got {self.device_batch_size}")
        if self.total_batch_size != -1 and self.total_batch_size < 1:
            raise RaychatError(f"--total-batch-size must be positive or -1 (auto), "
                               f"got {self.total_batch_size}")
        if not 0 <= self.warmdown_ratio <= 1:
            raise RaychatError(f"--warmdown-ratio must be within [0, 1], got {self.warmdown_ratio}")
        if not 0 <= self.final_lr_frac <= 1:  # outside, the lr multiplier would turn negative or overshoot
            raise RaychatError(f"--final-lr-frac must be within [0, 1], got {self.final_lr_frac}")
        if self.optimizer not in OPTIMIZERS:
            raise RaychatError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.sgd_lr <= 0:
            raise RaychatError(f"--sgd-lr must be positive, got {self.sgd_lr}")
        if not 0 <= self.sgd_momentum < 1:  # at 1 or above the momentum never forgets and the steps grow
            raise RaychatError(f"--sgd-momentum must be within [0, 1), got {self.sgd_momentum}")
        self.worker_range()  # raises on a malformed --num-workers
        if self.max_lost_minutes <= 0:
            raise RaychatError(f"--max-lost-minutes must be positive, got {self.max_lost_minutes} "
                               "(--save-every N or -1 sets a fixed cadence instead)")
        for flag, value in (("--run-name", self.run_name), ("--model-tag", self.model_tag)):
            if value:  # a directory name under --storage-path, never a path out of it
                check_name(value, flag)
        if self.replicate_every < -1:
            raise RaychatError(f"--replicate-every must be N >= 1, 0 (auto) or -1 (off), got "
                               f"{self.replicate_every}")
        if self.resize_check_every < 0:
            raise RaychatError(f"--resize-check-every must be >= 0 seconds, got {self.resize_check_every}")

    def worker_range(self) -> tuple[int, int]:
        """(min, max) workers from --num-workers 'N' or 'MIN:MAX'."""
        text = str(self.num_workers).strip()
        try:
            parts = [int(p) for p in text.split(":")]
        except ValueError:
            parts = []
        if len(parts) == 1:
            parts = parts * 2
        if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
            raise RaychatError(f"--num-workers must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
        return parts[0], parts[1]

    @property
    def tag(self) -> str:
        return self.model_tag or f"d{self.depth}"

    @property
    def name(self) -> str:
        return self.run_name or self.tag

    def to_public_dict(self) -> dict[str, Any]:
        """The flags as they may be shown (wandb, the metrics log): plain values, the locations
        without the credentials a URI can carry (raychat.locations.SafeLocation). Checkpoints keep
        the record (`to_dict`, raychat.records), which is as plain."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in LOCATION_FIELDS:
            values[name] = str(values[name])
        return values


LOCATION_FIELDS = ("storage_path", "data_dir", "tokenizer_dir")

# Presets: a named set of flag values applied before the user's own flags.
PRESETS: dict[str, dict[str, Any]] = {
    # A model that learns visibly within minutes on 2 CPU cores (bench.step's configuration A);
    # checkpoints on the auto cadence every run gets (raychat.elastic.cadence).
    "cpu": dict(
        depth=4, head_dim=64, max_seq_len=512, window_pattern="L", device_batch_size=8,
        total_batch_size=4096, num_iterations=60, warmup_steps=6, eval_every=20,
        eval_tokens=4 * 4096, sample_every=-1, vocab_size=8192, core_metric_every=-1,
    ),
}
# Why each preset is what it is, printed after the plan (`preset_note`).
PRESET_REASONS = {
    # The note's figures are the quick start's as last measured (bench/RESULTS.md, "End to end"). The
    # preset has 60 steps because a first run should end while its user still watches, and the first
    # preset, of 200 steps, did not on a CPU without AVX-512.
    "cpu": "about 4 minutes of steps on 2 x86 cores without AVX-512 (~1,000 tok/s), less with it, so a "
           "first run ends in minutes with val bpb clearly falling; --num-iterations N trains on (the same "
           "--run-name resumes)",
}


def preset_note(name: str) -> str | None:
    """What a preset chose and why, for the driver to print after the plan (None: no preset)."""
    if name not in PRESETS:
        return None
    p = PRESETS[name]
    tokens = p["num_iterations"] * p["total_batch_size"]
    return (f"Preset {name}: d{p['depth']}, {p['num_iterations']} steps of {p['total_batch_size']:,} tokens "
            f"({tokens:,} in all), validation every {p['eval_every']} steps on {p['eval_tokens']:,} tokens, "
            f"samples at the end: {PRESET_REASONS[name]}; flags given override these (the plan above is "
            "what runs)")


GROUP_TITLES = {
    "model": "model shape",
    "horizon": "training horizon (the first rule that is set wins)",
    "optimization": "optimization",
    "evaluation": "evaluation, sampling, checkpoints, logging",
    "data": "data and tokenizer",
    "ray": "Ray cluster and run storage",
}


def add_config_flags(parser: argparse.ArgumentParser, only: set[str] | None = None) -> None:
    """Add one --flag per TrainConfig field (or just those in `only`), defaults suppressed so that
    `config_from_args` can tell which flags the user actually gave."""
    groups = {key: parser.add_argument_group(title) for key, title in GROUP_TITLES.items()}
    for f in dataclasses.fields(TrainConfig):
        if only is not None and f.name not in only:
            continue
        default = f.default
        kwargs: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS,
                                      help=f"{f.metadata['help']} (default: {default!r})")
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if isinstance(default, bool):  # a switch, as nanochat's --fp8: given means True
            groups[f.metadata["group"]].add_argument("--" + f.name.replace("_", "-"), action="store_true",
                                                     **kwargs)
            continue
        kwargs["type"] = type(default)
        kwargs["metavar"] = {int: "N", float: "X", str: "TEXT"}[type(default)]
        groups[f.metadata["group"]].add_argument("--" + f.name.replace("_", "-"), **kwargs)


def flag_table() -> str:
    """The Markdown table of every flag (docs/flags.md holds it; tests/test_cli.py checks it is this)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(TrainConfig):
        default = "(empty)" if f.default == "" else f"`{f.default!r}`"
        rows.append(f"| `--{f.name.replace('_', '-')}` | {default} | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed flags: defaults, then the preset, then the flags given."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    values: dict[str, Any] = dict(PRESETS.get(given.get("preset", ""), {}))
    values.update(given)
    return TrainConfig(**values)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m raychat.config",
                                     description="Print the Markdown table of raychat's training flags "
                                                 "(what docs/flags.md holds), generated from TrainConfig.")
    parser.parse_args()
    print(flag_table(), end="")
