"""Checkpoints that are either complete or visibly not, load on any world size, and never run code.

A checkpoint is a directory:

    model.pt       flat dict parameter name -> full tensor                (torch.save)
    optim.pt       the optimizer's canonical state dict (nested dicts/lists/tuples of tensors and
                   plain numbers/strings/None, full logical tensors keyed by parameter name)
    meta.json      step, model config, plan, loader cursor, loop state, flags, version  (JSON)
    manifest.json  size and sha256 of the three files above; written LAST

Each file is written under a temporary name, fsynced and renamed, and the manifest comes last, so
a directory with a manifest whose sizes and hashes match is a whole checkpoint, and anything else
(a crash mid-write, a truncated copy into cloud storage) is detectably damaged. Because the state
is full logical tensors (the optimizer gathers its ZeRO shards into its canonical state dict), a
checkpoint saved by W workers loads on any W'.

Loading uses `torch.load(weights_only=True)` and `json`: a checkpoint file can hold tensors and
plain data, never a pickled object that runs code when loaded.

Saving must not stall training: `AsyncCheckpointWriter` copies the state to (reused, on CUDA
pinned) host buffers, which costs a memory copy, and writes the files in a background thread.
Ray Train V2 keeps reported checkpoints under `<storage_path>/<run_name>/checkpoint_<timestamp>/`
(`StorageContext.make_default_checkpoint_dir_name`: `checkpoint_%Y-%m-%d_%H-%M-%S.%f`), so names
sort in time order; `latest_valid_checkpoint` walks them newest first and skips damaged ones.
"""

import hashlib
import json
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from raychat.common import RaychatError

MODEL_FILE = "model.pt"
OPTIM_FILE = "optim.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
FORMAT = "raychat-checkpoint-1"
CHECKPOINT_PREFIX = "checkpoint_"  # Ray Train V2's directory names; ours when we name them too

_LEAF_TYPES = (bool, int, float, str, type(None), torch.Size)
_CRC32_OPTION_LOCK = threading.Lock()


# -----------------------------------------------------------------------------
# Writing


class _HashingWriter:
    """File object wrapper that hashes what passes through, so a save reads nothing back."""

    def __init__(self, file):
        self.file = file
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha256.update(data)  # hashlib releases the GIL for large buffers
        self.size += memoryview(data).nbytes
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """torch.save's per-record CRC32 costs about as much CPU as our sha256, which already guards
    every byte. The option is process-wide, so it is switched off only around our own saves (a
    concurrent foreign torch.save may then skip its CRC too, which torch.load does not mind)."""
    with _CRC32_OPTION_LOCK:
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(previous)


def _write_file(directory: Path, name: str, write: Callable[[Any], None]) -> dict:
    """Write one file under a temporary name, fsync, rename; return its manifest entry."""
    tmp = directory / f"{name}.tmp"
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        write(writer)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / name)
    return {"bytes": writer.size, "sha256": writer.sha256.hexdigest()}


def _check_key(key: Any, where: str) -> None:
    if type(key) not in (str, int):
        raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; checkpoint keys are str or int")


def _check_storable(obj: Any, where: str) -> None:
    """Refuse, at save time, anything `torch.load(weights_only=True)` would refuse at load time."""
    if isinstance(obj, torch.Tensor) or type(obj) in _LEAF_TYPES:
        return
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            _check_key(key, where)
            _check_storable(value, f"{where}[{key!r}]")
    elif type(obj) in (list, tuple):
        for i, value in enumerate(obj):
            _check_storable(value, f"{where}[{i}]")
    else:
        raise TypeError(f"{where} is a {type(obj).__name__}; a checkpoint holds tensors, dicts, lists, "
                        "tuples, bool/int/float/str and None")


def _encode_meta(meta: dict) -> bytes:
    # allow_nan: nanochat's loop state starts with min_val_bpb = inf, which Python's json round-trips
    return (json.dumps(meta, indent=2) + "\n").encode()


