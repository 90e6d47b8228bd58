"""The plan's memory estimate: each part against numbers worked by hand for a small config, and the
fits / does-not-fit verdict of `python -m raychat.plan`."""

import json

import pytest

from raychat.common import RaychatError
from raychat.memory import GIB, estimate_memory, format_memory, gpu_memory_gib
from raychat.plan import main as plan_main


def test_each_part_matches_the_hand_worked_numbers():
    # 1,000 AdamW parameters (embeddings, lm_head, scalars) and 3,000 Muon ones, on 2 ranks;
    # micro-batch 2 x 16 tokens, width 8, depth 2, vocabulary 50
    params = {"wte": 400, "value_embeds": 200, "lm_head": 390, "transformer_matrices": 3000, "scalars": 10,
              "total": 4000}
    m = estimate_memory(params, n_layer=2, n_embd=8, vocab_size=50, seq_len=16, device_batch_size=2,
                        world_size=2)
    assert m.parameters == 16_000 and m.gradients == 16_000  # 4 bytes x 4,000
    assert m.optimizer == (8 * 1000 + 4 * 3000) // 2 == 10_000
    assert m.step_buffers == 4 * 3000 + 4 * 1000 // 2 == 14_000
    assert m.activations == 2 * 34 * 32 * 8 + 8 * 32 * 50 == 30_208
    assert m.device_total == 86_208
    assert m.save_host == (16_000 + 8_000 + 12_000) // 2 == 18_000  # the rank's own share, on the host
    one_rank = estimate_memory(params, 2, 8, 50, 16, 2, world_size=1)
    assert one_rank.optimizer == 20_000 and one_rank.save_host == 36_000


def test_device_names_and_the_verdict():
    assert gpu_memory_gib("NVIDIA H100 80GB HBM3") == 79.6
    assert gpu_memory_gib("NVIDIA H100 NVL") == 93.6  # the longest matching name wins
    assert gpu_memory_gib("Some Future GPU") is None
    params = {"transformer_matrices": 0, "total": GIB // 4}  # 1 GiB of parameters
    m = estimate_memory(params, 1, 1, 1, 1, 1, 1)
    assert format_memory(m, 100.0, "big")[-1].startswith("  fits big (100 GiB)")
    assert "does not fit small" in format_memory(m, 4.0, "small")[-1]


def test_plan_prints_the_estimate_and_refuses_an_unknown_gpu(capsys, tmp_path):
    flags = ["--depth", "4", "--tokenizer-dir", str(tmp_path), "--data-dir", str(tmp_path)]
    assert plan_main([*flags, "--num-workers", "2", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["device_total"] == sum(memory[k] for k in ("parameters", "gradients", "optimizer",
                                                             "step_buffers", "activations"))
    assert plan_main([*flags, "--gpu", "H100"]) == 0
    assert "fits H100 (79.6 GiB)" in capsys.readouterr().out
    assert plan_main([*flags, "--device-batch-size", "512", "--gpu-memory", "8"]) == 0
    assert "warning: does not fit the device (8 GiB)" in capsys.readouterr().out
    with pytest.raises(RaychatError, match="--gpu 'TPU' .* --gpu-memory"):
        plan_main([*flags, "--gpu", "TPU"])
