"""`python -m raychat.checkpoint.convert DIR...`: rewrite old single-file checkpoints as sharded ones.

raychat used to save a checkpoint as `model.pt` + `optim.pt` (torch.save of full tensors, written
by rank 0 after gathering everything). Today's runs refuse such a directory in one line that names
this command. It reads the old files (checked against their manifest, loaded with
`torch.load(weights_only=True)`: tensors and plain data only) and writes the same state in the
sharded format as one rank would have saved it (`rank_00000-of-00001.safetensors`, `index.json`),
which resumes on any number of workers. The old `meta.json` is kept byte for byte, and the new
manifest replaces the old one in one write, so a conversion cut short leaves the old checkpoint
whole; `model.pt` and `optim.pt` are deleted after.
"""

import argparse
import io
import json
import pickle

import torch

from raychat.checkpoint.format import LEGACY_FORMAT, MANIFEST_FILE, META_FILE, read_verified
from raychat.checkpoint.sharded import canonical_pieces, finish_checkpoint, write_rank
from raychat.checkpoint.shardfile import CheckpointDamaged
from raychat.common import RaychatError, run_cli
from raychat.storage import Storage

MODEL_FILE = "model.pt"
OPTIM_FILE = "optim.pt"


def _load_tensors(directory: Storage, name: str, entry: dict) -> dict:
    data = read_verified(directory, name, entry)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointDamaged(f"{name} cannot be loaded as tensors and plain data: {reason}") from e


def convert(directory: Storage) -> None:
    """Rewrite one old-format checkpoint in place; refuse anything else in one line."""
    try:
        manifest = json.loads(directory.read_bytes(MANIFEST_FILE))
    except (FileNotFoundError, ValueError):
        raise RaychatError(f"{directory} has no readable {MANIFEST_FILE}: not a whole checkpoint") from None
    if manifest.get("format") != LEGACY_FORMAT:
        raise RaychatError(f"{directory} is not an old-format ({LEGACY_FORMAT}) checkpoint: nothing to do")
    files = manifest["files"]
    try:
        model_state = _load_tensors(directory, MODEL_FILE, files[MODEL_FILE])
        optim_state = _load_tensors(directory, OPTIM_FILE, files[OPTIM_FILE])
        meta_bytes = read_verified(directory, META_FILE, files[META_FILE])
    except CheckpointDamaged as e:
        raise RaychatError(f"cannot convert {directory}: {e}; use an earlier checkpoint of the run") from None
    pieces, extra = canonical_pieces(model_state, optim_state)
    write_rank(directory, 0, 1, "convert", pieces, extra)
    finish_checkpoint(directory, 1, "convert", meta_bytes, timeout_s=0.0)
    directory.delete(MODEL_FILE)
    directory.delete(OPTIM_FILE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raychat.checkpoint.convert",
        description="Convert checkpoints saved by an older raychat (model.pt + optim.pt) to the sharded "
                    "format that runs resume from. Each directory is rewritten in place; its metadata is "
                    "kept, and the state loads on any number of workers.",
        epilog="Example: python -m raychat.checkpoint.convert ~/.cache/raychat/runs/d12/checkpoint_005000",
    )
    parser.add_argument("directories", nargs="+", metavar="DIR",
                        help="a checkpoint directory: a local path or a URI "
                             "(s3://bucket/runs/d12/checkpoint_005000)")
    args = parser.parse_args(argv)
    for location in args.directories:
        directory = Storage(location)
        convert(directory)
        print(f"converted {directory}", flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
