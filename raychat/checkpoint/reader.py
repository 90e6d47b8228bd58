"""Reading a sharded checkpoint by byte range: each rank reads what it needs, verified as it goes.

`CheckpointReader.read(name, start, numel)` returns elements [start, start + numel) of a logical
tensor, read from whichever rank files hold them (the index says which), each byte range checked
against the block hashes in its file's header. A resume at W ranks asks each rank for its share, so
the checkpoint's bytes are read about once in total whatever W saved it. `load_checkpoint` reads
everything into full state dicts, for one process (sampling, tests, tools). Transient storage faults
are retried (raychat.faults), so only real damage reads as CheckpointDamaged.
"""

import json
import math
from typing import Any

import torch

from raychat.checkpoint.format import INDEX_FILE, META_FILE, read_manifest, read_verified
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.shardfile import CheckpointDamaged, ShardFile, torch_dtype
from raychat.common import RaychatError
from raychat.faults import retry_transient
from raychat.storage import Location, Storage


class CheckpointReader:
    """One checkpoint opened for partial reads: manifest, index and meta read and verified."""

    def __init__(self, directory: Location):
        self.directory = Storage.of(directory)
        # A transient fault (a reset, a 503) while reading the head is retried, never taken for
        # damage: damage makes the resume fall back to an older checkpoint, redoing steps.
        retry_transient(self._read_head, f"reading checkpoint {self.directory}")

    def _read_head(self) -> None:
        """The manifest, then the index and meta it vouches for, each verified."""
        files = read_manifest(self.directory)
        try:
            self.index: dict = json.loads(read_verified(self.directory, INDEX_FILE, files[INDEX_FILE]))
            self.tensors: dict[str, dict] = self.index["tensors"]
            self.extra: dict = self.index.get("extra") or {}
            headers = {name: entry["header_sha256"] for name, entry in self.index["files"].items()}
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointDamaged(f"{INDEX_FILE} is not a checkpoint index ({type(e).__name__})") from None
        self.meta = CheckpointMeta.from_json(read_verified(self.directory, META_FILE, files[META_FILE]),
                                             where=self.directory.path(META_FILE))
        self._files = {name: ShardFile(self.directory, name, sha) for name, sha in headers.items()}

    def shape(self, name: str) -> tuple[int, ...] | None:
        entry = self.tensors.get(name)
        return tuple(entry["shape"]) if entry is not None else None

    def read(self, name: str, start: int = 0, numel: int | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Elements [start, start + numel) of tensor `name`, flat (whole tensor when numel is None).
        `shape`: what the caller expects the whole tensor to be; another is a user error."""
        entry = self.tensors.get(name)
        if entry is None:
            raise RaychatError(f"checkpoint {self.directory} has no tensor {name}: resume with the saved "
                               "run's model flags (--depth, --aspect-ratio, ...) or start a new --run-name")
        if shape is not None and tuple(entry["shape"]) != tuple(shape):
            raise RaychatError(f"{name} is {tuple(entry['shape'])} in checkpoint {self.directory}, expected "
                               f"{tuple(shape)}: resume with the saved run's model flags or start a new "
                               "--run-name")
        total = math.prod(entry["shape"])
        numel = total - start if numel is None else numel
        stop, parts, covered = start + numel, [], start
        for piece in entry["pieces"]:
            low, high = max(covered, piece["start"]), min(stop, piece["start"] + piece["numel"])
            if low >= high:
                continue
            if low != covered:
                break
            parts.append(self._read_piece(piece["file"], piece["key"], low - piece["start"], high - low))
            covered = high
        if covered != stop:
            raise CheckpointDamaged(f"{INDEX_FILE} does not cover elements {covered}..{stop} of {name}")
        if not parts:
            return torch.empty(0, dtype=torch_dtype(entry["dtype"]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_many(self, wanted: list[tuple[str, int, int, tuple[int, ...]]]) -> list[torch.Tensor]:
        """`read(name, start, numel, shape)` of each of `wanted`, in order (a resume's reads)."""
        return [self.read(name, start, numel, shape=shape) for name, start, numel, shape in wanted]

    def _read_piece(self, file_name: str, key: str, start: int, numel: int) -> torch.Tensor:
        """Elements of one tensor piece from one rank file, transient faults retried."""
        file = self._files[file_name]

        def read() -> torch.Tensor:
            try:
                return file.read(key, start, numel)
            except Exception:
                file.close()   # a fault mid-header leaves it half open: the next try opens it again
                raise

        return retry_transient(read, f"reading {file_name} of checkpoint {self.directory}")

    def read_whole(self, name: str) -> torch.Tensor:
        return self.read(name).view(self.shape(name))

    def close(self) -> None:
        for file in self._files.values():
            file.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_checkpoint(directory: Location, load_optimizer: bool = True
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], CheckpointMeta]:
    """(model_state, optim_state, meta) as full tensors on the CPU, whatever world size saved it.
    optim_state is MuonAdamW's canonical state dict ({} with load_optimizer=False)."""
    directory = Storage.of(directory)
    try:
        with CheckpointReader(directory) as reader:
            model = {name.removeprefix("model/"): reader.read_whole(name)
                     for name in reader.tensors if name.startswith("model/")}
            optim: dict[str, Any] = {}
            if load_optimizer and reader.extra.get("param_groups"):
                state: dict[str, dict] = {name: {} for name in reader.extra["stateful"]}
                for name in reader.tensors:
                    if name.startswith("optim/"):
                        param, key = name.removeprefix("optim/").rsplit("/", 1)
                        state[param][key] = reader.read_whole(name)
                for param, step in reader.extra["steps"].items():
                    state[param]["step"] = step
                optim = {"state": state, "param_groups": reader.extra["param_groups"]}
            return model, optim, reader.meta
    except CheckpointDamaged as e:
        raise CheckpointDamaged(f"checkpoint {directory} is damaged or incomplete: {e}; "
                                "resume from an earlier checkpoint of the run") from None
