"""The optimizer seam (raychat.optim.base, raychat.optim.registry): a second optimizer, plain SGD, is one
module in raychat/optim plus its flags, and a run trains, saves, resumes (also at another world size)
and sizes its memory with it through the same code as with Muon + AdamW; a checkpoint resumes only
under the optimizer that saved it."""

import argparse
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import MEMORY_CONFIG as CONFIG
from helpers import MEMORY_PARAMS as PARAMS
from helpers import StepComponents, gloo_group, modules_loaded_by, step_components

from raychat.checkpoint.meta import CheckpointMeta
from raychat.checkpoint.reader import CheckpointReader
from raychat.checkpoint.resume import Restore
from raychat.checkpoint.saver import CheckpointSaver
from raychat.common import RaychatError
from raychat.config import OPTIMIZERS, TrainConfig, add_config_flags, config_from_args
from raychat.memory import estimate_memory
from raychat.optim.base import ShardedOptimizer
from raychat.optim.sgd import SGD
from raychat.run.prepare import check_resume_fits
from raychat.scaling import lr_multiplier, muon_momentum, muon_weight_decay, resolve_plan
from raychat.storage import Storage
from raychat.worker.state import apply_share, read_share, state_pieces
from raychat.worker.step import set_schedules, train_step

VOCAB, T, ROWS, STEPS, SAVE_AT = 128, 16, 8, 12, 6
CPU = torch.device("cpu")


def counting(step: int) -> torch.Tensor:
    """A learnable stream (tests/helpers.py StepRows): each of step `step`'s rows counts up from a
    seeded start (mod VOCAB), so the next token is the current one plus one."""
    starts = torch.randint(0, VOCAB, (ROWS, 1), generator=torch.Generator().manual_seed(1000 + step))
    return (starts + torch.arange(T + 1)) % VOCAB


def flags(*extra: str) -> TrainConfig:
    """The config the command line makes of these flags (raychat.config's generated parser)."""
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return config_from_args(parser.parse_args([
        "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", str(T),
        "--window-pattern", "L", "--device-batch-size", "4", "--total-batch-size", str(ROWS * T),
        "--num-iterations", str(STEPS), "--warmup-steps", "2", *extra]))


SGD_FLAGS = ("--optimizer", "sgd", "--sgd-lr", "50", "--sgd-momentum", "0.9")


def components(cfg: TrainConfig, world: int = 1, rank: int = 0, step: int = 0) -> StepComponents:
    """A rank's model and optimizer as the worker builds them (raychat.worker.setup): the model
    from the plan, the optimizer from the spec --optimizer names."""
    return step_components(cfg, VOCAB, counting, world, rank, step)


def save(run: Storage, c: StepComponents, step: int, world: int, rank: int, gather) -> None:
    """What the train loop's save does (raychat.worker.fault_tolerance.FaultTolerance.save), blocking."""
    saver = CheckpointSaver(run, keep=0, rank=rank, world_size=world, log=lambda _: None)
    saver.prepare(step)
    token = gather(f"token-{step}")[0]
    pieces, plain = state_pieces(c.model, c.optimizer, world, rank)
    meta = CheckpointMeta(step=step, model_config=c.plan.model, world_size=world,
                          user_config=c.cfg) if rank == 0 else None
    saver.save(step, pieces, token, meta, extra=plain, wait=True)
    saver.close()


def resume(run: Storage, cfg: TrainConfig, step: int, world: int = 1, rank: int = 0,
           gather=lambda obj: [obj]) -> StepComponents:
    """What raychat.worker.setup.setup does with a checkpoint: read this rank's share, apply it."""
    c = components(cfg, world, rank, step)
    restore = Restore(run, [f"checkpoint_{step:06d}"], gather, lambda _: None)
    share = restore.load(lambda reader: read_share(reader, c.model, c.optimizer, world, rank))
    apply_share(share, c.model, c.optimizer, world, CPU)
    return c


