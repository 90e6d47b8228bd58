"""Which checkpoints a run has, found and pruned the same way by everyone (the files of one checkpoint
are raychat.checkpoint.format's).

"The latest checkpoint" of a run is the newest of its current branch: the checkpoint with the
highest lineage sequence (meta.json: every save numbers its checkpoint one above every checkpoint
the run already has), then its parent, its parent's parent... Clocks are not trusted: a FUSE mount
or Lustre client with a clock behind, or a `cp -r` of the run, reorders mtimes, and a save's own
prune would then delete what it just wrote. After `--resume-from-step` rewinds a run, its new
checkpoints are the latest even though the abandoned branch has higher step numbers, and falling
back from a damaged latest follows parents, never into the abandoned branch. Checkpoints that a
superseded writer or an abandoned branch left (raychat.checkpoint.fence) are never listed. A record
that cannot be read is retried (raychat.faults); one that is damaged is left alone with a line:
never ordered as the oldest, never pruned. Write times (whole seconds, then the step) only break
ties between checkpoints without a sequence, written before raychat kept one.
"""

import re
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import cached_property

from raychat.checkpoint import fence
from raychat.checkpoint.fence import Fence, superseded
from raychat.checkpoint.format import (
    CHECKPOINT_PREFIX,
    MANIFEST_FILE,
    META_FILE,
    CheckpointUnreadable,
    _meta_bytes,
    damage,
)
from raychat.checkpoint.meta import CheckpointMeta
from raychat.common import RaychatError
from raychat.faults import retry_transient, short_reason
from raychat.storage import Location, Storage


def _warn(message: str) -> None:
    print(f"raychat: warning: {message}", file=sys.stderr, flush=True)


_NAME = re.compile(rf"{CHECKPOINT_PREFIX}(\d+)(?:-e\d+)?")


def step_of(name: str) -> int | None:
    """The step in a checkpoint directory's name (None: not one)."""
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def _written_at(directory: Storage) -> int:
    """Whole seconds (object stores keep no more) when the manifest was written; without one, when
    the newest file in the directory was."""
    info = directory.info(MANIFEST_FILE)
    times = [info.mtime] if info.mtime is not None else [e.mtime for e in directory.entries()]
    times = [t for t in times if t is not None]
    return int(max(times).timestamp()) if times else 0


@dataclass
class _Found:
    """One checkpoint directory as a survey saw it: its record, or why it has none to order by."""

    directory: Storage
    step: int
    meta: CheckpointMeta | None = None
    # "missing": no meta.json (a save that died before it, or one in progress); "damaged": a record
    # that does not parse; "denied": one that may not be read; "unfinished": a save of a rewind
    # that never saved a whole checkpoint (its record kept: it died before its manifest). Only
    # "missing" and "unfinished" may be pruned.
    problem: str | None = None


def _read_record(directory: Storage, log: Callable[[str], None], strict: bool) -> tuple[CheckpointMeta | None,
                                                                                         str | None]:
    """(record, None), or (None, why there is none to order by). A damaged record is left alone
    with a line. One that may not be read stops a `strict` caller (the driver choosing what to
    resume: guessing around it could resume an older checkpoint); a prune leaves it alone."""
    try:
        data = _meta_bytes(directory)
    except FileNotFoundError:
        return None, "missing"
    except CheckpointUnreadable as e:
        if strict:
            raise
        log(f"leaving checkpoint {directory} alone: {e}")
        return None, "denied"
    try:
        return CheckpointMeta.from_json(data, where=directory.path(META_FILE)), None
    except RaychatError as e:
        log(f"leaving checkpoint {directory} alone: {e}")
        return None, "damaged"


def _subdirs(run: Storage) -> list[str]:
    return retry_transient(run.subdirs, f"listing {run}")


def highest_sequence(run_dir: Location) -> int:
    """The highest lineage sequence of any checkpoint of the run with a readable record (0: none).
    A record that may not be read stops the caller in one line (CheckpointUnreadable): a lease's
    floor or a saver's numbering that missed it would later disown the checkpoint."""
    found = _Survey(Storage.of(run_dir), log=lambda _: None, leases=False).found
    return max((f.meta.sequence for f in found if f.meta is not None), default=0)


