"""The plan's memory estimate: each part against numbers worked by hand for a small config, the eager
activations against autograd's own count of what it keeps, the peak against a real step's allocations
(bench/memory.py), and the fits / does-not-fit verdict of `python -m raychat.plan`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MEMORY_CONFIG as CONFIG
from helpers import MEMORY_PARAMS as PARAMS

from raychat.common import RaychatError
from raychat.config import TrainConfig
from raychat.memory import (
    GIB,
    MARGIN,
    activation_bytes,
    embedding_tables,
    estimate_memory,
    fit_device_batch_size,
    fit_plan_to_device,
    format_memory,
    gpu_memory_gib,
    plan_memory,
)
from raychat.model.gpt import build_model, gpt_config
from raychat.model.precision import Precision
from raychat.plan import main as plan_main
from raychat.scaling import resolve_plan

REPO_ROOT = Path(__file__).resolve().parent.parent



@pytest.mark.unit
def test_each_part_matches_the_hand_worked_numbers():
    # micro-batches of 2 rows (32 tokens), 2 of them per step, on 2 ranks, bf16, eager
    m = estimate_memory(CONFIG, PARAMS, micro_batch_rows=2, micro_batches=2, world_size=2, compute_bytes=2,
                        compiled=False)
    assert m.parameters == 16_000 and m.gradients == 16_000  # 4 bytes x 4,000
    assert m.optimizer == (8 * 1000 + 4 * 3000) // 2 == 10_000
    assert m.step_buffers == 4 * 3000 + 4 * 1000 // 2 == 14_000
    # 32 tokens x 8 channels x (2 layers x (15 x 2 + 16) + 8 + 4 x 2); one value-embedding layer of 8
    # channels x 2 bytes; the block weights cast to bf16 (2 x 3,000); lm_head's fp32 dL/dW (4 x 64 x 8)
    assert m.activations == 256 * (2 * 46 + 16) + 256 * 2 + 6_000 + 2_048 == 36_208
    # the loss's chunk (all 32 rows) x vocab 50 x (8 + 2), lm_head's bf16 copy and product + fp32 sum
    assert m.transients == 32 * 50 * 10 + 64 * 8 * (2 * 2 + 4) == 20_096
    # gradients wait through the second micro-batch's forward: that phase, not the step, is the peak
    assert m.peak == 16_000 + 10_000 + 36_208 + 20_096 + 16_000 == 98_304
    assert m.save_host == (16_000 + 8_000 + 12_000) // 2 == 18_000  # the rank's own share, on the host
    one = estimate_memory(CONFIG, PARAMS, 2, 1, world_size=1, compute_bytes=4, compiled=False)
    assert one.optimizer == 20_000 and one.save_host == 36_000
    # fp32: no casts, no compute-dtype copies in the loss; one micro-batch: gradients only at the step
    assert one.activations == 256 * (2 * 76 + 24) + 256 * 4 + 2_048 and one.transients == 32 * 50 * 8
    assert one.peak == 16_000 + 20_000 + max(one.activations + one.transients, 16_000 + 14_000)
    compiled = estimate_memory(CONFIG, PARAMS, 2, 1, 1, compute_bytes=2, compiled=True)
    assert compiled.activations == 2 * 34 * 32 * 8 and compiled.transients == 8 * 32 * 50


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("depth,rows,seq_len,window", [(2, 4, 64, "L"), (3, 2, 128, "SSL")])
def test_eager_activations_are_what_autograd_keeps(dtype, depth, rows, seq_len, window):
    """Every tensor autograd saves for the backward, counted once per storage (parameters excluded)."""
    torch.manual_seed(0)
    config = gpt_config(depth=depth, aspect_ratio=32, head_dim=32, max_seq_len=seq_len, vocab_size=1000,
                        window_pattern=window)
    model = build_model(config, "cpu", Precision(dtype, None, False))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, 1000, (rows, seq_len + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens[:, :-1], tokens[:, 1:], loss_reduction="sum")
    predicted, _ = activation_bytes(config, rows, dtype.itemsize, compiled=False,
                                    matrix_params=model.num_scaling_params()["transformer_matrices"])
    assert abs(predicted / sum(saved.values()) - 1) < 0.03


@pytest.mark.slow  # a real d4 step in bench.memory, a subprocess: the estimate's logic is unit-tested above
def test_predicted_peak_is_within_15_percent_of_a_real_steps_allocations(tmp_path):
    """bench.memory at config A's shape in two micro-batches (d4, T 512, vocab 32,768), fp32."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "bench.memory", "--configs", "d4x4/4096", "--dtypes", "fp32",
               "--steps", "1"]
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert row["micro_batches"] == 2 and row["estimate"]["accumulates"]
    assert abs(row["predicted_vs_allocated"] - 1) <= 0.15, row
    assert row["rss_peak_bytes"] >= row["allocated_peak_bytes"] * 0.95  # RSS holds what was allocated


@pytest.mark.unit
def test_embedding_tables_in_fp32_and_in_bf16():
    tables = embedding_tables(PARAMS, world_size=2, cfg=TrainConfig())
    assert tables.params == 600
    assert tables.fp32_bytes == 4 * 600 + 4 * 600 + 8 * 600 // 2 == 7_200  # weights, grads, moments / W
    assert tables.bf16_bytes == 2 * 600 + 2 * 600 + 4 * 600 // 2 == 3_600
    assert tables.saving == 3_600
    # SGD keeps one momentum per parameter on every rank, or nothing without momentum
    sgd = embedding_tables(PARAMS, world_size=2, cfg=TrainConfig(optimizer="sgd", sgd_momentum=0.9))
    assert sgd.fp32_bytes == 4 * 600 + 4 * 600 + 4 * 600 == 7_200 and sgd.bf16_bytes == 2_400 + 1_200
    plain = embedding_tables(PARAMS, world_size=2, cfg=TrainConfig(optimizer="sgd", sgd_momentum=0.0))
    assert plain.fp32_bytes == 4_800 and plain.bf16_bytes == 2_400


