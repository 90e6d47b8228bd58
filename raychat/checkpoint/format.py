"""Checkpoints that are either complete or visibly not, load on any world size, and never run code.

A checkpoint is a directory `<storage>/<run>/checkpoint_<step:06d>/` on local disk or in a bucket:

    model.pt       flat dict parameter name -> full tensor                (torch.save)
    optim.pt       the optimizer's canonical state dict (nested dicts/lists/tuples of tensors and
                   plain numbers/strings/None, full logical tensors keyed by parameter name)
    meta.json      step, model config, plan, loader cursor, loop state, flags, version  (JSON)
    manifest.json  size and sha256 of the three files above; written LAST

On local disk each file is written under a temporary name, fsynced and renamed; in an object store
each object appears whole when its upload completes. The manifest comes last either way, so a
directory whose manifest matches its files' sizes and hashes is a whole checkpoint and anything else
(a crash mid-write, a truncated copy) is detectably damaged. Because the state is full logical
tensors (the optimizer gathers its ZeRO shards into its canonical state dict), a checkpoint saved by
W workers loads on any W'.

Loading streams each file once, hashing it on the way, and `torch.load(weights_only=True)`s the
bytes: a checkpoint file can hold tensors and plain data, never a pickled object that runs code.

"The latest checkpoint" of a run is the one whose manifest was written last (ties: the higher
step). After `--resume-from-step` rewinds a run, its new checkpoints are the latest even though the
abandoned branch has higher step numbers.
"""

import hashlib
import io
import json
import os
import pickle
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch

from raychat.common import RaychatError
from raychat.storage import Location, Storage

MODEL_FILE = "model.pt"
OPTIM_FILE = "optim.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
FORMAT = "raychat-checkpoint-1"
CHECKPOINT_PREFIX = "checkpoint_"

_LEAF_TYPES = (bool, int, float, str, type(None), torch.Size)
_CRC32_OPTION_LOCK = threading.Lock()
_READ_CHUNK = 16 << 20


class CheckpointDamaged(RaychatError):
    """A checkpoint that is incomplete or whose bytes do not match its manifest."""


def checkpoint_dir_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:06d}"


# -----------------------------------------------------------------------------
# Writing


class _HashingWriter:
    """File object wrapper that hashes what passes through, so a save reads nothing back."""

    def __init__(self, file: BinaryIO):
        self.file = file
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha256.update(data)  # hashlib releases the GIL for large buffers
        self.size += memoryview(data).nbytes
        self.file.write(data)
        return memoryview(data).nbytes

    def flush(self) -> None:
        self.file.flush()


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


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(directory: Storage, name: str, write: Callable[[Any], None]) -> dict:
    """Write one file and return its manifest entry. Local disk: temporary name, fsync, rename."""
    if directory.is_local:
        tmp = Path(directory.path(f"{name}.tmp"))
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory.path(name))
    else:
        with directory.open_output(name) as f:
            writer = _HashingWriter(f)
            write(writer)
    return {"bytes": writer.size, "sha256": writer.sha256.hexdigest()}


def check_key(key: Any, where: str) -> None:
    if type(key) not in (str, int):
        raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; checkpoint keys are str or int")


def check_storable(obj: Any, where: str) -> None:
    """Refuse, at save time, anything `torch.load(weights_only=True)` would refuse at load time."""
    if isinstance(obj, torch.Tensor) or type(obj) in _LEAF_TYPES:
        return
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            check_key(key, where)
            check_storable(value, f"{where}[{key!r}]")
    elif type(obj) in (list, tuple):
        for i, value in enumerate(obj):
            check_storable(value, f"{where}[{i}]")
    else:
        raise TypeError(f"{where} is a {type(obj).__name__}; a checkpoint holds tensors, dicts, lists, "
                        "tuples, bool/int/float/str and None")


def encode_meta(meta: dict) -> bytes:
    # allow_nan: nanochat's loop state starts with min_val_bpb = inf, which Python's json round-trips
    return (json.dumps(meta, indent=2) + "\n").encode()


