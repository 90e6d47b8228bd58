"""Nothing lost to an operator: a rewind that never trained hides and deletes nothing, a run whose
every checkpoint looks damaged is refused rather than started over, a record that may not be read
stops the driver in one line and never fails a whole save's prune, and saves that died before their
record are pruned once a newer checkpoint is whole."""

import dataclasses

import pytest
import torch
from conftest import s3_uri
from helpers import all_files, copy_tree, refusal, run_train, tiny_flags

from raychat.checkpoint import fence
from raychat.checkpoint.catalog import (
    highest_sequence,
    latest_valid_checkpoint,
    list_checkpoints,
    prune_checkpoints,
)
from raychat.checkpoint.fence import Fence, LeaseLost
from raychat.checkpoint.format import (
    MANIFEST_FILE,
    META_FILE,
    CheckpointUnreadable,
    checkpoint_dir_name,
    lineage_suffix,
    read_meta,
)
from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.resume import driver_choice
from raychat.checkpoint.saver import CheckpointSaver
from raychat.checkpoint.sharded import Piece, write_rank
from raychat.common import RaychatError
from raychat.config import add_config_flags, config_from_args
from raychat.elastic.lease import RunLease
from raychat.model.gpt import GPTConfig
from raychat.run.driver import hold_run
from raychat.run.prepare import prepare_run
from raychat.storage import Storage
from testkit.fault_proxy import FaultProxy

QUIET = lambda _: None  # noqa: E731


def _save(saver: CheckpointSaver, step: int) -> None:
    meta = CheckpointMeta(step=step, model_config=GPTConfig(), session="s")
    saver.save(step, [Piece("model/w", (4,), 0, torch.full((4,), float(step)))], f"t{step}", meta, wait=True)


def _names(run: Storage) -> list[str]:
    return [c.name for c in list_checkpoints(run, log=QUIET)]


def _config(flags: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args(flags))


@pytest.mark.ray
def test_a_rewind_that_stopped_before_training_hides_and_deletes_nothing(ray_session, tiny_corpus,
                                                                          two_worker_run, tmp_path):
    """A copy of conftest's `two_worker_run` (checkpoints 16 and 20). A driver given
    `--resume-from-step 16` takes the lease and stops before its workers train (Ctrl-C, a worker that
    fails at start): a plain rerun then resumes from 20 and its prune keeps it, and 20 can still be
    chosen by step."""
    storage = tmp_path / "storage"
    run = Storage(str(storage)).child(two_worker_run.name)
    copy_tree(Storage(two_worker_run.storage).child(two_worker_run.name), run)
    assert _names(run)[-2:] == ["checkpoint_000016", "checkpoint_000020"]
    flags = tiny_flags(tiny_corpus, storage, two_worker_run.name, *two_worker_run.flags)

    # The driver's own path up to trainer.fit(): choose, take the lease, record the rewind; then stop.
    rewind = _config([*flags, "--num-iterations", "24", "--resume-from-step", "16"])
    rewinding = prepare_run(rewind, log=QUIET)
    assert rewinding.resume_from.name == "checkpoint_000016"
    lease = hold_run(rewinding, log=QUIET)
    lease.release()
    assert rewinding.checkpoint_suffix == f"-e{lease.epoch}"  # its saves would never write over 20

    assert latest_valid_checkpoint(run, log=QUIET).name == "checkpoint_000020"
    assert driver_choice(run, 20, log=QUIET).name == "checkpoint_000020"

    # 20 looks damaged for a while (a restore still copying its rank file): a driver that falls back
    # to 16 by itself records no rewind, so its first save could never disown 20.
    twenty = run.child("checkpoint_000020")
    rank0 = next(f.base_name for f in twenty.files() if f.base_name.startswith("rank"))
    whole = twenty.read_bytes(rank0)
    twenty.delete(rank0)
    falling_back = prepare_run(_config([*flags, "--num-iterations", "24"]), log=QUIET)
    assert falling_back.resume_from.name == "checkpoint_000016"
    lease = hold_run(falling_back, log=QUIET)
    lease.release()
    assert lease.record.resumed == lease.record.floor and falling_back.checkpoint_suffix == f"-e{lease.epoch}"
    twenty.write_bytes(rank0, whole)

    rerun = run_train(ray_session, [*flags, "--num-iterations", "24"])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming from checkpoint_000020 (step 20)" in rerun.stdout
    assert _names(run)[-2:] == ["checkpoint_000020", "checkpoint_000024"]
    assert read_meta(run.child("checkpoint_000024")).parent == "checkpoint_000020"


