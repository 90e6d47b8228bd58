"""Lease epochs on storage: who may write a run, and which checkpoints a superseded writer left.

A run directory holds `lease/epoch_<n>.json`, one file per driver that ever took the run. A driver
takes the run by creating the next epoch's file with an operation the storage makes atomic
(`Storage.create_exclusive`: link on local disk and NFS, `If-None-Match: *` on S3), so two drivers
can never both hold epoch n + 1: the highest epoch is the writer, by construction, not by timing.
This is a fencing token, as etcd and ZooKeeper clients use: every checkpoint records the epoch of
the driver whose workers wrote it, and a writer that finds a higher epoch on storage writes and
deletes nothing more (`Fence.check`, before every save's manifest and every prune).

A writer may still finish a write it began before it was superseded (a check, then a pause, then
the write). So the takeover itself fixes what survives of the old epochs: each record says how far
its driver found the run (`floor`, the highest sequence among the run's complete checkpoints when
the epoch was created), and once its driver has chosen, the sequence it resumed from (`resumed`).
A checkpoint of an older epoch numbered above the floor was written after the takeover: it is never
chosen and never counted (`superseded`). One numbered above `resumed` lies on a branch that a
`--resume-from-step` rewound past, and is disowned the same way only once the rewound run has saved
a whole checkpoint of its own: a rewind that never trained replaced nothing, and hides nothing. That
first whole save is recorded at once (`lease/trained_<n>.json`, `mark_trained`), so the abandoned
branch stays abandoned even if that checkpoint is later damaged or deleted: the branch the run
trained on from there is the run's, and a damaged newest checkpoint falls back along it.
Holder liveness (the heartbeat in each record) is raychat.elastic.lease's concern.
"""

import json
import math
import typing
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, fields

from raychat.common import RaychatError
from raychat.faults import retry_transient
from raychat.storage import Storage

LEASE_DIR = "lease"
_PREFIX, _SUFFIX = "epoch_", ".json"
_TRAINED = "trained_"
MAX_HEARTBEAT_S = 600.0  # a holder silent for three beats longer than this is not a holder


class LeaseLost(RaychatError):
    """This writer's epoch is no longer the run's highest: another driver took the run over."""


def epoch_file(epoch: int) -> str:
    return f"{_PREFIX}{epoch:08d}{_SUFFIX}"


def _epoch_of(name: str, prefix: str = _PREFIX) -> int | None:
    digits = name[len(prefix):-len(_SUFFIX)]
    ok = name.startswith(prefix) and name.endswith(_SUFFIX) and digits.isdigit()
    return int(digits) if ok else None


@dataclass
class LeaseRecord:
    """One epoch's file. `beat` moves while its driver lives; `released` says it let go."""

    epoch: int
    holder: str  # a fresh id per driver process
    host: str
    pid: int
    started: str
    floor: int  # highest sequence among the run's complete checkpoints when this epoch was created
    resumed: int | None = None  # the sequence this epoch's driver resumed from (0: a fresh start)
    beat: int = 0
    released: bool = False
    # Its driver's run coordinator (a Ray actor: raychat.elastic.coordinator), which owns the run's replica
    # holders: a driver that takes the run over ends it. None for a driver outside Ray.
    coordinator: str | None = None
    namespace: str | None = None
    # Its driver's process as the kernel knows it (raychat.elastic.lease.process_identity): a driver on
    # the same machine can tell it is gone without waiting out its heartbeat. None where /proc is not.
    process: str | None = None
    # Its driver's heartbeat in seconds: a newcomer watches the record for a multiple of it (the
    # holder's timing, not the newcomer's). None: a record written before it was kept (read as
    # raychat.elastic.lease.HEARTBEAT_S, the default then).
    heartbeat_s: float | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str, epoch: int | None = None) -> "LeaseRecord":
        """The record in `data`, or one RaychatError line saying it is damaged. `epoch`: the one its
        file is named for, which the record must repeat (a record for another epoch, or a negative
        floor, would disown checkpoints it has nothing to do with)."""
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict):
                raise TypeError(f"a JSON {type(raw).__name__}, not an object")
            known = {f.name: f.type for f in fields(cls)}
            kept = {k: v for k, v in raw.items() if k in known}
            wrong = [k for k, v in kept.items() if not _fits(v, known[k])]
            if wrong:
                raise TypeError(f"field {wrong[0]!r} of the wrong type")
            record = cls(**kept)
        except (ValueError, TypeError) as e:
            raise _damaged(where, f"{type(e).__name__}") from None
        beat = record.heartbeat_s
        if beat is not None and not (math.isfinite(beat) and beat > 0):
            raise _damaged(where, f"heartbeat_s {beat}")
        if beat is not None and beat > MAX_HEARTBEAT_S:  # an older raychat took any beat: watched for
            record.heartbeat_s = MAX_HEARTBEAT_S         # at most the longest one it takes now
        if record.epoch < 1 or (epoch is not None and record.epoch != epoch):
            raise _damaged(where, f"epoch {record.epoch}")
        if record.floor < 0 or (record.resumed is not None and record.resumed < 0) or record.beat < 0:
            raise _damaged(where, "a negative sequence or beat")
        return record


def _damaged(where: str, what: str) -> RaychatError:
    # Records are created and replaced whole (never truncated in place): unreadable bytes are
    # damage, which no retry heals and no guess may treat as "free".
    return RaychatError(f"lease record {where} is damaged ({what}): something other than raychat wrote "
                        "it; check what runs on this run, then restore the record from a backup (removing "
                        "one lets checkpoints it disowns be chosen again), or train under a new --run-name")