def write_checkpoint(directory: Location, model_state: dict, optim_state: dict, meta_bytes: bytes) -> None:
    """Write the three files, then the manifest that claims them. Replaces an existing checkpoint:
    its manifest goes first, so the directory reads as incomplete until the new one is whole."""
    directory = Storage.of(directory)
    directory.make_dir()
    if directory.exists(MANIFEST_FILE):
        directory.delete(MANIFEST_FILE)
        if directory.is_local:
            _fsync_dir(directory.root)
    with _without_zip_crc32():
        files = {
            MODEL_FILE: _write_file(directory, MODEL_FILE, lambda f: torch.save(model_state, f)),
            OPTIM_FILE: _write_file(directory, OPTIM_FILE, lambda f: torch.save(optim_state, f)),
        }
    files[META_FILE] = _write_file(directory, META_FILE, lambda f: f.write(meta_bytes))
    if directory.is_local:
        _fsync_dir(directory.root)  # the three renames are durable before the manifest claims them
    manifest = (json.dumps({"format": FORMAT, "files": files}, indent=2) + "\n").encode()
    _write_file(directory, MANIFEST_FILE, lambda f: f.write(manifest))
    if directory.is_local:
        _fsync_dir(directory.root)


def save_checkpoint(directory: Location, model_state: dict[str, torch.Tensor], optim_state: dict,
                    meta: dict) -> None:
    """Write a checkpoint now (blocking). Tensors may live on any device; they load on any device."""
    check_storable(model_state, "model state")
    check_storable(optim_state, "optimizer state")
    write_checkpoint(directory, model_state, optim_state, encode_meta(meta))


# -----------------------------------------------------------------------------
# Checking and loading


def _read_manifest(directory: Storage) -> dict[str, dict]:
    """The manifest's file table, or CheckpointDamaged saying what is wrong with it."""
    try:
        manifest = json.loads(directory.read_bytes(MANIFEST_FILE))
    except FileNotFoundError:
        raise CheckpointDamaged(f"no {MANIFEST_FILE} (the save did not finish)") from None
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"unreadable {MANIFEST_FILE} ({type(e).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointDamaged(f"{MANIFEST_FILE} is not a {FORMAT} manifest")
    files = manifest.get("files")
    if (not isinstance(files, dict) or set(files) != {MODEL_FILE, OPTIM_FILE, META_FILE}
            or not all(isinstance(entry, dict) for entry in files.values())):
        raise CheckpointDamaged(f"{MANIFEST_FILE} does not list {MODEL_FILE}, {OPTIM_FILE} and {META_FILE}")
    return files


def _check_sizes(directory: Storage, files: dict[str, dict]) -> None:
    for name, entry in files.items():
        size = directory.info(name).size
        if size is None:
            raise CheckpointDamaged(f"{name} is missing")
        if size != entry.get("bytes"):
            raise CheckpointDamaged(f"{name} has {size} bytes, the manifest says {entry.get('bytes')}")


def _read_verified(directory: Storage, name: str, entry: dict, keep: bool = True) -> bytes:
    """A file's bytes, read once with its sha256 computed on the way; damage raises. keep=False
    only verifies: nothing is held in memory (the driver's pass over a multi-GB checkpoint)."""
    digest, buffer, size = hashlib.sha256(), io.BytesIO(), 0
    try:
        with directory.open_input(name) as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                if keep:
                    buffer.write(chunk)
    except FileNotFoundError:
        raise CheckpointDamaged(f"{name} is missing") from None
    if size != entry.get("bytes"):
        raise CheckpointDamaged(f"{name} has {size} bytes, the manifest says {entry.get('bytes')}")
    if digest.hexdigest() != entry.get("sha256"):
        raise CheckpointDamaged(f"{name} does not match its sha256 in the manifest")
    return buffer.getvalue()


def damage(directory: Location, deep: bool = True) -> str | None:
    """Why this directory is not a complete checkpoint (a short phrase), or None when it is.

    deep=False checks the manifest and the files' sizes only (a listing, no data read); deep=True
    also hashes every byte.
    """
    directory = Storage.of(directory)
    try:
        if not directory.is_dir():
            return "no such directory"
        files = _read_manifest(directory)
        _check_sizes(directory, files)
        if deep:
            for name, entry in files.items():
                _read_verified(directory, name, entry, keep=False)
    except CheckpointDamaged as e:
        return str(e)
    return None


def is_complete(directory: Location) -> bool:
    """True when the manifest is present and every file matches its size and sha256."""
    return damage(directory) is None