class _Survey:
    """One look at a run: every checkpoint directory with its record, and the lease records, each
    read once, so that listing, walking the branch and pruning agree on one picture.

    Which checkpoints may be chosen (raychat.checkpoint.fence): a late save of a superseded writer
    never; an abandoned branch once the run that rewound past it has trained (saved a whole
    checkpoint of its own epoch). Until then a rewind hides nothing: a driver that rewound and
    stopped before its first save leaves the run as it found it."""

    def __init__(self, run: Storage, log: Callable[[str], None], strict: bool = True, leases: bool = True):
        self.run, self.log = run, log
        self.found: list[_Found] = []
        for name in _subdirs(run):
            step = step_of(name)
            if step is not None:
                directory = run.child(name)
                meta, problem = _read_record(directory, log, strict)
                self.found.append(_Found(directory, step, meta, problem))
        records = fence.records(run) if leases and any(f.meta for f in self.found) else []
        trained = self._trained_epochs(records)
        self.is_superseded = superseded(records, trained=trained)
        # A rewind that never saved a whole checkpoint: what its unfinished saves name as their
        # parent is the checkpoint it rewound to, which must not lead the branch past the run's
        # newest checkpoint. They are not checkpoints, as a save that died before its record.
        untrained = {r.epoch for r in records if r.resumed is not None and r.resumed < r.floor} - trained
        for f in self.found:
            if f.meta is not None and f.meta.lease_epoch in untrained:
                f.problem = "unfinished"

    @cached_property
    def listed(self) -> list[tuple[Storage, CheckpointMeta]]:
        """The checkpoints that may be chosen, oldest first: by lineage sequence, then (for
        checkpoints without one) by when they were written, then by step."""
        keyed = [((f.meta.sequence, _written_at(f.directory), f.step), f) for f in self.found
                 if f.problem is None and not self.is_superseded(f.meta.lease_epoch, f.meta.sequence)]
        return [(f.directory, f.meta) for _, f in sorted(keyed, key=lambda item: item[0])]

    def _trained_epochs(self, records: list[fence.LeaseRecord]) -> set[int]:
        """Epochs that rewound (resumed below their floor) and have since saved a whole checkpoint
        that no later epoch disowns: marked so by their saver (fence.mark_trained), or, for runs from
        before the mark, with one still whole. Only these rewinds bind; the others are not asked about."""
        late = superseded(records)  # floors only: a superseded writer's late save trains nothing
        rewinds = [r for r in records if r.resumed is not None and r.resumed < r.floor]
        marked = fence.trained_marks(self.run) if rewinds else set()
        trained = set()
        for record in rewinds:
            own = [f for f in self.found if f.meta is not None and f.meta.lease_epoch == record.epoch]
            timely = [f for f in own if not late(record.epoch, f.meta.sequence)]
            marked_in_time = record.epoch in marked and len(timely) == len(own)
            if marked_in_time or any(damage(f.directory) is None
                                     for f in sorted(timely, key=lambda f: -f.meta.sequence)):
                trained.add(record.epoch)
        return trained

    def superseded(self) -> list[Storage]:
        """Checkpoints a superseded writer or a trained-past branch left: never chosen, pruned."""
        listed = {d.name for d, _ in self.listed}
        return [f.directory for f in self.found
                if f.problem is None and f.directory.name not in listed
                and self.is_superseded(f.meta.lease_epoch, f.meta.sequence)]

    def claimed(self) -> list[Storage]:
        """Directories that are or were meant to be checkpoints one may resume from: a record, or
        one that cannot be read (not a save that died before its record, nor a disowned one)."""
        disowned = {d.name for d in self.superseded()}
        return [f.directory for f in self.found if f.problem in ("damaged", "denied")
                or (f.problem is None and f.directory.name not in disowned)]

    def walk(self) -> tuple[list[Storage], int | None]:
        """(the branch newest first, the step of the pruned parent it stops at or None)."""
        listed = self.listed
        if not listed:
            return [], None
        present = {f.directory.name for f in self.found}
        by_name = {directory.name: i for i, (directory, _) in enumerate(listed)}
        chain: list[Storage] = []
        gap = None
        position: int | None = len(listed) - 1
        while position is not None and listed[position][0] not in chain:
            directory, meta = listed[position]
            chain.append(directory)
            parent = meta.parent if isinstance(meta.parent, str) else None
            below = step_of(parent) if parent is not None else None
            if parent in by_name:
                position = by_name[parent]
            elif parent in present and below is not None:
                # A parent whose record cannot be read: its ancestors lie at lower steps (the step is
                # in the name), so the chain goes on with the newest listed checkpoint below it; a
                # newer one could be an abandoned branch that no lease marked (a run from before leases).
                older = [i for i in range(position) if step_of(listed[i][0].name) < below]
                position = older[-1] if older else None
            elif parent is None and meta.sequence == 0:  # before raychat kept a lineage: list order
                position = position - 1 if position > 0 else None
            else:
                # The start of the lineage, or its older part pruned. Not followed further: below a
                # pruned parent may lie an abandoned branch as well as this one's older checkpoints.
                gap = below if parent is not None else None
                position = None
        return chain, gap


