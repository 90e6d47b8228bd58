"""Saving checkpoints during training without stalling it.

`AsyncCheckpointWriter` is the mechanism: it copies the state into (reused, on CUDA pinned) host
buffers, which is all the training thread waits for, and writes the files to the run's storage
(local disk or a bucket) in a background thread. `CheckpointSaver` is the policy the train loop
talks to: one save in flight at a time, prune old checkpoints once a new one is whole, log how long
each save stalled training, and the final save is synchronous.

Checkpoints are written straight into `<storage>/<run>/checkpoint_<step>/` by rank 0 rather than
handed to Ray Train: then the run's storage is the one source of truth for "the latest checkpoint",
read the same way by the driver, every worker, `raychat.sample` and the sweeps, and a re-run of the
same run name (a new Ray controller that never saw the old checkpoints) resumes where it stopped.
"""

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from raychat.checkpoint.format import (
    check_key,
    check_storable,
    checkpoint_dir_name,
    encode_meta,
    prune_checkpoints,
    write_checkpoint,
)
from raychat.common import RaychatError
from raychat.storage import Location, Storage


class AsyncCheckpointWriter:
    """Save checkpoints in the background: `submit` costs one copy of the state to host memory.

    submit() first waits for the previous save (one in flight at a time, so its host buffers can
    be reused), copies every tensor into a host buffer (CUDA: pinned, non_blocking, ordered after
    the work already queued on the current stream; CPU: a plain copy), then writes the files in a
    thread. done() polls; wait() blocks and raises if the write failed. The host buffers stay
    allocated for the next save until close().
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._directory: Storage | None = None
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

    def _snapshot(self, obj: Any, key: tuple, where: str) -> Any:
        """Deep copy of a state tree: tensors into host buffers, containers rebuilt (the caller
        keeps mutating its own dicts while we write)."""
        if isinstance(obj, torch.Tensor):
            return self._host_copy(obj, key)
        if type(obj) in (dict, OrderedDict):
            copy = type(obj)()
            for k, v in obj.items():
                check_key(k, where)
                copy[k] = self._snapshot(v, (*key, k), f"{where}[{k!r}]")
            return copy
        if type(obj) in (list, tuple):
            return type(obj)(self._snapshot(v, (*key, i), f"{where}[{i}]") for i, v in enumerate(obj))
        check_storable(obj, where)
        return obj

    def submit(self, directory: Location, model_state: dict[str, torch.Tensor], optim_state: dict,
               meta: dict, then: Callable[[], None] | None = None) -> None:
        """Snapshot the state now and write the checkpoint to `directory` in the background;
        `then` runs in the background after a successful write."""
        self.wait()
        start = time.perf_counter()
        meta_bytes = encode_meta(meta)  # now, so a later change to the caller's dict is not saved
        model_copy = self._snapshot(model_state, ("model",), "model state")
        optim_copy = self._snapshot(optim_state, ("optim",), "optimizer state")
        copies_done = None
        if any(b.is_pinned() for b in self._buffers.values()):
            copies_done = torch.cuda.Event()
            copies_done.record()  # the thread waits for the device-to-host copies queued above
        self.snapshot_seconds = time.perf_counter() - start
        self._directory = Storage.of(directory)
        self._error = None
        args = (self._directory, model_copy, optim_copy, meta_bytes, copies_done, then)
        self._thread = threading.Thread(target=self._write, name="raychat-checkpoint-writer", args=args)
        self._thread.start()

    def _write(self, directory: Storage, model_state: dict, optim_state: dict, meta_bytes: bytes,
               copies_done: "torch.cuda.Event | None", then: Callable[[], None] | None) -> None:
        start = time.perf_counter()
        try:
            if copies_done is not None:
                copies_done.synchronize()
            write_checkpoint(directory, model_state, optim_state, meta_bytes)
            if then is not None:
                then()
        except BaseException as e:  # handed to the training thread by wait()
            self._error = e
        self.write_seconds = time.perf_counter() - start

    def done(self) -> bool:
        """True when no save is in flight (the last one finished, well or not: wait() tells)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Storage | None:
        """Block until the save in flight (if any) is written; return its directory.

        Raises RaychatError if the background write failed (disk full, permissions, ...).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
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
    """The train loop's side of checkpointing (rank 0 writes; on other ranks every call is a no-op).

    save() at a step snapshots and returns; poll() at each later step reports a finished write
    (logged with its stall and write time) without waiting; finish() waits, for the final save and
    before stopping early (a NaN), so the last good checkpoint is always whole when the loop ends.
    """

    def __init__(self, run: Storage, keep: int, enabled: bool, log: Callable[[str], None]):
        self.run = run
        self.keep = keep
        self.log = log
        self.writer = AsyncCheckpointWriter() if enabled else None
        self._pending_step: int | None = None
        self.latest_step: int | None = None  # the newest checkpoint known to be whole in storage

    def save(self, step: int, model_state: dict, optim_state: dict, meta: dict, wait: bool = False) -> None:
        if self.writer is None:
            return
        self.poll(block=True)  # one save in flight: the previous one must be whole first
        self.writer.submit(self.run.child(checkpoint_dir_name(step)), model_state, optim_state, meta,
                           then=lambda: prune_checkpoints(self.run, self.keep, log=self.log))
        self._pending_step = step
        if wait:
            self.poll(block=True)

    def poll(self, block: bool = False) -> int | None:
        """The step of a save that finished since the last call, or None."""
        if self.writer is None or self._pending_step is None:
            return None
        if not block and not self.writer.done():
            return None
        directory = self.writer.wait()
        step, self._pending_step = self._pending_step, None
        self.latest_step = step
        self.log(f"Checkpoint {directory.name} saved to {self.run}: training stalled "
                 f"{self.writer.snapshot_seconds * 1000:.0f}ms, written in {self.writer.write_seconds:.1f}s")
        return step

    def finish(self) -> int | None:
        """Wait for a save in flight; the step it saved, if any."""
        return self.poll(block=True)

    def close(self) -> None:
        if self.writer is not None:
            self.finish()
            self.writer.close()
