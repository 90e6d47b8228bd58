"""What a checkpoint says about itself: one typed record, written as `meta.json`, read by everyone.

The driver (which checkpoint, does the tokenizer fit), every worker (step, cursor, loop state),
`raychat.sample` (the model's shape) and the benchmarks read the same fields through this class, so
a field changes in one place. The JSON is plain (a user reads it with any tool); `format_version`
says which fields exist, and a record from a newer raychat is refused in one line instead of being
half-understood. Version 1 is the untyped dict raychat wrote before this record: the same keys
without lineage or version, read as is.
"""

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from raychat.common import RaychatError

META_VERSION = 2


@dataclass
class CheckpointMeta:
    """One checkpoint's metadata. `sequence` counts the checkpoints of a lineage (1, 2, ...) and
    `parent` names the checkpoint this one's run resumed from or saved before it (None at the
    start), so "which checkpoint follows which" is recorded, not inferred from file times."""

    step: int
    model_config: dict[str, Any]
    world_size: int = 1
    vocab_size: int | None = None
    tokenizer_fingerprint: str | None = None
    session: str = ""
    sequence: int = 0
    parent: str | None = None
    lease_epoch: int = 0  # the run lease's epoch of the driver whose workers wrote it (checkpoint.fence)
    raychat_version: str = ""
    plan: dict[str, Any] = field(default_factory=dict)
    user_config: dict[str, Any] = field(default_factory=dict)
    corpus: dict[str, Any] = field(default_factory=dict)
    cursor: dict[str, Any] | None = None
    loop_state: dict[str, Any] = field(default_factory=dict)
    val_bpb: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    format_version: int = META_VERSION

    def to_json(self) -> bytes:
        # allow_nan: nanochat's loop state starts with min_val_bpb = inf, which Python's json round-trips
        return (json.dumps(asdict(self), indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes | str, where: str = "meta.json") -> "CheckpointMeta":
        """Parse a record; a newer version, or a record without step or model config, is refused."""
        try:
            raw = json.loads(data)
        except ValueError as e:
            raise RaychatError(f"{where} is not JSON ({e}); the checkpoint is damaged") from None
        if not isinstance(raw, dict):
            raise RaychatError(f"{where} is not a JSON object; the checkpoint is damaged")
        version = raw.get("format_version", 1)
        if not isinstance(version, int) or version > META_VERSION:
            raise RaychatError(f"{where} has checkpoint metadata version {version!r}, this raychat reads up "
                               f"to {META_VERSION}: upgrade raychat to use this checkpoint")
        missing = [name for name in ("step", "model_config") if name not in raw]
        if missing:
            raise RaychatError(f"{where} lacks {', '.join(missing)}; the checkpoint is damaged")
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in raw.items() if key in known}
        return cls(**{**values, "format_version": version})