@pytest.mark.unit
def test_device_names_and_the_verdict():
    assert gpu_memory_gib("NVIDIA H100 80GB HBM3") == 79.6
    assert gpu_memory_gib("NVIDIA H100 NVL") == 93.6  # the longest matching name wins
    assert gpu_memory_gib("Some Future GPU") is None
    params = {"wte": 0, "value_embeds": 0, "transformer_matrices": 0, "total": GIB // 8}  # 0.5 GiB in fp32
    m = estimate_memory(CONFIG, params, 1, 1, 1, 2, compiled=True)
    tables = embedding_tables(params, 1, TrainConfig())
    assert format_memory(m, tables, "GPU", 100.0, "big")[-1].startswith("  fits big (100 GiB)")
    assert "does not fit small" in format_memory(m, tables, "GPU", 1.0, "small")[-1]


@pytest.mark.unit
def test_plan_prints_the_estimate_and_refuses_an_unknown_gpu(capsys, tmp_path):
    flags = ["--depth", "4", "--tokenizer-dir", str(tmp_path), "--data-dir", str(tmp_path)]
    assert plan_main([*flags, "--num-workers", "2", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["mode"].startswith("CPU") and memory["mode"].endswith("eager")
    waiting = memory["gradients"] if memory["accumulates"] else 0
    compute = memory["activations"] + memory["transients"] + waiting
    assert memory["peak"] == memory["parameters"] + memory["optimizer"] + max(
        compute, memory["gradients"] + memory["step_buffers"])
    assert memory["embedding_tables"]["fp32_bytes"] > memory["embedding_tables"]["bf16_bytes"] > 0
    assert plan_main([*flags, "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "estimate, GPU, bf16, compiled" in out and "fits H100 (79.6 GiB)" in out
    assert "in bf16 as nanochat keeps them" in out
    assert plan_main([*flags, "--device-batch-size", "512", "--gpu-memory", "8"]) == 0
    assert "warning: does not fit the device (8 GiB)" in capsys.readouterr().out
    with pytest.raises(RaychatError, match="--gpu 'TPU' .* --gpu-memory"):
        plan_main([*flags, "--gpu", "TPU"])


@pytest.mark.unit
def test_auto_device_batch_is_the_largest_power_of_two_that_fits():
    """d24 on 8 workers (64 rows each per step), compiled bf16, on an 80 GB H100."""
    cfg = TrainConfig(depth=24, device_batch_size=-1, num_workers="8")
    plan = resolve_plan(cfg, 32768, world_size=8)
    assert plan.device_batch_rule == "auto" and plan.device_batch_size == 32  # nanochat's, until a device
    assert plan.rows_per_rank == 64
    h100 = int(gpu_memory_gib("H100") * GIB)
    rows = fit_device_batch_size(plan, h100, compute_bytes=2, compiled=True)
    assert rows == 16
    assert plan_memory(plan.with_device_batch_size(16), 2, True).peak <= MARGIN * h100
    assert plan_memory(plan.with_device_batch_size(32), 2, True).peak > MARGIN * h100
    assert fit_device_batch_size(plan, 1000 * GIB, 2, True) == 64  # never more than a rank's rows
    assert fit_device_batch_size(plan, 1 * GIB, 2, True) == 1     # nothing fits: 1, and the warning says so
    assert fit_device_batch_size(plan, 62 * GIB, 2, True) == 8    # 16 (57.5 GiB) is over 90% of 62 GiB

    fitted, lines = fit_plan_to_device(plan, h100, "NVIDIA H100 80GB HBM3", 2, True)
    assert fitted.device_batch_size == 16 and fitted.grad_accum_steps == 4
    assert lines == ["--device-batch-size -1: 16 rows per forward pass on NVIDIA H100 80GB HBM3 (estimated "
                     "peak 57.5 of 79.6 GiB)"]
    fixed = resolve_plan(TrainConfig(depth=24, num_workers="8"), 32768, world_size=8)
    same, lines = fit_plan_to_device(fixed, h100, "H100", 2, True)
    assert same == fixed and len(lines) == 1 and lines[0].startswith("warning: does not fit H100")
    assert "--device-batch-size (-1 picks the largest that fits)" in lines[0]


@pytest.mark.unit
def test_plan_resolves_auto_against_the_device_it_is_given(capsys, tmp_path):
    flags = ["--depth", "24", "--num-workers", "8", "--device-batch-size", "-1", "--tokenizer-dir",
             str(tmp_path), "--data-dir", str(tmp_path)]
    assert plan_main([*flags, "--gpu", "H100", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["device_batch_size"] == 16 and plan["device_batch_rule"] == "auto"
    assert plan_main([*flags, "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    assert "(rank 0: 2 x 32 rows), device batch auto" in out and "fits H200" in out
    with pytest.raises(RaychatError, match=r"--device-batch-size must be positive or -1 \(auto\), got 0"):
        plan_main([*flags[:4], "--device-batch-size", "0"])
