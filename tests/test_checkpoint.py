"""Checkpoints in one process: bit-exact round trips, damage detection, the typed record, the async
writer and the saver, on local disk and in a real S3 API (moto's server). Several ranks:
tests/test_checkpoint_sharded.py."""

import hashlib
import json
import os
import shutil
import time

import pytest
import torch
from helpers import assert_bitwise_equal
from safetensors import safe_open

from raychat.checkpoint.catalog import branch, latest_valid_checkpoint, list_checkpoints, prune_checkpoints
from raychat.checkpoint.convert import main as convert_main
from raychat.checkpoint.format import MANIFEST_FILE, damage, rank_file, read_meta
from raychat.checkpoint.meta import META_VERSION, CheckpointMeta, LoopState
from raychat.checkpoint.reader import CheckpointReader, load_checkpoint
from raychat.checkpoint.saver import AsyncCheckpointWriter, CheckpointSaver
from raychat.checkpoint.sharded import Piece, save_checkpoint
from raychat.checkpoint.shardfile import BLOCK_BYTES, CheckpointDamaged, io_count
from raychat.common import RaychatError
from raychat.model.gpt import GPTConfig, build_model, gpt_config
from raychat.optim.muon_adamw import build_optimizer
from raychat.storage import Storage
from raychat.worker.state import apply_share, read_share, state_pieces

RANK0 = rank_file(0, 1)


def meta(step: int, **kw) -> CheckpointMeta:
    return CheckpointMeta(step=step, model_config=GPTConfig(n_layer=1), **kw)


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])  # bit patterns that value-compare badly
    return {
        "transformer.wte.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "resid_lambdas": torch.cat([torch.ones(2), special]),
        "lm_head.weight": torch.randn(16, 64, generator=g).t(),  # non-contiguous view
    }


def trained(steps: int = 2):
    """The real GPT and MuonAdamW (tiny), after `steps` optimizer steps."""
    torch.manual_seed(0)
    model = build_model(gpt_config(depth=2, aspect_ratio=32, head_dim=32, max_seq_len=16, vocab_size=200,
                                   window_pattern="L"), "cpu")
    optimizer = build_optimizer(model, embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02, scalar_lr=0.5,
                                weight_decay=0.2)
    for step in range(steps):
        tokens = torch.randint(0, 200, (3, 17), generator=torch.Generator().manual_seed(step))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
    return model, optimizer