def _load_tensors(directory: Storage, name: str, entry: dict, device: torch.device | str) -> Any:
    data = _read_verified(directory, name, entry)
    try:
        return torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except torch.OutOfMemoryError:
        raise  # not damage: the checkpoint is fine, the device is full
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        # what torch.load raises for a forbidden global, a broken zip record or a short stream
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointDamaged(f"checkpoint file {directory.path(name)} cannot be loaded as tensors and "
                                f"plain data (torch.load weights_only): {reason}") from e


def load_checkpoint(directory: Location, device: torch.device | str = "cpu",
                    load_optimizer: bool = True) -> tuple[dict, dict, dict]:
    """(model_state, optim_state, meta) of a complete checkpoint, tensors on `device`.

    Each file is read once and checked against the manifest as it streams; a damaged checkpoint
    raises CheckpointDamaged (a RaychatError) naming the directory. With load_optimizer=False
    (inference) the optimizer file, twice the model's size, is not read and optim_state is empty.
    """
    directory = Storage.of(directory)
    try:
        files = _read_manifest(directory)
        model_state = _load_tensors(directory, MODEL_FILE, files[MODEL_FILE], device)
        optim_state = (_load_tensors(directory, OPTIM_FILE, files[OPTIM_FILE], device)
                       if load_optimizer else {})
        meta = json.loads(_read_verified(directory, META_FILE, files[META_FILE]))
    except CheckpointDamaged as e:
        raise CheckpointDamaged(f"checkpoint {directory} is damaged or incomplete: {e}; "
                                "resume from an earlier checkpoint of the run") from None
    return model_state, optim_state, meta


def read_meta(directory: Location) -> dict:
    """A checkpoint's meta.json (step, cursor, configs), read without verifying the tensors."""
    return json.loads(Storage.of(directory).read_bytes(META_FILE))


def _warn(message: str) -> None:
    print(f"raychat: warning: {message}", file=sys.stderr, flush=True)


def _step_of(name: str) -> int | None:
    digits = name[len(CHECKPOINT_PREFIX):]
    return int(digits) if name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() else None


def _written_at(directory: Storage) -> int:
    """Whole seconds (object stores keep no more) when the manifest was written; without one, when
    the newest file in the directory was."""
    info = directory.info(MANIFEST_FILE)
    times = [info.mtime] if info.mtime is not None else [e.mtime for e in directory.entries()]
    times = [t for t in times if t is not None]
    return int(max(times).timestamp()) if times else 0


def list_checkpoints(run_dir: Location) -> list[Storage]:
    """Checkpoint directories of a run, oldest first: by when they were written, then by step."""
    run = Storage.of(run_dir)
    keyed = []
    for name in run.subdirs():
        step = _step_of(name)
        if step is not None:
            directory = run.child(name)
            keyed.append(((_written_at(directory), step), directory))
    return [directory for _, directory in sorted(keyed, key=lambda item: item[0])]


def latest_valid_checkpoint(run_dir: Location, step: int | None = None, deep: bool = True,
                            log: Callable[[str], None] = _warn) -> Storage | None:
    """Newest complete checkpoint of a run (`<storage_path>/<run_name>`), or None.

    Damaged checkpoints newer than the one returned are skipped, each with a one-line warning.
    With `step`, only checkpoints of that step are considered. deep=False trusts sizes, not hashes.
    """
    for candidate in reversed(list_checkpoints(run_dir)):
        if step is not None and _step_of(candidate.name) != step:
            continue
        problem = damage(candidate, deep=deep)
        if problem is None:
            return candidate
        log(f"skipping damaged checkpoint {candidate}: {problem}")
    return None


def prune_checkpoints(run_dir: Location, keep: int, log: Callable[[str], None] = _warn) -> list[str]:
    """Delete all but the `keep` newest complete checkpoints (and anything older than those).
    Returns the names deleted. keep <= 0 keeps everything."""
    if keep <= 0:
        return []
    checkpoints = list_checkpoints(run_dir)
    complete = [c for c in checkpoints if damage(c, deep=False) is None]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    deleted = []
    for candidate in checkpoints[:checkpoints.index(oldest_kept)]:
        try:
            candidate.delete()
            deleted.append(candidate.name)
        except OSError as e:
            log(f"could not delete old checkpoint {candidate}: {e}")
    return deleted
