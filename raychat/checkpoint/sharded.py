"""Writing a sharded checkpoint: every rank writes what it owns, rank 0 closes the checkpoint.

A rank's state is a list of `Piece`s: flat ranges of logical tensors (a parameter, or one of its
optimizer tensors), named world-size-independently (`model/<param>`, `optim/<param>/<key>`). What a
rank owns is decided by whoever holds the state (the optimizer's ZeRO shards; `model_ranges` splits
the model's parameters, concatenated, into W equal ranges): nothing is gathered for a save.

Each rank writes `rank_<r>-of-<W>.safetensors` (raychat.checkpoint.shardfile) and then a small
marker `rank_<r>.done.json` (its file's size, sha256 and pieces). Rank 0 waits, in its background
writer, for the W markers of this save (a token shared by the save's collective tells them from a
dead attempt's), then writes `index.json` (every logical tensor's shape, dtype and pieces),
`meta.json` and last `manifest.json` (size and sha256 of every file). No manifest, no checkpoint.
"""

import json
import math
import time
from typing import Any, NamedTuple

import torch

from raychat.checkpoint.fence import Fence, LeaseLost
from raychat.checkpoint.format import (
    INDEX_FILE,
    MANIFEST_FILE,
    META_FILE,
    rank_file,
    write_file,
    write_manifest,
)
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.shardfile import dtype_name, write_tensors
from raychat.common import RaychatError
from raychat.storage import Storage

MARKER_WAIT_S = 1800.0  # how long rank 0 waits for the other ranks' files before failing the save
_MARKER_POLL_S = 0.2


class Piece(NamedTuple):
    """Elements [start, start + tensor.numel()) of the flattened logical tensor `name` of `shape`."""

    name: str
    shape: tuple[int, ...]
    start: int
    tensor: torch.Tensor

    @property
    def key(self) -> str:
        """The name inside the rank's file: the logical name when the piece is the whole tensor."""
        whole = self.start == 0 and self.tensor.numel() == math.prod(self.shape)
        return self.name if whole else f"{self.name}@{self.start}"


def marker_name(rank: int) -> str:
    return f"rank_{rank:05d}.done.json"


def split_range(n: int, world: int, rank: int) -> tuple[int, int]:
    return n * rank // world, n * (rank + 1) // world


def model_ranges(shapes: dict[str, tuple[int, ...]], world: int, rank: int) -> list[tuple[str, int, int]]:
    """(name, start, stop) of each tensor's part of rank's 1/world of the tensors concatenated in
    order: the model's split among ranks, for saving and for reading alike."""
    total = sum(math.prod(shape) for shape in shapes.values())
    low, high = split_range(total, world, rank)
    ranges, offset = [], 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        start, stop = max(low, offset), min(high, offset + n)
        if start < stop:
            ranges.append((name, start - offset, stop - offset))
        offset += n
    return ranges


def write_rank(directory: Storage, rank: int, world: int, token: str, pieces: list[Piece],
               extra: dict | None = None, fence: Fence | None = None) -> None:
    """This rank's file, then its marker (which says the file is whole); with `fence`, each write
    first checks that this rank's driver still holds the run (raychat.checkpoint.fence)."""
    name = rank_file(rank, world)
    tensors = [(piece.key, piece.tensor.reshape(-1) if piece.key != piece.name else piece.tensor)
               for piece in pieces]
    header: dict[str, str] = {}

    def write(f) -> None:
        header["sha256"] = write_tensors(f, tensors)

    entry = write_file(directory, name, write, fence)
    described = [{"name": p.name, "shape": list(p.shape), "dtype": dtype_name(p.tensor.dtype),
                  "start": p.start, "numel": p.tensor.numel(), "key": p.key} for p in pieces]
    marker = {"token": token, "file": name, **entry, "header_sha256": header["sha256"], "pieces": described,
              "extra": extra}
    write_file(directory, marker_name(rank), lambda f: f.write(json.dumps(marker).encode()), fence)


def _wait_for_markers(directory: Storage, world: int, token: str, timeout_s: float) -> list[dict]:
    markers: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(markers) < world:
        present = {info.base_name for info in directory.entries()}
        for rank in range(world):
            if rank not in markers and marker_name(rank) in present:
                marker = json.loads(directory.read_bytes(marker_name(rank)))
                if marker.get("token") == token:
                    markers[rank] = marker
        if len(markers) < world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(markers))
                raise RaychatError(f"ranks {missing} did not finish writing checkpoint {directory} within "
                                   f"{timeout_s:.0f}s; the checkpoint stays incomplete and is never resumed")
            time.sleep(_MARKER_POLL_S)
    return [markers[rank] for rank in range(world)]


