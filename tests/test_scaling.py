"""Scaling rules, batch layout and schedules, checked against numbers worked out by hand and against
seed 001 (a nanochat d12 run: batch 65536, 10000 steps, weight decay 0.099, 655,360,000 tokens,
tokens:params 5.95, 4 gradient-accumulation steps at device batch 8)."""

import math

import pytest

from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.scaling import (
    B_REF,
    format_plan,
    grad_accum_steps,
    lr_multiplier,
    micro_batch_sizes,
    muon_momentum,
    muon_weight_decay,
    rank_rows,
    resolve_plan,
    rows_per_step,
)

pytestmark = pytest.mark.unit

# Seed 001's run: depth 12, aspect 64, head_dim 128, vocab 32768, seq 2048, window L.
SEED_001 = dict(depth=12, window_pattern="L", total_batch_size=65536, num_iterations=10000,
                device_batch_size=8)


# ---------------------------------------------------------------------------------------------------
# learning-rate multiplier: 100 steps, 10 warmup, warmdown over the last 50 to 0.1


@pytest.mark.parametrize("step, expected", [
    (0, 0.1),  # (0 + 1) / 10
    (4, 0.5),
    (9, 1.0),  # last warmup step reaches the peak
    (10, 1.0),
    (50, 1.0),  # 100 - 50: the last flat step
    (75, 0.55),  # progress (100 - 75) / 50 = 0.5 -> 0.5 + 0.5 * 0.1
    (90, 0.28),  # progress 0.2 -> 0.2 + 0.8 * 0.1
    (100, 0.1),  # the end: final_lr_frac
])
def test_lr_multiplier_boundaries(step, expected):
    assert lr_multiplier(step, 100, 10, 0.5, 0.1) == pytest.approx(expected)


def test_lr_multiplier_nanochat_defaults():
    # 1000 steps, warmup 40, warmdown round(0.65 * 1000) = 650 steps starting after step 350, to 0.05
    lrm = [lr_multiplier(s, 1000, 40, 0.65, 0.05) for s in range(1001)]
    assert lrm[0] == pytest.approx(1 / 40)
    assert lrm[39] == 1.0 and lrm[350] == 1.0
    assert lrm[351] == pytest.approx(649 / 650 + (1 / 650) * 0.05)
    assert lrm[1000] == pytest.approx(0.05)
    assert all(a >= b for a, b in zip(lrm[40:], lrm[41:], strict=False))  # never rises after warmup


def test_lr_multiplier_without_warmup_or_warmdown():
    assert [lr_multiplier(s, 10, 0, 0.0, 0.05) for s in (0, 5, 9, 10)] == [1.0] * 4


# ---------------------------------------------------------------------------------------------------
# Muon momentum: 1000 steps, warmdown ratio 0.5 (warmdown from step 500)


@pytest.mark.parametrize("step, expected", [
    (0, 0.85),
    (200, 0.91),  # halfway through the 400-step warmup: (0.85 + 0.97) / 2
    (399, 0.85 + 0.12 * 399 / 400),
    (400, 0.97),
    (499, 0.97),
    (500, 0.97),  # warmdown starts: progress 0
    (750, 0.935),  # halfway down to 0.90
    (1000, 0.90),
])
def test_muon_momentum_boundaries(step, expected):
    assert muon_momentum(step, 1000, 0.5) == pytest.approx(expected)


def test_muon_momentum_warmup_wins_over_an_early_warmdown():
    # 100 steps at ratio 0.65: warmdown starts at step 35, inside the 400-step momentum warmup
    assert muon_momentum(50, 100, 0.65) == pytest.approx(0.85 + 0.12 * 50 / 400)


def test_muon_momentum_without_warmdown():
    assert muon_momentum(1000, 1000, 0.0) == 0.97


# ---------------------------------------------------------------------------------------------------
# Muon weight decay: cosine from wd to 0


