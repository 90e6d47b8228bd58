"""MuonAdamW across real gloo processes: data parallelism gives the single-process answer, the state
dict is the same on every rank and at every world size, and a state saved at one world size resumes
at another exactly as the unsaved run continues.

Every rank of a run trains the real GPT (tiny: width 64, 2 layers) and writes what it saw to a file;
the single-process reference runs in the test process. Two kinds of multi-rank run:
- data parallel: rank r takes its share of the rows (7 rows: 4 + 3, or 3 + 2 + 2) and the loss is
  divided by the global token count, as the trainer does. The SUM of per-rank gradients differs from
  the one-process gradient by float32 summation order only (~1e-7 relative), so after 3 steps at
  least 99.9% of the elements of every tensor agree to atol 1e-5 and every tensor's update (final -
  initial) agrees to 1e-3 of its norm. Not bitwise, and not every element: where a gradient element
  happens to land near AdamW's eps (1e-10), the step lr * g / (|g| + eps) is a steep function of g
  and the rounding noise shows (measured: 4 of 17408 elements of one value embedding at W=3, the
  largest off by 0.017; everything else within 1e-6).
- exact gradient: rank 0 computes the loss on all rows, the others multiply theirs by 0, so the
  SUM-reduced gradient is bitwise the one-process gradient and only the optimizer's sharding could
  make a difference. At W=3 the AdamW tensors divide unevenly (shards + replicated remainder) and
  the Muon groups (8, 2 and 1 matrices) leave ranks with padding or no matrix at all.
"""

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_bitwise_equal

from raychat.model.gpt import build_model, gpt_config
from raychat.optim.muon_adamw import build_optimizer

pytestmark = pytest.mark.integration  # gloo ranks

ROWS, T, VOCAB = 7, 16, 200
STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE = 2, 2
DATA_PARALLEL_STEPS = 3


def fresh_model_and_optimizer(params: dict | None = None):
    torch.manual_seed(0)
    model = build_model(gpt_config(depth=3, aspect_ratio=22, head_dim=34, max_seq_len=T, vocab_size=VOCAB,
                                   window_pattern="L"), "cpu")
    with torch.no_grad():
        # Off nanochat's init: its zero output projections make some scalar gradients exactly zero in
        # exact arithmetic, i.e. pure rounding noise, which AdamW (eps 1e-10) turns into full-size
        # steps whose sign depends on summation order. Perturbed, every gradient is a real signal.
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen), alpha=0.02)
    if params is not None:
        model.load_state_dict(params)
    optimizer = build_optimizer(model, embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02, scalar_lr=0.5,
                                weight_decay=0.2)
    return model, optimizer


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (ROWS, T + 1), generator=torch.Generator().manual_seed(1000 + step))
    return tokens[:, :-1], tokens[:, 1:]