def build_index(markers: list[dict]) -> dict:
    """index.json: every logical tensor's dtype, shape and pieces (file, key, start, numel)."""
    tensors: dict[str, dict] = {}
    for marker in markers:
        for p in marker["pieces"]:
            entry = tensors.setdefault(p["name"], {"dtype": p["dtype"], "shape": p["shape"], "pieces": []})
            entry["pieces"].append({"file": marker["file"], "key": p["key"], "start": p["start"],
                                    "numel": p["numel"]})
    for entry in tensors.values():
        entry["pieces"].sort(key=lambda piece: piece["start"])
    files = {m["file"]: {"header_sha256": m["header_sha256"]} for m in markers}
    return {"world_size": len(markers), "files": files, "tensors": tensors, "extra": markers[0]["extra"]}


def finish_checkpoint(directory: Storage, world: int, token: str, meta_bytes: bytes,
                      timeout_s: float = MARKER_WAIT_S, fence: Fence | None = None) -> None:
    """Rank 0, after its own file: wait for every rank's, then index, meta and the manifest (each
    write fenced, and never over a newer epoch's checkpoint: `refuse_newer`)."""
    markers = _wait_for_markers(directory, world, token, timeout_s)
    refuse_newer(directory, fence)
    index = (json.dumps(build_index(markers)) + "\n").encode()
    files = {m["file"]: {"bytes": m["bytes"], "sha256": m["sha256"]} for m in markers}
    files[INDEX_FILE] = write_file(directory, INDEX_FILE, lambda f: f.write(index), fence)
    files[META_FILE] = write_file(directory, META_FILE, lambda f: f.write(meta_bytes), fence)
    directory.sync()  # every rename is durable before the manifest claims the files
    write_manifest(directory, world, files, fence)
    for rank in range(world):  # the index holds what the markers said
        directory.delete(marker_name(rank))


def save_pieces(directory: Storage, pieces: list[Piece], extra: dict | None, meta_bytes: bytes,
                token: str = "single") -> None:
    """A whole checkpoint written by one process (world size 1), blocking."""
    directory.make_dir()
    write_rank(directory, 0, 1, token, pieces, extra)
    finish_checkpoint(directory, 1, token, meta_bytes, timeout_s=0.0)


def canonical_pieces(model_state: dict[str, torch.Tensor],
                     optim_state: dict[str, Any] | None) -> tuple[list[Piece], dict]:
    """Pieces and plain data of a full (unsharded) model state and MuonAdamW state dict: what one
    process saves, and what the converter of old checkpoints writes."""
    pieces = [Piece(f"model/{name}", tuple(t.shape), 0, t.detach()) for name, t in model_state.items()]
    extra: dict = {"param_groups": [], "steps": {}, "stateful": []}
    if optim_state:
        for name, entry in optim_state["state"].items():
            extra["stateful"].append(name)
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    pieces.append(Piece(f"optim/{name}/{key}", tuple(value.shape), 0, value.detach()))
                elif key == "step":
                    extra["steps"][name] = int(value)
        extra["param_groups"] = optim_state["param_groups"]
    return pieces, extra


def save_checkpoint(directory: Storage | str, model_state: dict[str, torch.Tensor],
                    optim_state: dict[str, Any] | None, meta_bytes: bytes) -> None:
    """Write a checkpoint of full states from one process now (tests, the converter)."""
    pieces, extra = canonical_pieces(model_state, optim_state)
    save_pieces(Storage.of(directory), pieces, extra, meta_bytes)


def refuse_newer(directory: Storage, fence: Fence | None) -> None:
    """LeaseLost if `directory` holds a checkpoint of a newer lease epoch than `fence`'s: a writer
    that was superseded while it waited never touches what its successor wrote at the same step."""
    if fence is None or fence.epoch <= 0:
        return
    try:
        theirs = CheckpointMeta.from_json(directory.read_bytes(META_FILE)).lease_epoch
    except (OSError, RaychatError):  # none yet (or not readable): the fence check decides
        theirs = 0
    if theirs > fence.epoch:
        raise LeaseLost(f"{directory} was written by a newer driver (lease epoch {theirs}, this writer's "
                        f"{fence.epoch}): this writer stopped and wrote nothing more")
    fence.check()


def prepare_overwrite(directory: Storage, fence: Fence | None = None) -> None:
    """Before any rank writes into `directory` again (a step saved twice), its manifest goes, so
    it reads as incomplete until the new save is whole; never a newer epoch's (`refuse_newer`)."""
    refuse_newer(directory, fence)
    if directory.exists(MANIFEST_FILE):
        directory.delete(MANIFEST_FILE)
        directory.sync()

