"""`python -m raychat.plan` as a user runs it: its stdout, stderr and exit code (every command of this
module in one reused interpreter: tests/reused_processes.py)."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLAN_KEYS = {"params", "scaling_params", "flops_per_token", "total_batch_size", "num_iterations",
             "total_tokens", "tokens_per_param", "lr_scale", "weight_decay", "grad_accum_steps", "model"}
PARAM_KEYS = {"wte", "value_embeds", "lm_head", "transformer_matrices", "scalars", "total"}


def run_plan(commands, *args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if home is not None:
        env["RAYCHAT_HOME"] = str(home)
    return commands.run("raychat.plan", *args, cwd=REPO, env=env, timeout=180)


@pytest.mark.integration  # commands in a reused interpreter
def test_depth_24_from_a_fresh_home(commands, tmp_path):
    """No tokenizer anywhere: the vocabulary comes from --vocab-size, the rest from the scaling rules."""
    result = run_plan(commands, "--depth", "24", "--json", home=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)  # the whole of stdout is one JSON object
    assert plan.keys() >= PLAN_KEYS
    assert plan["params"].keys() >= PARAM_KEYS
    assert plan["model"]["n_layer"] == 24 and plan["model"]["n_embd"] == 24 * 64
    assert plan["model"]["vocab_size"] == 32768 and "--vocab-size" in plan["vocab_source"]
    assert plan["scaling_params"] == plan["params"]["transformer_matrices"] + plan["params"]["lm_head"]
    assert plan["total_batch_size"] == 2**20  # the 0.383 power law from d12 (worked out in test_scaling.py)
    assert plan["num_iterations"] == int(12 * plan["scaling_params"]) // 2**20
    assert plan["total_tokens"] == plan["num_iterations"] * 2**20


@pytest.mark.integration  # commands in a reused interpreter
def test_vocab_size_comes_from_the_tokenizer(commands, tmp_path):
    """A trained tokenizer in --tokenizer-dir wins over --vocab-size (training would use it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raychat.tokenizer.train import train_tokenizer

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
             "box", "jovially"]
    for shard in range(2):  # shard 0 trains, shard 1 (the last) is validation
        texts = [" ".join(words[(i + j) % len(words)] for j in range(40)) for i in range(200)]
        pq.write_table(pa.table({"text": texts}), data_dir / f"shard_{shard:05d}.parquet")
    train_tokenizer(data_dir, tmp_path / "tok", vocab_size=300, log=lambda _: None)

    result = run_plan(commands, "--depth", "2", "--tokenizer-dir", str(tmp_path / "tok"), "--vocab-size",
                      "32768", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["model"]["vocab_size"] == 300 and str(tmp_path / "tok") in plan["vocab_source"]
    assert plan["params"]["wte"] == 320 * 2 * 64  # vocab padded to a multiple of 64, width 2 x 64


@pytest.mark.integration  # commands in a reused interpreter
def test_seed_001_through_the_cli(commands):
    result = run_plan(commands, "--depth", "12", "--window-pattern", "L", "--total-batch-size", "65536",
                      "--num-iterations", "10000", "--device-batch-size", "8",
                      "--vocab-size", "32768", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["params"]["total"] == 286_261_730
    assert plan["total_tokens"] == 655_360_000
    assert round(plan["tokens_per_param"], 2) == 5.95
    assert round(plan["weight_decay"], 3) == 0.099
    assert plan["grad_accum_steps"] == 4


@pytest.mark.integration  # commands in a reused interpreter
def test_readable_table_with_workers(commands):
    result = run_plan(commands, "--preset", "cpu", "--num-workers", "3")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # cpu preset: 4096-token steps of 512-token rows = 8 rows, dealt 3 + 3 + 2 over 3 workers
    assert "4,096 (--total-batch-size)" in out
    assert "8 x 512 tokens" in out
    assert "3 (2-3 rows each)" in out
    assert re.search(r"optimizer steps +60$", out, re.M)


@pytest.mark.integration  # commands in a reused interpreter
@pytest.mark.parametrize("args, flag", [
    (["--depth", "0"], "--depth"),
    (["--depth", "4", "--head-dim", "63"], "--head-dim"),  # rotary embeddings need channel pairs
    (["--depth", "12", "--total-batch-size", "65537"], "--total-batch-size 65536"),
    (["--depth", "4", "--max-seq-len", "2048", "--total-batch-size", "8192", "--num-workers", "5"],
     "--num-workers 5"),
])
def test_bad_input_is_one_line_and_exit_2(commands, args, flag):
    result = run_plan(commands, *args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("raychat: error:"), result.stderr
    assert flag in lines[0]


@pytest.mark.unit
def test_the_cpu_preset_says_what_it_chose_and_why():
    from raychat.config import PRESETS, preset_note

    note = preset_note("cpu")
    cpu = PRESETS["cpu"]
    assert f"{cpu['num_iterations']} steps of {cpu['total_batch_size']:,} tokens" in note
    assert "without AVX-512" in note and preset_note("") is None