def list_checkpoints(run_dir: Location, log: Callable[[str], None] = _warn) -> list[Storage]:
    """Checkpoint directories of a run that may be chosen, oldest first: by lineage sequence, then
    (for checkpoints without one) by when they were written, then by step."""
    return [directory for directory, _ in _Survey(Storage.of(run_dir), log).listed]


def claimed_checkpoints(run_dir: Location, log: Callable[[str], None] = _warn) -> list[Storage]:
    """Every directory of the run that is, or was meant to be, a checkpoint to resume from: what a
    driver that finds none whole must not start over on top of."""
    return _Survey(Storage.of(run_dir), log).claimed()


def branch(run_dir: Location, log: Callable[[str], None] = _warn) -> list[Storage]:
    """The current branch, newest first: the newest checkpoint, then its parent, its parent's
    parent... A rewound run's abandoned branch is not on it, whatever its step numbers (and once the
    rewound run has saved, not even listed). Where a parent cannot be read, or none was recorded
    (before raychat kept a lineage), the chain goes on with the next older checkpoint listed."""
    return _Survey(Storage.of(run_dir), log).walk()[0]


def latest_valid_checkpoint(run_dir: Location, step: int | None = None, deep: bool = False,
                            log: Callable[[str], None] = _warn) -> Storage | None:
    """Newest complete checkpoint of a run (`<storage_path>/<run_name>`) on its current branch, or None.

    Damaged checkpoints newer than the one returned are skipped, each with a one-line warning; the
    fallback walks the parent chain. With `step`, any checkpoint of that step that may be chosen
    is considered. deep=False trusts sizes, not hashes.
    """
    if step is not None:
        considered = [c for c in reversed(list_checkpoints(run_dir, log)) if step_of(c.name) == step]
    else:
        considered = branch(run_dir, log)
    for candidate in considered:
        problem = damage(candidate, deep=deep)
        if problem is None:
            return candidate
        log(f"skipping damaged checkpoint {candidate}: {problem}")
    return None


def prune_checkpoints(run_dir: Location, keep: int, log: Callable[[str], None] = _warn,
                      protect: Collection[str] = (), fence: Fence | None = None) -> list[str]:
    """Keep the `keep` newest complete checkpoints of the current branch and delete what is older
    than them: the branch's older checkpoints, what lies below the pruned parent the branch stops
    at, and saves that died before their record (at a step below the newest whole checkpoint's).
    Also what a superseded writer left and a branch the run has trained past. Never the checkpoints
    named in `protect` (the saver's: what it just wrote, what the run resumed from), never one whose
    record cannot be read. A checkpoint that cannot be deleted or read for good (access denied) is
    left with a line rather than failing the save it follows. With `fence`, the writer's lease is
    checked again before each deletion (LeaseLost once a newer epoch exists): a writer superseded
    while it pruned never deletes what its successor resumed from or is writing. Returns the names
    deleted, oldest first. keep <= 0 keeps everything."""
    if keep <= 0:
        return []
    survey = _Survey(Storage.of(run_dir), log, strict=False)
    chain, gap = survey.walk()
    chain.reverse()  # oldest first
    complete = [c for c in chain if damage(c, deep=False) is None]
    doomed = chain[:chain.index(complete[-keep])] if len(complete) > keep else []
    if gap is not None:
        # Below a pruned parent: what an earlier attempt's saver kept (the checkpoint it resumed
        # from is never its to prune) after pruning its children, so the branch no longer reaches
        # it. Older than every checkpoint of the branch: deleted, never chosen.
        doomed += [d for d, _ in survey.listed if d not in chain and step_of(d.name) < gap]
    if complete:
        # A save that died before its record (a killed rank 0, a lost node) left its ranks' files:
        # below the newest whole checkpoint's step no save of this writer is in progress.
        newest = step_of(complete[-1].name)
        doomed += [f.directory for f in survey.found
                   if f.problem in ("missing", "unfinished") and f.step < newest]
    doomed += survey.superseded()
    deleted = []
    for candidate in doomed:
        if candidate.name in protect:
            continue
        if fence is not None:
            fence.check()
        try:
            retry_transient(candidate.delete, f"deleting {candidate}")
            deleted.append(candidate.name)
        except OSError as e:
            log(f"could not delete old checkpoint {candidate}: {short_reason(e)}")
    return deleted
