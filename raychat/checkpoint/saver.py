"""Saving checkpoints during training without stalling it.

`AsyncCheckpointWriter` is the mechanism: it copies the state into (reused, on CUDA pinned) host
buffers, which is all the training thread waits for, and writes the files to the run's storage
(local disk or a bucket) in a background thread. `CheckpointSaver` is the policy the train loop
talks to on every rank: one save in flight at a time, each rank writes the pieces it owns (no
gather: its host buffers hold its own share only), rank 0 closes the checkpoint once every rank's
file is whole (raychat.checkpoint.sharded) and prunes old ones, each save's stall is logged, and
the final save is synchronous.

Checkpoints are written straight into `<storage>/<run>/checkpoint_<step>/` rather than handed to
Ray Train: then the run's storage is the one source of truth for "the latest checkpoint",
read the same way by the driver, every worker, `raychat.sample` and the sweeps, and a re-run of the
same run name (a new Ray controller that never saw the old checkpoints) resumes where it stopped.
"""

import dataclasses
import threading
import time
from collections.abc import Callable

import torch

from raychat.checkpoint.catalog import highest_sequence, prune_checkpoints, step_of
from raychat.checkpoint.fence import Fence, LeaseLost, mark_trained
from raychat.checkpoint.format import checkpoint_dir_name
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.sharded import Piece, finish_checkpoint, prepare_overwrite, write_rank
from raychat.common import RaychatError
from raychat.faults import StorageUnavailable, is_transient, short_reason
from raychat.storage import Storage


