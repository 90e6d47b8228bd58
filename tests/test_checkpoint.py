"""Checkpoints: bit-exact round trips, damage detection, no unpickling, the async writer and the saver,
on local disk and in a real S3 API (moto's server)."""

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from raychat.checkpoint.format import (
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    CheckpointDamaged,
    is_complete,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from raychat.checkpoint.saver import AsyncCheckpointWriter, CheckpointSaver
from raychat.common import RaychatError
from raychat.storage import Storage


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor: equal bits, not just equal values (NaN, -0.0)."""
    return t.detach().contiguous().flatten().view(torch.uint8)


def assert_same_tree(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_tree(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tree(x, y)
    else:
        assert a == b


def tiny_state(seed: int = 0) -> tuple[dict, dict, dict]:
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])  # bit patterns that value-compare badly
    model = {
        "transformer.wte.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "transformer.h.0.attn.c_q.weight": torch.randn(16, 16, generator=g),
        "resid_lambdas": torch.cat([torch.ones(2), special]),
        "lm_head.weight": torch.randn(16, 64, generator=g).t(),  # non-contiguous view
    }
    optim = {  # the shape of a canonical optimizer state: nested dicts and lists, tensors and numbers
        "state": {
            "transformer.wte.weight": {"exp_avg": torch.randn(64, 16, generator=g),
                                       "step": torch.tensor(7.0)},
            "transformer.h.0.attn.c_q.weight": {"momentum_buffer": torch.randn(16, 16, generator=g),
                                                "second_momentum_buffer": torch.randn(16, 1, generator=g)},
        },
        "param_groups": [
            {"kind": "adamw", "lr": 0.3, "initial_lr": 0.3, "betas": (0.8, 0.95), "eps": 1e-10,
             "weight_decay": 0.0, "names": ["transformer.wte.weight"]},
            {"kind": "muon", "lr": 0.02, "momentum": 0.95, "ns_steps": 5,
             "names": ["transformer.h.0.attn.c_q.weight"], "note": None},
        ],
        "step_count": 7,
    }
    meta = {"step": 7, "val_bpb": 1.25, "loop_state": {"min_val_bpb": float("inf"), "smooth_train_loss": 3.5},
            "cursor": {"epoch": 1, "next_unit": 12, "in_flight": [[1, 3, 17], [1, 4, 0]]}, "version": "0.1.0"}
    return model, optim, meta


def test_round_trip_is_bit_exact_with_nested_optimizer_state_and_json_meta(tmp_path):
    model, optim, meta = tiny_state()
    save_checkpoint(tmp_path / "ckpt", model, optim, meta)

    assert sorted(os.listdir(tmp_path / "ckpt")) == ["manifest.json", "meta.json", "model.pt", "optim.pt"]
    assert is_complete(tmp_path / "ckpt")
    # the manifest is the sha256 and size of each file, as anyone can recompute them
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST_FILE).read_text())
    for name, entry in manifest["files"].items():
        data = (tmp_path / "ckpt" / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # meta is plain JSON, readable without raychat or torch
    plain_meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert plain_meta["cursor"]["in_flight"] == [[1, 3, 17], [1, 4, 0]]

    assert torch.serialization.get_crc32_options()  # our save left torch's process-wide option alone
    model2, optim2, meta2 = load_checkpoint(tmp_path / "ckpt")
    assert_same_tree(model2, model)
    assert_same_tree(optim2, optim)
    assert meta2 == meta


def test_real_optimizer_resumes_identically_after_round_trip(tmp_path):
    """A torch optimizer's own state dict (int keys, tuple betas, tensor steps) survives, and a run
    resumed from the checkpoint takes exactly the step the uninterrupted run takes."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 2)

    def step(n, o):
        o.zero_grad()
        torch.nn.functional.mse_loss(n(x), y).backward()
        o.step()

    for _ in range(3):
        step(net, opt)
    save_checkpoint(tmp_path / "ckpt", net.state_dict(), opt.state_dict(), {"step": 3})

    model_state, optim_state, meta = load_checkpoint(tmp_path / "ckpt")
    net2 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    net2.load_state_dict(model_state)
    opt2 = torch.optim.AdamW(net2.parameters(), lr=0.5)
    opt2.load_state_dict(optim_state)
    step(net, opt)
    step(net2, opt2)
    assert meta == {"step": 3}
    assert_same_tree(net2.state_dict(), net.state_dict())


def make_run(run: Storage, steps: list[int]) -> list[Storage]:
    """Checkpoints named as raychat names them, written one after the other."""
    dirs = []
    for step in steps:
        d = run.child(f"checkpoint_{step:06d}")
        model, optim, _ = tiny_state(seed=step)
        save_checkpoint(d, model, optim, {"step": step})
        dirs.append(d)
    run.write_bytes("raychat_stopped.json", b"{}")  # other files of the run sit beside them
    return dirs


def truncate(directory: Storage, name: str) -> None:
    data = directory.read_bytes(name)
    directory.write_bytes(name, data[: len(data) // 2])


def test_truncated_file_is_damaged_and_the_previous_checkpoint_is_used(storage, capsys):
    run = Storage(storage).child("run")
    older, newest = make_run(run, [50, 100])
    truncate(newest, OPTIM_FILE)

    assert not is_complete(newest)
    with pytest.raises(CheckpointDamaged) as err:
        load_checkpoint(newest)
    assert str(newest) in str(err.value) and "\n" not in str(err.value)

    assert latest_valid_checkpoint(run) == older
    warning = capsys.readouterr().err.strip()
    assert len(warning.splitlines()) == 1
    assert "skipping damaged checkpoint" in warning and str(newest) in warning

    _, _, meta = load_checkpoint(latest_valid_checkpoint(run, log=lambda _: None))
    assert meta == {"step": 50}


def test_flipped_byte_with_the_right_size_is_caught_by_the_hash(storage):
    run = Storage(storage).child("run")
    (ckpt,) = make_run(run, [10])
    data = bytearray(ckpt.read_bytes(MODEL_FILE))
    data[-100] ^= 0xFF
    ckpt.write_bytes(MODEL_FILE, bytes(data))
    assert is_complete(ckpt) is False
    assert latest_valid_checkpoint(run, deep=False) == ckpt  # sizes alone cannot see it
    warnings = []
    assert latest_valid_checkpoint(run, log=warnings.append) is None
    assert len(warnings) == 1 and "sha256" in warnings[0]
    with pytest.raises(CheckpointDamaged, match="sha256"):  # loading checks as it streams
        load_checkpoint(ckpt)


def test_missing_manifest_means_incomplete(storage):
    run = Storage(storage).child("run")
    older, newest = make_run(run, [1, 2])
    newest.delete(MANIFEST_FILE)
    assert not is_complete(newest)
    with pytest.raises(RaychatError, match="manifest"):
        load_checkpoint(newest)
    warnings = []
    assert latest_valid_checkpoint(run, log=warnings.append) == older
    assert warnings == [f"skipping damaged checkpoint {newest}: no manifest.json (the save did not finish)"]


def test_latest_valid_checkpoint_by_step_and_on_empty_runs(storage):
    root = Storage(storage)
    first, second, third = make_run(root.child("run"), [50, 100, 150])
    assert list_checkpoints(root.child("run")) == [first, second, third]
    assert latest_valid_checkpoint(root.child("run")) == third
    assert latest_valid_checkpoint(root.child("run"), step=100) == second
    assert latest_valid_checkpoint(root.child("run"), step=75) is None
    assert latest_valid_checkpoint(root.child("no-such-run")) is None


def test_latest_is_the_last_written_not_the_highest_step(tmp_path):
    """After --resume-from-step rewinds a run, its new checkpoints are the latest although the
    abandoned branch has higher step numbers (order: manifest time, whole seconds, then step)."""
    run = Storage(str(tmp_path / "run"))
    old_10, old_20 = make_run(run, [10, 20])
    for directory, seconds in ((old_10, 1000), (old_20, 2000)):
        os.utime(directory.path(MANIFEST_FILE), (seconds, seconds))
    (new_15,) = make_run(run, [15])  # written now, long after 2000 s past the epoch
    assert list_checkpoints(run) == [old_10, old_20, new_15]
    assert latest_valid_checkpoint(run) == new_15
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


class RunsCodeWhenUnpickled:
    """What a malicious checkpoint would carry: unpickling it creates a file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_pickled_object_is_never_loaded(tmp_path):
    marker = tmp_path / "code-ran"
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, {"w": torch.ones(2)}, {"state": {}}, {"step": 1})
    # Replace model.pt by a torch.save of an arbitrary object and forge a matching manifest, so
    # only the loader itself stands between the file and code execution.
    torch.save({"w": RunsCodeWhenUnpickled(str(marker))}, ckpt / MODEL_FILE)
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    data = (ckpt / MODEL_FILE).read_bytes()
    manifest["files"][MODEL_FILE] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert is_complete(ckpt)
    # sanity: plain pickle would indeed run it
    pickle.loads(pickle.dumps(RunsCodeWhenUnpickled(str(tmp_path / "control"))))
    assert (tmp_path / "control").exists()

    with pytest.raises(CheckpointDamaged) as err:
        load_checkpoint(ckpt)
    assert str(ckpt / MODEL_FILE) in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("bad", [set(), pickle, lambda: 0])
def test_state_that_could_not_be_loaded_back_is_refused_at_save_time(tmp_path, bad):
    where = r"optimizer state\['state'\]\['x'\]"
    with pytest.raises(TypeError, match=where):
        save_checkpoint(tmp_path / "ckpt", {"w": torch.ones(1)}, {"state": {"x": bad}}, {})
    with pytest.raises(TypeError, match=where), AsyncCheckpointWriter() as writer:
        writer.submit(tmp_path / "ckpt", {"w": torch.ones(1)}, {"state": {"x": bad}}, {})
    assert not is_complete(tmp_path / "ckpt")


def large_state(seed: int) -> tuple[dict, dict, dict]:
    """64 MB: large enough that writing it takes far longer than returning from submit()."""
    g = torch.Generator().manual_seed(seed)
    model = {f"h.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(8)}
    optim = {"state": {name: {"exp_avg": torch.randn(1024, 1024, generator=g), "step": 3} for name in model},
             "param_groups": [{"lr": 0.1, "names": list(model)}]}
    return model, optim, {"step": seed}


def test_async_writer_writes_the_snapshot_taken_at_submit(storage):
    root = Storage(storage)
    model, optim, meta = large_state(seed=1)
    save_checkpoint(root.child("sync"), model, optim, meta)
    expected = {k: v.clone() for k, v in model.items()}

    with AsyncCheckpointWriter() as writer:
        writer.submit(root.child("async"), model, optim, meta)
        # training goes on and changes the live state at once: the checkpoint keeps the snapshot
        for t in model.values():
            t.add_(1.0)
        optim["state"]["h.0.weight"]["step"] = 4
        meta["step"] = 999
        assert writer.wait() == root.child("async")
        assert writer.done()

    assert is_complete(root.child("async"))
    for name in (MODEL_FILE, OPTIM_FILE, "meta.json", MANIFEST_FILE):
        assert root.child("async").read_bytes(name) == root.child("sync").read_bytes(name), name
    saved, _, saved_meta = load_checkpoint(root.child("async"))
    assert saved_meta == {"step": 1}
    assert_same_tree(saved, expected)


def test_async_writer_back_to_back_saves_keep_their_own_snapshots(tmp_path):
    model, optim, meta = tiny_state()
    expected_first = {k: v.clone() for k, v in model.items()}
    with AsyncCheckpointWriter() as writer:
        writer.submit(tmp_path / "a", model, optim, {"step": 1})
        for t in model.values():
            t.mul_(2)
        writer.submit(tmp_path / "b", model, optim, {"step": 2})  # waits for "a", reuses its buffers
        writer.wait()
    first, _, meta_a = load_checkpoint(tmp_path / "a")
    second, _, meta_b = load_checkpoint(tmp_path / "b")
    assert (meta_a, meta_b) == ({"step": 1}, {"step": 2})
    assert_same_tree(first, expected_first)
    assert_same_tree(second, model)


def test_async_write_failure_surfaces_in_wait(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    writer = AsyncCheckpointWriter()
    writer.submit(tmp_path / "a-file" / "ckpt", {"w": torch.ones(1)}, {}, {})
    with pytest.raises(RaychatError, match="writing checkpoint .*a-file/ckpt failed"):
        writer.wait()
    assert writer.wait() == Storage(str(tmp_path / "a-file" / "ckpt"))  # the error is reported once
    writer.close()


def test_overwriting_a_checkpoint_replaces_it(tmp_path):
    save_checkpoint(tmp_path / "ckpt", {"w": torch.zeros(3)}, {}, {"step": 1})
    save_checkpoint(tmp_path / "ckpt", {"w": torch.ones(3)}, {}, {"step": 2})
    model, _, meta = load_checkpoint(tmp_path / "ckpt")
    assert meta == {"step": 2} and torch.equal(model["w"], torch.ones(3))
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path / "ckpt"))


def test_saver_prunes_logs_the_stall_and_finishes_before_an_early_stop(storage):
    run = Storage(storage).child("run")
    lines = []
    saver = CheckpointSaver(run, keep=2, enabled=True, log=lines.append)
    model, optim, _ = tiny_state()
    for step in (5, 10, 15):
        saver.save(step, model, optim, {"step": step})
    # A stop (NaN) finishes the save in flight: the last good checkpoint is whole, not leaked.
    assert saver.finish() == 15 and saver.latest_step == 15
    assert [c.name for c in list_checkpoints(run)] == ["checkpoint_000010", "checkpoint_000015"]
    assert all(is_complete(c) for c in list_checkpoints(run))
    assert len(lines) == 3 and all("training stalled" in line and "written in" in line for line in lines)
    assert saver.poll() is None  # nothing in flight
    saver.close()
    # Other ranks hold a disabled saver: no writes.
    CheckpointSaver(run.child("other"), keep=2, enabled=False, log=lines.append).save(20, model, optim, {})
    assert not run.child("other").exists()


def test_an_error_that_is_not_damage_is_not_reported_as_damage(tmp_path, monkeypatch):
    """Only a short/missing file, a hash mismatch or an unreadable tensor file means "damaged, use an
    earlier checkpoint"; a device out of memory must surface as itself."""
    save_checkpoint(tmp_path / "ckpt", {"w": torch.ones(4)}, {"state": {}}, {"step": 1})

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "load", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        load_checkpoint(tmp_path / "ckpt")