def momenta(optimizer: ShardedOptimizer) -> dict[str, torch.Tensor]:
    return {name: optimizer.state[p]["momentum_buffer"].clone() for group in optimizer.param_groups
            for name, p in zip(group["names"], group["params"], strict=True)}


@pytest.mark.unit
def test_every_registered_optimizer_builds_one_by_its_name():
    for name in OPTIMIZERS:
        c = components(flags("--optimizer", name))
        assert isinstance(c.optimizer, ShardedOptimizer) and c.optimizer.name == name
        placed = [p for group in c.optimizer.param_groups for p in group["params"]]
        assert sorted(map(id, placed)) == sorted(id(p) for p in c.model.parameters())
    with pytest.raises(SystemExit):  # argparse offers the registered names only
        flags("--optimizer", "adagrad")
    with pytest.raises(RaychatError, match="--optimizer must be one of muon_adamw, sgd"):
        TrainConfig(optimizer="adagrad")
    with pytest.raises(RaychatError, match="--sgd-momentum"):
        flags("--optimizer", "sgd", "--sgd-momentum", "1")


@pytest.mark.unit
def test_the_step_schedules_every_lr_and_what_the_optimizer_itself_schedules():
    step = 9  # past the warmup, so nothing is at its start value
    for name in OPTIMIZERS:
        c = components(flags("--optimizer", name))
        lrm = set_schedules(c.optimizer, c.cfg, c.plan, step)
        assert lrm == lr_multiplier(step, STEPS, 2, c.cfg.warmdown_ratio, c.cfg.final_lr_frac) < 1
        for group in c.optimizer.param_groups:
            assert group["lr"] == group["initial_lr"] * lrm
            if group.get("kind") == "muon":  # nanochat's Muon schedules: momentum warmup, weight decay cosine
                assert group["momentum"] == muon_momentum(step, STEPS, c.cfg.warmdown_ratio)
                assert group["weight_decay"] == muon_weight_decay(step, STEPS, c.plan.weight_decay)
            if name == "sgd":  # SGD schedules nothing but its lr
                assert group["momentum"] == c.cfg.sgd_momentum


@pytest.mark.unit
def test_sgd_trains_and_a_checkpoint_of_it_resumes_bit_for_bit(tmp_path):
    cfg = flags(*SGD_FLAGS)
    assert cfg.optimizer == "sgd" and isinstance(components(cfg).optimizer, SGD)
    whole = components(cfg)
    losses = [train_step(whole, step).loss for step in range(STEPS)]
    assert losses[0] > 4 and losses[-1] < losses[0] / 4, losses  # ln(128) = 4.85 at the start

    first = components(cfg)
    for step in range(SAVE_AT):
        train_step(first, step)
    run = Storage(str(tmp_path / "run"))
    save(run, first, SAVE_AT, 1, 0, lambda obj: [obj])
    resumed = resume(run, cfg, SAVE_AT)
    assert all(torch.equal(a, b) for a, b in zip(momenta(first.optimizer).values(),
                                                 momenta(resumed.optimizer).values(), strict=True))
    for step in range(SAVE_AT, STEPS):
        assert train_step(resumed, step).loss == losses[step]
    for name, weights in whole.model.state_dict().items():
        assert torch.equal(weights, resumed.model.state_dict()[name]), name