@pytest.mark.ray
def test_a_run_whose_every_checkpoint_looks_damaged_is_refused_not_started_over(ray_session, tiny_corpus,
                                                                                 two_worker_run, commands,
                                                                                 tmp_path):
    """A restore from backup still copying: every checkpoint lacks its manifest. The driver names
    them and the way out in one line, before any worker starts, and nothing of the run changes."""
    storage = tmp_path / "storage"
    run = Storage(str(storage)).child(two_worker_run.name)
    copy_tree(Storage(two_worker_run.storage).child(two_worker_run.name), run)
    checkpoints = _names(run)
    for name in checkpoints:
        run.child(name).delete(MANIFEST_FILE)
    before = all_files(run)
    flags = [*tiny_flags(tiny_corpus, storage, two_worker_run.name, *two_worker_run.flags),
             "--num-iterations", "24"]
    line = refusal(commands, flags, ray_session)
    assert "every checkpoint of" in line and "looks damaged or incomplete" in line, line
    assert all(name in line for name in checkpoints) and "--resume-from-step" in line and "--run-name" in line
    assert all_files(run) == before


@pytest.mark.integration  # moto's S3 server, the fault proxy
def test_a_record_that_may_not_be_read_stops_the_driver_and_never_fails_a_whole_save(s3_endpoint):
    """A bucket policy denies one old checkpoint's meta.json (403 AccessDenied). The driver's choice
    stops in one line naming the file; a save's prune leaves that checkpoint alone and the save
    stays whole."""
    with FaultProxy(s3_endpoint, seed=0) as proxy:
        run = Storage(s3_uri(proxy.address, "denied-meta")).child("run")
        saver = CheckpointSaver(run, keep=2, rank=0, world_size=1, log=QUIET)
        for step in (1, 2):
            _save(saver, step)
        denied = f"{checkpoint_dir_name(1)}/{META_FILE}"
        proxy.inject("forbidden", match=denied)
        with pytest.raises(RaychatError) as refused:
            driver_choice(run, -1, log=QUIET)
        message = str(refused.value)
        assert denied in message and "access" in message.lower() and "read access" in message
        assert "\n" not in message
        said: list[str] = []
        saver.log, saver.keep = said.append, 1
        _save(saver, 3)  # prunes 2; leaves 1, whose record it may not read
        saver.close()
        assert any("leaving checkpoint" in line and "checkpoint_000001" in line for line in said), said
        proxy.clear()
    assert _names(run) == ["checkpoint_000001", "checkpoint_000003"]
    assert latest_valid_checkpoint(run, log=QUIET).name == "checkpoint_000003"


@pytest.mark.unit
def test_saves_that_died_before_their_record_are_pruned_below_the_newest_whole_one(tmp_path):
    """Ranks wrote their files, then rank 0 died before meta.json (a lost node mid-save): no prune
    used to reach that directory, a whole checkpoint's worth of storage each time. It goes once a
    newer checkpoint is whole; one above the newest whole step (a save in progress) stays."""
    run = Storage(str(tmp_path / "run"))
    saver = CheckpointSaver(run, keep=1, rank=0, world_size=1, log=QUIET)
    _save(saver, 2)
    for step in (3, 9):  # died mid-save: rank files only
        dead = [Piece("model/w", (4,), 2, torch.ones(2))]
        write_rank(run.child(checkpoint_dir_name(step)), 1, 2, "dead", dead)
    _save(saver, 4)
    saver.close()
    assert run.subdirs() == ["checkpoint_000004", "checkpoint_000009"]
    assert prune_checkpoints(run, keep=1, log=QUIET) == []  # nothing else to delete


def _held(run: Storage, resume_from: str | None, keep: int = 100) -> tuple[RunLease, CheckpointSaver]:
    """A driver's lease on `run`, resuming (or rewinding) to `resume_from`, and its rank 0's saver."""
    held = RunLease(run, heartbeat_s=60)
    held.acquire(floor=lambda: highest_sequence(run), log=QUIET)
    parent = read_meta(run.child(resume_from)) if resume_from else None
    held.record_resume(parent.sequence if parent else 0)
    saver = CheckpointSaver(run, keep=keep, rank=0, world_size=1, log=QUIET, fence=Fence(run, held.epoch),
                            parent=parent, parent_name=resume_from)
    return held, saver


