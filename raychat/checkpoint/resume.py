"""Which checkpoint a run resumes from: one rule, read from the run's storage by everyone.

The driver picks the checkpoint a new run starts from (the newest whole one, or `--resume-from-step`),
verifies its hashes once and passes its name to the workers. Within that driver's run, Ray may
restart the worker group (a lost worker, a resize); then the workers resume from the newest
checkpoint that this run itself wrote, which the driver could not know about. Rank 0 decides and
every rank follows, so all ranks load the same checkpoint; each rank reads only the byte ranges it
needs and checks their hashes on the way, and if any rank finds damage, all fall back to an earlier
one together. The driver's check is the manifest and the files' sizes (a listing), not a read.

The commands that read a finished run (`raychat.sample`, `raychat.evaluate`, `raychat.export`) take
the latest complete checkpoint, or the one at `--step`, by the same rule (`find_checkpoint`).
"""

from collections.abc import Callable
from typing import Any, TypeVar

from raychat.checkpoint.catalog import branch, claimed_checkpoints, latest_valid_checkpoint, list_checkpoints
from raychat.checkpoint.format import damage, read_meta
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.reader import CheckpointReader
from raychat.checkpoint.shardfile import CheckpointDamaged
from raychat.common import RaychatError
from raychat.storage import Storage

T = TypeVar("T")


def find_checkpoint(run: Storage, step: int | None) -> Storage:
    """The checkpoint a command reads: the run's latest complete one, or the one at `step`; one
    RaychatError line naming --run-name/--storage-path or --step when there is none."""
    with run.read_faults_as_errors():
        if not run.is_dir():
            raise RaychatError(f"no run at {run}: check --run-name and --storage-path")
        found = latest_valid_checkpoint(run, step=step)
    if found is None:
        wanted = "a complete checkpoint" if step is None else f"a complete checkpoint at step {step}"
        raise RaychatError(f"run {run} has no {wanted}: drop --step for the latest, or train longer")
    return found


def driver_choice(run: Storage, resume_from_step: int, log: Callable[[str], None]) -> Storage | None:
    """The checkpoint a new run starts from (manifest and sizes checked), or None for a fresh run."""
    if resume_from_step >= 0:
        found = latest_valid_checkpoint(run, step=resume_from_step, log=log)
        if found is None:
            steps = ", ".join(c.name for c in list_checkpoints(run)) or "none"
            raise RaychatError(f"--resume-from-step {resume_from_step}: no complete checkpoint of that step "
                               f"in {run} (checkpoints there: {steps}); pick one of those or drop the flag")
        return found
    latest = latest_valid_checkpoint(run, log=log)
    if latest is None:
        refuse_starting_over(run)
    return latest


def refuse_starting_over(run: Storage) -> None:
    """One line if `run` has checkpoints but none whole: a fresh start would train from step 0 and
    its first save would prune them, and they may only look damaged for now (a restore or a copy
    into the run still under way, a bucket's files still uploading)."""
    claimed = [c.name for c in claimed_checkpoints(run, log=lambda _: None)]
    if claimed:
        shown = ", ".join(claimed[-5:]) + (f" and {len(claimed) - 5} older" if len(claimed) > 5 else "")
        raise RaychatError(f"every checkpoint of {run} looks damaged or incomplete ({shown}): nothing was "
                           "started over them; if a copy or restore into the run is under way, let it "
                           "finish and rerun; else pick one with --resume-from-step, or use a new --run-name")


def candidates(run: Storage, session: str, first_choice: str | None) -> list[str]:
    """Checkpoint names to try, best first: this session's newest if it wrote any (a restart of
    the worker group), else the driver's choice; then each older whole-looking one of its branch
    (the parent chain, never an abandoned branch or a superseded writer's checkpoints)."""
    looking_whole = [c for c in branch(run) if damage(c, deep=False) is None]  # newest first
    names = [c.name for c in looking_whole]
    if looking_whole and read_meta(looking_whole[0]).session == session:
        return names
    if first_choice in names:
        return names[names.index(first_choice):]
    if first_choice is not None:
        # Starting fresh here would train from step 0 and let its saves prune the run's real
        # checkpoints: a hand (or a writer outside raychat's lease) removed what the driver verified.
        raise RaychatError(f"checkpoint {first_choice} of {run}, chosen by the driver, is gone (removed by "
                           "hand, or written over outside raychat): re-run to resume from what is there now")
    return []


class Restore:
    """Resume state agreed by all ranks: `meta` first (cheap: the loader can start on its cursor),
    then `load()` the tensors, falling back to an older checkpoint if any rank finds damage."""

    def __init__(self, run: Storage, names: list[str], all_gather: Callable[[Any], list[Any]],
                 log: Callable[[str], None]):
        self.run = run
        self.names = names
        self.all_gather = all_gather
        self.log = log
        self.meta: CheckpointMeta | None = read_meta(run.child(names[0])) if names else None

    @property
    def checkpoint(self) -> Storage | None:
        return self.run.child(self.names[0]) if self.names else None

    def load(self, read: Callable[[CheckpointReader], T]) -> T | None:
        """`read(reader)` of the first checkpoint every rank reads without damage (`read` must be
        local: no collective, since ranks that found damage stop early); None if there is nothing
        to resume. After a fallback `meta` describes the one loaded."""
        tried = list(self.names)
        while self.names:
            directory = self.run.child(self.names[0])
            try:
                with CheckpointReader(directory) as reader:
                    share, meta, problem = read(reader), reader.meta, None
            except CheckpointDamaged as e:
                share = meta = None
                problem = f"checkpoint {directory} is damaged or incomplete: {e}"
            problems = [p for p in self.all_gather(problem) if p is not None]
            if not problems:
                self.meta = meta
                return share
            self.log(f"warning: {problems[0]}; using an earlier checkpoint")
            self.names = self.names[1:]
            self.meta = read_meta(self.run.child(self.names[0])) if self.names else None
        if not tried:
            return None
        raise RaychatError(f"every checkpoint of {self.run} this run could resume from is damaged "
                           f"({', '.join(tried)}): restore one from a backup or start a new --run-name")
