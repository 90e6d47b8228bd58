"""raychat.worker.step.train_step, the worker's optimizer step, run without Ray: the step does not
depend on how a rank's rows are cut into micro-batches nor on how many ranks share them, and the
caller's values ride on the loss's all-reduce (the one sync of a step)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import StepComponents, step_components

from raychat.config import TrainConfig
from raychat.model.gpt import GPT
from raychat.optim.muon_adamw import MuonAdamW, build_optimizer
from raychat.scaling import Plan
from raychat.worker.step import train_step

VOCAB, T, ROWS, STEPS = 128, 16, 6, 3


def seeded(step: int) -> torch.Tensor:
    """Step `step`'s rows (all ranks'), random tokens from a seed (tests/helpers.py StepRows)."""
    return torch.randint(0, VOCAB, (ROWS, T + 1), generator=torch.Generator().manual_seed(1000 + step))


def off_init_muon_adamw(model: GPT, cfg: TrainConfig, plan: Plan) -> MuonAdamW:
    """The weights moved off nanochat's init (so that fewer gradients are pure rounding noise), then
    nanochat's MuonAdamW at the flags' lrs as given (not times the plan's batch-size scale)."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen), alpha=0.02)
    return build_optimizer(model, embedding_lr=cfg.embedding_lr, unembedding_lr=cfg.unembedding_lr,
                           matrix_lr=cfg.matrix_lr, scalar_lr=cfg.scalar_lr, weight_decay=plan.weight_decay)


def components(device_batch_size: int, world: int = 1, rank: int = 0) -> StepComponents:
    cfg = TrainConfig(depth=2, aspect_ratio=32, head_dim=32, max_seq_len=T, window_pattern="L",
                      device_batch_size=device_batch_size, total_batch_size=ROWS * T, num_iterations=STEPS,
                      warmup_steps=2)
    return step_components(cfg, VOCAB, seeded, world, rank, build=off_init_muon_adamw)


def run_steps(c: StepComponents, also_sum: tuple[float, ...] = ()) -> tuple[list, dict]:
    results = [train_step(c, step, also_sum) for step in range(c.plan.num_iterations)]
    return results, {k: v.clone() for k, v in c.model.state_dict().items()}


def assert_same_update(a: dict, b: dict) -> None:
    """Two runs from the same start moved every weight matrix the same way, up to float32 summation
    order. Not the scalars: some of their gradients are rounding noise, which AdamW (eps 1e-10) turns
    into full steps whose sign depends on that order, and which then reaches the matrices (measured:
    within 0.7% of the update after 3 steps, hence 2%)."""
    start = components(ROWS).model.state_dict()
    for name in a:
        if a[name].ndim >= 2:
            update = a[name] - start[name]
            assert (update - (b[name] - start[name])).norm() <= 2e-2 * update.norm(), name


@pytest.mark.unit
def test_micro_batches_do_not_change_the_step():
    whole, whole_params = run_steps(components(device_batch_size=ROWS))
    cut, cut_params = run_steps(components(device_batch_size=4))  # 4 + 2 rows
    assert [len(c.micro_slices) for c in (components(ROWS), components(4))] == [1, 2]
    for a, b in zip(whole, cut, strict=True):
        assert math.isclose(a.loss, b.loss, rel_tol=1e-5) and a.lrm == b.lrm
    assert_same_update(whole_params, cut_params)
    assert whole[0].lrm == 0.5 and whole[1].lrm == 1.0  # the warmup: (step + 1) / 2
    assert all(r.summed == [] and r.dt >= r.data_wait >= 0 for r in whole)


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        c = components(device_batch_size=2, world=2, rank=rank)
        results, params = run_steps(c, also_sum=(float(rank), 1.0))
        torch.save({"losses": [r.loss for r in results], "summed": [r.summed for r in results],
                    "params": params}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.integration  # gloo ranks
def test_two_ranks_take_the_one_rank_step_and_sum_the_callers_values(ranks, tmp_path):
    ranks.run(_rank, 2, str(tmp_path / "store"), str(tmp_path))
    one, one_params = run_steps(components(device_batch_size=2))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["summed"] == [[1.0, 2.0]] * STEPS  # (0 + 1, 1 + 1): summed over both ranks every step
        for loss, r in zip(got["losses"], one, strict=True):
            assert math.isclose(loss, r.loss, rel_tol=1e-5)
        assert_same_update(one_params, got["params"])


@pytest.mark.integration  # a subprocess
def test_importing_the_step_does_not_import_ray():
    code = "import sys, raychat.worker.step; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent).returncode == 0


@pytest.mark.unit
def test_callable_values_are_asked_after_the_steps_work_and_ride_on_its_all_reduce():
    """A callable `also_sum` is asked once, after the optimizer step (the memory tier's still-sending
    flag must have seen the step's time go by: raychat.worker.loop), and its values come back summed."""
    c = components(ROWS)
    before = {k: v.clone() for k, v in c.model.state_dict().items()}
    asked = []

    def values() -> tuple[float, float]:
        moved = any(not torch.equal(v, before[k]) for k, v in c.model.state_dict().items())
        asked.append(moved)
        return 2.0, 3.5

    assert train_step(c, 0, values).summed == [2.0, 3.5]
    assert asked == [True]


@pytest.mark.unit
def test_cpu_workers_split_the_cores_their_node_declared_to_ray():
    """A node's CPU workers share its cores, up to the CPUs the node declared to Ray: 1-CPU nodes that
    share a 2-core machine (the multi-node test clusters) get one thread per worker, not two each."""
    from raychat.worker.setup import cpu_threads

    assert cpu_threads(usable_cores=2, node_cpus=1.0, local_world_size=1) == 1
    assert cpu_threads(usable_cores=64, node_cpus=64.0, local_world_size=8) == 8
    assert cpu_threads(usable_cores=8, node_cpus=16.0, local_world_size=2) == 4  # a taskset's 8 cores
    assert cpu_threads(usable_cores=8, node_cpus=None, local_world_size=3) == 2  # not found: the cores
    assert cpu_threads(usable_cores=8, node_cpus=0.5, local_world_size=1) == 1  # a fraction: one core
    assert cpu_threads(usable_cores=2, node_cpus=2.0, local_world_size=4) == 1