@pytest.mark.unit
def test_round_trip_is_bit_exact_and_the_files_are_plain_safetensors(tmp_path):
    model, optimizer = trained()
    state = tiny_state()
    save_checkpoint(tmp_path / "ckpt", state, optimizer.state_dict(), meta(7, val_bpb=1.25).to_json())

    assert sorted(os.listdir(tmp_path / "ckpt")) == ["index.json", MANIFEST_FILE, "meta.json", RANK0]
    assert damage(tmp_path / "ckpt", deep=True) is None
    # the manifest is the sha256 and size of each file, as anyone can recompute them
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST_FILE).read_text())
    for name, entry in manifest["files"].items():
        data = (tmp_path / "ckpt" / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # a rank file is read by the safetensors package itself: no raychat, no pickle
    with safe_open(str(tmp_path / "ckpt" / RANK0), framework="pt") as f:
        assert_bitwise_equal(f.get_tensor("model/lm_head.weight"), state["lm_head.weight"])

    model_state, optim_state, saved_meta = load_checkpoint(tmp_path / "ckpt")
    assert_bitwise_equal(model_state, state)
    reference = optimizer.state_dict()
    assert_bitwise_equal(optim_state["state"], reference["state"])
    assert json.loads(json.dumps(reference["param_groups"])) == optim_state["param_groups"]
    assert saved_meta == meta(7, val_bpb=1.25)


@pytest.mark.unit
def test_a_resumed_optimizer_continues_exactly_like_the_uninterrupted_one(tmp_path):
    """The worker's own path at one rank: pieces -> saver -> read_share -> apply_share."""
    model, optimizer = trained(steps=2)
    saver = CheckpointSaver(Storage(str(tmp_path)), keep=0, rank=0, world_size=1, log=lambda _: None)
    pieces, plain = state_pieces(model, optimizer, 1, 0)
    saver.save(2, pieces, "t", meta(2), extra=plain, wait=True)
    saver.close()

    resumed, resumed_optimizer = trained(steps=0)
    with CheckpointReader(tmp_path / "checkpoint_000002") as reader:
        share = read_share(reader, resumed, resumed_optimizer, 1, 0)
    apply_share(share, resumed, resumed_optimizer, 1, torch.device("cpu"))
    assert_bitwise_equal(resumed_optimizer.state_dict(), optimizer.state_dict())
    for m, o in ((model, optimizer), (resumed, resumed_optimizer)):
        tokens = torch.randint(0, 200, (3, 17), generator=torch.Generator().manual_seed(99))
        m(tokens[:, :-1], tokens[:, 1:]).backward()
        o.step()
    assert_bitwise_equal(resumed.state_dict(), model.state_dict())


def make_run(run: Storage, steps: list[int]) -> list[Storage]:
    """Checkpoints named as raychat names them, written one after the other."""
    dirs = []
    for step in steps:
        d = run.child(f"checkpoint_{step:06d}")
        save_checkpoint(d, tiny_state(seed=step), None, meta(step).to_json())
        dirs.append(d)
    run.write_bytes("raychat_stopped.json", b"{}")  # other files of the run sit beside them
    return dirs


def test_truncated_file_is_damaged_and_the_previous_checkpoint_is_used(storage, capsys):
    run = Storage(storage).child("run")
    older, newest = make_run(run, [50, 100])
    data = newest.read_bytes(RANK0)
    newest.write_bytes(RANK0, data[: len(data) // 2])

    assert "bytes" in damage(newest)
    assert latest_valid_checkpoint(run) == older
    warning = capsys.readouterr().err.strip()
    assert len(warning.splitlines()) == 1
    assert "skipping damaged checkpoint" in warning and str(newest) in warning
    assert load_checkpoint(latest_valid_checkpoint(run, log=lambda _: None))[2].step == 50


def test_flipped_byte_with_the_right_size_is_caught_by_the_block_hash(storage):
    run = Storage(storage).child("run")
    (ckpt,) = make_run(run, [10])
    data = bytearray(ckpt.read_bytes(RANK0))
    data[-100] ^= 0xFF
    ckpt.write_bytes(RANK0, bytes(data))
    assert latest_valid_checkpoint(run) == ckpt  # the driver's check: sizes cannot see it
    assert "sha256" in damage(ckpt, deep=True)
    with pytest.raises(CheckpointDamaged, match="sha256") as err:  # a rank's read checks what it reads
        load_checkpoint(ckpt)
    assert str(ckpt) in str(err.value) and "\n" not in str(err.value)


def test_missing_manifest_means_incomplete(storage):
    run = Storage(storage).child("run")
    older, newest = make_run(run, [1, 2])
    newest.delete(MANIFEST_FILE)
    with pytest.raises(RaychatError, match="manifest"):
        load_checkpoint(newest)
    warnings = []
    assert latest_valid_checkpoint(run, log=warnings.append) == older
    assert warnings == [f"skipping damaged checkpoint {newest}: no manifest.json (the save did not finish)"]


@pytest.mark.unit
def test_latest_by_step_by_write_time_and_on_empty_runs(tmp_path):
    """After --resume-from-step rewinds a run, its new checkpoints are the latest although the
    abandoned branch has higher step numbers (order: manifest time, whole seconds, then step)."""
    run = Storage(str(tmp_path / "run"))
    old_10, old_20 = make_run(run, [10, 20])
    for directory, seconds in ((old_10, 1000), (old_20, 2000)):
        os.utime(directory.path(MANIFEST_FILE), (seconds, seconds))
    (new_15,) = make_run(run, [15])
    assert list_checkpoints(run) == [old_10, old_20, new_15]
    assert latest_valid_checkpoint(run) == new_15
    assert latest_valid_checkpoint(run, step=20) == old_20
    assert latest_valid_checkpoint(run, step=75) is None
    assert latest_valid_checkpoint(Storage(str(tmp_path / "no-such-run"))) is None
    assert prune_checkpoints(run, keep=2) == ["checkpoint_000010"]
    assert list_checkpoints(run) == [old_20, new_15]


def test_prune_keeps_the_newest_complete_ones(storage):
    run = Storage(storage).child("run")
    dirs = make_run(run, [1, 2, 3, 4])
    dirs[3].delete(MANIFEST_FILE)  # the newest is incomplete: it does not count toward keep
    assert prune_checkpoints(run, keep=2) == ["checkpoint_000001"]
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint_000002", "checkpoint_000003",
                                                       "checkpoint_000004"]
    assert prune_checkpoints(run, keep=0) == []  # 0: keep everything


@pytest.mark.unit
def test_a_partial_read_reads_only_the_blocks_it_needs(tmp_path):
    big = torch.arange(3 * BLOCK_BYTES // 4, dtype=torch.float32)  # 3 blocks
    save_checkpoint(tmp_path / "ckpt", {"w": big}, None, meta(1).to_json())
    with CheckpointReader(tmp_path / "ckpt") as reader:
        before = io_count.read
        part = reader.read("model/w", start=BLOCK_BYTES // 4 + 5, numel=10)  # inside the second block
        read = io_count.read - before
    assert torch.equal(part, big[BLOCK_BYTES // 4 + 5:BLOCK_BYTES // 4 + 15])
    header = 8 + int.from_bytes((tmp_path / "ckpt" / RANK0).read_bytes()[:8], "little")
    assert read == header + BLOCK_BYTES


@pytest.mark.unit
def test_the_record_round_trips_and_a_newer_version_is_refused_in_one_line():
    record = meta(3, loop_state=LoopState(step=3))  # min_val_bpb inf: JSON's Infinity
    assert CheckpointMeta.from_json(record.to_json()) == record
    newer = json.dumps({**json.loads(record.to_json()), "format_version": META_VERSION + 1})
    with pytest.raises(RaychatError, match="upgrade raychat") as err:
        CheckpointMeta.from_json(newer, where="ckpt/meta.json")
    assert "ckpt/meta.json" in str(err.value) and "\n" not in str(err.value)
    # version 1: the dict raychat wrote before the typed record (no version, no lineage)
    old = CheckpointMeta.from_json(json.dumps({"step": 5, "model_config": {}, "world_size": 2}))
    assert (old.step, old.world_size, old.sequence, old.model_config) == (5, 2, 0, GPTConfig())


@pytest.mark.unit
def test_async_writer_writes_the_snapshot_taken_at_submit(tmp_path):
    live = torch.zeros(1 << 20)
    written = {}
    with AsyncCheckpointWriter() as writer:
        writer.submit(Storage(str(tmp_path)), [Piece("model/w", (1 << 20,), 0, live)],
                      lambda snapshot: written.update(w=snapshot[0].tensor.clone()))
        live.add_(1.0)  # training goes on at once: the write sees the snapshot
        writer.wait()
    assert torch.equal(written["w"], torch.zeros(1 << 20))


@pytest.mark.unit
def test_async_write_failure_surfaces_in_wait(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    saver = CheckpointSaver(Storage(str(tmp_path / "a-file")), keep=0, rank=0, world_size=1, log=print)
    saver.save(1, [Piece("model/w", (1,), 0, torch.ones(1))], "t", meta(1))
    with pytest.raises(RaychatError, match="writing checkpoint .*a-file/checkpoint_000001 failed"):
        saver.finish()
    saver.close()


@pytest.mark.unit
def test_saving_a_step_again_replaces_it(tmp_path):
    run = Storage(str(tmp_path))
    for value in (0.0, 1.0):
        saver = CheckpointSaver(run, keep=0, rank=0, world_size=1, log=lambda _: None)
        saver.prepare(3)
        saver.save(3, [Piece("model/w", (3,), 0, torch.full((3,), value))], f"t{value}", meta(3), wait=True)
        saver.close()
    model, _, _ = load_checkpoint(run.child("checkpoint_000003"))
    assert torch.equal(model["w"], torch.ones(3))
    leftovers = [n for n in os.listdir(tmp_path / "checkpoint_000003") if n.endswith((".tmp", ".done.json"))]
    assert not leftovers


@pytest.mark.unit
def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    """Storage.write_whole (every checkpoint file, corpus.json, a lease epoch's replacement): a reader
    sees the old content or the new, never a torn file, and a failed write leaves nothing behind."""
    directory = Storage(str(tmp_path / "d"))
    directory.write_whole("f", lambda f: f.write(b"old"))

    def torn(f) -> None:
        f.write(b"half")
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        directory.write_whole("f", torn)
    assert directory.read_bytes("f") == b"old"
    assert os.listdir(tmp_path / "d") == ["f"]


def test_saver_prunes_logs_the_stall_and_records_the_lineage(storage):
    run = Storage(storage).child("run")
    lines = []
    resumed = meta(0, sequence=4)
    saver = CheckpointSaver(run, keep=2, rank=0, world_size=1, log=lines.append, parent=resumed,
                            parent_name="checkpoint_000000")
    for step in (5, 10, 15):
        saver.save(step, [Piece("model/w", (4,), 0, torch.full((4,), float(step)))], f"t{step}", meta(step))
    # A stop (NaN) finishes the save in flight: the last good checkpoint is whole, not leaked.
    assert saver.finish() == 15 and saver.latest_step == 15
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint_000010", "checkpoint_000015"]
    assert all(damage(c, deep=True) is None for c in list_checkpoints(run))
    assert len(lines) == 3 and all("training stalled" in line and "written in" in line for line in lines)
    saved = [load_checkpoint(c)[2] for c in list_checkpoints(run)]
    assert [(m.sequence, m.parent) for m in saved] == [(6, "checkpoint_000005"), (7, "checkpoint_000010")]
    assert saver.poll() is None  # nothing in flight
    saver.close()



def write_legacy(directory, model_state: dict, optim_state: dict, meta_dict: dict) -> None:
    """A checkpoint as raychat wrote it before the sharded format (model.pt + optim.pt)."""
    directory.mkdir(parents=True)
    torch.save(model_state, directory / "model.pt")
    torch.save(optim_state, directory / "optim.pt")
    (directory / "meta.json").write_text(json.dumps(meta_dict))
    files = {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
             for name in ("model.pt", "optim.pt", "meta.json") for data in [(directory / name).read_bytes()]}
    (directory / MANIFEST_FILE).write_text(json.dumps({"format": "raychat-checkpoint-1", "files": files}))


@pytest.mark.unit
def test_an_old_checkpoint_is_refused_in_one_line_and_converts_to_the_same_state(tmp_path, capsys):
    model, optimizer = trained()
    old = tmp_path / "run" / "checkpoint_000002"
    old_meta = {"step": 2, "model_config": {}, "world_size": 2}
    write_legacy(old, model.state_dict(), optimizer.state_dict(), old_meta)
    with pytest.raises(RaychatError) as err:
        latest_valid_checkpoint(tmp_path / "run")
    assert "python -m raychat.checkpoint.convert" in str(err.value) and "\n" not in str(err.value)

    assert convert_main([str(old)]) == 0
    assert capsys.readouterr().out.strip() == f"converted {old}"
    assert sorted(os.listdir(old)) == ["index.json", MANIFEST_FILE, "meta.json", RANK0]
    model_state, optim_state, saved_meta = load_checkpoint(latest_valid_checkpoint(tmp_path / "run"))
    assert_bitwise_equal(model_state, model.state_dict())
    assert_bitwise_equal(optim_state["state"], optimizer.state_dict()["state"])
    assert (saved_meta.step, saved_meta.world_size) == (2, 2)
    with pytest.raises(RaychatError, match="nothing to do"):
        convert_main([str(old)])


def _save_steps(saver: CheckpointSaver, steps: list[int]) -> None:
    for step in steps:
        saver.save(step, [Piece("model/w", (2,), 0, torch.full((2,), float(step)))], f"t{step}", meta(step),
                   wait=True)
    saver.close()


def _set_mtimes(directory: Storage, seconds: float) -> None:
    for name in os.listdir(directory.root):
        os.utime(os.path.join(directory.root, name), (seconds, seconds))


@pytest.mark.unit
def test_latest_and_pruning_follow_the_lineage_not_the_clock(tmp_path):
    """A branch (--resume-from-step 3 after 9) is the latest whatever the files' times say: written
    with a clock an hour behind, or after a `cp -r` that gave every file the same time."""
    run = Storage(str(tmp_path / "run"))
    quiet = lambda _: None  # noqa: E731
    _save_steps(CheckpointSaver(run, keep=0, rank=0, world_size=1, log=quiet), [3, 6, 9])
    _save_steps(CheckpointSaver(run, keep=0, rank=0, world_size=1, log=quiet,
                                parent=read_meta(run.child("checkpoint_000003")),
                                parent_name="checkpoint_000003"), [4])
    lineage = ["checkpoint_000003", "checkpoint_000006", "checkpoint_000009", "checkpoint_000004"]
    now = time.time()
    for name, seconds in zip(lineage, (now + 3600, now, now, now - 3600), strict=True):
        _set_mtimes(run.child(name), seconds)  # the branch's clock behind, the first one's ahead
    assert [c.name for c in list_checkpoints(run)] == lineage
    assert latest_valid_checkpoint(run).name == "checkpoint_000004"

    copy = Storage(str(tmp_path / "copy"))
    shutil.copytree(run.root, copy.root, copy_function=shutil.copy)  # cp -r: every mtime is now
    assert [c.name for c in list_checkpoints(copy)] == lineage
    # A save resumed from the branch with --keep-checkpoints 1 keeps what it wrote and where it
    # resumed from, and prunes the rest of its branch. The abandoned 6 and 9 are on no branch it
    # knows of (no lease record says the run was rewound past them: test_lease covers that) and
    # are left alone.
    _save_steps(CheckpointSaver(copy, keep=1, rank=0, world_size=1, log=quiet,
                                parent=read_meta(copy.child("checkpoint_000004")),
                                parent_name="checkpoint_000004"), [5])
    assert [c.name for c in list_checkpoints(copy)] == ["checkpoint_000006", "checkpoint_000009",
                                                        "checkpoint_000004", "checkpoint_000005"]
    assert [c.name for c in branch(copy)] == ["checkpoint_000005", "checkpoint_000004"]
    assert [read_meta(c).sequence for c in list_checkpoints(copy)] == [2, 3, 4, 5]


@pytest.mark.unit
def test_a_checkpoint_an_earlier_attempt_resumed_from_is_pruned_by_a_later_one(tmp_path):
    """An attempt resumed from 3 (kept by its saver) saves 6 and 9 with --keep-checkpoints 1, which
    prunes 6: the branch 9 -> 6 has a gap. The next attempt, resumed from 9, must still reach 3
    and prune it (it once lay beyond the gap forever: seen in bench.goodput after node losses),
    while the branch itself stops at the gap: below it may lie an abandoned branch too."""
    run = Storage(str(tmp_path / "run"))
    quiet = lambda _: None  # noqa: E731
    _save_steps(CheckpointSaver(run, keep=0, rank=0, world_size=1, log=quiet), [3])
    _save_steps(CheckpointSaver(run, keep=1, rank=0, world_size=1, log=quiet,
                                parent=read_meta(run.child("checkpoint_000003")),
                                parent_name="checkpoint_000003"), [6, 9])
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint_000003", "checkpoint_000009"]
    assert [c.name for c in branch(run)] == ["checkpoint_000009"]
    _save_steps(CheckpointSaver(run, keep=1, rank=0, world_size=1, log=quiet,
                                parent=read_meta(run.child("checkpoint_000009")),
                                parent_name="checkpoint_000009"), [12])
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint_000009", "checkpoint_000012"]


@pytest.mark.unit
def test_a_malformed_parent_ends_the_branch_and_a_rewind_below_a_gap_is_never_chosen(tmp_path):
    """Save 2, 4, 6, 8; rewind to 2 (no lease records it) and save 3, 5, 7 keeping 1, which prunes 3
    and 5. With 7 damaged nothing of the abandoned 4..8 is chosen; a parent that names no checkpoint
    ends the branch rather than the command. A parent of the wrong kind (not a name) is a record
    that does not fit (raychat.records): that meta.json is left alone in one line, like any damaged
    one, not read with its parent guessed."""
    run = Storage(str(tmp_path / "run"))
    quiet = lambda _: None  # noqa: E731
    _save_steps(CheckpointSaver(run, keep=0, rank=0, world_size=1, log=quiet), [2, 4, 6, 8])
    _save_steps(CheckpointSaver(run, keep=1, rank=0, world_size=1, log=quiet,
                                parent=read_meta(run.child("checkpoint_000002")),
                                parent_name="checkpoint_000002"), [3, 5, 7])
    run.child("checkpoint_000007").delete(MANIFEST_FILE)
    assert latest_valid_checkpoint(run, log=quiet) is None
    meta_path = tmp_path / "run" / "checkpoint_000007" / "meta.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "parent": "checkpoint_latest"}))
    assert [c.name for c in branch(run, log=quiet)] == ["checkpoint_000007"]
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "parent": 5}))
    said: list[str] = []
    assert "checkpoint_000007" not in [c.name for c in branch(run, log=said.append)]
    assert said == [f"leaving checkpoint {run.child('checkpoint_000007')} alone: {meta_path}: CheckpointMeta "
                    "has the field 'parent' of the wrong kind: expected str or None, got int"]