class AsyncCheckpointWriter:
    """Save in the background: `submit` costs one copy of this rank's pieces to host memory.

    submit() first waits for the previous save (one in flight at a time, so its host buffers can
    be reused), copies every piece into a host buffer (CUDA: pinned, non_blocking, ordered after
    the work already queued on the current stream; CPU: a plain copy), then runs the write in a
    thread. done() polls; wait() blocks and raises if the write failed. The host buffers stay
    allocated for the next save until close().
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._directory: Storage | str | None = None
        self._error: BaseException | None = None
        self.snapshot_seconds = 0.0  # of the last submit: time the caller was blocked copying state
        self.write_seconds = 0.0  # of the last save: time the background thread spent writing

    def _host_copy(self, tensor: torch.Tensor, key: tuple) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
        buffer.copy_(tensor.detach(), non_blocking=buffer.is_pinned())
        return buffer

    def submit(self, directory: Storage | str, pieces: list[Piece], write: Callable[[list[Piece]], None]
               ) -> None:
        """Snapshot `pieces` now and run `write(snapshot)` in the background; `directory` names where
        it goes, for errors."""
        self.wait()
        start = time.perf_counter()
        snapshot = [piece._replace(tensor=self._host_copy(piece.tensor, (piece.name, piece.start)))
                    for piece in pieces]
        copies_done = None
        if any(b.is_pinned() for b in self._buffers.values()):
            copies_done = torch.cuda.Event()
            copies_done.record()  # the thread waits for the device-to-host copies queued above
        self.snapshot_seconds = time.perf_counter() - start
        self._directory = directory
        self._error = None
        self._thread = threading.Thread(target=self._write, name="raychat-checkpoint-writer",
                                        args=(snapshot, write, copies_done))
        self._thread.start()

    def _write(self, snapshot: list[Piece], write: Callable[[list[Piece]], None],
               copies_done: "torch.cuda.Event | None") -> None:
        start = time.perf_counter()
        try:
            if copies_done is not None:
                copies_done.synchronize()
            write(snapshot)
        except BaseException as e:  # handed to the training thread by wait()
            self._error = e
        self.write_seconds = time.perf_counter() - start

    @property
    def buffer_bytes(self) -> int:
        """Host memory held for saves: the snapshot buffers, this rank's share of the state."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def done(self) -> bool:
        """True when no save is in flight (the last one finished, well or not: wait() tells)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Storage | str | None:
        """Block until the save in flight (if any) is written; return its directory.

        Raises RaychatError if the background write failed for a reason the user must fix (disk
        full, permissions, a missing bucket), StorageUnavailable (a plain exception: Ray restarts
        the attempt) for a storage fault that outlasted its retries, and a bug as it is.
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, RaychatError):  # already one line (a lease lost to another driver)
                raise error
            if isinstance(error, StorageUnavailable) or is_transient(error):
                reason = short_reason(error)
                raise StorageUnavailable(f"writing checkpoint {self._directory}: {reason}") from error
            if not isinstance(error, OSError):
                raise error
            raise RaychatError(f"writing checkpoint {self._directory} failed: {error}; "
                               "check free space and permissions of the checkpoint storage") from error
        return self._directory

    def close(self) -> None:
        """Finish the save in flight and free the host buffers."""
        try:
            self.wait()
        finally:
            self._buffers.clear()

    def __enter__(self) -> "AsyncCheckpointWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CheckpointSaver:
    """The train loop's side of checkpointing, on every rank.

    save() at a step snapshots this rank's pieces and returns; poll() at each later step reports a
    finished write (rank 0: the whole checkpoint, logged with its stall and write time) without
    waiting; finish() waits, for the final save and before stopping early (a NaN), so the last good
    checkpoint is whole when the loop ends. Rank 0 keeps the lineage: each checkpoint's meta names
    the one before it (`parent`) and counts (`sequence`).

    A background write that finds the run taken over (LeaseLost, on whichever rank) is not raised
    by poll() or prepare(): one rank leaving the loop would leave the others waiting in the next
    collective until its timeout. It is kept in `lost`, which the loop sums across ranks at the
    next step's all-reduce (or gathers after a synchronous save), so every rank stops at the same
    step (raychat.worker.loop). save() raises it (its caller may need to know; the loop catches it),
    and writes nothing once it is set; so does close().
    """

    def __init__(self, run: Storage, keep: int, rank: int, world_size: int, log: Callable[[str], None],
                 parent: CheckpointMeta | None = None, parent_name: str | None = None,
                 fence: Fence | None = None, suffix: str = ""):
        self.run, self.keep, self.rank, self.world_size, self.log = run, keep, rank, world_size, log
        # The run lease's fencing token: rank 0 checks it before a checkpoint's first shared file
        # and before every prune, and stamps it into each meta (raychat.checkpoint.fence).
        self.fence = fence or Fence(run, 0)
        self._marked = False  # this epoch's first whole save recorded (fence.mark_trained)
        self.writer = AsyncCheckpointWriter()
        self._pending_step: int | None = None
        self.latest_step: int | None = None  # the newest checkpoint known to be whole (this rank's part)
        self.latest_name: str | None = None  # and its directory's name
        # The run's driver resumed below its newest checkpoint (raychat.checkpoint.format.lineage_suffix):
        # every rank saves under names of this lineage's own.
        self.suffix = suffix
        self.parent_name = parent_name
        self.resumed_from = parent_name  # never pruned by this saver
        self.submitted_step: int | None = None  # the step of the last save() (one checkpoint per step)
        self.lost: str | None = None  # why a save of this rank was fenced: another driver holds the run
        self.sequence = max(parent.sequence if parent is not None else 0, self._run_sequence())

    def _run_sequence(self) -> int:
        """Rank 0: the highest sequence among the run's checkpoints (a superseded writer's too), so
        this saver numbers its own above them all and "latest" follows the lineage, not clocks. A
        run directory that is not a directory counts as empty here; its first write fails clearly
        (storage faults are retried and, past their budget, fail the attempt)."""
        if self.rank != 0:
            return 0
        try:
            return highest_sequence(self.run)
        except (NotADirectoryError, PermissionError):
            return 0

    def already_saved(self, step: int) -> bool:
        """This step is checkpointed already: by this saver, or it is the checkpoint the run resumed
        from (an attempt restarted after its final save). A checkpoint directory with a manifest is
        never written again: a second fault while it was rewritten would leave none."""
        resumed_step = step_of(self.resumed_from) if self.resumed_from is not None else None
        return step == self.submitted_step or step == resumed_step

    def prepare(self, step: int) -> None:
        """Rank 0, before the save's collective: a directory saved before at this step (a rerun)
        reads as incomplete before any rank writes into it again."""
        if self.rank == 0:
            self.poll(block=True)
            if self.lost is None:
                try:
                    prepare_overwrite(self.run.child(checkpoint_dir_name(step, self.suffix)), self.fence)
                except LeaseLost as e:
                    self.lost = str(e)

    def save(self, step: int, pieces: list[Piece], token: str, meta: CheckpointMeta | None = None,
             extra: dict | None = None, wait: bool = False) -> None:
        """Write this rank's `pieces`; rank 0 also `meta` and `extra` (the optimizer's plain data).
        `token` is the same on every rank for one save (from the save's collective)."""
        self.poll(block=True)  # one save in flight: the previous one must be whole first
        if self.lost is not None:
            raise LeaseLost(self.lost)
        directory = self.run.child(checkpoint_dir_name(step, self.suffix))
        rank, world = self.rank, self.world_size
        if rank == 0:
            self.sequence += 1
            meta = dataclasses.replace(meta, sequence=self.sequence, parent=self.parent_name,
                                       lease_epoch=self.fence.epoch)
            self.parent_name = directory.name
            meta_bytes = meta.to_json()  # now: a later change to the caller's objects is not saved

            def write(snapshot: list[Piece]) -> None:
                write_rank(directory, rank, world, token, snapshot, extra, self.fence)
                # a superseded writer never closes a checkpoint (each write of it fenced)
                finish_checkpoint(directory, world, token, meta_bytes, fence=self.fence)
                self.fence.check()  # nor deletes one
                if not self._marked and self.fence.epoch > 0:
                    mark_trained(self.run, self.fence.epoch)  # a rewind's abandoned branch, for good
                    self._marked = True
                protect = {directory.name, self.resumed_from}
                prune_checkpoints(self.run, self.keep, log=self.log, protect=protect, fence=self.fence)
        else:
            def write(snapshot: list[Piece]) -> None:
                write_rank(directory, rank, world, token, snapshot, fence=self.fence)
        self.writer.submit(directory, pieces, write)
        self._pending_step = self.submitted_step = step
        if wait:
            self.poll(block=True)
            if self.lost is not None:
                raise LeaseLost(self.lost)

    def poll(self, block: bool = False) -> int | None:
        """The step of a save that finished since the last call, or None."""
        if self._pending_step is None:
            return None
        if not block and not self.writer.done():
            return None
        try:
            directory = self.writer.wait()
        except LeaseLost as e:
            self._pending_step, self.lost = None, str(e)
            return None
        step, self._pending_step = self._pending_step, None
        self.latest_step, self.latest_name = step, directory.name
        if self.rank == 0:
            self.log(f"Checkpoint {directory.name} saved to {self.run} by {self.world_size} rank(s): "
                     f"training stalled {self.writer.snapshot_seconds * 1000:.0f}ms, written in "
                     f"{self.writer.write_seconds:.1f}s")
        return step

    def finish(self) -> int | None:
        """Wait for a save in flight; the step it saved, if any."""
        return self.poll(block=True)

    def close(self) -> None:
        """Finish the save in flight and free the host buffers; LeaseLost if a save was fenced."""
        self.finish()
        self.writer.close()
        if self.lost is not None:
            raise LeaseLost(self.lost)