@pytest.mark.unit
def test_a_checkpoint_resumes_only_under_the_optimizer_that_saved_it(tmp_path):
    for saved, other in (("sgd", "muon_adamw"), ("muon_adamw", "sgd")):
        cfg = flags("--optimizer", saved)
        c = components(cfg)
        train_step(c, 0)
        run = Storage(str(tmp_path / saved))
        save(run, c, 1, 1, 0, lambda obj: [obj])
        message = f"saved with --optimizer {saved}, not {other}: .* resume with --optimizer {saved}"
        with pytest.raises(RaychatError, match=message):  # the workers (a group Ray restarts)
            resume(run, flags("--optimizer", other), 1)
        later = flags("--optimizer", other)  # the driver, before Ray starts
        checkpoint = run.child("checkpoint_000001")
        meta = CheckpointMeta.from_json(checkpoint.read_bytes("meta.json"))
        with pytest.raises(RaychatError, match=message) as refused:
            check_resume_fits(later, resolve_plan(later, VOCAB), None, meta, checkpoint)
        assert "\n" not in str(refused.value)
        check_resume_fits(cfg, resolve_plan(cfg, VOCAB), None, meta, checkpoint)  # the same one passes


@pytest.mark.unit
def test_the_memory_estimate_counts_sgd_state_by_hand():
    """PARAMS: 4,000 parameters, 1,000 of them AdamW's and 3,000 Muon's (tests/helpers.py); 2 ranks."""
    args = dict(micro_batch_rows=2, micro_batches=2, world_size=2, compute_bytes=2, compiled=False)
    muon = estimate_memory(CONFIG, PARAMS, **args)
    assert muon == estimate_memory(CONFIG, PARAMS, **args, cfg=flags("--optimizer", "muon_adamw"))
    sgd = estimate_memory(CONFIG, PARAMS, **args, cfg=flags(*SGD_FLAGS))
    # SGD: one fp32 momentum per parameter, whole on every rank; gradients reduced in place
    assert sgd.optimizer == 4 * 4000 == muon.optimizer + 6_000  # Muon + AdamW: (8 x 1,000 + 4 x 3,000) / 2
    assert sgd.step_buffers == 0 == muon.step_buffers - 14_000  # Muon's stack 4 x 3,000, AdamW 4 x 1,000 / 2
    assert sgd.save_host == 4 * 4000 // 2 + 4 * 4000 == muon.save_host + 6_000  # rank 0 writes all momenta
    assert (sgd.parameters, sgd.gradients, sgd.activations, sgd.transients) == \
        (muon.parameters, muon.gradients, muon.activations, muon.transients)
    assert sgd.peak == muon.peak + 6_000  # the forward is the peak phase of both (test_memory)
    # --sgd-momentum 0: no state at all, nothing of it to save; the rest as with momentum
    plain = estimate_memory(CONFIG, PARAMS, **args, cfg=flags("--optimizer", "sgd", "--sgd-momentum", "0"))
    assert plain.optimizer == 0 and plain.step_buffers == 0
    assert plain.save_host == 4 * 4000 // 2 == 8_000  # the rank's half of the model only
    assert (plain.parameters, plain.gradients, plain.activations, plain.transients) == \
        (sgd.parameters, sgd.gradients, sgd.activations, sgd.transients)
    assert plain.peak == sgd.peak - 4 * 4000


@pytest.mark.unit
def test_sgd_without_momentum_keeps_saves_and_reads_no_state(tmp_path):
    """--sgd-momentum 0: SGD keeps no state, so a checkpoint holds none of it and a resume continues
    bit for bit from the weights alone; a checkpoint saved with momentum, resumed without it, reads
    none of its buffers (they would never be used, and the estimate counts none)."""
    plain = flags("--optimizer", "sgd", "--sgd-lr", "50", "--sgd-momentum", "0")
    whole = components(plain)
    losses = [train_step(whole, step).loss for step in range(STEPS)]
    first = components(plain)
    for step in range(SAVE_AT):
        train_step(first, step)
    assert len(first.optimizer.state) == 0
    run = Storage(str(tmp_path / "plain"))
    save(run, first, SAVE_AT, 1, 0, lambda obj: [obj])
    with CheckpointReader(run.child(f"checkpoint_{SAVE_AT:06d}")) as reader:
        assert reader.extra["stateful"] == []
        assert not any(name.startswith("optim/") for name in reader.tensors)
    resumed = resume(run, plain, SAVE_AT)
    assert len(resumed.optimizer.state) == 0
    for step in range(SAVE_AT, STEPS):
        assert train_step(resumed, step).loss == losses[step]
    for name, weights in whole.model.state_dict().items():
        assert torch.equal(weights, resumed.model.state_dict()[name]), name

    with_momentum = components(flags(*SGD_FLAGS))
    for step in range(SAVE_AT):
        train_step(with_momentum, step)
    run = Storage(str(tmp_path / "momentum"))
    save(run, with_momentum, SAVE_AT, 1, 0, lambda obj: [obj])
    assert len(resume(run, flags(*SGD_FLAGS), SAVE_AT).optimizer.state) > 0
    assert len(resume(run, plain, SAVE_AT).optimizer.state) == 0


