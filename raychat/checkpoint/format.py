"""One checkpoint directory: its files, written so that it is whole or visibly not.

A checkpoint is a directory `<storage>/<run>/checkpoint_<step:06d>/` on local disk or in a bucket
(`checkpoint_<step:06d>-e<epoch>/` when its run resumed below the run's newest checkpoint: a rewind's
saves never write into the branch it left):

    rank_<r>-of-<W>.safetensors   what rank r of the W that saved owns (raychat.checkpoint.sharded)
    index.json                    every logical tensor: dtype, shape, which file holds which range
    meta.json                     the typed record (raychat.checkpoint.meta.CheckpointMeta)
    manifest.json                 size and sha256 of every file above; written LAST, by rank 0

On local disk each file is written under a temporary name, fsynced and renamed; in an object store
each object appears whole when its upload completes. The manifest comes last either way, so a
directory whose manifest matches its files is a whole checkpoint and anything else (a crash
mid-save, a rank that died, a truncated copy) is detectably damaged. Checking a checkpoint before a
run costs one listing (the manifest's sizes); the hashes are checked by the ranks as they read.

Checkpoints of raychat before the sharded format (model.pt + optim.pt) are refused in one line that
names `python -m raychat.checkpoint.convert`, which rewrites them in place.

Which checkpoints a run has, and which of them is the latest, is raychat.checkpoint.catalog's.
"""

import hashlib
import json
from collections.abc import Callable
from typing import Any, BinaryIO

from raychat.checkpoint.fence import Fence
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.shardfile import CheckpointDamaged
from raychat.common import RaychatError
from raychat.faults import retry_transient, short_reason
from raychat.storage import Location, Storage

META_FILE = "meta.json"
INDEX_FILE = "index.json"
MANIFEST_FILE = "manifest.json"
FORMAT = "raychat-checkpoint-2"
LEGACY_FORMAT = "raychat-checkpoint-1"  # model.pt + optim.pt, one process wrote everything
CHECKPOINT_PREFIX = "checkpoint_"
_READ_CHUNK = 16 << 20


class LegacyCheckpoint(RaychatError):
    """A checkpoint in raychat's old single-file format: not damaged, not readable as is."""


class CheckpointUnreadable(RaychatError):
    """A checkpoint record that is there but may not be read (access denied): no retry heals it, and
    no guess may order the checkpoint around it."""


def checkpoint_dir_name(step: int, suffix: str = "") -> str:
    """`checkpoint_<step>`, or with `suffix` (`-e<epoch>`): the name a run that resumed below the
    run's newest checkpoint (a rewind, a fallback from damage) saves under, so that its saves never
    write into a checkpoint of the branch it left, whole or still being restored."""
    return f"{CHECKPOINT_PREFIX}{step:06d}{suffix}"


def lineage_suffix(epoch: int) -> str:
    return f"-e{epoch}"


def rank_file(rank: int, world: int) -> str:
    return f"rank_{rank:05d}-of-{world:05d}.safetensors"


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


def write_file(directory: Storage, name: str, write: Callable[[Any], None],
               fence: Fence | None = None) -> dict:
    """Write one file and return its manifest entry. Local disk: temporary name, fsync, rename.
    A transient storage fault rewrites the whole file (`write` writes from the save's host
    snapshot, so it can run again); past the retry budget the attempt fails (raychat.faults).
    With `fence`, every try first checks that this writer still holds the run: a write that
    stalled past a takeover is not retried over the new writer's files."""
    def attempt() -> dict:
        if fence is not None:
            fence.check()
        return _write_file_once(directory, name, write)

    return retry_transient(attempt, f"writing {directory}/{name}")


def _write_file_once(directory: Storage, name: str, write: Callable[[Any], None]) -> dict:
    def hashed(f: BinaryIO) -> _HashingWriter:
        writer = _HashingWriter(f)
        write(writer)
        return writer

    writer = directory.write_whole(name, hashed)
    return {"bytes": writer.size, "sha256": writer.sha256.hexdigest()}


def write_manifest(directory: Storage, world: int, files: dict[str, dict],
                   fence: Fence | None = None) -> None:
    """The last write of a save: from now on the directory is a checkpoint."""
    manifest = (json.dumps({"format": FORMAT, "world_size": world, "files": files}, indent=2) + "\n").encode()
    write_file(directory, MANIFEST_FILE, lambda f: f.write(manifest), fence)
    directory.sync()