def test_muon_weight_decay_cosine():
    wd = 0.2
    assert muon_weight_decay(0, 800, wd) == pytest.approx(0.2)
    assert muon_weight_decay(200, 800, wd) == pytest.approx(0.2 * (1 + math.sqrt(2) / 2) / 2)
    assert muon_weight_decay(400, 800, wd) == pytest.approx(0.1)
    assert muon_weight_decay(800, 800, wd) == pytest.approx(0.0, abs=1e-15)


# ---------------------------------------------------------------------------------------------------
# batch layout


def test_rows_per_step_and_its_error():
    assert rows_per_step(65536, 2048) == 32
    with pytest.raises(RaychatError, match=r"--total-batch-size .*--max-seq-len 2048.*size 65536"):
        rows_per_step(65537, 2048)
    with pytest.raises(RaychatError, match=r"--total-batch-size 2048"):  # less than one row
        rows_per_step(1000, 2048)


def test_rank_rows_deal():
    assert [rank_rows(10, 3, r) for r in range(3)] == [4, 3, 3]
    assert [rank_rows(11, 3, r) for r in range(3)] == [4, 4, 3]
    assert [rank_rows(32, 32, r) for r in range(32)] == [1] * 32
    for world_size in range(1, 38):  # every W from 1 to R covers the R rows exactly once
        assert sum(rank_rows(37, world_size, r) for r in range(world_size)) == 37
    with pytest.raises(RaychatError, match="--num-workers 38"):
        rank_rows(37, 38, 0)


def test_micro_batches_and_grad_accum():
    assert micro_batch_sizes(20, 8) == [8, 8, 4]
    assert micro_batch_sizes(16, 8) == [8, 8]
    assert micro_batch_sizes(3, 8) == [3]
    assert grad_accum_steps(32, 1, 8) == 4  # seed 001: 65536 / (8 x 2048)
    assert grad_accum_steps(32, 3, 8) == 2  # rank 0 takes 11 rows: 8 + 3
    assert grad_accum_steps(32, 32, 8) == 1
    assert grad_accum_steps(37, 2, 5) == 4  # rank 0 takes 19 rows: 5 + 5 + 5 + 4


# ---------------------------------------------------------------------------------------------------
# the resolved plan


def test_seed_001_plan():
    plan = resolve_plan(TrainConfig(**SEED_001), vocab_size=32768)
    assert (plan.model.n_layer, plan.model.n_head, plan.model.n_embd) == (12, 6, 768)
    assert plan.params["total"] == 286_261_730
    assert plan.total_batch_size == 65536 and plan.batch_rule == "flag"
    assert plan.num_iterations == 10000 and plan.horizon_rule == "num_iterations"
    assert plan.total_tokens == 655_360_000
    assert round(plan.tokens_per_param, 2) == 5.95
    # d12 at the default ratio is the reference itself (D = D_REF): only the batch scales the decay
    assert plan.weight_decay == pytest.approx(0.28 * math.sqrt(1 / 8))
    assert round(plan.weight_decay, 3) == 0.099
    assert plan.lr_scale == pytest.approx(math.sqrt(1 / 8))
    assert plan.rows_per_step == 32 and plan.grad_accum_steps == 4


def test_auto_batch_d12_is_the_reference():
    plan = resolve_plan(TrainConfig(depth=12), vocab_size=32768)
    assert plan.total_batch_size == B_REF == 2**19 and plan.batch_rule == "auto"
    assert plan.lr_scale == 1.0 and plan.weight_decay == pytest.approx(0.28)
    assert plan.target_tokens == int(12 * plan.scaling_params)
    assert plan.num_iterations == plan.target_tokens // 2**19


def test_auto_batch_d24_follows_the_power_law():
    d12 = resolve_plan(TrainConfig(depth=12), vocab_size=32768)
    d24 = resolve_plan(TrainConfig(depth=24), vocab_size=32768)
    # By hand: d24 is 1536 wide, so its matrices are ~24 * 12 * 1536^2 = 679.5M and lm_head
    # 32768 * 1536 = 50.3M: ~729.8M scaling params against d12's ~110.1M, ratio ~6.63.
    # B = 2^19 * 6.63^0.383 = 2^19 * 2.06 = 2^20.04, which rounds to 2^20.
    assert 6.5 < d24.scaling_params / d12.scaling_params < 6.8
    assert d24.total_batch_size == 2**20
    horizon_ratio = d24.target_tokens / (12 * d12.scaling_params)
    assert math.log2(2**19 * horizon_ratio**0.383) == pytest.approx(20.04, abs=0.02)
    assert d24.lr_scale == pytest.approx(math.sqrt(2))
    assert d24.weight_decay == pytest.approx(0.28 * math.sqrt(2) / horizon_ratio)
    assert d24.num_iterations == d24.target_tokens // 2**20