def _write_checkpoint(directory: Path, model_state: dict, optim_state: dict, meta_bytes: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    # Overwriting: drop the old manifest first, so the directory reads as incomplete until the end.
    stale_manifest = directory / MANIFEST_FILE
    if stale_manifest.exists():
        stale_manifest.unlink()
        _fsync_dir(directory)
    with _without_zip_crc32():
        files = {
            MODEL_FILE: _write_file(directory, MODEL_FILE, lambda f: torch.save(model_state, f)),
            OPTIM_FILE: _write_file(directory, OPTIM_FILE, lambda f: torch.save(optim_state, f)),
        }
    files[META_FILE] = _write_file(directory, META_FILE, lambda f: f.write(meta_bytes))
    _fsync_dir(directory)  # the three renames are durable before the manifest claims them
    manifest = (json.dumps({"format": FORMAT, "files": files}, indent=2) + "\n").encode()
    _write_file(directory, MANIFEST_FILE, lambda f: f.write(manifest))
    _fsync_dir(directory)


def save_checkpoint(directory: str | Path, model_state: dict[str, torch.Tensor], optim_state: dict,
                    meta: dict) -> None:
    """Write a checkpoint now (blocking). Tensors may live on any device; they load on any device.

    Files are written under temporary names and renamed; the manifest, written last, marks the
    checkpoint complete. Saving into an existing checkpoint directory replaces it.
    """
    _check_storable(model_state, "model state")
    _check_storable(optim_state, "optimizer state")
    _write_checkpoint(Path(directory), model_state, optim_state, _encode_meta(meta))


# -----------------------------------------------------------------------------
# Checking and loading


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def damage(directory: str | Path) -> str | None:
    """Why this directory is not a complete checkpoint (a short phrase), or None when it is."""
    directory = Path(directory)
    if not directory.is_dir():
        return "no such directory"
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST_FILE} (the save did not finish)"
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST_FILE} ({type(e).__name__})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"{MANIFEST_FILE} is not a {FORMAT} manifest"
    files = manifest.get("files")
    if (not isinstance(files, dict) or set(files) != {MODEL_FILE, OPTIM_FILE, META_FILE}
            or not all(isinstance(entry, dict) for entry in files.values())):
        return f"{MANIFEST_FILE} does not list {MODEL_FILE}, {OPTIM_FILE} and {META_FILE}"
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {entry.get('bytes')}"
        if _sha256_of(path) != entry.get("sha256"):
            return f"{name} does not match its sha256 in the manifest"
    return None


def is_complete(directory: str | Path) -> bool:
    """True when the manifest is present and every file matches its size and sha256."""
    return damage(directory) is None


def _load_tensors(path: Path, device: torch.device | str) -> Any:
    try:
        with open(path, "rb") as f:
            return torch.load(f, map_location=device, weights_only=True)
    except Exception as e:  # UnpicklingError, zip errors, RuntimeError from torch: all mean "not loadable"
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise RaychatError(f"checkpoint file {path} cannot be loaded as tensors and plain data "
                           f"(torch.load weights_only): {reason}; use an earlier checkpoint") from e


def load_checkpoint(directory: str | Path, device: torch.device | str = "cpu",
                    load_optimizer: bool = True, verified: bool = False) -> tuple[dict, dict, dict]:
    """(model_state, optim_state, meta) of a complete checkpoint, tensors on `device`.

    Verifies the manifest first; a damaged checkpoint raises RaychatError naming the directory.
    verified=True skips that when the caller has just checked the directory (damage() or
    latest_valid_checkpoint): hashing reads every byte, as much as the load itself. With
    load_optimizer=False (inference) the optimizer file, twice the model's size, is not read and
    optim_state is empty.
    """
    directory = Path(directory)
    problem = None if verified else damage(directory)
    if problem is not None:
        raise RaychatError(f"checkpoint {directory} is damaged or incomplete: {problem}; "
                           "resume from an earlier checkpoint of the run")
    model_state = _load_tensors(directory / MODEL_FILE, device)
    optim_state = _load_tensors(directory / OPTIM_FILE, device) if load_optimizer else {}
    return model_state, optim_state, read_meta(directory)