@pytest.mark.unit
def test_a_rewind_whose_first_save_died_before_its_manifest_hides_and_deletes_nothing(tmp_path):
    """Saves 10..50; a driver rewinds to 20 and its first save (25) dies between meta.json and the
    manifest. That save is not a checkpoint: the next driver resumes from 50 (not from 20, where the
    dead save's parent points), and its prune deletes the dead save, nothing of the branch."""
    run = Storage(str(tmp_path / "run"))
    first, saver = _held(run, None)
    for step in (10, 20, 30, 40, 50):
        _save(saver, step)
    saver.close()
    first.release()
    rewinding, _ = _held(run, checkpoint_dir_name(20))
    dead = run.child(checkpoint_dir_name(25))
    write_rank(dead, 0, 1, "t25", [Piece("model/w", (4,), 0, torch.full((4,), 25.0))])
    meta = dataclasses.replace(read_meta(run.child(checkpoint_dir_name(20))), step=25, sequence=6,
                               parent=checkpoint_dir_name(20), lease_epoch=rewinding.epoch)
    dead.write_bytes(META_FILE, meta.to_json())  # and then the node was lost
    rewinding.release()
    assert latest_valid_checkpoint(run, log=QUIET).name == "checkpoint_000050"
    rerun, saver = _held(run, "checkpoint_000050")
    _save(saver, 60)
    saver.close()
    rerun.release()
    assert _names(run) == [checkpoint_dir_name(step) for step in (10, 20, 30, 40, 50, 60)]
    assert not run.exists(checkpoint_dir_name(25))


@pytest.mark.integration  # moto's S3 server, the fault proxy
def test_a_floor_that_cannot_read_every_record_takes_no_lease(s3_endpoint):
    """The floor a new epoch records must count every checkpoint: one whose meta.json is denied
    (403) stops the driver in one line before its epoch exists, rather than being disowned later."""
    with FaultProxy(s3_endpoint, seed=0) as proxy:
        run = Storage(s3_uri(proxy.address, "denied-floor")).child("run")
        saver = CheckpointSaver(run, keep=0, rank=0, world_size=1, log=QUIET)
        for step in (1, 2):
            _save(saver, step)
        saver.close()
        proxy.inject("forbidden", match=f"{checkpoint_dir_name(2)}/{META_FILE}")
        with pytest.raises(CheckpointUnreadable, match="checkpoint_000002/meta.json"):
            RunLease(run, heartbeat_s=60).acquire(floor=lambda: highest_sequence(run), log=QUIET)
        proxy.clear()
        assert fence.epochs(run) == []


@pytest.mark.unit
def test_a_writer_superseded_while_it_prunes_deletes_nothing_more(tmp_path):
    """Epoch 1 is about to prune; epoch 2 takes the run over first. The prune's check before each
    deletion stops it: nothing epoch 2 may resume from or be writing is deleted."""
    run = Storage(str(tmp_path / "run"))
    held, saver = _held(run, None)
    for step in (1, 2, 3):
        _save(saver, step)
    saver.close()
    fence.create_record(run, fence.LeaseRecord(epoch=2, holder="taker", host="h", pid=1, started="now",
                                               floor=3, resumed=1))
    with pytest.raises(LeaseLost):
        prune_checkpoints(run, keep=1, log=QUIET, fence=Fence(run, held.epoch))
    assert _names(run) == [checkpoint_dir_name(step) for step in (1, 2, 3)]
    held.release()


@pytest.mark.unit
def test_a_rewinds_save_at_a_step_the_run_has_never_writes_over_that_checkpoint(tmp_path):
    """Saves 10..50; a driver rewinds to 20 and its first save, at 30, dies before its manifest. The
    rewound run saves under names of its own lineage, so the branch's whole checkpoint_000030 is
    untouched: the next driver resumes from 50 and `--resume-from-step 30` still finds it."""
    run = Storage(str(tmp_path / "run"))
    first, saver = _held(run, None)
    for step in (10, 20, 30, 40, 50):
        _save(saver, step)
    saver.close()
    first.release()
    thirty = all_files(run.child(checkpoint_dir_name(30)))
    rewinding, saver = _held(run, checkpoint_dir_name(20), keep=0)  # (no prune: it "dies" after the save)
    saver.suffix = lineage_suffix(rewinding.epoch)  # what its driver hands the workers (hold_run)
    _save(saver, 30)
    saver.close()
    ours = run.child(checkpoint_dir_name(30, lineage_suffix(rewinding.epoch)))
    ours.delete(MANIFEST_FILE)  # it died before its manifest
    fence.lease_dir(run).delete(fence.trained_file(rewinding.epoch))  # so never marked its epoch trained
    rewinding.release()
    assert all_files(run.child(checkpoint_dir_name(30))) == thirty
    assert latest_valid_checkpoint(run, log=QUIET).name == "checkpoint_000050"
    assert driver_choice(run, 30, log=QUIET).name == "checkpoint_000030"
