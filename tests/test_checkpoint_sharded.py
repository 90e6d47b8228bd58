"""Sharded checkpoints across real gloo processes: each rank writes what it owns and reads what it
needs, and the state that comes back at W=1 or W=2 is bit for bit the state that was saved.

One run of 2 ranks (conftest.py's `ranks`: saving at W=2, resuming at W=2, resuming a W=1 checkpoint
at W=2, falling back together from a damaged shard); the single-process halves (the W=1 checkpoint,
resuming the W=2 one at W=1) run in the test process. The reference state is the optimizer's own gathered
`state_dict()`, which the sharded path never calls.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_bitwise_equal, gloo_group

from raychat.checkpoint.catalog import latest_valid_checkpoint
from raychat.checkpoint.format import damage, rank_file
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.reader import CheckpointReader, load_checkpoint
from raychat.checkpoint.resume import Restore, candidates
from raychat.checkpoint.saver import CheckpointSaver
from raychat.checkpoint.sharded import finish_checkpoint, write_rank
from raychat.checkpoint.shardfile import io_count
from raychat.common import RaychatError
from raychat.model.gpt import GPTConfig, build_model, gpt_config
from raychat.optim.muon_adamw import build_optimizer
from raychat.storage import Storage
from raychat.worker.state import apply_share, read_share, state_pieces

STEPS = 2
CPU = torch.device("cpu")


def fresh():
    torch.manual_seed(0)
    model = build_model(gpt_config(depth=2, aspect_ratio=32, head_dim=32, max_seq_len=16, vocab_size=200,
                                   window_pattern="L"), "cpu")
    optimizer = build_optimizer(model, embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02, scalar_lr=0.5,
                                weight_decay=0.2)
    return model, optimizer


def train(model, optimizer, steps, weight: float = 1.0) -> None:
    for step in steps:
        tokens = torch.randint(0, 200, (4, 17), generator=torch.Generator().manual_seed(step))
        (model(tokens[:, :-1], tokens[:, 1:]) * weight).backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)


def save(run: Storage, model, optimizer, world: int, rank: int, gather) -> CheckpointSaver:
    """What the train loop's save does (raychat.worker.fault_tolerance.FaultTolerance.save), at step
    STEPS, blocking."""
    saver = CheckpointSaver(run, keep=0, rank=rank, world_size=world, log=lambda _: None)
    saver.prepare(STEPS)
    token = gather(f"token-{world}")[0]
    pieces, plain = state_pieces(model, optimizer, world, rank)
    meta = CheckpointMeta(step=STEPS, model_config=GPTConfig(), world_size=world) if rank == 0 else None
    saver.save(STEPS, pieces, token, meta, extra=plain, wait=True)
    return saver


def resume(run: Storage, names: list[str], world: int, rank: int, gather, log=lambda _: None):
    model, optimizer = fresh()
    restore = Restore(run, names, gather, log)
    share = restore.load(lambda reader: read_share(reader, model, optimizer, world, rank))
    apply_share(share, model, optimizer, world, CPU)
    return model, optimizer, restore


def _worker(rank: int, tmp: str) -> None:
    tmp_dir = Path(tmp)
    with gloo_group(rank, tmp) as gather:
        out: dict = {}
        model, optimizer = fresh()
        train(model, optimizer, range(STEPS), weight=1.0 if rank == 0 else 0.0)
        out["reference"] = optimizer.state_dict()  # the gathered state the sharded save never builds
        run = Storage(str(tmp_dir / "w2"))
        written = io_count.written
        saver = save(run, model, optimizer, 2, rank, gather)
        out["written"] = io_count.written - written
        out["buffer_bytes"] = saver.writer.buffer_bytes
        saver.close()
        dist.barrier()  # rank 0's save returned: the manifest is written

        read = io_count.read
        resumed, resumed_optimizer, _ = resume(run, ["checkpoint_000002"], 2, rank, gather)
        out["read"] = io_count.read - read
        out["resumed"] = resumed_optimizer.state_dict()
        for m, o in ((model, optimizer), (resumed, resumed_optimizer)):
            train(m, o, [STEPS], weight=1.0 if rank == 0 else 0.0)
        pairs = zip(model.state_dict().values(), resumed.state_dict().values(), strict=True)
        out["continued_equal"] = all(torch.equal(a, b) for a, b in pairs)

        if rank == 0:  # a copy whose rank-1 file has one flipped byte (same size: only a hash sees it)
            damaged = tmp_dir / "w2" / "checkpoint_000003"
            shutil.copytree(tmp_dir / "w2" / "checkpoint_000002", damaged)
            data = bytearray((damaged / rank_file(1, 2)).read_bytes())
            data[-3] ^= 0xFF
            (damaged / rank_file(1, 2)).write_bytes(bytes(data))
        dist.barrier()
        warnings: list[str] = []
        _, _, restore = resume(run, ["checkpoint_000003", "checkpoint_000002"], 2, rank, gather,
                               log=warnings.append)
        out["fell_back_to"], out["warnings"] = restore.checkpoint.name, warnings

        _, from_single, _ = resume(Storage(str(tmp_dir / "w1")), ["checkpoint_000002"], 2, rank, gather)
        out["from_single"] = from_single.state_dict()
        torch.save(out, tmp_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(ranks, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_sharded")
    model, optimizer = fresh()
    train(model, optimizer, range(STEPS))
    single = {"reference": optimizer.state_dict()}
    save(Storage(str(tmp / "w1")), model, optimizer, 1, 0, lambda obj: [obj]).close()
    ranks.run(_worker, 2, str(tmp))
    saw = [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(2)]
    return {"tmp": tmp, "single": single, "ranks": saw}


def checkpoint_bytes(directory: Path) -> int:
    files = json.loads((directory / "manifest.json").read_text())["files"]
    return sum(entry["bytes"] for entry in files.values())


@pytest.mark.integration  # gloo ranks
def test_saved_at_two_resumed_at_two_is_the_saved_state_bit_for_bit(runs):
    for rank in runs["ranks"]:
        assert_bitwise_equal(rank["resumed"], rank["reference"])
        assert rank["continued_equal"]


@pytest.mark.integration  # gloo ranks
def test_saved_at_two_resumed_at_one_is_the_saved_state_bit_for_bit(runs):
    directory = runs["tmp"] / "w2" / "checkpoint_000002"
    reference = runs["ranks"][0]["reference"]
    _, optim_state, _ = load_checkpoint(directory)
    assert_bitwise_equal(optim_state["state"], reference["state"])
    read = io_count.read
    _, optimizer, _ = resume(Storage(str(runs["tmp"] / "w2")), ["checkpoint_000002"], 1, 0, lambda obj: [obj])
    assert io_count.read - read <= 1.1 * checkpoint_bytes(directory)  # every byte about once
    assert_bitwise_equal(optimizer.state_dict(), reference)


@pytest.mark.integration  # gloo ranks
def test_saved_at_one_resumed_at_two_is_the_saved_state_bit_for_bit(runs):
    for rank in runs["ranks"]:
        assert_bitwise_equal(rank["from_single"], runs["single"]["reference"])


@pytest.mark.integration  # gloo ranks
def test_each_rank_writes_and_reads_about_its_own_share(runs):
    """Counted by the checkpoint files' reader and writer: no rank writes or holds the whole state.
    The whole: the same state saved by one process."""
    total = checkpoint_bytes(runs["tmp"] / "w1" / "checkpoint_000002")
    written = [rank["written"] for rank in runs["ranks"]]
    read = [rank["read"] for rank in runs["ranks"]]
    assert max(written) <= 0.6 * total and sum(written) <= 1.05 * total
    assert max(read) <= 0.6 * total and sum(read) <= 1.1 * total
    # the save's host buffers are the rank's own share, not a gathered copy of the state
    assert all(rank["buffer_bytes"] <= 0.6 * total for rank in runs["ranks"])


@pytest.mark.integration  # gloo ranks
def test_a_damaged_shard_of_one_rank_makes_every_rank_fall_back(runs):
    for rank in runs["ranks"]:
        assert rank["fell_back_to"] == "checkpoint_000002"
    (line,) = runs["ranks"][0]["warnings"]  # rank 1 found it; rank 0 says so, in one line
    assert "checkpoint_000003" in line and "sha256" in line and "earlier checkpoint" in line


@pytest.mark.unit
def test_a_save_some_rank_did_not_finish_is_never_chosen(tmp_path):
    """Rank 1 died before its file: rank 0's save fails after its wait, and writes no manifest."""
    run = Storage(str(tmp_path))
    model, optimizer = fresh()
    save(run, model, optimizer, 1, 0, lambda obj: [obj]).close()
    directory = run.child("checkpoint_000005")
    pieces, plain = state_pieces(model, optimizer, 2, 0)
    write_rank(directory, 0, 2, "t", pieces, plain)
    with pytest.raises(RaychatError, match=r"ranks \[1\] did not finish"):
        finish_checkpoint(directory, 2, "t", CheckpointMeta(step=5, model_config=GPTConfig()).to_json(),
                          timeout_s=0.5)
    assert "manifest" in damage(directory)
    assert latest_valid_checkpoint(run, log=lambda _: None) == run.child("checkpoint_000002")
    with pytest.raises(RaychatError, match="checkpoint_000005 .* is gone"):  # nor may a worker start from it
        candidates(run, "session", "checkpoint_000005")
    assert candidates(run, "session", "checkpoint_000002") == ["checkpoint_000002"]
    with CheckpointReader(run.child("checkpoint_000002")) as reader:
        assert reader.meta.step == STEPS