def read_meta(directory: str | Path) -> dict:
    """A checkpoint's meta.json (step, cursor, configs), read without verifying the tensors."""
    return json.loads((Path(directory) / META_FILE).read_text())


def _warn(message: str) -> None:
    print(f"raychat: warning: {message}", file=sys.stderr, flush=True)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories of a run, oldest first (Ray's timestamped names sort in time order)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX))


def latest_valid_checkpoint(run_dir: str | Path, step: int | None = None,
                            log: Callable[[str], None] = _warn) -> Path | None:
    """Newest complete checkpoint under a Ray run directory (`<storage_path>/<run_name>`), or None.

    Damaged checkpoints newer than the one returned are skipped, each with a one-line warning.
    With `step`, only checkpoints whose meta.json says that step are considered.
    """
    for candidate in reversed(list_checkpoints(run_dir)):
        if step is not None and _meta_step(candidate) != step:
            continue  # cheap test first: verifying hashes reads the whole checkpoint
        problem = damage(candidate)
        if problem is None:
            return candidate
        log(f"skipping damaged checkpoint {candidate}: {problem}")
    return None


def _meta_step(directory: Path) -> int | None:
    try:
        return read_meta(directory).get("step")
    except (OSError, ValueError, AttributeError):
        return None


# -----------------------------------------------------------------------------
# Asynchronous saving


class AsyncCheckpointWriter:
    """Save checkpoints in the background: `submit` costs one copy of the state to host memory.

    submit() first waits for the previous save (one in flight at a time, so its host buffers can
    be reused), copies every tensor into a host buffer (CUDA: pinned, non_blocking, ordered after
    the work already queued on the current stream; CPU: a plain copy), then writes the files in a
    thread. Poll done() each step; when it is True, wait() returns the directory, ready for
    `ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))`.
    The host buffers stay allocated for the next save until close().
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._directory: Path | None = None
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
                _check_key(k, where)
                copy[k] = self._snapshot(v, (*key, k), f"{where}[{k!r}]")
            return copy
        if type(obj) in (list, tuple):
            return type(obj)(self._snapshot(v, (*key, i), f"{where}[{i}]") for i, v in enumerate(obj))
        _check_storable(obj, where)
        return obj

    def submit(self, directory: str | Path, model_state: dict[str, torch.Tensor], optim_state: dict,
               meta: dict) -> None:
        """Snapshot the state now and write the checkpoint to `directory` in the background."""
        self.wait()
        start = time.perf_counter()
        meta_bytes = _encode_meta(meta)  # now, so a later change to the caller's dict is not saved
        model_copy = self._snapshot(model_state, ("model",), "model state")
        optim_copy = self._snapshot(optim_state, ("optim",), "optimizer state")
        copies_done = None
        if any(b.is_pinned() for b in self._buffers.values()):
            copies_done = torch.cuda.Event()
            copies_done.record()  # the thread waits for the device-to-host copies queued above
        self.snapshot_seconds = time.perf_counter() - start
        self._directory = Path(directory)
        self._error = None
        args = (self._directory, model_copy, optim_copy, meta_bytes, copies_done)
        self._thread = threading.Thread(target=self._write, name="raychat-checkpoint-writer", args=args)
        self._thread.start()

    def _write(self, directory: Path, model_state: dict, optim_state: dict, meta_bytes: bytes,
               copies_done: "torch.cuda.Event | None") -> None:
        start = time.perf_counter()
        try:
            if copies_done is not None:
                copies_done.synchronize()
            _write_checkpoint(directory, model_state, optim_state, meta_bytes)
        except BaseException as e:  # handed to the training thread by wait()
            self._error = e
        self.write_seconds = time.perf_counter() - start

    def done(self) -> bool:
        """True when no save is in flight (the last one finished, well or not: wait() tells)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is written; return its directory.

        Raises RaychatError if the background write failed (disk full, permissions, ...).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RaychatError(f"writing checkpoint {self._directory} failed: {error}; "
                               "check free space and permissions of the checkpoint directory") from error
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