# -----------------------------------------------------------------------------
# Checking


def convert_hint(directory: Storage) -> str:
    return (f"checkpoint {directory} is in raychat's old format (model.pt + optim.pt); convert it once with "
            f"`python -m raychat.checkpoint.convert {directory}`, then rerun")


def read_manifest(directory: Storage) -> dict[str, dict]:
    """The manifest's file table, CheckpointDamaged saying what is wrong with it, or LegacyCheckpoint."""
    try:  # a transient read error is retried, never taken for damage (raychat.faults)
        data = retry_transient(lambda: directory.read_bytes(MANIFEST_FILE), f"reading {directory} manifest")
        manifest = json.loads(data)
    except FileNotFoundError:
        raise CheckpointDamaged(f"no {MANIFEST_FILE} (the save did not finish)") from None
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"unreadable {MANIFEST_FILE} ({type(e).__name__})") from None
    if isinstance(manifest, dict) and manifest.get("format") == LEGACY_FORMAT:
        raise LegacyCheckpoint(convert_hint(directory))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointDamaged(f"{MANIFEST_FILE} is not a {FORMAT} manifest")
    files = manifest.get("files")
    if (not isinstance(files, dict) or not {INDEX_FILE, META_FILE} <= set(files)
            or not all(isinstance(entry, dict) for entry in files.values())):
        raise CheckpointDamaged(f"{MANIFEST_FILE} does not list {INDEX_FILE} and {META_FILE}")
    return files


def _check_sizes(directory: Storage, files: dict[str, dict]) -> None:
    """One listing: every file the manifest claims is there with its size."""
    sizes = {info.base_name: info.size for info in retry_transient(directory.entries, f"listing {directory}")}
    for name, entry in files.items():
        if name not in sizes:
            raise CheckpointDamaged(f"{name} is missing")
        if sizes[name] != entry.get("bytes"):
            raise CheckpointDamaged(f"{name} has {sizes[name]} bytes, the manifest says {entry.get('bytes')}")


def read_verified(directory: Storage, name: str, entry: dict, keep: bool = True) -> bytes:
    """A file's bytes, read once with its sha256 computed on the way; damage raises. keep=False
    only verifies: nothing is held in memory."""
    digest, chunks, size = hashlib.sha256(), [], 0
    try:
        with directory.open_input(name) as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                if keep:
                    chunks.append(chunk)
    except FileNotFoundError:
        raise CheckpointDamaged(f"{name} is missing") from None
    if size != entry.get("bytes"):
        raise CheckpointDamaged(f"{name} has {size} bytes, the manifest says {entry.get('bytes')}")
    if digest.hexdigest() != entry.get("sha256"):
        raise CheckpointDamaged(f"{name} does not match its sha256 in the manifest")
    return b"".join(chunks)


def damage(directory: Location, deep: bool = False) -> str | None:
    """Why this directory is not a complete checkpoint (a short phrase), or None when it is.

    deep=False checks the manifest and the files' sizes (one listing and a kilobyte read: what the
    driver does before a run); deep=True also hashes every byte (a tool's full check).
    """
    directory = Storage.of(directory)
    try:
        if not retry_transient(directory.is_dir, f"reading {directory}"):
            return "no such directory"
        files = read_manifest(directory)
        _check_sizes(directory, files)
        if deep:
            for name, entry in files.items():
                read_verified(directory, name, entry, keep=False)
    except CheckpointDamaged as e:
        return str(e)
    return None


def read_meta(directory: Location) -> CheckpointMeta:
    """A checkpoint's meta.json, read without verifying the tensors."""
    directory = Storage.of(directory)
    return CheckpointMeta.from_json(_meta_bytes(directory), where=directory.path(META_FILE))


def _meta_bytes(directory: Storage) -> bytes:
    """meta.json's bytes. A transient read error is retried (raychat.faults), never guessed; one no
    retry heals (access denied) is CheckpointUnreadable, one line naming the file."""
    where = directory.path(META_FILE)
    try:
        return retry_transient(lambda: directory.read_bytes(META_FILE), f"reading {where}")
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CheckpointUnreadable(f"cannot read {where} ({short_reason(e)}): give this machine read "
                                   "access to the run's storage, then rerun") from None