def test_horizon_precedence():
    base = dict(depth=4, head_dim=64, max_seq_len=512, window_pattern="L", total_batch_size=4096)
    by_ratio = resolve_plan(TrainConfig(**base, target_param_data_ratio=20), vocab_size=8192)
    assert by_ratio.horizon_rule == "target_param_data_ratio"
    assert by_ratio.num_iterations == int(20 * by_ratio.scaling_params) // 4096

    flops_per_step = by_ratio.flops_per_token * 4096
    by_flops = resolve_plan(TrainConfig(**base, target_flops=123.4 * flops_per_step), vocab_size=8192)
    assert by_flops.horizon_rule == "target_flops" and by_flops.num_iterations == 123

    by_steps = resolve_plan(TrainConfig(**base, target_flops=123.4 * flops_per_step, num_iterations=7),
                            vocab_size=8192)
    assert by_steps.horizon_rule == "num_iterations" and by_steps.num_iterations == 7
    assert by_steps.total_tokens == 7 * 4096


def test_ratio_cancels_out_of_batch_and_weight_decay():
    """D / D_REF = ratio * N / (ratio * N_d12): any ratio, or none (-1, with --num-iterations set),
    gives the same auto batch and weight decay."""
    plans = [resolve_plan(TrainConfig(depth=16, num_iterations=10, target_param_data_ratio=ratio), 32768)
             for ratio in (12, 20, -1)]
    assert len({p.total_batch_size for p in plans}) == 1
    assert plans[1].weight_decay == pytest.approx(plans[0].weight_decay)
    assert plans[2].weight_decay == pytest.approx(plans[0].weight_decay)
    assert [p.target_tokens for p in plans] == [int(12 * plans[0].scaling_params),
                                                int(20 * plans[0].scaling_params), 0]


def test_world_size_changes_only_the_layout():
    cfg = TrainConfig(**SEED_001)
    plans = [resolve_plan(cfg, vocab_size=32768, world_size=w) for w in (1, 2, 3, 5, 32)]
    assert {(p.total_batch_size, p.num_iterations, p.rows_per_step, p.weight_decay) for p in plans} == {
        (65536, 10000, 32, plans[0].weight_decay)}
    assert [p.grad_accum_steps for p in plans] == [4, 2, 2, 1, 1]  # rank 0: 32, 16, 11, 7, 1 rows
    with pytest.raises(RaychatError, match="--num-workers 33"):
        resolve_plan(cfg, vocab_size=32768, world_size=33)


def test_impossible_plans():
    with pytest.raises(RaychatError, match=r"--total-batch-size 65536"):
        resolve_plan(TrainConfig(**{**SEED_001, "total_batch_size": 65000}), vocab_size=32768)
    # an auto batch (a power of two) cannot be cut into rows of 1000 tokens
    with pytest.raises(RaychatError, match=r"auto batch size .*--max-seq-len 1000"):
        resolve_plan(TrainConfig(depth=4, max_seq_len=1000), vocab_size=8192)
    with pytest.raises(RaychatError, match="--target-param-data-ratio"):
        resolve_plan(TrainConfig(depth=4, target_param_data_ratio=1e-6, total_batch_size=2**19),
                     vocab_size=8192)


def test_format_plan_table():
    text = format_plan(resolve_plan(TrainConfig(**SEED_001), vocab_size=32768, world_size=3))
    assert "286,261,730" in text and "65,536" in text and "10,000" in text and "5.95" in text
    assert "0.098995" in text  # weight decay
    assert "8 + 3" in text  # rank 0's micro-batches at 3 workers