def _fits(value: object, annotation: object) -> bool:
    """Whether a JSON value fits a field's annotation (int, str, bool, float, or one of them | None)."""
    allowed = typing.get_args(annotation) or (annotation,)
    if isinstance(value, bool):  # JSON true is no epoch
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    return isinstance(value, allowed)


def lease_dir(run: Storage) -> Storage:
    return run.child(LEASE_DIR)


def epochs(run: Storage, log: Callable[[str], None] | None = None,
           budget_s: float | None = None) -> list[int]:
    """Epoch numbers present on storage, ascending (one listing, retried through storage faults)."""
    directory = lease_dir(run)
    kwargs = {"log": log} if log is not None else {}
    infos = retry_transient(directory.entries, f"listing {directory}", budget_s=budget_s, **kwargs)
    return sorted(e for e in (_epoch_of(info.base_name) for info in infos) if e is not None)


def trained_file(epoch: int) -> str:
    return f"{_TRAINED}{epoch:08d}{_SUFFIX}"


def mark_trained(run: Storage, epoch: int) -> None:
    """Record that `epoch` has saved a whole checkpoint of its own (its saver calls this after its
    first manifest). Created once, exclusively; a mark already there is this epoch's own."""
    directory, name = lease_dir(run), trained_file(epoch)
    retry_transient(lambda: directory.create_exclusive(name, b"{}"), f"creating {directory.child(name)}")


def trained_marks(run: Storage) -> set[int]:
    """The epochs that recorded a whole save of their own (`mark_trained`)."""
    directory = lease_dir(run)
    infos = retry_transient(directory.entries, f"listing {directory}")
    return {e for e in (_epoch_of(info.base_name, _TRAINED) for info in infos) if e is not None}


def read_record(run: Storage, epoch: int, log: Callable[[str], None] | None = None) -> LeaseRecord:
    directory = lease_dir(run)
    kwargs = {"log": log} if log is not None else {}
    data = retry_transient(lambda: directory.read_replaceable(epoch_file(epoch)),
                           f"reading {directory.child(epoch_file(epoch))}", **kwargs)
    return LeaseRecord.from_json(data, str(directory.child(epoch_file(epoch))), epoch=epoch)


def records(run: Storage) -> list[LeaseRecord]:
    """Every epoch's record, ascending."""
    return [read_record(run, epoch) for epoch in epochs(run)]


def create_record(run: Storage, record: LeaseRecord) -> bool:
    """Create `record`'s epoch file if no driver has; True if this call took that epoch.

    A create whose answer was lost (a reset after the bucket took the PUT) is tried again, by the
    S3 client or by `retry_transient`, and that try finds the file there: it is this driver's own
    when it names this driver's `holder` (a fresh id per process), so the epoch is taken."""
    directory = lease_dir(run)
    name = epoch_file(record.epoch)
    if retry_transient(lambda: directory.create_exclusive(name, record.to_json()),
                       f"creating {directory.child(name)}"):
        return True
    return read_record(run, record.epoch).holder == record.holder


def replace_record(run: Storage, record: LeaseRecord, budget_s: float | None = None) -> None:
    """The holder's own update of its epoch's file (heartbeat, resume point, release), retried
    within `budget_s` (the heartbeat's own beat; the default budget elsewhere)."""
    directory = lease_dir(run)
    retry_transient(lambda: directory.replace_atomically(epoch_file(record.epoch), record.to_json()),
                    f"writing {directory.child(epoch_file(record.epoch))}", budget_s=budget_s)


def superseded(leases: list[LeaseRecord], trained: Collection[int] = ()) -> Callable[[int, int], bool]:
    """Whether a checkpoint of (epoch, sequence) was left by a superseded writer or an abandoned
    branch: some later epoch found the run before that sequence existed (its `floor`), or rewound
    below it (its `resumed`) and has trained since: `trained` holds the epochs that saved a whole
    checkpoint of their own. A rewind that never trained hides nothing, so a driver that rewound
    and stopped before its first save (Ctrl-C, a worker error) leaves every checkpoint as it was."""
    def bound_of(record: LeaseRecord) -> int:
        binding = record.resumed is not None and record.epoch in trained
        return min(record.floor, record.resumed) if binding else record.floor

    bounds = [(record.epoch, bound_of(record)) for record in leases]

    def test(epoch: int, sequence: int) -> bool:
        return any(later > epoch and sequence > bound for later, bound in bounds)

    return test


class Fence:
    """A worker's check that its driver still holds the run: `check()` raises LeaseLost once a
    higher epoch exists. Epoch 0 (tools, tests, old callers) never fences."""

    def __init__(self, run: Storage, epoch: int, budget_s: float | None = None):
        self.run, self.epoch, self.budget_s = run, epoch, budget_s

    def newer(self) -> int | None:
        """The highest epoch above this one, if any (one listing)."""
        if self.epoch <= 0:
            return None
        found = epochs(self.run, budget_s=self.budget_s)
        return found[-1] if found and found[-1] > self.epoch else None

    def check(self) -> None:
        newer = self.newer()
        if newer is not None:
            raise LeaseLost(f"run {self.run} was taken over by another driver (lease epoch {newer}, this "
                            f"writer's {self.epoch}): this writer stopped and wrote nothing more")