def _rank(rank: int, tmp: str) -> None:
    with gloo_group(rank, tmp) as gather:
        cfg = flags(*SGD_FLAGS)
        c = components(cfg, 2, rank)
        losses = [train_step(c, step).loss for step in range(SAVE_AT)]
        save(Storage(str(Path(tmp) / "w2")), c, SAVE_AT, 2, rank, gather)
        dist.barrier()  # rank 0's save returned: its meta and manifest are written
        resumed = resume(Storage(str(Path(tmp) / "w2")), cfg, SAVE_AT, 2, rank, gather)
        out = {"losses": losses, "momenta": momenta(c.optimizer), "resumed": momenta(resumed.optimizer),
               "params": {k: v.clone() for k, v in c.model.state_dict().items()}}
        torch.save(out, Path(tmp) / f"rank{rank}.pt")


@pytest.mark.integration  # gloo ranks
def test_two_ranks_of_sgd_take_the_one_rank_steps_and_resume_at_either_world_size(ranks, tmp_path):
    ranks.run(_rank, 2, str(tmp_path))
    one = components(flags(*SGD_FLAGS))
    losses = [train_step(one, step).loss for step in range(SAVE_AT)]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for got in ranks:
        for loss, expected in zip(got["losses"], losses, strict=True):
            assert math.isclose(loss, expected, rel_tol=1e-4)
        for name, p in one.model.state_dict().items():  # the same update, up to summation order
            assert torch.allclose(got["params"][name], p, rtol=1e-3, atol=1e-5), name
        for name, m in got["momenta"].items():  # every rank holds the whole state, and gets it back
            assert torch.equal(m, ranks[0]["momenta"][name]) and torch.equal(got["resumed"][name], m), name
    # The W=2 checkpoint (rank 0 wrote the one copy) resumed by one process
    at_one = resume(Storage(str(tmp_path / "w2")), flags(*SGD_FLAGS), SAVE_AT)
    for name, m in momenta(at_one.optimizer).items():
        assert torch.equal(m, ranks[0]["momenta"][name]), name



@pytest.mark.integration  # a subprocess
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_cpu_worker_builds_and_steps_without_loading_torchdynamo(optimizer):
    """A worker on the CPU never loads TorchDynamo: torch.optim.Optimizer's methods would, at the
    optimizer's build (~2 s of CPU in every worker, again at every restart: raychat.optim.base).
    A fresh interpreter builds the model and optimizer as the worker does and takes a step."""
    cfg = flags(*(SGD_FLAGS if optimizer == "sgd" else ()))
    stream = f"lambda step: torch.randint(0, {VOCAB}, ({ROWS}, {T + 1}))"
    script = ("import torch\n"
              "from helpers import step_components\n"
              "from raychat.config import TrainConfig\n"
              "from raychat.worker.step import train_step\n"
              f"c = step_components(TrainConfig(**{dataclasses.asdict(cfg)!r}), {VOCAB}, {stream})\n"
              "train_step(c, 0)")
    assert not modules_loaded_by(script, "torch._dynamo"), "TorchDynamo was loaded"