def rank_rows(world: int, rank: int) -> slice:
    """The first ROWS % world ranks take one row more (raychat.scaling.rank_rows' rule)."""
    counts = [ROWS // world + (r < ROWS % world) for r in range(world)]
    return slice(sum(counts[:rank]), sum(counts[:rank + 1]))


def train(model, optimizer, steps, rows: slice = slice(None), weight: float = 1.0) -> None:
    for step in steps:
        x, y = batch(step)
        loss = model(x[rows], y[rows], loss_reduction="sum") * (weight / (ROWS * T))
        loss.backward()
        for group in optimizer.param_groups:  # a changing schedule, as the trainer sets it
            group["lr"] = group["initial_lr"] * (1.0 - 0.15 * step)
            if group["kind"] == "muon":
                group["momentum"] = 0.85 + 0.03 * step
                group["weight_decay"] = 0.2 * (1.0 - 0.2 * step)
        optimizer.step()
        model.zero_grad(set_to_none=True)


def params_of(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _run_world(world: int, rank: int, store_path: Path, resume_path: Path) -> dict:
    """Everything one rank of a `world`-rank process group checks; returns what it saw."""
    dist.init_process_group("gloo", store=dist.FileStore(str(store_path), world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        out: dict = {}
        model, optimizer = fresh_model_and_optimizer()
        train(model, optimizer, range(DATA_PARALLEL_STEPS), rows=rank_rows(world, rank))
        out["data_parallel"] = params_of(model)

        exact = 1.0 if rank == 0 else 0.0
        model, optimizer = fresh_model_and_optimizer()
        train(model, optimizer, range(STEPS_BEFORE_SAVE), weight=exact)
        out["saved_params"], out["saved_optim"] = params_of(model), optimizer.state_dict()
        # the same world size resumes from the saved state in a new optimizer...
        reloaded, reloaded_optimizer = fresh_model_and_optimizer(out["saved_params"])
        reloaded_optimizer.load_state_dict(out["saved_optim"])
        continuing = range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE)
        train(model, optimizer, continuing, weight=exact)
        train(reloaded, reloaded_optimizer, continuing, weight=exact)
        out["continued"], out["reloaded"] = params_of(model), params_of(reloaded)
        # ...and so does a state saved at another world size
        saved = torch.load(resume_path, weights_only=True)
        resumed, resumed_optimizer = fresh_model_and_optimizer(saved["params"])
        resumed_optimizer.load_state_dict(saved["optim"])
        train(resumed, resumed_optimizer, continuing, weight=exact)
        out["resumed"] = params_of(resumed)
        return out
    finally:
        dist.destroy_process_group()


def _worker(rank: int, tmp: str) -> None:
    """Three processes: ranks 0 and 1 first form a 2-rank group (resuming the 1-process state), then
    all three a 3-rank group (resuming the 2-rank state). One run of the reused rank processes
    (conftest.py's `ranks`), since starting Python + torch costs more than the training checked here."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    tmp_dir = Path(tmp)
    if rank < 2:
        out = _run_world(2, rank, tmp_dir / "store_w2", tmp_dir / "saved_w1.pt")
        torch.save(out, tmp_dir / f"w2_rank{rank}.pt")
        if rank == 0:  # written before rank 0 joins the 3-rank group, whose rendezvous the others wait in
            torch.save({"params": out["saved_params"], "optim": out["saved_optim"]}, tmp_dir / "saved_w2.pt")
    out = _run_world(3, rank, tmp_dir / "store_w3", tmp_dir / "saved_w2.pt")
    torch.save(out, tmp_dir / f"w3_rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(ranks, tmp_path_factory):
    """One process as the reference, then 2 and 3 ranks (see _worker)."""
    tmp = tmp_path_factory.mktemp("optim_dist")
    model, optimizer = fresh_model_and_optimizer()
    one = {"initial": params_of(model)}
    train(model, optimizer, range(DATA_PARALLEL_STEPS))
    one["data_parallel"] = params_of(model)
    model, optimizer = fresh_model_and_optimizer()
    train(model, optimizer, range(STEPS_BEFORE_SAVE))
    one["saved_params"], one["saved_optim"] = params_of(model), optimizer.state_dict()
    train(model, optimizer, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE))
    one["continued"] = params_of(model)
    torch.save({"params": one["saved_params"], "optim": one["saved_optim"]}, tmp / "saved_w1.pt")

    ranks.run(_worker, 3, str(tmp))
    load = torch.load
    return {1: one, 2: [load(tmp / f"w2_rank{r}.pt", weights_only=True) for r in range(2)],
            3: [load(tmp / f"w3_rank{r}.pt", weights_only=True) for r in range(3)]}


def assert_same(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_matches_one_process(runs, world):
    initial, expected = runs[1]["initial"], runs[1]["data_parallel"]
    for rank_result in runs[world]:
        for name, value in rank_result["data_parallel"].items():
            update, expected_update = value - initial[name], expected[name] - initial[name]
            assert (update - expected_update).norm() <= 1e-3 * expected_update.norm(), name
            assert ((value - expected[name]).abs() > 1e-5).float().mean() <= 1e-3, name


@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_is_full_and_identical_on_every_rank(runs, world):
    for rank_result in runs[world][1:]:
        assert_bitwise_equal(rank_result["saved_optim"], runs[world][0]["saved_optim"])
    # full logical tensors, the same as one process holds, whatever the world size
    groups = runs[world][0]["saved_optim"]["param_groups"]
    assert_bitwise_equal(groups, runs[1]["saved_optim"]["param_groups"])
    state, reference = runs[world][0]["saved_optim"]["state"], runs[1]["saved_optim"]["state"]
    assert state.keys() == reference.keys()
    for name in state:
        assert state[name].keys() == reference[name].keys()
        for key, value in state[name].items():
            if isinstance(value, torch.Tensor):
                assert value.shape == reference[name][key].shape
                torch.testing.assert_close(value, reference[name][key], rtol=0, atol=1e-7,
                                           msg=f"{name}.{key}")
            else:
                assert value == reference[name][key] == STEPS_BEFORE_SAVE


@pytest.mark.parametrize("world", [2, 3])
def test_same_world_size_resume_is_bitwise(runs, world):
    for rank_result in runs[world]:
        assert_same(rank_result["reloaded"], rank_result["continued"])


# Across world sizes the arithmetic is the same per element (64-aligned AdamW shards, Muon per
# matrix), so these runs matched bit for bit on the development machine; the tolerance only allows
# a BLAS that rounds a batched matmul differently for different batch counts.
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_runs_match_one_process(runs, world):
    for rank_result in runs[world]:
        assert_same(rank_result["continued"], runs[1]["continued"], atol=1e-6)


@pytest.mark.parametrize(("saved_at", "resumed_at"), [(1, 2), (2, 3)])
def test_resume_at_another_world_size_continues_like_unsaved(runs, saved_at, resumed_at):
    for rank_result in runs[resumed_at]:
        assert_same(rank_result["resumed"], runs[1]["continued"], atol=1e-6)


@pytest.mark.parametrize("saved_at", [2, 3])
def test_resume_in_one_process_from_sharded_state(runs, saved_at):
    saved = runs[saved_at][0]
    model, optimizer = fresh_model_and_optimizer(saved["saved_params"])
    optimizer.load_state_dict(saved["saved_optim"])
    train(model, optimizer, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE))
    assert_same(params_of(model), runs[1]["continued"], atol=1e-6)
