"""What a checkpoint says about itself: one typed record, written as `meta.json`, read by everyone.

The driver (which checkpoint, does the tokenizer fit, does the corpus), every worker (step, cursor,
loop state), `raychat.sample` and `raychat.export` (the model's shape, the flags) and the benchmarks
read the same fields through this class, so a field changes in one place. Every part is a record
(raychat.records): the model's shape, the plan, the flags, the corpus, the data cursor, the loop
state and the totals, each read back by attribute and refused in one line naming the field when it
does not fit. The JSON is plain (a user reads it with any tool); `format_version` says which fields
exist, and a record from a newer raychat is refused in one line instead of being half-understood.

Versions: 1 is the untyped dict raychat wrote before this record (the same keys without lineage or
version); 2 added lineage and the version but kept every part a plain dict, empty when unknown;
3 types every part, None when unknown; 4 adds `loop_state.final_evaluated` (the state of the last step
taken before its evaluation, as the memory tier's last replica is, says so). Versions 1 to 3 are read
as they were written.
"""

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.corpus.index import CorpusRecord
from raychat.data.cursor import Cursor
from raychat.model.gpt import GPTConfig
from raychat.records import Record, RecordError
from raychat.scaling import Plan

META_VERSION = 4


@dataclass
class LoopState(Record):
    """Where the loop is and what a resume must restore besides the weights (nanochat's loop_state)."""

    step: int = 0  # the next optimizer step
    min_val_bpb: float = float("inf")
    smooth_train_loss: float = 0.0
    total_training_time: float = 0.0
    val_bpb: float | None = None
    core_metric: float | None = None  # at the last CORE evaluation (raychat.worker.core_metric)
    restarts: int = 0  # worker-group restarts after failures
    resizes: int = 0  # planned resizes (the group grew or shrank with nothing lost)
    redone_steps: int = 0  # steps trained again after restarts (work lost since the last checkpoint)
    # At the last step: the final evaluation, CORE and samples are done (and in this record). The
    # memory tier's replica of the last step comes before them: a restart from it evaluates again.
    final_evaluated: bool = False


@dataclass
class Totals(Record):
    """What the run had trained on when the checkpoint was saved."""

    tokens_so_far: int
    flops_so_far: int


@dataclass
class CheckpointMeta(Record):
    """One checkpoint's metadata. `sequence` counts the checkpoints of a lineage (1, 2, ...) and
    `parent` names the checkpoint this one's run resumed from or saved before it (None at the
    start), so "which checkpoint follows which" is recorded, not inferred from file times."""

    VERSION: ClassVar[int] = META_VERSION
    VERSION_KEY: ClassVar[str] = "format_version"  # what versions 1 and 2 named it: they refuse a 3

    step: int
    model_config: GPTConfig
    world_size: int = 1
    vocab_size: int | None = None
    tokenizer_fingerprint: str | None = None
    session: str = ""
    sequence: int = 0
    parent: str | None = None
    lease_epoch: int = 0  # the run lease's epoch of the driver whose workers wrote it (checkpoint.fence)
    raychat_version: str = ""
    plan: Plan | None = None
    user_config: TrainConfig | None = None  # the flags, locations without credentials (SafeLocation)
    corpus: CorpusRecord | None = None
    cursor: Cursor | None = None
    loop_state: LoopState = field(default_factory=LoopState)
    val_bpb: float | None = None
    metrics: Totals | None = None

    @classmethod
    def upgrade(cls, values: dict[str, Any], version: int) -> dict[str, Any]:
        """Versions 1 and 2 wrote an unknown part as an empty dict: None now. A descriptive part
        written before a field it now requires existed (the plan's precision, added after the first
        release) reads as unknown too, rather than making the whole checkpoint unreadable: a run
        that cannot read its checkpoints starts over."""
        values = {key: value for key, value in values.items()
                  if not (value == {} and key in ("plan", "user_config", "corpus", "cursor", "metrics"))}
        for key, record in (("plan", Plan), ("corpus", CorpusRecord), ("metrics", Totals)):
            if isinstance(values.get(key), dict):
                try:
                    record.from_dict(values[key])
                except (RecordError, TypeError, ValueError):
                    values[key] = None
        return values

    def to_json(self) -> bytes:
        # allow_nan: nanochat's loop state starts with min_val_bpb = inf, which Python's json round-trips
        return (json.dumps(self.to_dict(), indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes | str, where: str = "meta.json") -> "CheckpointMeta":
        """Parse a record; one from a newer raychat, or one that does not fit the record (no step,
        an unknown field), is refused in one line naming `where`."""
        try:
            raw = json.loads(data)
        except ValueError as e:
            raise RaychatError(f"{where} is not JSON ({e}); the checkpoint is damaged") from None
        try:
            return cls.from_dict(raw, where=where)
        except RecordError:
            raise
        except (TypeError, ValueError, AttributeError, RaychatError) as e:  # a value of the wrong kind,
            # or a stored flag the config's checks refuse (an edited file): the file's fault, not a flag's
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise RecordError(f"{where} holds a value that does not fit its record ({reason}); the "
                              "checkpoint is damaged") from None
